"""Which parts of a state may differ between replicas: the declaration protocol.

A NamedTuple state whose fields are not all equal on every replica declares so
with `declare`; its class may define `restart_params()` (the params after a
re-layout to another replica count), `restart_local()` (the node after one) and
`RESTART_NOTE` (what restarted). Readers ask only this module.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax

PyTree = Any


class _Declaration(NamedTuple):
    cls: type
    fields: tuple[str, ...]
    local: tuple[str, ...]
    required: tuple[str, ...]
    trains_locally: bool


_DECLARED: list[_Declaration] = []


def declare(
    *, local: tuple[str, ...], required: tuple[str, ...], trains_locally: bool = False
) -> Callable[[type], type]:
    """Class decorator: records a NamedTuple state's per-replica fields.

    `local` fields may differ between replicas; `required` ones identify the
    node in flax NNX's mapping layout; `trains_locally`: its optimizer trains
    each replica on its own gradients.
    """

    def register(cls: type) -> type:
        fields = tuple(cls._fields)
        if unknown := (set(local) | set(required)) - set(fields):
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}.")
        _DECLARED.append(_Declaration(cls, fields, local, required, trains_locally))
        return cls

    return register


def declare_per_replica(*fields: str) -> Callable[[type], type]:
    """Class decorator: these fields of a state differ between replicas.

    For the NamedTuple state of one's own sync piece or optimizer: the named
    fields (error-feedback buffers) may differ between replicas, the others must
    agree. The divergence guard (`check_sync`) compares only the others, and
    checkpoints save the named ones with every replica.

    Args:
      *fields: Names of the NamedTuple's fields that differ between replicas.

    Returns:
      The decorator, which returns the class unchanged after recording it.

    Raises:
      TypeError: If the class is not a NamedTuple, or a field is not a str.
      ValueError: If a named field is not one of the class's fields.

    Example:
      >>> from typing import NamedTuple
      >>> import jax, jdp
      >>> @jdp.declare_per_replica("error")
      ... class TopKState(NamedTuple):
      ...     error: dict  # what each replica's top-k left out, per replica
      ...     count: jax.Array  # the same on every replica
    """
    for f in fields:
        if not isinstance(f, str):
            raise TypeError(
                "`jdp.declare_per_replica` takes field names (str), e.g. "
                f"`@jdp.declare_per_replica('error')`; got {f!r}."
            )

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and hasattr(cls, "_fields")):
            raise TypeError(
                "`jdp.declare_per_replica` decorates a NamedTuple class (a "
                f"piece's state); got {cls!r}."
            )
        if unknown := sorted(set(fields) - set(cls._fields)):
            raise ValueError(
                f"`jdp.declare_per_replica`: {cls.__name__} has no field(s) "
                f"{unknown}; its fields are {list(cls._fields)}."
            )
        return declare(local=tuple(fields), required=tuple(cls._fields))(cls)

    return register


def _declaration(x: Any) -> _Declaration | None:
    for d in _DECLARED:
        if isinstance(x, d.cls):
            return d
        if isinstance(x, Mapping) and set(d.required) <= x.keys() <= set(d.fields):
            return d
    return None


def _is_declared(x: Any) -> bool:
    return _declaration(x) is not None


def find(tree: PyTree) -> list[Any]:
    """Every declared node in `tree`, in order, as instances of its class.

    Nodes in flax NNX's mapping layout get None for the fields they lack.
    """
    found = []
    for x in jax.tree.leaves(tree, is_leaf=_is_declared):
        if (d := _declaration(x)) is None:
            continue
        if not isinstance(x, d.cls):
            x = d.cls(**{f: x.get(f) for f in d.fields})
        found.append(x)
    return found


def trains_locally(tree: PyTree) -> bool:
    """Whether `tree` holds a node whose optimizer trains replicas locally."""
    return any(_declaration(x).trains_locally for x in find(tree))


def _less_local(x: Any, d: _Declaration) -> Any:
    """A declared node without its local fields (set to None, or dropped)."""
    if isinstance(x, d.cls):
        return x._replace(**{f: None for f in d.local})
    return {k: v for k, v in x.items() if k not in d.local}


def map_declared(
    tree: PyTree, other: Callable[[Any, Any], Any], *, stop_at: tuple[type, ...] = ()
) -> PyTree:
    """Declared nodes less their local fields; other leaves as `other(path, x)`.

    `stop_at`: further node types handed to `other` whole (flax NNX variables).
    """

    def is_leaf(x):
        return _is_declared(x) or isinstance(x, stop_at)

    def one(path, x):
        d = _declaration(x)
        return other(path, x) if d is None else _less_local(x, d)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_leaf)


def without_local(tree: PyTree) -> PyTree:
    """`tree` with its declared nodes' local fields set to None (or dropped)."""
    return map_declared(tree, lambda path, x: x)


