"""How a train step applies an optimizer, with optax's extra arguments.

An `optax.MultiSteps` (gradient accumulation by the optimizer) runs its
collectives only on the micro-steps that update.
"""

from __future__ import annotations

from typing import Any

import optax
from jax import lax

from jdp import _collectives


def update(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    **extra_args: Any,
) -> tuple[Any, Any]:
    """`tx.update` with optax's extra arguments, run as a train step runs it.

    Transforms that take no extra arguments ignore them. An `optax.MultiSteps`
    (recognised here, and only here) runs its collectives only on the
    micro-steps that update: `optax.MultiSteps` runs its inner optimizer on
    every micro-step and masks the result on the steps that only accumulate, so
    a `jdp.sync_gradients()` inside it would all-reduce on every micro-step.
    Here the micro-steps that only accumulate run with jdp's collectives turned
    off (the extra argument `COLLECTIVES_ARG=False`; their inner result is
    discarded anyway) and the updating ones as they are, under `lax.cond`: the
    all-reduce sits in the branch taken once per update. Whether a micro-step
    updates is read from the optimizer's own bookkeeping (a first evaluation
    whose only kept output is the `gradient_step` counter; XLA removes the
    rest), so any `every_k_schedule` works. The numbers equal `tx.update`'s.

    The decision is the same on every replica as long as the counters are: they
    are, unless a `should_skip_update_fn` decides differently on different
    replicas (which would stall optax's own conditional around the inner
    optimizer too).
    """
    if not isinstance(tx, optax.MultiSteps):  # whose `update` takes extra args
        tx = optax.with_extra_args_support(tx)
    if not isinstance(opt_state, optax.MultiStepsState):
        return tx.update(grads, opt_state, params, **extra_args)

    def accumulate():
        quiet = {**extra_args, _collectives.COLLECTIVES_ARG: False}
        return tx.update(grads, opt_state, params, **quiet)

    probe = accumulate()[1]
    updates = probe.gradient_step != opt_state.gradient_step
    return lax.cond(
        updates, lambda: tx.update(grads, opt_state, params, **extra_args), accumulate
    )
