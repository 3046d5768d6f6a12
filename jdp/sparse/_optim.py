"""Row-wise optimizers (sparse SGD, Adagrad, momentum, Adam) and `optimizer`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdp import _validate
from jdp._tree import PyTree
from jdp.sparse import _lookup
from jdp.sparse._gather import combine_rows
from jdp.sparse._lookup import IndexedRows, TablePath, is_rows, locate_tables


class RowOptimizer(NamedTuple):
    """An optimizer for one table that can update only the rows it is given.

    Attributes:
      init: `init(table) -> state`.
      update: `update(grads, state, table) -> (new_table, new_state)`, `grads`
        being `jdp.sparse.IndexedRows` (only those rows change) or dense.
    """

    init: Callable[[jax.Array], Any]
    update: Callable[[Any, Any, jax.Array], tuple[jax.Array, Any]]


def _update(grads: IndexedRows | jax.Array, table: jax.Array,
            states: tuple[jax.Array, ...], step: Callable[..., tuple[jax.Array, ...]],
            api: str) -> tuple[jax.Array, tuple[jax.Array, ...]]:  # fmt: skip
    """`step(g, *state_rows) -> (delta, *new_state_rows)` on the rows touched.

    With per-row state, repeated ids are summed first; invalid ids are dropped.
    """
    if not isinstance(grads, IndexedRows):
        delta, *new = step(grads, *states)
        states = tuple(n.astype(s.dtype) for s, n in zip(states, new, strict=True))
        return table + delta.astype(table.dtype), states
    if grads.rows.shape[1:] != table.shape[1:] or grads.ids.ndim != 1:
        raise ValueError(
            f"`{api}`: got ids of shape {grads.ids.shape} and rows of shape "
            f"{grads.rows.shape} for a table of shape {table.shape}; expected ids "
            f"(n,) and rows (n,) + {table.shape[1:]}."
        )
    ids, rows = combine_rows(*grads) if states else grads
    index = _lookup.row_index(ids, table.shape[0])
    gathered = (s.at[index].get(mode="fill", fill_value=0) for s in states)
    delta, *new = step(rows, *gathered)
    table = table.at[index].add(delta.astype(table.dtype), mode="drop")
    states = tuple(
        s.at[index].set(n.astype(s.dtype), mode="drop")
        for s, n in zip(states, new, strict=True)
    )
    return table, states


def _row_optimizer(init_fn, step, api: str) -> RowOptimizer:
    """`step` on the rows touched; the state is a NamedTuple of per-row arrays."""

    def update_fn(grads, state, table):
        table, states = _update(grads, table, tuple(state), step, api)
        return table, type(state)(*states)

    return RowOptimizer(init_fn, update_fn)


def sgd(learning_rate: float) -> RowOptimizer:
    """Plain SGD on the rows touched: `table[ids] -= learning_rate * rows`.

    The same table as `optax.sgd(learning_rate)` on the dense gradient.

    Args:
      learning_rate: Step size (a constant).

    Returns:
      A `jdp.sparse.RowOptimizer` (stateless).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> opt, table = jdp.sparse.sgd(0.5), jnp.zeros((3, 2))
      >>> grads = jdp.sparse.IndexedRows(jnp.array([1, 1]), jnp.ones((2, 2)))
      >>> opt.update(grads, opt.init(table), table)[0][:, 0]
      Array([ 0., -1.,  0.], dtype=float32)
    """

    def update_fn(grads, state, table):  # any state: it has none
        step = lambda g: (-learning_rate * g,)  # noqa: E731
        return _update(grads, table, (), step, "jdp.sparse.sgd")[0], state

    return RowOptimizer(lambda table: optax.EmptyState(), update_fn)


class AdagradRowState(NamedTuple):
    """State of `jdp.sparse.adagrad`."""

    sum_of_squares: jax.Array  # like the table


def adagrad(
    learning_rate: float, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> RowOptimizer:
    """Adagrad on the rows touched (Caffe2's `SparseAdagrad`).

    `optax.adagrad`'s rule on each distinct id (repeated ids summed first), so
    the dense gradient gives the same table. Duchi, Hazan and Singer, JMLR 2011.

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
    """

    def init_fn(table):
        return AdagradRowState(jnp.full_like(table, initial_accumulator_value))

    def step(g, s):
        s = g * g + s
        inv = jnp.where(s > 0, jax.lax.rsqrt(s + eps), 0.0)
        return -learning_rate * (inv * g), s

    return _row_optimizer(init_fn, step, "jdp.sparse.adagrad")


class MomentumRowState(NamedTuple):
    """State of `jdp.sparse.momentum`."""

    momentum: jax.Array  # like the table: each row's momentum buffer


def momentum(
    learning_rate: float, momentum: float, *, nesterov: bool = False
) -> RowOptimizer:
    """SGD with momentum on the rows touched (Caffe2's `SparseMomentumSGDUpdate`).

    `optax.sgd(learning_rate, momentum, nesterov=nesterov)`'s rule on the
    touched rows only (repeated ids summed first); a row not in the batch keeps
    its value and momentum, where dense momentum moves it.

    Args:
      learning_rate: Step size (a constant, >= 0).
      momentum: Decay of the momentum buffers, in `[0, 1)`.
      nesterov: Use Nesterov momentum.

    Returns:
      A `jdp.sparse.RowOptimizer` whose state is a `MomentumRowState`.

    Raises:
      TypeError: If an argument has the wrong type.
      ValueError: If `learning_rate` or `momentum` is not finite or in range.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> opt, table = jdp.sparse.momentum(0.1, momentum=0.5), jnp.zeros((3, 1))
      >>> state = opt.init(table)
      >>> for ids in ([0, 2], [2]):  # row 0 only in the first batch
      ...     grads = jdp.sparse.IndexedRows(jnp.array(ids), jnp.ones((len(ids), 1)))
      ...     table, state = opt.update(grads, state, table)
      >>> table[:, 0]  # row 0 stopped (dense momentum would move it on to -0.15)
      Array([-0.1 ,  0.  , -0.25], dtype=float32)
    """
    lr = _validate.finite_number("learning_rate", learning_rate, at_least=0)
    decay = _validate.finite_number("momentum", momentum, at_least=0, below=1)
    _validate.boolean("nesterov", nesterov)

    def step(g, m):
        m = g + decay * m
        return -lr * (g + decay * m if nesterov else m), m

    zeros = lambda table: MomentumRowState(jnp.zeros_like(table))  # noqa: E731
    return _row_optimizer(zeros, step, "jdp.sparse.momentum")


class AdamRowState(NamedTuple):
    """State of `jdp.sparse.adam`."""

    count: jax.Array  # int32 scalar: the number of updates, touched or not
    mu: jax.Array  # like the table: each row's first moment
    nu: jax.Array  # like the table: each row's second moment


def adam(
    learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> RowOptimizer:
    """Lazy Adam on the rows touched (PyTorch's `SparseAdam`, TF's `LazyAdam`).

    `optax.adam(learning_rate, b1, b2, eps)`'s rule on the touched rows only
    (repeated ids summed first); a row not in the batch keeps its value and
    moments, where dense Adam moves it. The bias correction uses the table's
    step count. Kingma and Ba, ICLR 2015.

    Args:
      learning_rate: Step size (a constant, >= 0).
      b1: Decay of the first moments, in `[0, 1)`.
      b2: Decay of the second moments, in `[0, 1)`.
      eps: Added to the denominator, > 0.

    Returns:
      A `jdp.sparse.RowOptimizer` whose state is an `AdamRowState`.

    Raises:
      TypeError: If a hyperparameter is not a real number.
      ValueError: If a hyperparameter is not finite or out of range.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> opt, table = jdp.sparse.adam(0.1), jnp.zeros((3, 1))
      >>> state = opt.init(table)
      >>> for ids in ([0, 2], [2]):  # row 0 only in the first batch
      ...     grads = jdp.sparse.IndexedRows(jnp.array(ids), jnp.ones((len(ids), 1)))
      ...     table, state = opt.update(grads, state, table)
      >>> state.mu[:, 0], state.count  # row 0 kept its moments (dense: decayed)
      (Array([0.1 , 0.  , 0.19], dtype=float32), Array(2, dtype=int32))
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


class OptimizerState(NamedTuple):
    """State of `jdp.sparse.optimizer`: the dense optimizer's and each table's."""

    dense: optax.OptState
    tables: dict[str, Any]


class SparseTransformation(optax.GradientTransformation):
    """An `optax.GradientTransformation` that also trains some tables sparsely.

    Made by `jdp.sparse.optimizer`. Its `update` takes a table's gradient dense
    or as `jdp.sparse.IndexedRows`, and returns the table's update dense.

    Attributes:
      dense: The optimizer of every parameter that is not a table.
      tables: `((path, RowOptimizer), ...)`, paths as `"a/b"` strings.
    """

    dense: optax.GradientTransformation
    tables: tuple[tuple[str, RowOptimizer], ...]


def optimizer(
    dense_tx: optax.GradientTransformation, tables: Mapping[TablePath, RowOptimizer]
) -> SparseTransformation:
    """Combines an optax optimizer for the dense parameters with row optimizers.

    For `sync=jdp.sparse.rows()` (the tables' rows only are updated), or the
    dense path (`jdp.all_reduce()`). No dense optimizer state is allocated for
    the tables.

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
      >>> tx.init(params).dense[0].mu["embed"] is None  # no Adam moments for the table
      True
    """
    api = "jdp.sparse.optimizer"
    named = tuple((_lookup.normalize_path(p), opt) for p, opt in tables.items())
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
        leaves, _, index = locate_tables(params, [t for t, _ in named], api=api)
        return OptimizerState(
            dense=dense_tx.init(_without_tables(params, index)),
            tables={p: opt.init(jnp.asarray(leaves[index[p]])) for p, opt in named},
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "`jdp.sparse.optimizer(...).update` needs `params` (the tables' row "
                "optimizers update the tables themselves)."
            )
        return apply_sparse(tx, updates, state, params, api=api, as_updates=True)

    tx = SparseTransformation(init_fn, update_fn)
    tx.dense, tx.tables = dense_tx, named
    return tx


def _without_tables(tree: PyTree, index: dict[str, int]) -> PyTree:
    """`tree` with None at the table leaves (`index`'s leaf positions)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_rows)
    at_table = set(index.values())
    leaves = [None if i in at_table else x for i, x in enumerate(leaves)]
    return treedef.unflatten(leaves)


def apply_sparse(
    tx: SparseTransformation, grads: PyTree, opt_state: OptimizerState, params: PyTree,
    *, api: str = "jdp.sparse.rows", as_updates: bool = False,
) -> tuple[PyTree, OptimizerState]:  # fmt: skip
    """New params (or with `as_updates`, optax's updates) from `tx` on `grads`."""
    leaves, treedef, index = locate_tables(params, [t for t, _ in tx.tables], api=api)
    dense_params = _without_tables(params, index)
    updates, dense_state = tx.dense.update(
        _without_tables(grads, index), opt_state.dense, dense_params
    )
    if not as_updates:
        updates = optax.apply_updates(dense_params, updates)
    out = jax.tree.leaves(updates, is_leaf=lambda x: x is None)
    grad_leaves = jax.tree.leaves(grads, is_leaf=is_rows)
    table_states = {}
    for p, opt in tx.tables:
        i = index[p]
        new, table_states[p] = opt.update(
            grad_leaves[i], opt_state.tables[p], leaves[i]
        )
        out[i] = new - leaves[i] if as_updates else new
    return treedef.unflatten(out), OptimizerState(dense_state, table_states)
