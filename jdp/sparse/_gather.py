"""Exchanging sparse rows between replicas: Caffe2's Concat of GradientSlices."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdp._collectives import AxisName, axis_size, resolve_axis
from jdp.sparse._lookup import IndexedRows, integer_ids


def _flat(ids: Any, rows: Any, api: str) -> IndexedRows:
    ids = integer_ids(ids, api)
    rows = jnp.asarray(rows)
    if rows.shape[: ids.ndim] != ids.shape:
        raise ValueError(
            f"`{api}`: rows of shape {rows.shape} do not start with the ids' shape "
            f"{ids.shape}; give one row per id, `rows.shape == ids.shape + "
            "row_shape`."
        )
    n = ids.size
    return IndexedRows(ids.reshape(n), rows.reshape((n,) + rows.shape[ids.ndim :]))


def combine_rows(ids: Any, rows: Any) -> IndexedRows:
    """Sums the rows of repeated ids (a coalesce with a static shape).

    Args:
      ids: Integer ids, shape `(n,)`.
      rows: One row per id, shape `(n, ...)`.

    Returns:
      `IndexedRows` of the same shapes: each distinct id once, in increasing
      order, with the sum of its rows, then `-1` padding slots with zero rows
      (unsigned ids come back as int32, where -1 is no row).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> ids, rows = jdp.sparse.combine_rows(jnp.array([4, 1, 4]), jnp.ones((3, 2)))
      >>> ids, rows[:, 0]
      (Array([ 1,  4, -1], dtype=int32), Array([1., 2., 0.], dtype=float32))
    """
    ids, rows = _flat(ids, rows, "jdp.sparse.combine_rows")
    if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
        # The -1 padding would wrap to a real row (255 for uint8 ids).
        ids = ids.astype(jnp.int64 if ids.dtype.itemsize == 8 else jnp.int32)
    n = ids.shape[0]
    if n == 0:
        return IndexedRows(ids, rows)
    # Padding (-1) sorts last, a real -1 first: both are skipped as invalid.
    unique, inverse = jnp.unique(ids, size=n, fill_value=-1, return_inverse=True)
    summed = jax.ops.segment_sum(rows, inverse.reshape(n), num_segments=n)
    return IndexedRows(unique, summed)


def all_gather_rows(
    ids: Any,
    rows: Any,
    *,
    axis_name: AxisName | None = None,
    combine: bool = False,
) -> IndexedRows:
    """Concatenates every replica's `(ids, rows)` slices, inside a parallel step.

    Replica 0's first; the rows are concatenated, not averaged.

    Args:
      ids: This replica's integer ids, any shape.
      rows: One row per id, shape `ids.shape + row_shape`.
      axis_name: Replica axis; None (default) uses `jdp.parallelize`'s.
      combine: Sum the rows of repeated ids with `jdp.sparse.combine_rows`.

    Returns:
      `IndexedRows` of `num_replicas * ids.size` ids and rows, on every replica.

    Raises:
      RuntimeError: If `axis_name` is not bound (outside a parallel step).
      ValueError: If `rows` does not have one row per id.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> def step_fn(state, batch):
      ...     ones = jnp.ones((2, 1))
      ...     ids, rows = jdp.sparse.all_gather_rows(batch, ones, combine=True)
      ...     return state, {"ids": ids, "rows": rows[:, 0]}
      >>> step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
      >>> out = step(step.replicate({}), step.shard(jnp.array([5, 7, 7, 2])))[1]
      >>> out["ids"].astype(int), out["rows"]
      (Array([ 2,  5,  7, -1], dtype=int32), Array([1., 1., 2., 0.], dtype=float32))
    """
    api = "jdp.sparse.all_gather_rows"
    axis_name = resolve_axis(axis_name)
    axis_size(axis_name, api)
    ids, rows = _flat(ids, rows, api)
    if ids.shape[0] == 0:  # XLA refuses to gather nothing; every replica has none
        return combine_rows(ids, rows) if combine else IndexedRows(ids, rows)
    gathered = IndexedRows(*lax.all_gather((ids, rows), axis_name, tiled=True))
    return combine_rows(*gathered) if combine else gathered
