"""Private: how a step's metrics are combined over replicas (`jdp.metrics`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp._layout import AxisName
from jdp._tree import PyTree, keystr


@dataclasses.dataclass(frozen=True)
class Reduced:
    """A metric value and how to combine it over replicas (a pytree node)."""

    value: Any
    how: Literal["sum", "gather"]


jax.tree_util.register_dataclass(Reduced, data_fields=["value"], meta_fields=["how"])


class Weighted(NamedTuple):
    """A total and the weight it is to be divided by, once, over all replicas."""

    total: Any
    weight: Any

    def __repr__(self) -> str:
        return (
            f"Weighted(total={self.total!r}, weight={self.weight!r}) (a `jdp.weighted` "
            "pair, which a `jdp.make_train_step` step divides over all replicas; "
            "outside one, differentiate `w.total / w.weight`, this replica's mean)"
        )


def weighted(total: Any, weight: Any) -> Weighted:
    """A loss or metric normalised by a count that differs between replicas.

    Return `jdp.weighted(jnp.sum(loss * mask), jnp.sum(mask))` instead of the
    replica's own mean: `jdp.make_train_step` sums the totals, the weights and
    the gradients over replicas (and microbatches) and divides once by the
    global weight, for one device's per-item mean. Among a step's metrics, a
    weighted value comes back as `sum(total) / sum(weight)`. See the Padding
    guide (docs/guides/padding.md).

    Args:
      total: The replica's sum (a scalar), e.g. of per-token losses times the mask.
      weight: What it is to be divided by (a scalar), e.g. the number of real
        tokens. No gradient flows into it.

    Returns:
      A `Weighted` pair for the step to return.

    Raises:
      ValueError: If `total` or `weight` is not a scalar.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> def eval_step(state, batch):
      ...     real = (batch > 0).astype(jnp.float32)
      ...     return {"mean": jdp.weighted(jnp.sum(batch * real), jnp.sum(real))}
      >>> step = jdp.parallelize(eval_step, devices=jax.devices()[:2])
      >>> batch = jnp.array([0.0, 0.0, 3.0, 5.0])  # replica 0: all padding
      >>> float(step(step.replicate({}), step.shard(batch))["mean"])
      4.0
    """
    for name, x in (("total", total), ("weight", weight)):
        if np.ndim(x) != 0:
            raise ValueError(
                f"`jdp.weighted` takes a scalar {name} (a sum over the replica's "
                f"items); got shape {np.shape(x)}. Sum it first, e.g. "
                "`jdp.weighted(jnp.sum(loss * mask), jnp.sum(mask))`."
            )
    return Weighted(total, weight)


def is_marker(x: Any) -> bool:
    """Whether `x` says how to combine it (`jdp.metrics.sum`, `jdp.weighted`, ...)."""
    return isinstance(x, (Reduced, Weighted))


def sum(x: Any) -> Reduced:  # noqa: A001 - `jdp.metrics.sum`, as users write it
    """Marks a metric to be summed over replicas instead of averaged.

    Integer and boolean values are summed as integers (exact counts); floating
    values in their own dtype.

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

    Per-example values are concatenated in replica order, the order of the
    global batch given to `step.shard`; with `step.shard(..., pad=True)`, drop
    the padded rows with the mask (`values[np.asarray(mask).reshape(-1)]`). A
    scalar gives one value per replica.

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