def with_local_of(tree: PyTree, original: PyTree) -> PyTree:
    """`without_local(...)`'s `tree` with the local fields of `original` put back."""

    def one(new, old):
        d = _declaration(old)
        if d is None:
            return new
        if isinstance(old, d.cls):
            return new._replace(**{f: getattr(old, f) for f in d.local})
        merged = {**new, **{k: v for k, v in old.items() if k in d.local}}
        return merged if type(old) is dict else type(old)(merged)

    return jax.tree.map(one, tree, original, is_leaf=_is_declared)


def agreed(tree: PyTree) -> PyTree | None:
    """`tree`'s declared nodes less their local fields, other leaves None.

    None if `tree` holds no declared node.
    """
    return map_declared(tree, lambda path, x: None) if find(tree) else None


def _name(key: Any) -> Any:
    """A key path entry without its kind: `['w']`, `.w` and NNX's `w` all name `w`."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def _shaped_leaves(tree: PyTree, is_leaf) -> list[tuple[tuple, tuple, tuple]]:
    """`(path, key names, shape)` of each array leaf (or NNX `Variable`) of `tree`.

    Declared nodes are left out.
    """
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        arrays = jax.tree.leaves(x)
        if not _is_declared(x) and len(arrays) == 1 and hasattr(arrays[0], "shape"):
            out.append((tuple(path), tuple(map(_name, path)), tuple(arrays[0].shape)))
    return out


def must_agree(tree: PyTree) -> PyTree:
    """`tree` (any container) with the leaves that may differ set to None.

    Those are the local fields of declared nodes and, where a node trains
    locally, every leaf of a subtree laid out like its `restart_params()` (the
    same key names to leaves of the same shapes, more leaves allowed for params
    an `optax.masked` saw part of): the params, and the parts of the optimizer
    state shaped like them, outside declared nodes. `tree` itself if it holds no
    declared node.
    """
    if not (found := find(tree)):
        return tree
    nnx = sys.modules.get("flax.nnx")  # no NNX state unless it was imported
    variables = (nnx.Variable,) if nnx is not None else ()
    is_variable = lambda x: isinstance(x, variables)  # noqa: E731
    templates: list[dict[tuple, tuple]] = []
    for x in found:
        if _declaration(x).trains_locally and hasattr(x, "restart_params"):
            params = _shaped_leaves(x.restart_params(), is_variable)
            template = {names: shape for _, names, shape in params}
            if template and template not in templates:
                templates.append(template)
    leaves = _shaped_leaves(tree, lambda x: _is_declared(x) or is_variable(x))
    differ: set[tuple] = set()
    for template in templates:
        # Per subtree, the leaves where the template has one of the same shape;
        # a subtree holding all of them is laid out like the params.
        hits: dict[tuple, list[tuple]] = defaultdict(list)
        for path, names, shape in leaves:
            for cut in range(len(names) + 1):
                if template.get(names[cut:]) == shape:
                    hits[names[:cut]].append(path)
        for paths in hits.values():
            if len(paths) == len(template):
                differ.update(paths)
    return map_declared(
        tree, lambda path, x: None if tuple(path) in differ else x, stop_at=variables
    )


def restart_params(tree: PyTree) -> list[PyTree]:
    """The `restart_params()` of every declared node in `tree` that has one."""
    return [x.restart_params() for x in find(tree) if hasattr(x, "restart_params")]


def restart_local(tree: PyTree) -> tuple[PyTree, list[str]]:
    """`(tree, notes)`: every declared node replaced by its `restart_local()`.

    `notes` holds the `RESTART_NOTE` of each kind of node that changed, once.
    """
    notes: list[str] = []

    def one(x):
        d = _declaration(x)
        if d is not None and isinstance(x, d.cls) and hasattr(x, "restart_local"):
            new = x.restart_local()
            note = getattr(type(x), "RESTART_NOTE", "")
            if new is not x and note and note not in notes:
                notes.append(note)
            return new
        return x

    return jax.tree.map(one, tree, is_leaf=_is_declared), notes
