"""The block sync of BMUF and DiLoCo: the whole model at once, every period.

One implementation for every option of the block sync: the averaging step
(`_average`: a plain mean or `wire=`; `_drop`: the valid replicas' mean) hands
its `Mean` to the one update formula (`_update`).
"""

from __future__ import annotations

from typing import Any

from jax import lax

from jdp import _collectives
from jdp._bmuf import _average, _drop, _update
from jdp._bmuf._state import block_start, cast_like

PyTree = Any


def merge(params, old_state, state, *, inner, axis, options):
    """`jdp.bmuf`'s block sync, the one implementation, on locally updated params.

    Args:
      params: The params after this step's local (inner) update.
      old_state: The state before the update.
      state: The state the update returned (`count` and `synced` advanced).
      inner: The inner optimizer (for `inner_state_at_sync="reset"`).
      axis: The replica axis as given to `jdp.bmuf` (None: the bound one).
      options: The block-filter options.

    Returns:
      `(params, state)`: on a step that ends a block, every replica's params are
      exactly the next block's start and the state holds the new global model
      and velocity; otherwise both as given (during warmup `g` follows the
      replicas).
    """
    at_sync = options.inner_state_at_sync
    axis_name = _collectives.resolve_axis(axis)
    eta = _update.eta(axis_name, options.block_momentum)
    applied = state.count != old_state.count  # not an accumulation micro-step
    g, start, _ = _update.follow_warmup(
        params, old_state, state, applied, options.warmup_steps
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
            inner_state, target, inner, at_sync, axis_name, mean
        )
        dropped = mean.count_dropped(dropped, axis_name)
        return cast_like(target, params), g, start, v, inner_state, dropped

    # Only what the sync changes crosses the conditional; everything in it is
    # already in memory (the updated params are the step's output), so a step
    # that does not sync pays nothing for it.
    keeps = at_sync == "keep" and options.on_bad_replica is None
    params, g, start, v, inner_state, dropped = lax.cond(
        applied & state.synced,
        sync,
        lambda operands: operands,
        (
            params,
            g,
            start,
            state.velocity,
            None if keeps else state.inner_state,
            state.dropped,
        ),
    )
    return params, state._replace(
        global_params=g,
        start=start,
        velocity=v,
        inner_state=state.inner_state if keeps else inner_state,
        dropped=dropped,
    )


def average(params, ref, axis_name, options) -> _average.Mean:
    """The average across replicas of a block sync, `ref` the block start.

    The one seam of the options that change what is averaged: every replica's
    params (`wire=`: their compressed pseudo-gradients), or the valid ones'
    alone (`on_bad_replica="drop"`).
    """
    if options.on_bad_replica is not None:
        return _drop.valid_mean(params, ref, axis_name, options.bad_replica_max_norm)
    return _average.Mean(_average.params_mean(params, ref, axis_name, options.wire))
