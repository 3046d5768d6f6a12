"""The block sync of BMUF and DiLoCo: the whole model at once, every period."""

from __future__ import annotations

from typing import Any

from jax import lax

from jdp import _collectives
from jdp._bmuf import _average, _drop, _update
from jdp._bmuf._state import block_start, cast_like

PyTree = Any


def merge(params, old_state, state, *, inner, axis, options):
    """`jdp.bmuf`'s block sync on the params after this step's local update.

    Args:
      params: The locally updated params.
      old_state: The state before the update.
      state: The state the update returned (`count` and `synced` advanced).
      inner: The inner optimizer.
      axis: The replica axis as given to `jdp.bmuf` (None: the bound one).
      options: The `_options.Options`.

    Returns:
      `(params, state)`: on a step that ends a block, every replica's params are
      exactly the next block's start and the state holds the new global model
      and velocity; otherwise both as given (during warmup `g` follows the
      replicas).
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
    params, g, start, v, inner_state, dropped = lax.cond(
        applied & state.synced, sync, lambda operands: operands, operands
    )
    return params, _update.with_sync(
        state, inner_state, global_params=g, start=start, velocity=v, dropped=dropped
    )


def average(params, ref, axis_name, options) -> _average.Mean:
    """The replicas' `Mean` at a block sync, `ref` the block start.

    The seam of the options that change what is averaged: `wire=` (compressed
    pseudo-gradients) and `on_bad_replica="drop"` (the valid replicas alone).
    """
    if options.on_bad_replica is not None:
        return _drop.valid_mean(params, ref, axis_name, options.bad_replica_max_norm)
    return _average.Mean(_average.params_mean(params, ref, axis_name, options.wire))
