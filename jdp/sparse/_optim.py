"""Row-wise optimizers (sparse SGD, Adagrad, momentum, Adam) and `optimizer`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdp import _validate
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


def _update_rows(
    grads: IndexedRows,
    table: jax.Array,
    states: tuple[jax.Array, ...],
    step: Callable[..., tuple[jax.Array, ...]],
    api: str,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Applies a row-wise rule to the rows `grads` touches, and to nothing else.

    Repeated ids are summed first (`combine_rows`), so each touched row is
    updated once, with the gradient the dense path would give it. Invalid ids
    (negative, or `>= num_rows`) read zero state and their writes are dropped.

    Args:
      grads: The sparse gradient.
      table: The table.
      states: Per-row state arrays, each shaped like the table.
      step: `step(rows, *state_rows) -> (delta, *new_state_rows)`.
      api: The optimizer's name, for error messages.

    Returns:
      `(new_table, new_states)`.
    """
    _check_rows(grads, table, api)
    ids, rows = combine_rows(*grads)
    index = _row_index(ids, table.shape[0])
    delta, *new = step(
        rows, *(s.at[index].get(mode="fill", fill_value=0) for s in states)
    )
    table = table.at[index].add(delta.astype(table.dtype), mode="drop")
    states = tuple(
        s.at[index].set(n.astype(s.dtype), mode="drop")
        for s, n in zip(states, new, strict=True)
    )
    return table, states


