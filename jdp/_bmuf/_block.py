"""The block sync of BMUF and DiLoCo: the whole model at once, every period."""

from __future__ import annotations

import jax
from jax import lax

from jdp import _collectives
from jdp._bmuf import _average, _drop, _update
from jdp._bmuf._state import block_start, cast_like


def merge(params, old_state, state, *, inner, axis, options):
    """`(params, state)` after the block sync of the locally updated `params`.

    `old_state` is the state before the update, `state` the one it returned. On
    a step that ends a block every replica's params become exactly the next
    block's start; otherwise both come back as given (but for warmup).
    """
    axis_name = _collectives.resolve_axis(axis)
    eta = _update.eta(axis_name, options.block_momentum)
    applied, g, start, _ = _update.follow_warmup(
        params, old_state, state, options.warmup_steps
    )

    def sync(operands):
        params, g, start, v, inner_state, dropped = operands
        mean = average(params, block_start(g, start), axis_name, options)
        new = _update.block_update(
            g, start, v, mean.params, eta, options.block_learning_rate, options.outer
        )
        g, start, v = mean.unless_none_valid(new, (g, start, v))
        target = block_start(g, start)
        inner_state = _update.inner_state_at_sync(
            inner_state, target, inner, options.inner_state_at_sync, axis_name, mean
        )
        dropped = mean.count_dropped(dropped, axis_name)
        return cast_like(target, params), g, start, v, inner_state, dropped

    # Only what the sync changes crosses the conditional, so a step that does
    # not sync pays nothing for it.
    inner_state = None if options.keeps_inner_state else state.inner_state
    operands = (params, g, start, state.velocity, inner_state, state.dropped)
    with jax.named_scope("bmuf_block_sync"):  # names it in profiles and HLO
        params, g, start, v, inner_state, dropped = lax.cond(
            applied & state.synced, sync, lambda operands: operands, operands
        )
    return params, _update.with_sync(
        state, inner_state, global_params=g, start=start, velocity=v, dropped=dropped
    )


def average(params, ref, axis_name, options) -> _average.Mean:
    """The replicas' `Mean` at a block sync (`wire=`, `on_bad_replica=`)."""
    if options.on_bad_replica is not None:
        return _drop.valid_mean(params, ref, axis_name, options.bad_replica_max_norm)
    return _average.Mean(_average.params_mean(params, ref, axis_name, options.wire))
