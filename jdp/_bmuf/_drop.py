"""Dropping bad replicas (`on_bad_replica="drop"`): the mean of the valid ones.

Each replica's validity bit masks its contribution and rides in the same
all-reduce; the contributions' mean over the bits' mean is the valid replicas'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdp._bmuf._average import Mean, divided, masked, mean
from jdp._tree import PyTree, as_real, finite, is_float


def valid_mean(local: PyTree, ref: PyTree, axis_name, max_norm) -> Mean:
    """The valid replicas' mean of their `local` params, `ref` the block start."""
    valid = _replica_valid(local, ref, max_norm)
    total, share = mean((masked(local, valid), valid.astype(jnp.float32)), axis_name)
    return Mean(divided(total, share), valid, share)


def _replica_valid(params, ref, max_norm) -> jax.Array:
    """This replica's validity bit: finite params, within `max_norm` of `ref`."""
    if max_norm is None:
        return finite(params)
    squares = jnp.zeros((), jnp.float32)
    for x, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        if is_float(x):
            d = [as_real(jnp.asarray(a)).astype(jnp.float32) for a in (x, r)]
            squares += jnp.sum((d[0] - d[1]) ** 2)
    return finite(params) & (jnp.sqrt(squares) <= max_norm)
