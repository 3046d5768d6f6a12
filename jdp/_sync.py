"""The gradient sync pieces, and `jdp.sync_gradients` to put one in an optimizer.

`jdp.Sync`, `jdp.all_reduce`, `jdp.local` and `jdp.sync_gradients`, any piece
as an optax transform.

A sync piece transforms one replica's gradients into the gradients the
optimizer sees, as an optax transform transforms updates: `init(params)` makes
its state, `update(grads, state, params, axis_name)` returns the synced
gradients, its new state and metrics. The train step differentiates, asks the
piece, then applies the optimizer once. A piece whose state differs between
replicas (error-feedback buffers) says so on the state's class with
`jdp.declare_per_replica`, which the divergence guard and checkpoints read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp import (
    _bmuf,
    _collectives,
    _layout,
    _replica_parts,
    _transforms,
    _wire,
)
from jdp._tree import is_float

PyTree = Any
BatchStatsMode = Literal["mean", "broadcast"]
OnBadReplica = Literal["drop"]


class Sync(NamedTuple):
    """A gradient sync piece, for `jdp.make_train_step(..., sync=piece)`.

    Like optax's `GradientTransformation`: a pair of pure functions, plus what
    the rest of the library needs to know about the gradients they return.
    `jdp.all_reduce`, `jdp.local`, `jdp.powersgd` and `jdp.partition` make
    them; `jdp.sync_gradients` turns one into an optax transform for a step of
    one's own.

    Attributes:
      init: `init(params) -> state`: the piece's state (error-feedback
        buffers, low-rank factors), kept in the train state's `sync_state`
        (`jdp.TrainState.create(..., sync=piece)` fills it); None for a piece
        that keeps none. A state whose fields differ between replicas declares
        them with `jdp.declare_per_replica` on its class.
      update: `update(grads, state, params, axis_name) -> (grads, state,
        metrics)`, run inside the step on one replica's gradients (`axis_name`
        is the step's replica axis, resolved): the gradients the optimizer
        sees, the piece's new state and a dict of scalar metrics.
      averages: Whether the returned gradients are synced (True), or left for
        the optimizer to sync (False: `jdp.local()`, for optimizers that sync
        the replicas themselves such as `jdp.bmuf`; the step then warns if the
        optimizer never communicates, and the divergence guard compares only
        what such an optimizer keeps in agreement).
      must_agree: None, or `must_agree(train_state)`: the train state with the
        parts that may differ between replicas set to None (a piece that
        leaves some leaves' gradients unsynced, as `jdp.partition` with a
        `"per_replica"` label).

    Example:
      A piece of one's own: sum the gradients instead of averaging them.

      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> def summed(grads, state, params, axis_name):
      ...     return jax.lax.psum(grads, axis_name), state, {}
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch * params["w"] - 1.0) ** 2)
      >>> tx = optax.sgd(0.1)
      >>> sync = jdp.Sync(None, summed)
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=sync),
      ...                        devices=jax.devices()[:2])
      >>> state = step.replicate(jdp.TrainState.create(params={"w": 0.0}, tx=tx))
      >>> state, metrics = step(state, step.shard(jnp.ones(4)))
      >>> round(float(step.unreplicate(state).params["w"]), 4)  # 0.1 * (2 + 2)
      0.4
    """

    init: Callable[[PyTree], PyTree] | None
    update: Callable[..., tuple[PyTree, PyTree, dict[str, jax.Array]]]
    averages: bool = True
    must_agree: Callable[[PyTree], PyTree] | None = None

    def initial_state(self, params: PyTree) -> PyTree:
        """`init(params)`, or None for a piece without `init`."""
        return None if self.init is None else self.init(params)


class OwnUpdate(NamedTuple):
    """A sync piece that applies the optimizer itself: `jdp.sparse.rows`.

    Not a `jdp.Sync`: it differentiates its own way (with respect to the rows
    a batch looks up) and applies row optimizers.
    `apply(grads, state, tx, axis_name) -> (params, opt_state, metrics)`;
    `value_and_grad`, None or `value_and_grad(tx)`, how it differentiates the
    loss.
    """

    apply: Callable[..., tuple[PyTree, PyTree, dict[str, jax.Array]]]
    value_and_grad: Callable[[Any], Callable[..., Any]] | None = None


def check_batch_stats(batch_stats: Any) -> None:
    """A clear error unless `batch_stats` is a known mode."""
    if batch_stats not in get_args(BatchStatsMode):
        raise ValueError(
            f"`batch_stats` must be one of {get_args(BatchStatsMode)}; got "
            f"{batch_stats!r}."
        )


def apply_tx(grads, state, tx) -> tuple[PyTree, PyTree, dict[str, jax.Array]]:
    """`tx` applied to `grads`: `(params, opt_state, {})`.

    A `jdp.bmuf` inside `tx` merges after the update, on the updated params
    (the optimizer is called with the extra argument that asks for it), so
    every replica lands on exactly the same bits after a sync and a step that
    does not sync costs what the local step costs.
    """
    merges: list = []
    updates, opt_state = _transforms.update(
        tx, grads, state.opt_state, state.params, **{_bmuf.MERGES_ARG: merges}
    )
    params = optax.apply_updates(state.params, updates)
    params, opt_state = _merged(params, state.opt_state, opt_state, merges)
    return params, opt_state, {}


def _merged(params, old_opt_state, opt_state, merges):
    """`jdp.bmuf`'s block sync on the updated params it holds.

    Under `optax.multi_transform` a `jdp.bmuf` holds one label's params, the
    others masked (as in its block start): the sync runs
    on those and the rest of the params are left as they are.
    """
    if not merges:
        return params, opt_state
    for start in _replica_parts.restart_params(old_opt_state):
        if jax.tree.structure(start) == jax.tree.structure(params):
            break
        try:
            masked = jax.tree.map(
                lambda s, p: s if _transforms.is_masked(s) else p,
                start,
                params,
                is_leaf=_transforms.is_masked,
            )
        except ValueError:
            continue
        merged, opt_state = _bmuf.merge_updated(
            masked, old_opt_state, opt_state, merges
        )
        params = jax.tree.map(
            lambda s, p, m: p if _transforms.is_masked(s) else m,
            start,
            params,
            merged,
            is_leaf=_transforms.is_masked,
        )
        return params, opt_state
    return _bmuf.merge_updated(params, old_opt_state, opt_state, merges)


def all_reduce(
    *,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
    wire: _wire.Wire | None = None,
    error_feedback: bool = False,
    axis_name: _collectives.AxisName | None = None,
    on_bad_replica: OnBadReplica | None = None,
) -> Sync:
    """Averages gradients over replicas (PyTorch DDP's all-reduce).

    The default piece of `jdp.make_train_step`: one bucketed all-reduce of the
    gradients in reverse leaf order (`jdp.all_reduce_gradients`); the optimizer
    then sees the average, the same on every replica.

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
        float32 first and only the exchange between hosts is compressed.
      error_feedback: With `wire`: add what quantisation dropped at one step
        to the next step's gradients, per replica (the worker error) and per
        chunk owner (the server error). The buffers are the piece's state
        (`jdp.TrainState.create(..., sync=sync)`), two float32 vectors the
        size of the gradients, different on every replica; checkpoints save
        them per replica.
      axis_name: The mesh axis (or axes) to average over; None (default): the
        step's replica axis. On a host mesh `("host", "device")`,
        `axis_name="device"` averages within each host only: hierarchical
        local SGD, with an optimizer that syncs the hosts itself
        (`jdp.bmuf(inner, sync_period=..., axis_name="host")`).
      on_bad_replica: `"drop"`: average only the replicas whose own gradients
        are finite. Each replica multiplies its gradients by its validity bit
        and the bit rides as one more float32 value in the same all-reduce, so
        the sum is divided by the count of valid replicas; metric
        `"dropped_replicas"` says how many were left out. If every replica is
        bad the average is not finite: give the step `skip_nonfinite=True`
        (`jdp.make_train_step`) to skip such a step. Not with `wire` (the
        compressed exchange carries no count). None (default): every replica
        is averaged, as is.

    Returns:
      A `jdp.Sync`.

    Raises:
      ValueError: If `bucket_bytes` is not a positive int or None,
        `error_feedback` is asked for without a `wire`, both `wire` and
        `reduce_dtype` are given, `on_bad_replica` is neither None nor
        "drop", or `on_bad_replica` is combined with `wire`.
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
    _wire.check_options(wire, error_feedback, reduce_dtype, "jdp.all_reduce")
    _check_on_bad_replica(on_bad_replica, wire)
    if on_bad_replica is not None:
        return _dropping(bucket_bytes, reduce_dtype, axis_name)
    if wire is not None:
        return _compressed(wire, error_feedback, axis_name)

    def update(grads, state, params, step_axis):
        del params
        if (
            axis_name is None
            and reduce_dtype is None
            and _collectives.axis_size(step_axis, "jdp.all_reduce") == 1
        ):
            # A step of one replica: the mean is the gradient itself, bit for
            # bit, and XLA:CPU would still copy every gradient through a
            # collective (an 8.9M MLP: 28.6 ms a step, 63.5 ms with it).
            return grads, state, {}
        grads = _collectives.all_reduce(
            grads,
            axis_name=step_axis if axis_name is None else axis_name,
            bucket_bytes=bucket_bytes,
            reduce_dtype=reduce_dtype,
            api="jdp.all_reduce",
        )
        return grads, state, {}

    return Sync(None, update)


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
            "use `wire=None` with it, or `on_bad_replica=None` (with the step's "
            "`skip_nonfinite=True` to skip the whole step)."
        )


