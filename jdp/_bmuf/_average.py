"""The average across replicas at a sync: the seam upstream of the block update.

Every sync averages the replicas' params here, and nowhere else: the block sync
on the whole tree, a fragment's sync with `delay=0`, and each chunk of a
delayed one (`params_mean`: a plain all-reduce, or a compressed exchange with
`wire=`). The block sync hands the update a `Mean`, which also says which
replicas it counted: every one, or (`jdp._bmuf._drop`) the valid ones only. The
update formula (`jdp._bmuf._update`) reads the mean alone, so neither dropping
nor `wire=` has an update of its own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jdp import _collectives, _wire
from jdp._bmuf._state import float_map

PyTree = Any


class Mean(NamedTuple):
    """The replicas' mean of their params at a sync, and the replicas it counts.

    Attributes:
      params: The mean of the replicas' locally updated params (the block
        update's `avg`); None where only the replicas counted matter.
      valid: This replica's validity bit (bool, shape ()), or None: every
        replica counts.
      share: The fraction of the replicas that are valid (float32, shape ()),
        or None: every replica counts.
    """

    params: PyTree = None
    valid: jax.Array | None = None
    share: jax.Array | None = None

    def of(self, tree: PyTree, axis_name) -> PyTree:
        """The mean of another tree (the inner state) over the same replicas."""
        if self.valid is None:
            return mean(tree, axis_name)
        return divided(mean(masked(tree, self.valid), axis_name), self.share)

    def unless_none_valid(self, new: PyTree, old: PyTree) -> PyTree:
        """`new`, or `old` where no replica was valid (the update is skipped)."""
        if self.share is None:
            return new
        any_valid = self.share > 0
        return jax.tree.map(lambda n, o: jnp.where(any_valid, n, o), new, old)

    def count_dropped(self, dropped: jax.Array | None, axis_name) -> jax.Array | None:
        """`dropped` plus the number of replicas this mean left out."""
        if self.share is None:
            return dropped
        num = _collectives.axis_size(axis_name, "jdp.bmuf")
        count = jnp.round(self.share * num).astype(jnp.int32)
        return dropped + (num - count)


#: The `Mean` of a sync that counts every replica, without its params.
EVERY = Mean()


def params_mean(local: PyTree, ref: PyTree, axis_name, wire=None) -> PyTree:
    """The replicas' mean of their `local` params at a sync: the one place.

    `ref` (the same structure) is the block start every replica began from:
    with a `wire` format the outer pseudo-gradient `ref - local` is what is
    compressed and averaged (`_wire.mean`), and the result is `ref` minus that
    mean; without one, the params themselves are averaged.
    """
    if wire is None:
        return mean(local, axis_name)
    pseudo = float_map(lambda r, x: r - x.astype(r.dtype), ref, local)
    avg, _ = _wire.mean(pseudo, wire=wire, axis_name=axis_name, api="jdp.bmuf")
    return float_map(lambda r, d: r - d, ref, avg)


def mean(tree: PyTree, axis_name) -> PyTree:
    """Mean over replicas of the floating leaves (integer leaves pass through)."""
    return _collectives.all_reduce_gradients(tree, axis_name=axis_name, reverse=False)


def masked(tree: PyTree, valid: jax.Array) -> PyTree:
    """`tree`'s floating leaves, zeros where this replica is not `valid`."""
    return float_map(lambda x: jnp.where(valid, x, jnp.zeros_like(x)), tree)


def divided(total: PyTree, share: jax.Array) -> PyTree:
    """The mean of masked contributions over the valid replicas' `share`."""
    return float_map(lambda x: (x / share).astype(x.dtype), total)
