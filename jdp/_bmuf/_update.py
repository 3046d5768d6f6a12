"""What a sync does to the state, for the whole tree or a fragment's slices."""

from __future__ import annotations

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


def advance(g, start, v, eta):
    """The new `g + v` and, where `start` is stored, the next start `g + eta v`."""
    g = float_map(lambda g, v: g + v, g, v)
    if start is not None:
        start = cast_like(lookahead(g, v, eta), start)
    return g, start


def block_update(g, start, v, avg, eta, block_learning_rate, outer):
    """The new `(g, start, v)` of a sync, `avg` the replicas' mean.

    With `outer`, `v` is its state and `g` moves by its update of the
    pseudo-gradient `g - avg`; `start` is None unless the state stores it.
    """
    if outer is not None:
        pseudo = float_map(lambda s, a: s - a, g, avg)
        outer_updates, v = outer.update(pseudo, v, g)
        return cast_like(optax.apply_updates(g, outer_updates), g), start, v
    v = velocity(v, avg, block_start(g, start), eta, block_learning_rate)
    g, start = advance(g, start, v, eta)
    return g, start, v


def inner_state_at_sync(inner_state, target, inner, mode, axis_name, mean=EVERY):
    """`inner`'s state (None: left alone) after a sync whose block start is `target`.

    `mode` "reset" resets its floating leaves, "average" averages them over the
    replicas `mean` counts (resets them if none), "keep" keeps them but on a
    replica `mean` left out, which is reset (its accumulators may have gone bad).
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


def with_sync(state, inner_state, **fields):
    """`state` with the sync's `fields`, and `inner_state` unless None (kept)."""
    if inner_state is not None:
        fields["inner_state"] = inner_state
    return state._replace(**fields)


def follow_warmup(params, old_state, state, warmup_steps):
    """`(applied, g, start, pending)` at a step's sync.

    `applied` is False on an accumulation micro-step. On an update within the
    first `warmup_steps`, `g` (and `start`, `pending` where the state has them)
    become the locally updated `params`; otherwise they are the state's.
    """
    applied = state.count != old_state.count
    g, start, pending = state.global_params, state.start, state.pending
    if not warmup_steps:
        return applied, g, start, pending

    def follow(operands):
        params, g, start, pending = operands
        g = cast_like(params, g)
        pending = None if pending is None else cast_like(params, pending)
        return g, (None if start is None else g), pending

    in_warmup = applied & (old_state.count < warmup_steps)
    operands = (params, g, start, pending)
    g, start, pending = lax.cond(in_warmup, follow, lambda ops: ops[1:], operands)
    return applied, g, start, pending