#: The metric under which `jdp.all_reduce(on_bad_replica="drop")` tells the train
#: step this replica's share of the loss: `num_replicas / kept` if it was kept, 0
#: if it was dropped (1 everywhere when none was kept). The step reports the loss
#: averaged over the kept replicas, and returns no such metric.
KEPT = "_jdp_kept_share"


def _dropping(bucket_bytes, reduce_dtype, axis_name) -> Sync:
    """`jdp.all_reduce(on_bad_replica="drop")`: the mean of the valid replicas."""

    def update(grads, state, params, step_axis):
        del params
        axis = step_axis if axis_name is None else axis_name
        num = _collectives.axis_size(axis, "jdp.all_reduce")
        valid = finite(grads)
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
        # No valid replica: a NaN average, which the step skips with
        # `skip_nonfinite=True` (a zero would still move momentum and decay).
        scale = jnp.where(count > 0, num / jnp.maximum(count, 1), jnp.nan)
        grads = jax.tree.map(
            lambda g: (
                (g * scale.astype(jnp.float32)).astype(g.dtype) if is_float(g) else g
            ),
            total,
        )
        share = jnp.where(count > 0, jnp.where(valid, scale, 0.0), 1.0)
        return grads, state, {"dropped_replicas": num - count, KEPT: share}

    return Sync(None, update)


