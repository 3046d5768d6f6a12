"""How a train step applies an optimizer, and what jdp knows of optax's states.

An `optax.MultiSteps` (gradient accumulation by the optimizer) runs its
collectives only on the micro-steps that update. This is the one module that
recognises optax's own state types (`MultiStepsState`, `PartitionState`,
`MaskedNode`); the rest of jdp asks it.
"""

from __future__ import annotations

from typing import Any

import jax
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


def is_masked(x: Any) -> bool:
    """Whether `x` is a leaf `optax.masked` / `optax.multi_transform` left out."""
    return isinstance(x, optax.MaskedNode)


def map_label_states(opt_state: Any, fn) -> Any:
    """`opt_state` with each `optax.multi_transform` label's inner state mapped.

    Args:
      opt_state: An optimizer state.
      fn: `fn(label, inner_state) -> inner_state`.

    Returns:
      The state with every `optax.multi_transform` node's inner states
      replaced by `fn`'s; None if it holds no such node.
    """

    def is_partition(x):
        return isinstance(x, optax.transforms.PartitionState)

    if not any(
        is_partition(x) for x in jax.tree.leaves(opt_state, is_leaf=is_partition)
    ):
        return None

    def one(x):
        if not is_partition(x):
            return x
        inner = {k: fn(k, v) for k, v in x.inner_states.items()}
        return x._replace(inner_states=inner)

    return jax.tree.map(one, opt_state, is_leaf=is_partition)
