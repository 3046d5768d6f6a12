"""`jdp.sync_gradients`: the gradient all-reduce as an optax transform.

Also how a train step applies an `optax.MultiSteps` (gradient accumulation by
the optimizer) so that the collectives inside it run only on the micro-steps
that update.
"""

from __future__ import annotations

from typing import Any

import optax
from jax import lax

from jdp import _collectives, _wire


def sync_gradients(
    *,
    axis_name: _collectives.AxisName | None = None,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reverse: bool = True,
    reduce_dtype: Any = None,
    flatten: bool | None = None,
    wire: _wire.Wire | None = None,
    error_feedback: bool = False,
) -> optax.GradientTransformation:
    """Averages updates over replicas; put it first in an `optax.chain`.

    The optax form of `jdp.all_reduce_gradients` (same options), in the spirit of
    `optax.contrib.sam(batch_axis_name=...)`: a step that does not average its
    gradients itself gets synchronous data parallelism from its optimizer alone.
    Stateless (`optax.EmptyState`), unless `error_feedback` keeps its error
    buffers (`jdp.wire.WireState`, different on every replica) in the optimizer
    state.

    Args:
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.
      bucket_bytes: Largest bucket in bytes (25 MiB); None for one bucket per dtype.
      reverse: Pack leaves last-first.
      reduce_dtype: Optional wire dtype (e.g. `jnp.bfloat16`).
      flatten: Flat buffers or tuples per bucket (see `jdp.all_reduce_gradients`).
      wire: A compressed exchange (`jdp.wire.int8()`, ...) instead of the
        all-reduce, as for `jdp.all_reduce(wire=...)`.
      error_feedback: With `wire`, feed back what quantisation dropped.

    Returns:
      An `optax.GradientTransformation`.

    Raises:
      ValueError: As `jdp.all_reduce` for `wire`, `error_feedback` and
        `reduce_dtype`.

    Example:
      >>> import optax, jdp
      >>> tx = optax.chain(jdp.sync_gradients(), optax.clip_by_global_norm(1.0),
      ...                  optax.adam(1e-3))
      >>> # use it with `jdp.make_train_step(loss_fn, tx, sync=jdp.local())`
    """
    _collectives.check_bucket_bytes(bucket_bytes)
    _wire.check_options(wire, error_feedback, reduce_dtype, "jdp.sync_gradients")
    options = dict(axis_name=axis_name, bucket_bytes=bucket_bytes, reverse=reverse)

    def init_fn(params):
        if error_feedback:
            return _wire.init_state(params, wire)
        return optax.EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        del params
        if not extra_args.get(_collectives.COLLECTIVES_ARG, True):
            return updates, state
        if wire is not None:
            axis = _collectives.resolve_axis(axis_name)
            _collectives.axis_size(axis, "jdp.sync_gradients")  # bound here?
            synced, error = _wire.mean(
                updates,
                wire=wire,
                axis_name=axis,
                error=state if error_feedback else None,
                api="jdp.sync_gradients",
            )
            return synced, (error if error_feedback else state)
        synced = _collectives.all_reduce(
            updates,
            reduce_dtype=reduce_dtype,
            flatten=flatten,
            api="jdp.sync_gradients",
            **options,
        )
        return synced, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