def _compressed(wire, error_feedback, axis_name) -> Sync:
    """`jdp.all_reduce(wire=...)`: the compressed exchange."""

    def update(grads, state, params, step_axis):
        del params
        axis = step_axis if axis_name is None else axis_name
        _collectives.axis_size(axis, "jdp.all_reduce")  # bound here?
        grads, error = _wire.mean(
            grads, wire=wire, axis_name=axis, error=state if error_feedback else None
        )
        return grads, (error if error_feedback else state), {}

    init = functools.partial(_wire.init_state, wire=wire) if error_feedback else None
    return Sync(init, update)


def local() -> Sync:
    """Each replica keeps its OWN gradients: no all-reduce.

    For optimizers that communicate themselves: `jdp.bmuf` (BMUF, DiLoCo, local
    SGD), or `jdp.sync_gradients` inside `optax.MultiSteps` (whose all-reduce
    then runs only on the micro-steps that update). With an optimizer that never
    communicates the replicas train different models, and the step warns.

    `jdp.bmuf`'s block sync runs after the parameter update, on the updated
    params, so every replica lands on exactly the same bits after a sync and a
    step that does not sync costs what the local step costs.

    Replicas agree on the step counter, the batch statistics and the global
    parts of `jdp.bmuf`'s state; params and other optimizer state may differ
    (the divergence guard compares only what agrees).

    Returns:
      A `jdp.Sync` whose `update` returns the gradients as they are.

    Example:
      >>> import optax, jdp
      >>> tx = jdp.bmuf(optax.sgd(0.1), sync_period=8)
      >>> sync = jdp.local()  # jdp.make_train_step(loss_fn, tx, sync=sync)
    """
    return Sync(None, _own, averages=False)


def _own(grads, state, params, axis_name):
    """`jdp.local()`'s update: the replica's own gradients."""
    del params, axis_name
    return grads, state, {}


