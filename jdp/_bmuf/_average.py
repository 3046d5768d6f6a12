"""The average across replicas at a sync: the one place every sync averages."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jdp import _collectives, _wire
from jdp._bmuf._state import float_map
from jdp._tree import PyTree


class Mean(NamedTuple):
    """The replicas' mean of their params at a sync, and the replicas it counts.

    `params` is the block update's `avg` (None where only the count matters);
    `valid` is this replica's validity bit and `share` the fraction of valid
    replicas, both None when every replica counts.
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
        return jax.tree.map(lambda n, o: jnp.where(self.share > 0, n, o), new, old)

    def count_dropped(self, dropped: jax.Array | None, axis_name) -> jax.Array | None:
        """`dropped` plus the number of replicas this mean left out."""
        if self.share is None:
            return dropped
        num = _collectives.axis_size(axis_name, "jdp.bmuf")
        return dropped + num - jnp.round(self.share * num).astype(jnp.int32)


#: The `Mean` of a sync that counts every replica, without its params.
EVERY = Mean()


def params_mean(local: PyTree, ref: PyTree, axis_name, wire=None) -> PyTree:
    """The replicas' mean of `local`; with `wire`, `ref` minus the pseudo-gradients'."""
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
