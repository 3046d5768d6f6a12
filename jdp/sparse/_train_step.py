"""`jdp.sparse.rows`: all-reduce for dense params, all-gather for tables."""

from __future__ import annotations

import atexit
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp import _collectives, _jax_compat, _sync
from jdp._tree import PyTree
from jdp.sparse._gather import all_gather_rows, combine_rows
from jdp.sparse._lookup import is_rows, path_name, split_rows, value_and_grad
from jdp.sparse._optim import SparseTransformation, apply_sparse


class IdsOutOfRangeError(ValueError):
    """An id out of its table's range, seen by a `check_ids=True` step.

    It reaches the caller inside a `jax.errors.JaxRuntimeError`.
    """


def _not_an_id_error(record: logging.LogRecord) -> bool:
    """Drops JAX's per-replica log of the id check's error (raised anyway)."""
    return not (record.exc_info and isinstance(record.exc_info[1], IdsOutOfRangeError))


@functools.cache
def _install_filter() -> None:
    """Quiets JAX's logs of the id check's error and its replay at exit (once)."""
    for name in _jax_compat.CALLBACK_LOGGERS:
        logging.getLogger(name).addFilter(_not_an_id_error)
    # Runs before JAX's own exit handlers (registered when JAX was imported),
    # which would raise a handled id check error again from its tokens.
    atexit.register(
        _jax_compat.drop_failed_runtime_tokens,
        lambda e: _jax_compat.error_names_type(e, IdsOutOfRangeError),
    )


def _raise_if_out_of_range(count, first, *, table: str, num_rows: int) -> np.ndarray:
    if int(count):
        raise IdsOutOfRangeError(
            f"jdp.sparse: {int(count)} id(s) out of range [0, {num_rows}) for table "
            f"{table!r} in this step's global batch (first: {int(first)}). Fix the "
            "input pipeline (e.g. hash or clip ids into the table); without "
            "`check_ids` such ids read zero rows and are never updated."
        )
    return np.asarray(True)


def _check_ids(ids: jax.Array, num_rows: int, table: str) -> jax.Array:
    """`ids`, made to depend on a host check of their range (same on every replica)."""
    bad = (ids < 0) | (ids >= num_rows)
    count = jnp.sum(bad)
    first = ids[jnp.argmax(bad)] if ids.size else jnp.zeros((), ids.dtype)
    check = functools.partial(_raise_if_out_of_range, table=table, num_rows=num_rows)
    ok = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.bool_), count, first)
    return jnp.where(ok, ids, -1)


def rows(
    *,
    combine: bool = False,
    check_ids: bool = False,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
) -> _sync.Sync:
    """A sync piece that trains embedding tables with sparse gradients.

    With `tx` made by `jdp.sparse.optimizer` and a loss that reads each table
    through `jdp.sparse.lookup`: dense gradients are all-reduced; each table's
    row gradients are all-gathered and applied to the touched rows only, with
    the results of `jdp.all_reduce()` and the same `tx`. It may be one label's
    piece in a `jdp.partition`. See the Sparse embeddings guide
    (docs/guides/sparse.md).

    Args:
      combine: Sum the rows of repeated ids after gathering (changes no result).
      check_ids: Fail the step on every replica if a gathered id is out of its
        table's range (a debugging mode): reading the step's outputs raises a
        `jax.errors.JaxRuntimeError` carrying the `IdsOutOfRangeError`.
      bucket_bytes: Largest bucket of the dense parameters' all-reduce.
      reduce_dtype: Wire dtype of the dense parameters' all-reduce.

    Returns:
      A `jdp.Sync` that takes tables' gradients as `jdp.sparse.IndexedRows`.

    Raises:
      ValueError: If `bucket_bytes` is out of range or `reduce_dtype` is not a
        real floating-point type.
      TypeError: At trace time, if the optimizer is not a `jdp.sparse.optimizer`.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, ids):
      ...     return jnp.sum(jdp.sparse.lookup(params["embed"], ids) * params["w"])
      >>> tx = jdp.sparse.optimizer(optax.sgd(0.1), {"embed": jdp.sparse.sgd(0.8)})
      >>> step = jdp.parallelize(
      ...     jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows()))
      >>> params = {"embed": jnp.zeros((100_000, 2)), "w": jnp.ones(2)}
      >>> state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
      >>> ids = jnp.array([0, 2, 2, 4, 4, 4, 6, 6])  # one id on each of 8 replicas
      >>> state, metrics = step(state, step.shard(ids))
      >>> step.unreplicate(state).params["embed"][:7, 0]  # -0.8 * count / 8
      Array([-0.1,  0. , -0.2,  0. , -0.3,  0. , -0.2], dtype=float32)
    """
    _collectives.check_bucket_bytes(bucket_bytes)
    _collectives.check_reduce_dtype(reduce_dtype)
    if check_ids:
        _install_filter()
    api = "jdp.sparse.rows"

    def update(grads, state, params, axis_name):
        num = _collectives.axis_size(axis_name, api)
        dense = _collectives.all_reduce(
            split_rows(grads)[0], axis_name=axis_name, bucket_bytes=bucket_bytes,
            reduce_dtype=reduce_dtype, api=api,
        )  # fmt: skip

        def exchange(path, g, reduced, param):
            if not is_rows(g):
                return reduced
            gathered = all_gather_rows(g.ids, g.rows / num, axis_name=axis_name)
            if check_ids:
                ids = _check_ids(gathered.ids, param.shape[0], path_name(path))
                gathered = gathered._replace(ids=ids)
            return combine_rows(*gathered) if combine else gathered

        grads = jax.tree_util.tree_map_with_path(
            exchange, grads, dense, params, is_leaf=is_rows
        )
        return grads, state, {}

    return _sync.TakesRows(None, update)


def differentiate(optimizer: Any):
    """`value_and_grad` that keeps the optimizer's tables' gradients as rows."""
    if not isinstance(optimizer, SparseTransformation):
        raise TypeError(
            "`jdp.sparse.rows` needs an optimizer made by "
            "`jdp.sparse.optimizer(dense_tx, {table_path: jdp.sparse.sgd(lr)})`"
            f"; got {type(optimizer).__name__}. For dense table gradients use "
            "`jdp.all_reduce()`."
        )
    return functools.partial(value_and_grad, tables=[t for t, _ in optimizer.tables])


def apply(grads, state, optimizer) -> tuple[PyTree, PyTree, dict[str, jax.Array]]:
    """`(params, opt_state, {})`: `optimizer` applied, tables on their rows only."""
    return (*apply_sparse(optimizer, grads, state.opt_state, state.params), {})