def sync_gradients(
    sync: Any = None, *, axis_name: _collectives.AxisName | None = None
) -> optax.GradientTransformationExtraArgs:
    """Any sync piece as an optax transform; put it first in an `optax.chain`.

    For a step that does not sync its gradients itself (a hand-written step
    under `jdp.parallelize`, or `jdp.make_train_step(..., sync=jdp.local())`),
    in the spirit of `optax.contrib.sam(batch_axis_name=...)`: synchronous data
    parallelism from the optimizer alone. The piece's state (error-feedback
    buffers, PowerSGD's factors) is this transform's state, in the optimizer
    state; its metrics are dropped (optax has no place for them). Inside
    `optax.MultiSteps` it communicates only on the micro-steps that update.

    Args:
      sync: A `jdp.Sync` (`jdp.all_reduce(...)`, `jdp.powersgd(...)`,
        `jdp.partition(...)`, one of your own); None for `jdp.all_reduce()`.
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.

    Returns:
      An `optax.GradientTransformationExtraArgs`.

    Raises:
      TypeError: If `sync` is not a `jdp.Sync` (e.g. `jdp.sparse.rows()`,
        which applies the optimizer itself).

    Example:
      >>> import optax, jdp
      >>> tx = optax.chain(jdp.sync_gradients(), optax.clip_by_global_norm(1.0),
      ...                  optax.adam(1e-3))
      >>> tx = optax.chain(jdp.sync_gradients(jdp.powersgd(rank=4)),
      ...                  optax.adam(1e-3))
      >>> # a hand-written step, or `jdp.make_train_step(loss_fn, tx,
      >>> # sync=jdp.local())`
    """
    if sync is None:
        sync = all_reduce()
    if not isinstance(sync, Sync):
        raise TypeError(
            "`jdp.sync_gradients` turns a `jdp.Sync` (e.g. `jdp.all_reduce()`, "
            f"`jdp.powersgd(rank=4)`) into an optax transform; got "
            f"{type(sync).__name__}. `jdp.sparse.rows()` applies the optimizer "
            "itself: give it to `jdp.make_train_step(..., sync=...)` instead."
        )

    def init_fn(params):
        state = sync.initial_state(params)
        return optax.EmptyState() if state is None else state

    def update_fn(updates, state, params=None, **extra_args):
        if not extra_args.get(_collectives.COLLECTIVES_ARG, True):
            return updates, state
        axis = _collectives.resolve_axis(axis_name)
        _collectives.axis_size(axis, "jdp.sync_gradients")  # bound here?
        held = None if isinstance(state, optax.EmptyState) else state
        synced, new, _ = sync.update(updates, held, params, axis)
        return synced, (state if held is None else new)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def finite(grads: PyTree) -> jax.Array:
    """Whether every floating-point leaf of `grads` is finite (a bool scalar)."""
    ok = jnp.array(True)
    for g in jax.tree.leaves(grads):
        if is_float(g):
            ok &= jnp.all(jnp.isfinite(g))
    return ok


def unless_nonfinite(ok, run, state, *, counted: bool = True):
    """`run()`'s `(params, opt_state, metrics)` if `ok`, else the state's own.

    `ok` must be the same on every replica; metric `"skipped"` is 1 for a
    skipped step. `counted`: the state must have a `skipped_steps` counter.
    """
    if counted and getattr(state, "skipped_steps", None) is None:
        raise ValueError(
            "`skip_nonfinite=True` counts skipped steps in the state's "
            "`skipped_steps` field, which this state does not have (or holds "
            f"None): {type(state).__name__}. Use `jdp.TrainState.create(...)`, "
            "or add a `skipped_steps` field (an int32 zero) to your state."
        )

    def skip():
        shapes = jax.eval_shape(run)
        extra = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[2])
        # In the update's dtypes, so that both branches agree; a dtype the
        # update changed is reported by the step's layout check.
        kept = jax.tree.map(
            lambda s, x: jnp.asarray(x, s.dtype),
            shapes[:2],
            (state.params, state.opt_state),
        )
        return (*kept, extra)

    params, opt_state, extra = lax.cond(ok, run, skip)
    return params, opt_state, {**extra, "skipped": 1 - ok.astype(jnp.int32)}


def agreed_locally(state: PyTree) -> PyTree:
    """What replicas that train on their own gradients still agree on.

    The step counter and batch statistics (synced every step), and the parts of
    the optimizer state declared to agree (`_replica_parts`: the global parts
    of `jdp.bmuf`'s state); not the params or other optimizer state.
    """
    if not hasattr(state, "replace"):
        return None
    if syncs_gradients(state.opt_state):  # `jdp.zero`: replicas hold equal params
        return _replica_parts.must_agree(state)
    return state.replace(params=None, opt_state=_replica_parts.agreed(state.opt_state))


def syncs_gradients(opt_state: PyTree) -> bool:
    """Whether the optimizer state declares that it averages gradients itself."""
    nodes = jax.tree.leaves(opt_state, is_leaf=_layout.is_custom)
    return any(_layout.is_custom(x) and x.syncs_gradients for x in nodes)
