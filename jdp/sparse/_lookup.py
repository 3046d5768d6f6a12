"""Embedding lookups whose table gradient is kept as rows, not as a dense table."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdp import _jax_compat
from jdp._tree import PyTree, format_problems, keystr

TablePath = str | tuple[Any, ...]


class IndexedRows(NamedTuple):
    """Rows of a table at given ids: a sparse gradient (Caffe2's `GradientSlice`).

    Repeated ids add up; ids outside `[0, num_rows)` (the `-1` padding) are
    skipped by the row optimizers.

    Attributes:
      ids: Integer row ids, shape `(n,)`.
      rows: Values, shape `(n,) + table.shape[1:]`.
    """

    ids: jax.Array
    rows: jax.Array


def is_rows(x: Any) -> bool:
    return isinstance(x, IndexedRows)


def split_rows(grads: PyTree) -> tuple[PyTree, PyTree]:
    """`grads` as its dense leaves and its `IndexedRows`, None where the other is."""
    dense = jax.tree.map(lambda g: None if is_rows(g) else g, grads, is_leaf=is_rows)
    rows = jax.tree.map(lambda g: g if is_rows(g) else None, grads, is_leaf=is_rows)
    return dense, rows


def path_name(path: Sequence[Any]) -> str:
    """A pytree key path as `"a/b/c"`, the form `jdp.sparse` names tables by."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def normalize_path(table: TablePath) -> str:
    """`"embed"`, `"a/b"` or `("a", "b")` -> `"a/b"`."""
    if isinstance(table, str):
        return table.strip("/")
    if isinstance(table, tuple):
        return "/".join(str(k) for k in table)
    raise TypeError(
        f"A table is named by a '/'-separated string of keys (e.g. 'embed' or "
        f"'tower/embedding') or a tuple of keys; got {table!r}."
    )


def locate_tables(
    params: PyTree, tables: Sequence[str], *, api: str
) -> tuple[list[Any], Any, dict[str, int]]:
    """Flattens `params`; returns `(leaves, treedef, {table name: leaf index})`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = {path_name(p): i for i, (p, _) in enumerate(flat)}
    if missing := [t for t in tables if t not in names]:
        listed = format_problems(sorted(names))
        raise ValueError(
            f"`{api}`: no parameter leaf at table path(s) {missing}. Name a table "
            f"by its keys joined with '/'; the parameter leaves are:{listed}"
        )
    index = {t: names[t] for t in tables}
    for t, i in index.items():
        if np.ndim(flat[i][1]) < 1:
            raise ValueError(
                f"`{api}`: table {t!r} at {keystr(flat[i][0])} is a scalar; a table "
                "needs a leading row axis."
            )
    return [x for _, x in flat], treedef, index


def row_index(ids: jax.Array, num_rows: int) -> jax.Array:
    """Ids with negative ones moved out of range (no wrap-around), for `mode=`."""
    if ids.dtype.itemsize < 4:
        ids = ids.astype(jnp.int32)
    return jnp.where(ids < 0, num_rows, ids)


def densify(grads: IndexedRows, table: jax.Array) -> jax.Array:
    """A table's sparse gradient as the dense one (repeated ids added)."""
    index = row_index(grads.ids, table.shape[0])
    zeros = jnp.zeros(table.shape, grads.rows.dtype)
    return zeros.at[index].add(grads.rows, mode="drop")


def integer_ids(ids: Any, api: str) -> jax.Array:
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"`{api}`: ids must be integers, got dtype {ids.dtype}. Cast them "
            "with `ids.astype(jnp.int32)`."
        )
    return ids


def _gather(table: jax.Array, ids: Any) -> jax.Array:
    index = row_index(integer_ids(ids, "jdp.sparse.lookup"), table.shape[0])
    return table.at[index].get(mode="fill", fill_value=0)


def lookup(table: Any, ids: Any) -> jax.Array:
    """Looks up rows of an embedding table: `table[ids]`, with a sparse gradient.

    Inside `jdp.sparse.value_and_grad` and `jdp.sparse.rows()` the table's
    gradient is kept as `jdp.sparse.IndexedRows`; elsewhere it is dense. Ids
    outside `[0, num_rows)` read zeros and receive no update.

    Args:
      table: The table, shape `(num_rows, ...)`: a parameter leaf.
      ids: Integer ids, any shape.

    Returns:
      The rows, shape `ids.shape + table.shape[1:]`.

    Raises:
      TypeError: If `ids` are not integers.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> table = jnp.arange(6.0).reshape(3, 2)
      >>> jdp.sparse.lookup(table, jnp.array([2, -1]))  # -1: out of range
      Array([[4., 5.],
             [0., 0.]], dtype=float32)
    """
    if isinstance(table, _TableHandle):
        return table._lookup(ids)
    return _gather(jnp.asarray(table), ids)


class _Record(NamedTuple):
    table: str
    shape: tuple[int, ...]


class _Recorder:
    """One trace's lookups: their shapes (first pass) or their ids (second)."""

    def __init__(self, perturbations: Sequence[jax.Array] | None = None, expected=None):
        self.records: list[_Record] = []
        self.ids: list[jax.Array] = []
        self.perturbations, self.expected = perturbations, expected


_DENSE_USE_NOTE = (
    "jdp.sparse: the tables {names} are trained sparsely, so inside the loss they "
    "are handles, not arrays: read them only with `jdp.sparse.lookup(table, ids)`."
)


