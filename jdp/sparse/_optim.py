"""Row-wise optimizers (SparseSGD, SparseAdagrad) and `partition` for mixed models."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdp.sparse._gather import combine_rows
from jdp.sparse._lookup import IndexedRows, TablePath, locate_tables, normalize_path

PyTree = Any


class RowOptimizer(NamedTuple):
    """An optimizer for one table that can update only the rows it is given.

    Attributes:
      init: `init(table) -> state`.
      update: `update(grads, state, table) -> (new_table, new_state)`, where
        `grads` is either `jdp.sparse.IndexedRows` (only those rows change: a
        scatter, O(rows touched)) or a dense gradient shaped like the table.
    """

    init: Callable[[jax.Array], Any]
    update: Callable[[Any, Any, jax.Array], tuple[jax.Array, Any]]


def _check_rows(grads: IndexedRows, table: jax.Array, api: str) -> None:
    if grads.rows.shape[1:] != table.shape[1:] or grads.ids.ndim != 1:
        raise ValueError(
            f"`{api}`: got ids of shape {grads.ids.shape} and rows of shape "
            f"{grads.rows.shape} for a table of shape {table.shape}; expected ids "
            f"(n,) and rows (n,) + {table.shape[1:]}."
        )


def _row_index(ids: jax.Array, num_rows: int) -> jax.Array:
    """Ids with negative ones moved out of range, so `mode="drop"` skips them."""
    if ids.dtype.itemsize < 4:
        ids = ids.astype(jnp.int32)
    return jnp.where(ids < 0, num_rows, ids)


def sgd(learning_rate: float) -> RowOptimizer:
    """Plain SGD on the rows touched: `table[ids] -= learning_rate * rows`.

    Caffe2's `ScatterWeightedSum` / PyTorch's `SGD` on a sparse gradient. Gives
    the same table as `optax.sgd(learning_rate)` on the dense gradient: rows not
    touched have a zero gradient and do not move. Repeated ids add up.

    Args:
      learning_rate: Step size (a constant).

    Returns:
      A `jdp.sparse.RowOptimizer` (stateless).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> opt = jdp.sparse.sgd(0.5)
      >>> grads = jdp.sparse.IndexedRows(jnp.array([1, 1]), jnp.ones((2, 2)))
      >>> table, _ = opt.update(grads, opt.init(jnp.zeros((3, 2))), jnp.zeros((3, 2)))
      >>> table
      Array([[ 0.,  0.],
             [-1., -1.],
             [ 0.,  0.]], dtype=float32)
    """

    def init_fn(table):
        del table
        return optax.EmptyState()

    def update_fn(grads, state, table):
        if isinstance(grads, IndexedRows):
            _check_rows(grads, table, "jdp.sparse.sgd")
            index = _row_index(grads.ids, table.shape[0])
            delta = (-learning_rate * grads.rows).astype(table.dtype)
            return table.at[index].add(delta, mode="drop"), state
        return table + (-learning_rate * grads).astype(table.dtype), state

    return RowOptimizer(init_fn, update_fn)


class AdagradRowState(NamedTuple):
    """State of `jdp.sparse.adagrad`."""

    sum_of_squares: jax.Array  # like the table


def adagrad(
    learning_rate: float,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
) -> RowOptimizer:
    """Adagrad on the rows touched (Caffe2's `SparseAdagrad`).

    For each distinct id (repeated ids are summed first, as PyTorch's sparse
    Adagrad coalesces), `s[id] += g ** 2` and `table[id] -= learning_rate * g /
    sqrt(s[id] + eps)`, elementwise. This is `optax.adagrad`'s rule with its
    defaults, so on the dense gradient both give the same table: a row with zero
    gradient keeps its value and its accumulator.

    Args:
      learning_rate: Step size (a constant).
      initial_accumulator_value: Starting value of the accumulators.
      eps: Added inside the square root.

    Returns:
      A `jdp.sparse.RowOptimizer` whose state is an `AdagradRowState`.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> opt = jdp.sparse.adagrad(0.1, initial_accumulator_value=0.0)
      >>> table = jnp.zeros((3, 1))
      >>> grads = jdp.sparse.IndexedRows(jnp.array([2]), jnp.array([[4.0]]))
      >>> table, state = opt.update(grads, opt.init(table), table)
      >>> table[:, 0], state.sum_of_squares[:, 0]
      (Array([ 0. ,  0. , -0.1], dtype=float32), Array([ 0.,  0., 16.], dtype=float32))

    References:
      Duchi, Hazan and Singer, "Adaptive Subgradient Methods for Online Learning
      and Stochastic Optimization", JMLR 2011.
    """

    def init_fn(table):
        return AdagradRowState(jnp.full_like(table, initial_accumulator_value))

    def step(g, s):
        s = g * g + s
        inv = jnp.where(s > 0, jax.lax.rsqrt(s + eps), 0.0)
        return -learning_rate * (inv * g), s

    def update_fn(grads, state, table):
        acc = state.sum_of_squares
        if isinstance(grads, IndexedRows):
            _check_rows(grads, table, "jdp.sparse.adagrad")
            ids, rows = combine_rows(*grads)
            index = _row_index(ids, table.shape[0])
            delta, s = step(rows, acc.at[index].get(mode="fill", fill_value=0))
            table = table.at[index].add(delta.astype(table.dtype), mode="drop")
            acc = acc.at[index].set(s.astype(acc.dtype), mode="drop")
            return table, AdagradRowState(acc)
        delta, s = step(grads, acc)
        return table + delta.astype(table.dtype), AdagradRowState(s.astype(acc.dtype))

    return RowOptimizer(init_fn, update_fn)


# -- mixed models ----------------------------------------------------------------


class PartitionState(NamedTuple):
    """State of `jdp.sparse.partition`: the dense optimizer's and each table's."""

    dense: optax.OptState
    tables: dict[str, Any]


class SparseTransformation(optax.GradientTransformation):
    """An `optax.GradientTransformation` that also trains some tables sparsely.

    Made by `jdp.sparse.partition`. Its `init`/`update` follow optax (`update`
    takes dense gradients, so the same optimizer also works with
    `jdp.make_train_step`); `jdp.sparse.make_train_step` instead applies the
    tables' row optimizers to sparse gradients directly.

    Attributes:
      dense: The optimizer of every parameter that is not a table.
      tables: `((path, RowOptimizer), ...)`, paths as `"a/b"` strings.
    """

    dense: optax.GradientTransformation
    tables: tuple[tuple[str, RowOptimizer], ...]


def _split(params: PyTree, tx: SparseTransformation, api: str):
    names = [t for t, _ in tx.tables]
    leaves, treedef, index = locate_tables(params, names, api=api)
    at_table = set(index.values())
    dense = jax.tree_util.tree_unflatten(
        treedef, [None if i in at_table else x for i, x in enumerate(leaves)]
    )
    return leaves, treedef, index, dense


def _flat_with_none(tree: PyTree) -> list[Any]:
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)


def partition(
    dense_tx: optax.GradientTransformation,
    tables: Mapping[TablePath, RowOptimizer],
) -> SparseTransformation:
    """Combines an optax optimizer for the dense parameters with row optimizers.

    The state for `jdp.TrainState.create(params=..., tx=...)` holds `dense_tx`'s
    state for every parameter except the tables (no dense optimizer state is
    allocated for a table) and each table's row-optimizer state. Use it with
    `jdp.sparse.make_train_step` for sparse table gradients; it also works with
    `jdp.make_train_step` (dense table gradients, the same updates).

    Args:
      dense_tx: optax optimizer for all non-table parameters.
      tables: `{path: row_optimizer}`; a path is the table leaf's keys joined by
        `/` (`"embed"`, `"tower/embedding"`) or a tuple of keys.

    Returns:
      A `jdp.sparse.SparseTransformation` (an `optax.GradientTransformation`).

    Raises:
      ValueError: If `tables` is empty, or (at `init`) a path names no parameter.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> tables = {"embed": jdp.sparse.adagrad(0.1)}
      >>> tx = jdp.sparse.partition(optax.adam(1e-3), tables)
      >>> params = {"embed": jnp.zeros((10_000, 8)), "w": jnp.zeros(8)}
      >>> state = jdp.TrainState.create(params=params, tx=tx)
      >>> state.opt_state.dense[0].mu  # Adam moments only for the dense part
      {'embed': None, 'w': Array([0., 0., 0., 0., 0., 0., 0., 0.], dtype=float32)}
    """
    named = tuple((normalize_path(p), opt) for p, opt in tables.items())
    if not named:
        raise ValueError("`jdp.sparse.partition`: `tables` is empty.")
    for path, opt in named:
        if not isinstance(opt, RowOptimizer):
            raise TypeError(
                f"`jdp.sparse.partition`: table {path!r} needs a row optimizer such "
                f"as `jdp.sparse.sgd(lr)` or `jdp.sparse.adagrad(lr)` (a "
                f"`jdp.sparse.RowOptimizer`), got {type(opt).__name__}."
            )

    def init_fn(params):
        leaves, _, index, dense = _split(params, tx, "jdp.sparse.partition")
        return PartitionState(
            dense=dense_tx.init(dense),
            tables={p: opt.init(jnp.asarray(leaves[index[p]])) for p, opt in named},
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "`jdp.sparse.partition(...).update` needs `params` (the tables' row "
                "optimizers update the tables themselves)."
            )
        leaves, treedef, index, dense_params = _split(
            params, tx, "jdp.sparse.partition"
        )
        grads = jax.tree_util.tree_leaves(
            updates, is_leaf=lambda x: isinstance(x, IndexedRows)
        )
        if any(isinstance(g, IndexedRows) for g in grads):
            raise TypeError(
                "`jdp.sparse.partition(...).update` got sparse `IndexedRows` "
                "gradients; apply those with `jdp.sparse.make_train_step`, or pass "
                "dense gradients."
            )
        at_table = set(index.values())
        dense_grads = jax.tree_util.tree_unflatten(
            treedef, [None if i in at_table else g for i, g in enumerate(grads)]
        )
        dense_updates, dense_state = dense_tx.update(
            dense_grads, state.dense, dense_params
        )
        out = _flat_with_none(dense_updates)
        table_states = {}
        for p, opt in named:
            i = index[p]
            new, table_states[p] = opt.update(grads[i], state.tables[p], leaves[i])
            out[i] = new - leaves[i]
        return jax.tree_util.tree_unflatten(treedef, out), PartitionState(
            dense_state, table_states
        )

    tx = SparseTransformation(init_fn, update_fn)
    tx.dense = dense_tx
    tx.tables = named
    return tx


def apply_sparse(
    tx: SparseTransformation, grads: PyTree, opt_state: PartitionState, params: PyTree
) -> tuple[PyTree, PartitionState]:
    """Applies dense grads with `tx.dense` and `IndexedRows` with the row optimizers."""
    leaves, treedef, index, dense_params = _split(
        params, tx, "jdp.sparse.make_train_step"
    )
    flat = jax.tree_util.tree_leaves(
        grads, is_leaf=lambda x: isinstance(x, IndexedRows)
    )
    at_table = set(index.values())
    dense_grads = jax.tree_util.tree_unflatten(
        treedef, [None if i in at_table else g for i, g in enumerate(flat)]
    )
    updates, dense_state = tx.dense.update(dense_grads, opt_state.dense, dense_params)
    new_leaves = _flat_with_none(optax.apply_updates(dense_params, updates))
    table_states = {}
    for p, opt in tx.tables:
        i = index[p]
        new_leaves[i], table_states[p] = opt.update(
            flat[i], opt_state.tables[p], leaves[i]
        )
    return jax.tree_util.tree_unflatten(treedef, new_leaves), PartitionState(
        dense_state, table_states
    )
