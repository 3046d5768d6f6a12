"""How a step applies an optimizer; the one module that knows optax's states."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax import lax

from jdp import _collectives


def update(tx: optax.GradientTransformation, grads, opt_state, params, **extra_args):
    """`tx.update` with optax's extra arguments, as a train step runs it.

    Under `optax.MultiSteps`, the micro-steps that only accumulate run with jdp's
    collectives off (`COLLECTIVES_ARG=False`), in a `lax.cond` on whether a first
    evaluation advanced `gradient_step` (XLA removes the rest of it).
    """
    if not isinstance(tx, optax.MultiSteps):  # whose `update` takes extra args
        tx = optax.with_extra_args_support(tx)
    if not isinstance(opt_state, optax.MultiStepsState):
        return tx.update(grads, opt_state, params, **extra_args)

    def accumulate():
        quiet = {**extra_args, _collectives.COLLECTIVES_ARG: False}
        return tx.update(grads, opt_state, params, **quiet)

    updates = accumulate()[1].gradient_step != opt_state.gradient_step
    return lax.cond(
        updates, lambda: tx.update(grads, opt_state, params, **extra_args), accumulate
    )


def without_accumulated(tree: Any, stop_at) -> Any:
    """`tree` with what `optax.MultiSteps` accumulated (`acc_grads`) set to None.

    Nodes for which `stop_at(node)` holds are left whole.
    """

    def is_leaf(x):
        return isinstance(x, optax.MultiStepsState) or stop_at(x)

    def one(x):
        if not isinstance(x, optax.MultiStepsState):
            return x
        inner = without_accumulated(x.inner_opt_state, stop_at)
        return x._replace(acc_grads=None, inner_opt_state=inner)

    return jax.tree.map(one, tree, is_leaf=is_leaf)


def is_masked(x: Any) -> bool:
    """Whether `x` is a leaf `optax.masked` / `optax.multi_transform` left out."""
    return isinstance(x, optax.MaskedNode)


def map_label_states(opt_state: Any, fn) -> Any:
    """`fn(label, state)` on each `optax.multi_transform` inner state; or None."""

    def is_partition(x):
        return isinstance(x, optax.transforms.PartitionState)

    if not any(map(is_partition, jax.tree.leaves(opt_state, is_leaf=is_partition))):
        return None

    def one(x):
        if not is_partition(x):
            return x
        return x._replace(inner_states={k: fn(k, v) for k, v in x.inner_states.items()})

    return jax.tree.map(one, opt_state, is_leaf=is_partition)