class _TableHandle:
    """Stands in for a table inside `jdp.sparse.value_and_grad`."""

    def __init__(self, name: str, table: jax.Array, recorder: _Recorder):
        self.name, self._table, self._recorder = name, table, recorder
        self.shape, self.dtype, self.ndim = table.shape, table.dtype, table.ndim

    def _lookup(self, ids: Any) -> jax.Array:
        rec = self._recorder
        rows = _gather(self._table, ids)
        k = len(rec.records)
        rec.records.append(_Record(self.name, tuple(np.shape(ids))))
        if rec.perturbations is None:
            return rows
        if k >= len(rec.expected) or rec.expected[k] != rec.records[k]:
            raise RuntimeError(
                "`jdp.sparse`: the loss looked up its tables differently in two "
                f"traces (lookup {k}: {rec.records[k]} vs "
                f"{rec.expected[k] if k < len(rec.expected) else 'none'}). The "
                "sequence of `jdp.sparse.lookup` calls and their id shapes must "
                "not depend on values."
            )
        rec.ids.append(jnp.asarray(ids))
        return rows + rec.perturbations[k]

    def _dense_use(self, *args, **kwargs):
        raise TypeError(
            f"Table {self.name!r} is trained sparsely here, so it can only be read "
            "with `jdp.sparse.lookup(table, ids)` (it is a handle, not an array). Use "
            "lookup for every read of the table, or leave it out of the sparse tables."
        )

    __array__ = __getitem__ = _dense_use
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _dense_use
    __matmul__ = __rmatmul__ = __truediv__ = __rtruediv__ = _dense_use

    def __repr__(self) -> str:
        return f"SparseTable({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def value_and_grad(
    fun: Callable[..., Any], tables: Sequence[TablePath], *, has_aux: bool = False
) -> Callable[..., tuple[Any, PyTree]]:
    """Like `jax.value_and_grad`, but the gradient of each table is sparse rows.

    `fun` reads each table only through `jdp.sparse.lookup`, at its top level
    (not inside `jax.vmap`/`lax.scan`); each table's gradient is a
    `jdp.sparse.IndexedRows` of all its lookups' ids, in call order.

    Args:
      fun: `fun(params, *args) -> loss` (or `(loss, aux)` with `has_aux`).
      tables: Paths of the table leaves in `params`: keys joined with `/`
        (`"embed"`, `"tower/embedding"`) or tuples of keys.
      has_aux: Whether `fun` returns `(loss, aux)`.

    Returns:
      `f(params, *args) -> (value, grads)`, `value` being what `fun` returns.

    Raises:
      ValueError: If a table path names no leaf of `params`.
      TypeError: If `fun` uses a table other than through `jdp.sparse.lookup`.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> def loss_fn(params, ids):
      ...     return jnp.sum(jdp.sparse.lookup(params["embed"], ids) * params["w"])
      >>> params = {"embed": jnp.zeros((1000, 2)), "w": jnp.array([1.0, 2.0])}
      >>> grad_fn = jdp.sparse.value_and_grad(loss_fn, ["embed"])
      >>> loss, grads = grad_fn(params, jnp.array([7, 3, 7]))
      >>> grads["embed"].ids, grads["embed"].rows.shape
      (Array([7, 3, 7], dtype=int32), (3, 2))
    """
    api = "jdp.sparse.value_and_grad"
    names = [normalize_path(t) for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"`{api}`: a table is listed twice: {names}.")

    def wrapped(params, *args):
        leaves, treedef, index = locate_tables(params, names, api=api)
        table_values = {t: jnp.asarray(leaves[i]) for t, i in index.items()}
        dense = [None if i in index.values() else x for i, x in enumerate(leaves)]

        def call(dense_leaves, recorder, args):
            full = list(dense_leaves)
            for t, i in index.items():
                full[i] = _TableHandle(t, table_values[t], recorder)
            return fun(jax.tree_util.tree_unflatten(treedef, full), *args)

        shapes = _Recorder()
        try:
            jax.eval_shape(lambda d, a: call(d, shapes, a), dense, args)
        except (TypeError, ValueError) as e:
            if _jax_compat.error_names_type(e, _TableHandle):
                e.add_note(_DENSE_USE_NOTE.format(names=names))
            raise
        records = shapes.records
        zeros = []
        for r in records:
            table = table_values[r.table]
            zeros.append(jnp.zeros(r.shape + table.shape[1:], table.dtype))

        def differentiable(dense_leaves, perturbations):
            recorder = _Recorder(perturbations, records)
            out = call(dense_leaves, recorder, args)
            if len(recorder.records) != len(records):
                raise RuntimeError(
                    "`jdp.sparse`: the loss made a different number of lookups in "
                    f"two traces ({len(records)} then {len(recorder.records)})."
                )
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, recorder.ids)

        (loss, (aux, ids)), (dense_grads, row_grads) = jax.value_and_grad(
            differentiable, argnums=(0, 1), has_aux=True
        )(dense, zeros)
        grads = list(dense_grads)
        for t, i in index.items():
            row_shape = table_values[t].shape[1:]
            mine = [k for k, r in enumerate(records) if r.table == t]
            table_ids = [ids[k].reshape(-1) for k in mine]
            rows = [row_grads[k].reshape((-1,) + row_shape) for k in mine]
            if not mine:
                table_ids = [jnp.zeros((0,), jnp.int32)]
                rows = [jnp.zeros((0,) + row_shape, table_values[t].dtype)]
            grads[i] = IndexedRows(jnp.concatenate(table_ids), jnp.concatenate(rows))
        value = (loss, aux) if has_aux else loss
        return value, jax.tree_util.tree_unflatten(treedef, grads)

    return wrapped
