"""Private: how a step's metrics are combined over replicas (`jdp.metrics`).

A metric a step returns is averaged over replicas by default. Wrapped with
`jdp.metrics.sum` it is summed (integers stay integers, so counts are exact), and
with `jdp.metrics.gather` every replica's values are gathered in replica order,
which is the global batch order for per-example values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from jdp._layout import AxisName
from jdp._tree import keystr

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Reduced:
    """A metric value and how to combine it over replicas (not a pytree node)."""

    value: Any
    how: Literal["sum", "gather"]


def sum(x: Any) -> Reduced:  # noqa: A001 - `jdp.metrics.sum`, as users write it
    """Marks a metric to be summed over replicas instead of averaged.

    Integer and boolean values are summed as integers (exact counts); floating
    values in their own dtype. Use it in the step given to `jdp.parallelize`.

    Args:
      x: The replica's value: a number or array.

    Returns:
      A marker the step returns among its metrics; the caller receives the sum.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> def eval_step(state, batch):
      ...     return {"correct": jdp.metrics.sum(jnp.sum(batch > 1)),
      ...             "rate": jnp.mean(batch > 1)}
      >>> step = jdp.parallelize(eval_step, devices=jax.devices()[:2])
      >>> m = step(step.replicate({}), step.shard(jnp.arange(6)))
      >>> m["correct"], round(float(m["rate"]), 4)
      (Array(4, dtype=int32), 0.6667)
    """
    return Reduced(x, "sum")


def gather(x: Any) -> Reduced:
    """Marks a metric whose every replica's values come back, in batch order.

    Per-example values (a leading axis of the replica's examples) are
    concatenated in replica order, which is the order of the global batch given
    to `step.shard`: predictions for every example, say. With
    `step.shard(..., pad=True)`, drop the padded rows with the mask:
    `values[np.asarray(mask).reshape(-1)]`. A scalar gives one value per replica.

    Args:
      x: The replica's values: an array with a leading example axis, or a scalar.

    Returns:
      A marker the step returns among its metrics; the caller receives the
      gathered values.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jdp
      >>> def predict(state, batch):
      ...     return {"pred": jdp.metrics.gather(batch * 10)}
      >>> step = jdp.parallelize(predict, devices=jax.devices()[:4])
      >>> batch, mask = step.shard(jnp.arange(6), pad=True)
      >>> pred = step(step.replicate({}), batch)["pred"]
      >>> pred[np.asarray(mask).reshape(-1)]
      Array([ 0, 10, 20, 30, 40, 50], dtype=int32)
    """
    return Reduced(x, "gather")


def _is_reduced(x: Any) -> bool:
    return isinstance(x, Reduced)


def reduce_metrics(metrics: PyTree, axis_name: AxisName) -> PyTree:
    """A step's metrics combined over replicas: averaged unless marked otherwise."""

    def combine(path, m):
        how = "mean"
        if isinstance(m, Reduced):
            m, how = m.value, m.how
        m = _as_array(path, m)
        if how == "sum":
            if m.dtype == jnp.bool_:
                m = m.astype(jnp.int32)
            return lax.psum(m, axis_name)
        if how == "gather":
            return lax.all_gather(m, axis_name, tiled=m.ndim >= 1)
        if not jnp.issubdtype(m.dtype, jnp.inexact):
            m = m.astype(jnp.result_type(float))  # integer counts average to floats
        return lax.pmean(m, axis_name)

    return jax.tree_util.tree_map_with_path(combine, metrics, is_leaf=_is_reduced)


def _as_array(path, m) -> jax.Array:
    dtype = getattr(m, "dtype", None)
    if (dtype is None and not isinstance(m, (bool, int, float, complex))) or (
        getattr(dtype, "kind", "") in ("U", "S", "O", "V")
    ):
        raise TypeError(
            f"The step's metric {keystr(path)} is a {type(m).__name__} "
            f"({m!r:.60}); metrics must be numbers or numeric arrays, which "
            "jdp averages over replicas. Return text or other objects from "
            "the host side of your loop instead."
        )
    return jnp.asarray(m)