def reduce_metrics(metrics: PyTree, axis_name: AxisName, totals: dict | None = None):
    """A step's metrics combined over replicas: averaged unless marked otherwise.

    `totals` maps a microbatch mean to its total, which a `jdp.metrics.sum` of
    that very value sums.
    """
    totals = totals or {}

    def combine(path, m):
        if isinstance(m, Weighted):
            total, weight = (as_array(path, x, m) for x in m)
            dtype = sum_dtype(total.dtype)
            both = lax.psum((total.astype(dtype), weight.astype(dtype)), axis_name)
            mean = ratio(*both)  # an integer total's mean stays a float
            floating = jnp.issubdtype(total.dtype, jnp.inexact)
            return mean.astype(total.dtype) if floating else mean
        how, marker = "mean", None
        if isinstance(m, Reduced):
            marker, m, how = m, m.value, m.how
            mean, total = totals.get(id(m), (None, None))
            if how == "sum" and mean is m:
                m = total
        m = as_array(path, m, marker)
        if how == "sum":
            # Booleans and narrow integers (a uint8 mask's sum) count in int32,
            # so that a total over replicas cannot wrap around.
            narrow = jnp.issubdtype(m.dtype, jnp.integer) and m.dtype.itemsize < 4
            if narrow or m.dtype == jnp.bool_:
                m = m.astype(jnp.int32)
            return lax.psum(m, axis_name)
        if how == "gather":
            if m.ndim and m.shape[0] == 0:  # nothing on any replica (same shapes)
                return m
            return lax.all_gather(m, axis_name, tiled=m.ndim >= 1)
        if not jnp.issubdtype(m.dtype, jnp.inexact):
            m = m.astype(jnp.result_type(float))  # integer counts average to floats
        return _mean(m, axis_name)

    return jax.tree_util.tree_map_with_path(combine, metrics, is_leaf=is_marker)


def sum_dtype(dtype: Any) -> Any:
    """The type a weighted total and its weight are summed in: float32 at least."""
    if not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.result_type(float)
    return jnp.promote_types(dtype, jnp.float32)


def ratio(total: jax.Array, weight: jax.Array) -> jax.Array:
    """`total / weight`, 0 where `weight` is not positive."""
    some = weight > 0
    return jnp.where(some, total / jnp.where(some, weight, 1), 0)


def _mean(m: jax.Array, axis_name: AxisName) -> jax.Array:
    """The mean over replicas; for a scalar all replicas hold alike, that value.

    (A sum over N is often an ulp off it: replica 0's value is returned where
    the mean is within N ulps of it.)
    """
    dtype = m.dtype
    if jnp.finfo(dtype).bits < 32:  # a float16 sum over replicas could overflow
        m = m.astype(jnp.float32)
    if m.ndim:  # arrays: a plain mean (their second copy would cost real bytes)
        return lax.pmean(m, axis_name).astype(dtype)
    first = jnp.where(lax.axis_index(axis_name) == 0, m, jnp.zeros_like(m))
    total, first = lax.psum((m, first), axis_name)
    num = lax.axis_size(axis_name)
    mean = total / num
    ulp = float(jnp.finfo(dtype).eps) * jnp.abs(first)  # (float8 does not promote)
    return jnp.where(jnp.abs(mean - first) <= num * ulp, first, mean).astype(dtype)


def check_no_markers(state: PyTree) -> None:
    """A step's new state must hold no metric marker (they belong in metrics)."""
    for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_marker)[0]:
        if is_marker(x):
            raise TypeError(
                f"The step returned a {_marker_name(x)} in its state, at "
                f"{keystr(path)}; markers say how to combine a metric over replicas, "
                "so return it among the metrics (the step's second result), and keep "
                "the plain value in the state."
            )


def _marker_name(m: Any) -> str:
    return "`jdp.weighted`" if isinstance(m, Weighted) else f"`jdp.metrics.{m.how}`"


def as_array(path, m, marker=None) -> jax.Array:
    """A metric's value as an array, refused if it is a marker inside `marker`."""
    if is_marker(m):
        raise TypeError(
            f"The step's metric {keystr(path)} is marked twice (a "
            f"{_marker_name(marker)} of a {_marker_name(m)}); mark it once."
        )
    dtype = getattr(m, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"The step's metric {keystr(path)} is a PRNG key; metrics must be "
            "numbers or numeric arrays. Return `jax.random.key_data(key)` if you "
            "need its bits, or keep the key in the state."
        )
    kind = getattr(dtype, "kind", "")  # bfloat16 and the float8s are "V" too
    bad_kind = kind in ("U", "S", "O") or (
        kind == "V" and not jnp.issubdtype(dtype, jnp.number)
    )
    if bad_kind or (dtype is None and not isinstance(m, (bool, int, float, complex))):
        raise TypeError(
            f"The step's metric {keystr(path)} is a {type(m).__name__} "
            f"({m!r:.60}); metrics must be numbers or numeric arrays, which "
            "jdp averages over replicas. Return text or other objects from "
            "the host side of your loop instead."
        )
    return jnp.asarray(m)
