"""Gradient synchronisation as pieces: `jdp.all_reduce`, `jdp.local`, `jdp.zero`.

A train step made by `jdp.make_train_step` takes one piece, `sync=`, that says
how the replicas' gradients are synchronised and applied, and declares what the
rest of the library needs to know about the state that implies: its layout
across replicas (`state_layout`) and the part of it replicas must agree on
(`must_agree`). A new way to synchronise is a new piece, not a flag.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp import (
    _bmuf,
    _collectives,
    _jax_compat,
    _replica_parts,
    _transforms,
    _validate,
    _wire,
    _zero,
)
from jdp._layout import StateLayout
from jdp._tree import is_float

PyTree = Any
BatchStatsMode = Literal["mean", "broadcast"]
OnBadReplica = Literal["drop"]


class Sync(NamedTuple):
    """How a train step synchronises and applies gradients: a piece for `sync=`.

    Like optax's `GradientTransformation`, a tuple of pure functions plus data;
    `jdp.all_reduce`, `jdp.local`, `jdp.zero` and `jdp.sparse.rows` make them.

    Attributes:
      apply: `apply(grads, state, tx, axis_name) -> (params, opt_state,
        metrics)`, run inside the step on one replica's gradients (`axis_name`
        is the replica axis, resolved).
      averages: Whether the optimizer sees gradients averaged over replicas
        (False: each replica's own, for optimizers that communicate themselves,
        such as `jdp.bmuf`).
      state_layout: None, or `state_layout(tx)`: the `StateLayout` the piece
        needs for optimizer `tx` (`step.replicate` and checkpoints follow it).
      must_agree: None (the whole state must agree), or `must_agree(state)`:
        the state with the parts that may differ between replicas set to None
        (the divergence guard compares the rest).
      value_and_grad: None (`jax.value_and_grad`), or `value_and_grad(tx)`
        returning how to differentiate the loss for optimizer `tx` (sparse row
        gradients).
      apply_averaged: None, or like `apply` for gradients a loss scaler has
        already averaged over replicas (loss scaling needs it).
      batch_stats: How batch statistics are synced every step: `"mean"` or
        `"broadcast"` (see `jdp.sync_batch_stats`).
      init: None (the piece keeps no state), or `init(params) -> sync_state`:
        the piece's own state (error-feedback buffers, low-rank factors), kept
        in the train state's `sync_state` field, which
        `jdp.TrainState.create(..., sync=piece)` fills. A piece with `init`
        reads `state.sync_state` in `apply` and returns a 4-tuple `(params,
        opt_state, metrics, sync_state)`.

    Example:
      A piece of one's own: sum the gradients instead of averaging them.

      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> def summed(grads, state, tx, axis_name):
      ...     grads = jax.lax.psum(grads, axis_name)
      ...     updates, opt_state = tx.update(grads, state.opt_state, state.params)
      ...     return optax.apply_updates(state.params, updates), opt_state, {}
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch * params["w"] - 1.0) ** 2)
      >>> tx = optax.sgd(0.1)
      >>> train_step = jdp.make_train_step(loss_fn, tx, sync=jdp.Sync(summed))
      >>> step = jdp.parallelize(train_step, devices=jax.devices()[:2])
      >>> state = step.replicate(jdp.TrainState.create(params={"w": 0.0}, tx=tx))
      >>> state, metrics = step(state, step.shard(jnp.ones(4)))
      >>> round(float(step.unreplicate(state).params["w"]), 4)  # 0.1 * (2 + 2)
      0.4
    """

    apply: Callable[..., tuple[PyTree, PyTree, dict[str, jax.Array]]]
    averages: bool = True
    state_layout: Callable[[Any], StateLayout | None] | None = None
    must_agree: Callable[[PyTree], PyTree] | None = None
    value_and_grad: Callable[[Any], Callable[..., Any]] | None = None
    apply_averaged: Callable[..., tuple] | None = None
    batch_stats: BatchStatsMode = "mean"
    init: Callable[[PyTree], PyTree] | None = None


def check_batch_stats(batch_stats: Any) -> None:
    """A clear error unless `batch_stats` is a known mode."""
    if batch_stats not in get_args(BatchStatsMode):
        raise ValueError(
            f"`batch_stats` must be one of {get_args(BatchStatsMode)}; got "
            f"{batch_stats!r}."
        )


def apply_tx(grads, state, tx) -> tuple[PyTree, PyTree, dict[str, jax.Array]]:
    """`tx` applied to `grads`: `(params, opt_state, {})`.

    A `jdp.bmuf` inside `tx` (hierarchical local SGD, syncing over other axes
    than the piece's) merges after the update, on the updated params, as under
    `jdp.local()`: every replica lands on exactly the same bits.
    """
    merges: list = []
    updates, opt_state = _transforms.update(
        tx, grads, state.opt_state, state.params, **{_bmuf.MERGES_ARG: merges}
    )
    params = optax.apply_updates(state.params, updates)
    params, opt_state = _bmuf.merge_updated(params, state.opt_state, opt_state, merges)
    return params, opt_state, {}


def all_reduce(
    *,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
    wire: _wire.Wire | None = None,
    error_feedback: bool = False,
    skip_nonfinite: bool = False,
    batch_stats: BatchStatsMode = "mean",
    axis_name: _collectives.AxisName | None = None,
    on_bad_replica: OnBadReplica | None = None,
) -> Sync:
    """Averages gradients over replicas before the optimizer (PyTorch DDP).

    The default piece of `jdp.make_train_step`: one bucketed all-reduce of the
    gradients in reverse leaf order (`jdp.all_reduce_gradients`), then `tx` on
    the average, the same on every replica.

    Args:
      bucket_bytes: Largest bucket of the gradient all-reduce (25 MiB); None for
        one bucket per dtype.
      reduce_dtype: Wire dtype of the all-reduce (e.g. `jnp.bfloat16`); the
        gradients are divided by the replica count first, so a narrow type
        cannot overflow. XLA may compute it wider (on CPU a bfloat16
        all-reduce runs in float32); `wire` is sure to send fewer bytes.
      wire: A compressed exchange instead of the all-reduce: `jdp.wire.bf16()`,
        `jdp.wire.int8()` or `jdp.wire.fp8()`. The gradients are quantised,
        exchanged by an all-to-all (each replica owns a chunk), averaged in
        float32 by each chunk's owner, quantised again and all-gathered, so
        both exchanges move the narrow type (see `jdp.wire`). On a host mesh
        (`axis_name=("host", "device")`) the devices of a host average in
        float32 first and only the exchange between hosts is compressed. Not
        with loss scaling (a state with a `dynamic_scale`), whose scaler
        averages the gradients itself.
      error_feedback: With `wire`: add what quantisation dropped at one step
        to the next step's gradients, per replica (the worker error) and per
        chunk owner (the server error). The buffers are the piece's state
        (`jdp.TrainState.create(..., sync=sync)`), two float32 vectors the
        size of the gradients, different on every replica; checkpoints save
        them per replica.
      skip_nonfinite: Skip a step whose gradients are not finite on any replica:
        params and optimizer state stay as they were on every replica, the
        state's `skipped_steps` grows by one and metric `"skipped"` is 1.
      batch_stats: How batch statistics (`state.batch_stats`) are synced every
        step: `"mean"` (default) or `"broadcast"` replica 0's.
      axis_name: The mesh axis (or axes) to average over; None (default): the
        step's replica axis. On a host mesh `("host", "device")`,
        `axis_name="device"` averages within each host only: hierarchical
        local SGD, with an optimizer that syncs the hosts itself
        (`jdp.bmuf(inner, sync_period=..., axis_name="host")`).
      on_bad_replica: `"drop"`: average only the replicas whose own gradients
        are finite, instead of skipping the step. Each replica multiplies its
        gradients by its validity bit and the bit rides as one more float32
        value in the same all-reduce, so the sum is divided by the count of
        valid replicas; metric `"dropped_replicas"` says how many were left
        out. If every replica is bad, the step is skipped as with
        `skip_nonfinite` (the state needs `skipped_steps`). With
        `skip_nonfinite=True` as well, a step whose average of the valid
        replicas is still not finite (an overflowing sum) is skipped too.
        Averaging over some of the step's axes (`axis_name="device"`), the
        skip decision is agreed over the step's axes by one scalar collective.
        Not with `wire` (the compressed exchange carries no count) nor with
        loss scaling (whose scaler averages the gradients itself). None
        (default): every replica is averaged, as is.

    Returns:
      A `jdp.Sync`.

    Raises:
      ValueError: If `bucket_bytes` is not a positive int or None,
        `batch_stats` is unknown, `error_feedback` is asked for without a
        `wire`, both `wire` and `reduce_dtype` are given, `on_bad_replica` is
        neither None nor "drop", or `on_bad_replica` is combined with `wire`;
        at trace time, for `on_bad_replica` or `wire` with loss scaling.
      TypeError: If `wire` is not a wire format.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
      >>> train_step = jdp.make_train_step(loss_fn, optax.sgd(0.1), sync=sync)
      >>> step = jdp.parallelize(train_step, devices=jax.devices()[:4])
      >>> params = {"w": jnp.zeros((512, 1))}
      >>> state = jdp.TrainState.create(params=params, tx=optax.sgd(0.1), sync=sync)
      >>> state = step.replicate(state)
      >>> batch = step.shard({"x": jnp.ones((8, 512)), "y": jnp.ones((8, 1))})
      >>> ops = step.collectives(state, batch)
      >>> sorted((c.kind, c.dtype) for c in ops if c.dtype == "u8")  # 1 byte a value
      [('all-gather', 'u8'), ('all-to-all', 'u8')]
    """
    _collectives.check_bucket_bytes(bucket_bytes)
    check_batch_stats(batch_stats)
    _wire.check_options(wire, error_feedback, reduce_dtype, "jdp.all_reduce")
    _check_on_bad_replica(on_bad_replica, wire)
    if on_bad_replica is not None:
        return _dropping(
            bucket_bytes, reduce_dtype, skip_nonfinite, batch_stats, axis_name
        )
    if wire is not None:
        return _compressed(wire, error_feedback, skip_nonfinite, batch_stats, axis_name)

    def apply_averaged(grads, state, tx, step_axis):
        if not skip_nonfinite:
            return apply_tx(grads, state, tx)
        # The average is the same on every replica (of `axis_name`), and
        # checking it (not each replica's own) also catches a sum that
        # overflowed.
        finite = _agreed_finite(grads, axis_name, step_axis)
        return _unless_nonfinite(finite, lambda: apply_tx(grads, state, tx), state)

    def apply(grads, state, tx, step_axis):
        if (
            axis_name is None
            and reduce_dtype is None
            and _collectives.axis_size(step_axis, "jdp.all_reduce") == 1
        ):
            # A step of one replica: the mean is the gradient itself, bit for
            # bit, and XLA:CPU would still copy every gradient through a
            # collective (an 8.9M MLP: 28.6 ms a step, 63.5 ms with it).
            return apply_averaged(grads, state, tx, step_axis)
        grads = _collectives.all_reduce(
            grads,
            axis_name=step_axis if axis_name is None else axis_name,
            bucket_bytes=bucket_bytes,
            reduce_dtype=reduce_dtype,
            api="jdp.all_reduce",
        )
        return apply_averaged(grads, state, tx, step_axis)

    return Sync(apply, apply_averaged=apply_averaged, batch_stats=batch_stats)


def _check_on_bad_replica(on_bad_replica, wire) -> None:
    """`jdp.all_reduce`'s checks of `on_bad_replica`."""
    if on_bad_replica is None:
        return
    if on_bad_replica not in get_args(OnBadReplica):
        raise ValueError(
            "`on_bad_replica` must be None (average every replica) or 'drop' "
            "(average the replicas whose gradients are finite); got "
            f"{on_bad_replica!r}."
        )
    if wire is not None:
        raise ValueError(
            "`on_bad_replica='drop'` counts the valid replicas in the gradients' "
            "all-reduce, which a compressed exchange (`wire=`) does not carry: "
            "use `wire=None` with it, or `on_bad_replica=None` (with "
            "`skip_nonfinite=True` to skip the whole step)."
        )


#: The metric under which `jdp.all_reduce(on_bad_replica="drop")` tells the train
#: step this replica's share of the loss: `num_replicas / kept` if it was kept, 0
#: if it was dropped (1 everywhere when none was kept). The step reports the loss
#: averaged over the kept replicas, and returns no such metric.
KEPT = "_jdp_kept_share"


def _dropping(bucket_bytes, reduce_dtype, skip_nonfinite, batch_stats, axis_name):
    """`jdp.all_reduce(on_bad_replica="drop")`: the mean of the valid replicas."""

    def apply(grads, state, tx, step_axis):
        axis = step_axis if axis_name is None else axis_name
        num = _collectives.axis_size(axis, "jdp.all_reduce")
        valid = _finite(grads)
        masked = jax.tree.map(
            lambda g: jnp.where(valid, g, jnp.zeros_like(g)) if is_float(g) else g,
            grads,
        )
        # The bit is the last leaf: one more value in the same all-reduce.
        total, share = _collectives.all_reduce(
            (masked, valid.astype(jnp.float32)),
            axis_name=axis,
            bucket_bytes=bucket_bytes,
            reduce_dtype=reduce_dtype,
            api="jdp.all_reduce",
        )
        count = jnp.round(share * num).astype(jnp.int32)
        scale = num / jnp.maximum(count, 1).astype(jnp.float32)  # 1 if all valid
        grads = jax.tree.map(
            lambda g: (g * scale).astype(g.dtype) if is_float(g) else g, total
        )
        ok = count > 0
        if skip_nonfinite:
            ok &= _finite(grads)
        if axis_name is not None and axis_name != step_axis:
            ok = lax.pmin(ok.astype(jnp.int32), step_axis) > 0
        params, opt_state, metrics = _unless_nonfinite(
            ok, lambda: apply_tx(grads, state, tx), state
        )
        share = jnp.where(count > 0, jnp.where(valid, scale, 0.0), 1.0)
        dropped = {"dropped_replicas": num - count, KEPT: share}
        return params, opt_state, {**metrics, **dropped}

    def apply_averaged(grads, state, tx, step_axis):
        raise ValueError(
            "`jdp.all_reduce(on_bad_replica='drop')` cannot be combined with loss "
            "scaling (a state with a `dynamic_scale`): the scaler averages the "
            "gradients before the piece sees them, so no replica can be left "
            "out. Use `on_bad_replica=None`; the scaler skips non-finite steps."
        )

    return Sync(apply, apply_averaged=apply_averaged, batch_stats=batch_stats)


def _agreed_finite(grads, axis_name, step_axis) -> jax.Array:
    """Whether averaged `grads` are finite, agreed by every replica of the step.

    Averaged over all of the step's axes, the verdict is the same everywhere;
    averaged over some (`axis_name`), it is combined over the step's axis, so
    that every replica takes the same branch.
    """
    finite = _finite(grads)
    if axis_name is None or axis_name == step_axis:
        return finite
    return lax.pmin(finite.astype(jnp.int32), step_axis) > 0


def _compressed(wire, error_feedback, skip_nonfinite, batch_stats, axis_name) -> Sync:
    """`jdp.all_reduce(wire=...)`: the compressed exchange, then `tx`."""

    def apply_mean(grads, state, tx, step_axis):
        if not skip_nonfinite:
            return apply_tx(grads, state, tx)
        finite = _agreed_finite(grads, axis_name, step_axis)
        return _unless_nonfinite(finite, lambda: apply_tx(grads, state, tx), state)

    def apply_averaged(grads, state, tx, step_axis):
        unused = " and the error-feedback buffers never used" if error_feedback else ""
        raise ValueError(
            f"`jdp.all_reduce(wire=jdp.wire.{wire.name}(), error_feedback="
            f"{error_feedback})` cannot be combined with loss scaling (a state "
            "with a `dynamic_scale`): flax's `DynamicScale` averages the gradients "
            f"itself, in full precision, so nothing would be compressed{unused}. "
            "Use `jdp.all_reduce()` (no `wire`) with loss scaling, or train in "
            "bfloat16, which needs no loss scaling, with the `wire`."
        )

    def apply(grads, state, tx, step_axis):
        error = state.sync_state if error_feedback else None
        axis = step_axis if axis_name is None else axis_name
        _collectives.axis_size(axis, "jdp.all_reduce")  # bound here?
        grads, new_error = _wire.mean(grads, wire=wire, axis_name=axis, error=error)
        params, opt_state, metrics = apply_mean(grads, state, tx, step_axis)
        if not error_feedback:
            return params, opt_state, metrics
        if skip_nonfinite:  # a skipped step leaves the buffers as they were
            keep = metrics["skipped"] > 0
            new_error = jax.tree.map(
                lambda old, new: jnp.where(keep, old, new), error, new_error
            )
        return params, opt_state, metrics, new_error

    if not error_feedback:
        return Sync(apply, apply_averaged=apply_averaged, batch_stats=batch_stats)
    return Sync(
        apply,
        apply_averaged=apply_averaged,
        batch_stats=batch_stats,
        must_agree=agreed_sync_state,
        init=functools.partial(_wire.init_state, wire=wire),
    )


def agreed_sync_state(state: PyTree) -> PyTree:
    """The state less the per-replica parts of its `sync_state` (error buffers)."""
    if not hasattr(state, "replace"):
        return state
    return state.replace(sync_state=_replica_parts.agreed(state.sync_state))


def local(
    *, skip_nonfinite: bool = False, batch_stats: BatchStatsMode = "mean"
) -> Sync:
    """Each replica applies the optimizer to its OWN gradients: no all-reduce.

    For optimizers that communicate themselves: `jdp.bmuf` (BMUF, DiLoCo, local
    SGD), or `jdp.sync_gradients` inside `optax.MultiSteps` (whose all-reduce
    then runs only on the micro-steps that update). With an optimizer that never
    communicates, the replicas train different models.

    `jdp.bmuf`'s block sync runs after the parameter update, on the updated
    params (the optimizer is called with the extra argument that asks for it),
    so every replica lands on exactly the same bits after a sync and a step
    that does not sync costs what the local step costs.

    Replicas agree on the step counter, the batch statistics and the global
    parts of `jdp.bmuf`'s state; params and other optimizer state may differ
    (the divergence guard compares only what agrees).

    Args:
      skip_nonfinite: As for `jdp.all_reduce`: skip a step whose gradients are
        not finite on any replica (decided over all replicas).
      batch_stats: How batch statistics are synced every step: `"mean"` or
        `"broadcast"`.

    Returns:
      A `jdp.Sync`.

    Raises:
      ValueError: If `batch_stats` is unknown.

    Example:
      >>> import optax, jdp
      >>> tx = jdp.bmuf(optax.sgd(0.1), sync_period=8)
      >>> sync = jdp.local()  # jdp.make_train_step(loss_fn, tx, sync=sync)
    """
    check_batch_stats(batch_stats)

    def apply(grads, state, tx, axis_name):
        num = _collectives.axis_size(axis_name, "jdp.local")
        if num > 1 and not _communicates(tx, grads, state.opt_state, state.params):
            warnings.warn(
                "`jdp.local()` applies the optimizer to each replica's own "
                "gradients, and this optimizer never communicates (no `jdp.bmuf`, "
                f"no `jdp.sync_gradients`): the {num} replicas train {num} "
                "different models. Use `sync=jdp.all_reduce()` for synchronous "
                "training, or an optimizer that syncs (`jdp.bmuf(tx, "
                "sync_period=...)`).",
                UserWarning,
                stacklevel=2,
            )
        merges: list = []
        updates, opt_state = _transforms.update(
            tx,
            grads,
            state.opt_state,
            state.params,
            **{_bmuf.MERGES_ARG: merges},
        )
        params = optax.apply_updates(state.params, updates)
        params, opt_state = _bmuf.merge_updated(
            params, state.opt_state, opt_state, merges
        )
        return params, opt_state, {}

    sync = Sync(
        apply, averages=False, must_agree=_agreed_locally, batch_stats=batch_stats
    )
    return _skipping(sync) if skip_nonfinite else sync


def zero(
    *,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
    clip_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    batch_stats: BatchStatsMode = "mean",
) -> Sync:
    """ZeRO stages 1 and 2: the optimizer state sharded over replicas.

    PyTorch's `ZeroRedundancyOptimizer`, DeepSpeed ZeRO-1/2: gradients are
    reduce-scattered, each replica keeps and updates only its 1/N slice of the
    (flattened, padded) optimizer state, and the updated parameters are
    all-gathered. The same numbers as `jdp.all_reduce` for element-wise
    optimizers (SGD, momentum, Adam, AdamW, RMSProp, Lion, Adagrad, with
    schedules); others are refused with a message. `step.replicate` lays the
    optimizer state out sharded; `step.unreplicate` and checkpoints see one full
    logical copy.

    Args:
      bucket_bytes: Largest bucket of the reduce-scatters and all-gathers.
      reduce_dtype: Wire dtype of the reduce-scatter.
      clip_grad_norm: If set, clip the averaged gradients to this global L2
        norm, computed across the replicas' slices (a `psum`; an
        `optax.clip_by_global_norm` inside `tx` would see one slice only), and
        report the norm before clipping as metric `"grad_norm"`.
      skip_nonfinite: As for `jdp.all_reduce`.
      batch_stats: How batch statistics are synced every step.

    Returns:
      A `jdp.Sync`.

    Raises:
      ValueError: If `clip_grad_norm` is not a positive finite number, or an
        argument is out of range as for `jdp.all_reduce`; at trace time, if the
        optimizer is not element-wise or the state was not placed by
        `step.replicate`.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> tx = optax.adam(1e-3)
      >>> params = {"w": jnp.zeros((800, 1))}
      >>> batch = {"x": jnp.zeros((8, 800)), "y": jnp.zeros((8, 1))}
      >>> def bytes_per_device(sync):
      ...     step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=sync))
      ...     state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
      ...     return step.memory_analysis(state, step.shard(batch)).argument_bytes
      >>> bytes_per_device(jdp.all_reduce()) - bytes_per_device(jdp.zero())
      5600

    References:
      Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
      Parameter Models", SC 2020, https://arxiv.org/abs/1910.02054.
    """
    _collectives.check_bucket_bytes(bucket_bytes)
    check_batch_stats(batch_stats)
    if clip_grad_norm is not None:
        _validate.finite_number(
            "clip_grad_norm", clip_grad_norm, above=0, note="a global norm, or None"
        )
    apply = _zero.update_fn(
        bucket_bytes=bucket_bytes,
        reduce_dtype=reduce_dtype,
        clip_grad_norm=clip_grad_norm,
    )
    sync = Sync(apply, state_layout=_zero.layout_fn, batch_stats=batch_stats)
    return _skipping(sync) if skip_nonfinite else sync


def _communicates(tx, grads, opt_state, params) -> bool:
    """Whether `tx.update` issues a collective (traced, nothing runs)."""
    closed = jax.make_jaxpr(
        lambda g, s, p: _transforms.update(tx, g, s, p, **{_bmuf.MERGES_ARG: None})
    )(grads, opt_state, params)
    return any(
        eqn.primitive.name in _jax_compat.COLLECTIVE_PRIMITIVES
        for eqn in _jax_compat.equations(closed)
    )


def _finite(grads: PyTree) -> jax.Array:
    finite = jnp.array(True)
    for g in jax.tree.leaves(grads):
        if is_float(g):
            finite &= jnp.all(jnp.isfinite(g))
    return finite


def _unless_nonfinite(finite, run, state):
    """`run()`'s `(params, opt_state, metrics)` if `finite`, else the state's own.

    `finite` must be the same on every replica; metric `"skipped"` is 1 for a
    skipped step.
    """
    if getattr(state, "skipped_steps", None) is None:
        raise ValueError(
            "`skip_nonfinite=True` counts skipped steps in the state's "
            "`skipped_steps` field, which this state does not have (or holds "
            f"None): {type(state).__name__}. Use `jdp.TrainState.create(...)`, "
            "or add a `skipped_steps` field (an int32 zero) to your state."
        )

    def skip():
        shapes = jax.eval_shape(run)
        extra = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[2])
        return state.params, state.opt_state, extra

    params, opt_state, extra = lax.cond(finite, run, skip)
    return params, opt_state, {**extra, "skipped": 1 - finite.astype(jnp.int32)}


def _skipping(sync: Sync) -> Sync:
    """`sync` that leaves params and optimizer state alone for non-finite grads.

    For pieces that do not average before the optimizer: every replica's own
    gradients are checked and the verdict is combined over replicas (one scalar
    collective), so all replicas take the same branch.
    """
    apply = sync.apply

    def skipping(grads, state, tx, axis_name):
        finite = lax.pmin(_finite(grads).astype(jnp.int32), axis_name) > 0
        return _unless_nonfinite(
            finite, lambda: apply(grads, state, tx, axis_name), state
        )

    return sync._replace(apply=skipping)


def _agreed_locally(state: PyTree) -> PyTree:
    """What replicas that train on their own gradients still agree on.

    The step counter and batch statistics (synced every step), and the parts of
    the optimizer state declared to agree (`_replica_parts`: the global parts
    of `jdp.bmuf`'s state); not the params or other optimizer state.
    """
    if not hasattr(state, "replace"):
        return None
    return state.replace(params=None, opt_state=_replica_parts.agreed(state.opt_state))
