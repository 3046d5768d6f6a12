"""What a sync does to the state, written once for every schedule.

The block filter (`_outer.velocity`, then `advance`) or the `outer` optimizer,
applied to the mean the averaging step (`jdp._bmuf._average`) hands it; the inner
state at a sync; and the global model following the replicas during warmup.
The block sync applies them to the whole tree, Streaming DiLoCo to each
fragment's slices.
"""

from __future__ import annotations

from typing import Any

import optax
from jax import lax

from jdp._bmuf._average import EVERY
from jdp._bmuf._outer import eta as eta  # the sync's block momentum
from jdp._bmuf._outer import velocity
from jdp._bmuf._state import (
    block_start,
    cast_like,
    float_map,
    float_where,
    lookahead,
    reset,
)

PyTree = Any


def advance(g, start, v, eta):
    """The new `g + v` and, where `start` is stored, the next start `g + eta v`."""
    g = float_map(lambda g, v: g + v, g, v)
    if start is not None:
        start = cast_like(lookahead(g, v, eta), start)
    return g, start


def block_update(g, start, v, avg, eta, block_learning_rate, outer):
    """The block update of a sync: returns the new `g`, `start` and `v`.

    `avg` is the mean of the replicas' locally updated params; `start` is None
    unless the state stores it (`jdp.block_momentum(nesterov=True)`), the block
    start then being `g`. With `outer`, `v` is the outer optimizer's state and
    the new `g` is `g` updated by it with the pseudo-gradient `g - avg`.
    """
    if outer is not None:
        pseudo = float_map(lambda s, a: s - a, g, avg)
        outer_updates, v = outer.update(pseudo, v, g)
        return cast_like(optax.apply_updates(g, outer_updates), g), start, v
    v = velocity(v, avg, block_start(g, start), eta, block_learning_rate)
    g, start = advance(g, start, v, eta)
    return g, start, v


def inner_state_at_sync(inner_state, target, inner, mode, axis_name, mean=EVERY):
    """`inner`'s state after a sync whose block start is `target`.

    Args:
      inner_state: The state, or None where the sync leaves it alone.
      target: The next block start (what `inner.init` resets to).
      inner: The inner optimizer.
      mode: `inner_state_at_sync`: "reset" its floating leaves, "average"
        them over the replicas `mean` counts (reset if it counts none), or
        "keep" them (reset on a replica `mean` left out: its own accumulators
        may be what went bad).
      axis_name: The replica axis.
      mean: The sync's `Mean`, which says which replicas it counts; every
        replica by default.

    Returns:
      The new state (None for None).
    """
    if inner_state is None or (mode == "keep" and mean.valid is None):
        return inner_state
    if mode == "average" and mean.valid is None:
        return mean.of(inner_state, axis_name)
    initial = reset(inner_state, inner.init(target))
    if mode == "reset":
        return initial
    if mode == "average":
        return float_where(mean.share > 0, mean.of(inner_state, axis_name), initial)
    return float_where(mean.valid, inner_state, initial)


def follow_warmup(params, old_state, state, applied, warmup_steps):
    """`(g, start, pending)`: during warmup, the replicas' (identical) params.

    On an update during the first `warmup_steps` updates, `g` (and `start` and
    `pending`, where the state has them) become the locally updated `params`;
    otherwise they are the state's.
    """
    g, start, pending = state.global_params, state.start, state.pending
    if not warmup_steps:
        return g, start, pending

    def follow(operands):
        params, g, start, pending = operands
        g = cast_like(params, g)
        pending = None if pending is None else cast_like(params, pending)
        return g, (None if start is None else g), pending

    return lax.cond(
        applied & (old_state.count < warmup_steps),
        follow,
        lambda operands: operands[1:],
        (params, g, start, pending),
    )