def _update_dense(
    grads: jax.Array,
    table: jax.Array,
    states: tuple[jax.Array, ...],
    step: Callable[..., tuple[jax.Array, ...]],
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The same rule on a dense gradient: every row counts as touched."""
    delta, *new = step(grads, *states)
    states = tuple(n.astype(s.dtype) for s, n in zip(states, new, strict=True))
    return table + delta.astype(table.dtype), states


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


def _update(grads, table, states, step, api: str):
    """`step` on the touched rows (row gradients) or on every row (a dense one)."""
    if isinstance(grads, IndexedRows):
        return _update_rows(grads, table, states, step, api)
    return _update_dense(grads, table, states, step)


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
        table, states = _update(grads, table, tuple(state), step, "jdp.sparse.adagrad")
        return table, AdagradRowState(*states)

    return RowOptimizer(init_fn, update_fn)


class MomentumRowState(NamedTuple):
    """State of `jdp.sparse.momentum`."""

    momentum: jax.Array  # like the table: each row's momentum buffer


def momentum(
    learning_rate: float, momentum: float, *, nesterov: bool = False
) -> RowOptimizer:
    """SGD with momentum on the rows touched (Caffe2's `SparseMomentumSGDUpdate`).

    Each row of the table has its own momentum buffer `m`. For each distinct id
    in the gradient (repeated ids are summed first), `m[id] = g + momentum *
    m[id]` and `table[id] -= learning_rate * m[id]` (with `nesterov`, `table[id]
    -= learning_rate * (g + momentum * m[id])`). This is `optax.sgd(learning_rate,
    momentum=momentum, nesterov=nesterov)`'s rule, applied to the touched rows
    only.

    Unlike dense momentum, a row that is not in the batch is left alone: it
    keeps its value and its momentum. Dense momentum (`optax.sgd(...,
    momentum=...)`) decays every row's momentum every step and keeps moving the
    rows with nonzero momentum even when they get no gradient. The two give the
    same table only while every row is touched at every step; otherwise a row
    trained here stops moving as soon as it leaves the batch.

    Given a dense gradient (the table trained by `jdp.make_train_step`), every
    row counts as touched, and the update is dense momentum.

    Args:
      learning_rate: Step size (a constant, >= 0).
      momentum: Decay of the momentum buffers, in `[0, 1)`.
      nesterov: Use Nesterov momentum, as `optax.sgd(..., nesterov=True)`.

    Returns:
      A `jdp.sparse.RowOptimizer` whose state is a `MomentumRowState` (one
      buffer shaped like the table, initially zero).

    Raises:
      TypeError: If `learning_rate` or `momentum` is not a real number, or
        `nesterov` is not a bool.
      ValueError: If `learning_rate` or `momentum` is not finite or out of range.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> opt = jdp.sparse.momentum(0.1, momentum=0.5)
      >>> table = jnp.zeros((3, 1))
      >>> state = opt.init(table)
      >>> for ids in ([0, 2], [2]):  # row 2 is in both batches, row 0 in one
      ...     grads = jdp.sparse.IndexedRows(jnp.array(ids), jnp.ones((len(ids), 1)))
      ...     table, state = opt.update(grads, state, table)
      >>> table[:, 0]  # row 0 stopped (dense momentum would move it on to -0.15)
      Array([-0.1 ,  0.  , -0.25], dtype=float32)
      >>> state.momentum[:, 0]  # and kept its momentum (dense: decayed to 0.5)
      Array([1. , 0. , 1.5], dtype=float32)
    """
    lr = _validate.finite_number("learning_rate", learning_rate, at_least=0)
    decay = _validate.finite_number("momentum", momentum, at_least=0, below=1)
    if not isinstance(nesterov, bool):
        raise TypeError(
            f"`nesterov` must be a bool, got {_validate.describe(nesterov)}."
        )

    def init_fn(table):
        return MomentumRowState(jnp.zeros_like(table))

    def step(g, m):
        m = g + decay * m
        direction = g + decay * m if nesterov else m
        return -lr * direction, m

    def update_fn(grads, state, table):
        table, states = _update(grads, table, tuple(state), step, "jdp.sparse.momentum")
        return table, MomentumRowState(*states)

    return RowOptimizer(init_fn, update_fn)


class AdamRowState(NamedTuple):
    """State of `jdp.sparse.adam`."""

    count: jax.Array  # int32 scalar: the number of updates, touched or not
    mu: jax.Array  # like the table: each row's first moment
    nu: jax.Array  # like the table: each row's second moment


def adam(
    learning_rate: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> RowOptimizer:
    """Lazy Adam on the rows touched (PyTorch's `SparseAdam`, TF's `LazyAdam`).

    Each row of the table has its own first and second moments `mu`, `nu`; a
    step count `t` is shared by the whole table. Every update increments `t`;
    for each distinct id in the gradient (repeated ids are summed first, so a
    repeated id counts as one row with the summed gradient, as in the dense
    gradient), `mu[id] = b1 * mu[id] + (1 - b1) * g`, `nu[id] = b2 * nu[id] +
    (1 - b2) * g ** 2` and `table[id] -= learning_rate * mu_hat / (sqrt(nu_hat)
    + eps)`, with `mu_hat = mu[id] / (1 - b1 ** t)` and `nu_hat = nu[id] / (1 -
    b2 ** t)`. This is `optax.adam(learning_rate, b1, b2, eps)`'s rule (`eps`
    is added after the bias correction, as optax does; PyTorch adds it before),
    applied to the touched rows only.

    Unlike dense Adam, a row that is not in the batch is left alone: it keeps
    its value and its moments. Dense Adam (`optax.adam`) decays every row's
    moments every step and keeps moving the rows whose first moment is nonzero
    even when they get no gradient. The two give the same table only while every
    row is touched at every step.

    The bias correction uses the global step count `t`, as PyTorch's
    `SparseAdam` and TF's `LazyAdam` do, not a count of the row's own updates.
    A row first touched at step `t` gets `mu_hat = (1 - b1) * g / (1 - b1 **
    t)` and `nu_hat = (1 - b2) * g ** 2 / (1 - b2 ** t)`, so its first step is
    `learning_rate` at `t = 1` but tends to `(1 - b1) / sqrt(1 - b2)` times
    `learning_rate` for large `t` (2.5 times at step 1000 with the defaults,
    3.2 times in the limit).

    Given a dense gradient (the table trained by `jdp.make_train_step`), every
    row counts as touched, and the update is dense Adam.

    Args:
      learning_rate: Step size (a constant, >= 0).
      b1: Decay of the first moments, in `[0, 1)`.
      b2: Decay of the second moments, in `[0, 1)`.
      eps: Added to the denominator, > 0.

    Returns:
      A `jdp.sparse.RowOptimizer` whose state is an `AdamRowState` (a step count
      and two moments shaped like the table, initially zero).

    Raises:
      TypeError: If a hyperparameter is not a real number.
      ValueError: If a hyperparameter is not finite or out of range.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> opt = jdp.sparse.adam(0.1)
      >>> table = jnp.zeros((3, 1))
      >>> state = opt.init(table)
      >>> for ids in ([0, 2], [2]):  # row 2 is in both batches, row 0 in one
      ...     grads = jdp.sparse.IndexedRows(jnp.array(ids), jnp.ones((len(ids), 1)))
      ...     table, state = opt.update(grads, state, table)
      >>> [round(x, 4) for x in table[:, 0].tolist()]  # row 0 stopped after step 1
      [-0.1, 0.0, -0.2]
      >>> state.mu[:, 0], state.count  # row 0 kept its moments (dense: decayed)
      (Array([0.1 , 0.  , 0.19], dtype=float32), Array(2, dtype=int32))

    References:
      Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.
    """
    lr = _validate.finite_number("learning_rate", learning_rate, at_least=0)
    b1 = _validate.finite_number("b1", b1, at_least=0, below=1)
    b2 = _validate.finite_number("b2", b2, at_least=0, below=1)
    eps = _validate.finite_number("eps", eps, above=0)

    def init_fn(table):
        zeros = jnp.zeros_like(table)
        return AdamRowState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update_fn(grads, state, table):
        count = optax.safe_increment(state.count)

        def step(g, mu, nu):
            mu = (1 - b1) * g + b1 * mu
            nu = (1 - b2) * g**2 + b2 * nu
            mu_hat = mu / (1 - b1**count).astype(mu.dtype)
            nu_hat = nu / (1 - b2**count).astype(nu.dtype)
            return -lr * (mu_hat / (jnp.sqrt(nu_hat) + eps)), mu, nu

        moments = (state.mu, state.nu)
        table, moments = _update(grads, table, moments, step, "jdp.sparse.adam")
        return table, AdamRowState(count, *moments)

    return RowOptimizer(init_fn, update_fn)


# -- mixed models ----------------------------------------------------------------


class OptimizerState(NamedTuple):
    """State of `jdp.sparse.optimizer`: the dense optimizer's and each table's."""

    dense: optax.OptState
    tables: dict[str, Any]


class SparseTransformation(optax.GradientTransformation):
    """An `optax.GradientTransformation` that also trains some tables sparsely.

    Made by `jdp.sparse.optimizer`. Its `init`/`update` follow optax (`update`
    takes dense gradients, so the same optimizer also works with
    `jdp.make_train_step`); `jdp.sparse.rows()` instead applies the
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


def optimizer(
    dense_tx: optax.GradientTransformation,
    tables: Mapping[TablePath, RowOptimizer],
) -> SparseTransformation:
    """Combines an optax optimizer for the dense parameters with row optimizers.

    The state for `jdp.TrainState.create(params=..., tx=...)` holds `dense_tx`'s
    state for every parameter except the tables (no dense optimizer state is
    allocated for a table) and each table's row-optimizer state. Use it with
    `sync=jdp.sparse.rows()` for sparse table gradients; it also works with
    `jdp.make_train_step` (dense table gradients). With `sgd` and `adagrad` both
    give the same updates; with `momentum` and `adam` a dense gradient touches
    every row, so `jdp.make_train_step` gives dense momentum / dense Adam, which
    also moves the rows outside the batch.

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
      >>> tx = jdp.sparse.optimizer(optax.adam(1e-3), tables)
      >>> params = {"embed": jnp.zeros((10_000, 8)), "w": jnp.zeros(8)}
      >>> state = jdp.TrainState.create(params=params, tx=tx)
      >>> state.opt_state.dense[0].mu  # Adam moments only for the dense part
      {'embed': None, 'w': Array([0., 0., 0., 0., 0., 0., 0., 0.], dtype=float32)}
    """
    named = tuple((normalize_path(p), opt) for p, opt in tables.items())
    if not named:
        raise ValueError("`jdp.sparse.optimizer`: `tables` is empty.")
    for path, opt in named:
        if not isinstance(opt, RowOptimizer):
            raise TypeError(
                f"`jdp.sparse.optimizer`: table {path!r} needs a row optimizer such "
                f"as `jdp.sparse.sgd(lr)` or `jdp.sparse.adagrad(lr)` (a "
                f"`jdp.sparse.RowOptimizer`), got {type(opt).__name__}."
            )

    def init_fn(params):
        leaves, _, index, dense = _split(params, tx, "jdp.sparse.optimizer")
        return OptimizerState(
            dense=dense_tx.init(dense),
            tables={p: opt.init(jnp.asarray(leaves[index[p]])) for p, opt in named},
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "`jdp.sparse.optimizer(...).update` needs `params` (the tables' row "
                "optimizers update the tables themselves)."
            )
        leaves, treedef, index, dense_params = _split(
            params, tx, "jdp.sparse.optimizer"
        )
        grads = jax.tree_util.tree_leaves(
            updates, is_leaf=lambda x: isinstance(x, IndexedRows)
        )
        if any(isinstance(g, IndexedRows) for g in grads):
            raise TypeError(
                "`jdp.sparse.optimizer(...).update` got sparse `IndexedRows` "
                "gradients; apply those with `sync=jdp.sparse.rows()`, or pass "
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
        return jax.tree_util.tree_unflatten(treedef, out), OptimizerState(
            dense_state, table_states
        )

    tx = SparseTransformation(init_fn, update_fn)
    tx.dense = dense_tx
    tx.tables = named
    return tx


def apply_sparse(
    tx: SparseTransformation, grads: PyTree, opt_state: OptimizerState, params: PyTree
) -> tuple[PyTree, OptimizerState]:
    """Applies dense grads with `tx.dense` and `IndexedRows` with the row optimizers."""
    leaves, treedef, index, dense_params = _split(params, tx, "jdp.sparse.rows")
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
    return jax.tree_util.tree_unflatten(treedef, new_leaves), OptimizerState(
        dense_state, table_states
    )
