"""Which parts of a state may differ between replicas: the declaration protocol.

A state node (an optimizer state, a sync piece's state) whose fields are not all
equal on every replica declares so with `declare`:

    @_replica_parts.declare(local=("inner_state",), required=("count",))
    class MyState(NamedTuple): ...

- `local` names the fields whose values may differ between replicas (trained on
  each replica's own gradients, or error buffers); every other field must agree.
- `required` names fields that are always present, so that the node is also
  recognised in the layout flax NNX gives it (`nnx.state` turns a NamedTuple
  into a mapping from field names to values, dropping fields that hold no
  array): a mapping whose keys are the class's fields and include `required`.
- `trains_locally=True` says the optimizer that owns the node trains replicas on
  their own gradients (so a step must not average the gradients first).
- A `restart_params(self)` method, if the class has one, returns the params
  every replica should hold when the state is laid out anew for another replica
  count (a checkpoint restored elsewhere): BMUF's block start.
- A `restart_local(self)` method, if the class has one, returns the node as it
  should be after such a re-layout (error-feedback buffers start from zero)
  instead of replica 0's copy of its local fields, or the node itself if
  nothing restarts; its class's `RESTART_NOTE` says what restarted (a sentence
  for the checkpoint's warning).

Readers (the divergence guard, `jdp.local()`, checkpoints, the train step's
checks) ask only this module; none of them knows the declaring classes.
"""

from __future__ import annotations

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
    """Class decorator: declares a NamedTuple state's per-replica fields.

    Args:
      local: The fields whose values may differ between replicas.
      required: Fields always present (they identify the NNX mapping layout).
      trains_locally: Whether the optimizer owning the state trains each replica
        on its own gradients.

    Returns:
      The decorator, which returns the class unchanged after recording it.
    """

    def register(cls: type) -> type:
        fields = tuple(cls._fields)
        unknown = (set(local) | set(required)) - set(fields)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}.")
        _DECLARED.append(_Declaration(cls, fields, local, required, trains_locally))
        return cls

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

    Nodes in flax NNX's mapping layout come back as instances of their class,
    with None for the fields the mapping lacks.
    """
    found = []
    for x in jax.tree.leaves(tree, is_leaf=_is_declared):
        d = _declaration(x)
        if d is None:
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


def agreed(tree: PyTree) -> PyTree | None:
    """What replicas agree on in `tree`: its declared nodes less their local fields.

    Every leaf outside a declared node is None (not declared to agree: the
    caller decides about it). None if `tree` holds no declared node.
    """
    if not find(tree):
        return None
    return map_declared(tree, lambda path, x: None)


def restart_params(tree: PyTree) -> list[PyTree]:
    """The `restart_params()` of every declared node in `tree` that has one."""
    return [x.restart_params() for x in find(tree) if hasattr(x, "restart_params")]


def restart_local(tree: PyTree) -> tuple[PyTree, list[str]]:
    """`tree` with every declared node that has `restart_local()` replaced by it.

    Returns:
      `(tree, notes)`: the `RESTART_NOTE` of each kind of node that changed, in
      the order found, each once (empty if none changed).
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
