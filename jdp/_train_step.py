"""`jdp.TrainState` and `jdp.make_train_step` (Caffe2's `Parallelize_GPU`).

A train step is composed of pieces rather than switched by flags:

- how gradients are taken (`jax.value_and_grad`, or `jdp.sparse`'s row
  gradients), with `remat` wrapped around the loss;
- how they are synchronised and applied, ONE choice (`grad_sync`): averaged by an
  all-reduce, kept local (for optimizers that communicate themselves, such as
  `jdp.bmuf`), or reduce-scattered onto a sharded optimizer state (ZeRO);
- how the state is laid out across replicas, declared as data (`state_layout`
  of the returned `TrainStep`), which `step.replicate` follows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
import optax
from flax import struct
from jax import lax

from jdp import _bmuf, _collectives, _transforms, _validate, _zero
from jdp._layout import StateLayout
from jdp._tree import format_problems, is_float, keystr

PyTree = Any
GradSync = Literal["all_reduce", "none", "zero"]
GRAD_SYNCS = ("all_reduce", "none", "zero")
REMAT_MODES = (None, "full")


class TrainState(struct.PyTreeNode):
    """An immutable training state: step counter, params, optimizer state, stats.

    A flax `struct` dataclass (a pytree); the optimizer is a static field.
    `jdp.make_train_step` also accepts flax's own `flax.training.train_state.
    TrainState` or any pytree with `step`, `params`, `opt_state` and `replace`.

    Attributes:
      step: Number of updates applied (an int32 array).
      params: The trained parameters.
      opt_state: The optimizer's state.
      batch_stats: Computed, non-trained state such as BatchNorm statistics, or
        None.
      skipped_steps: Steps skipped because their gradients were not finite
        (`make_train_step(..., skip_nonfinite=True)`, or a loss scaler's
        overflow; an int32 array).
      dynamic_scale: A flax `DynamicScale` for float16 training (loss scaling),
        or None.
      tx: The optax optimizer (static: not a pytree leaf).

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> state = jdp.TrainState.create(params={"w": jnp.zeros(2)}, tx=optax.adam(1e-3))
      >>> int(state.step)
      0
    """

    step: jax.Array
    params: PyTree
    opt_state: optax.OptState
    batch_stats: PyTree = None
    skipped_steps: jax.Array | None = None
    dynamic_scale: Any = None
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation,
        batch_stats: PyTree = None,
        dynamic_scale: Any = None,
    ) -> TrainState:
        """Makes a state at step 0 with `tx.init(params)` as optimizer state."""
        return cls(
            step=jax.numpy.zeros((), jax.numpy.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=batch_stats,
            skipped_steps=jax.numpy.zeros((), jax.numpy.int32),
            dynamic_scale=dynamic_scale,
            tx=tx,
        )

    def apply_gradients(self, *, grads: PyTree) -> TrainState:
        """Applies one optimizer update; returns the new state."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(
            step=self.step + 1,
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
        )


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A per-replica train step and the layout of the state it expects.

    What `jdp.make_train_step` returns: call it as `step_fn(state, batch)`.
    `state_layout`, when set, maps the abstract logical state and the replica
    count to the per-replica layout; `step.replicate` follows it. `must_agree`,
    when set, maps a state to the part of it replicas must agree on (others set
    to None); `jdp.parallelize`'s `check_sync` compares only that part.
    """

    step_fn: Callable[[PyTree, PyTree], tuple[PyTree, dict[str, jax.Array]]]
    state_layout: StateLayout | None = None
    must_agree: Callable[[PyTree], PyTree] | None = None

    def __call__(self, state: PyTree, batch: PyTree):
        return self.step_fn(state, batch)

    @property
    def __name__(self) -> str:
        return getattr(self.step_fn, "__name__", "train_step")


class Update(NamedTuple):
    """How a step synchronises and applies gradients (one `grad_sync` choice).

    `apply(grads, state, tx) -> (params, opt_state, metrics)` runs inside the
    step on one replica's gradients; `state_layout` is the layout it needs;
    `must_agree` the part of the state replicas agree on, if not all of it.
    """

    apply: Callable[[PyTree, PyTree, optax.GradientTransformation], tuple]
    state_layout: StateLayout | None = None
    must_agree: Callable[[PyTree], PyTree] | None = None
    #: Like `apply` for gradients that are already averaged (a loss scaler's), or
    #: None where that does not apply.
    apply_synced: Callable[..., tuple] | None = None


def make_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation | None = None,
    *,
    has_aux: bool = False,
    grad_sync: GradSync = "all_reduce",
    axis_name: _collectives.AxisName | None = None,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
    batch_stats_mode: Literal["mean", "broadcast"] = "mean",
    remat: Literal["full"] | Callable[..., Any] | None = None,
    clip_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    microbatches: int = 1,
) -> TrainStep:
    """Builds the per-replica training step for `jdp.parallelize`.

    The step computes `loss_fn` and its gradients on the replica's slice of the
    batch, averages the gradients over replicas with `jdp.all_reduce_gradients`
    (bucketed, reverse leaf order), applies `tx`, syncs batch statistics when the
    state has them, and returns `{"loss": ...}` plus the auxiliary metrics. Because
    every replica's loss is a mean over its slice and the gradients are averaged,
    N replicas on a global batch of B examples take the same step as one device on
    all B (Caffe2's loss scale `1 / (devices * shards)`, written as a mean).

    Args:
      loss_fn: `loss_fn(params, batch) -> loss` (or `-> (loss, aux)` with
        `has_aux`). When the state has `batch_stats` (not None), it is called as
        `loss_fn(params, batch_stats, batch)` and returns `(loss, new_batch_stats)`
        (or `(loss, (new_batch_stats, aux))` with `has_aux`).
      tx: The optax optimizer; None uses the state's own `tx` (flax `TrainState`).
      has_aux: Whether `loss_fn` returns auxiliary data; a dict of scalars becomes
        extra metrics, anything else is returned under `"aux"`.
      grad_sync: How gradients are synchronised across replicas:
        `"all_reduce"` (default) averages them before `tx` (PyTorch DDP);
        `"none"` keeps each replica's own gradients, for optimizers that
        communicate themselves (`jdp.bmuf`; `jdp.sync_gradients` inside
        `optax.MultiSteps`, whose all-reduce then runs only on the micro-steps
        that update) or local SGD; `"zero"` is ZeRO stages 1 and 2
        (PyTorch's `ZeroRedundancyOptimizer`, DeepSpeed ZeRO-1/2): gradients are
        reduce-scattered, each replica keeps and updates only its 1/N slice of
        the (flattened, padded) optimizer state, and the updated parameters are
        all-gathered. `"zero"` gives the same numbers as `"all_reduce"` for
        element-wise optimizers (SGD, momentum, Adam, AdamW, RMSProp, Lion,
        Adagrad, with schedules); others are refused with a message.
        `step.replicate` lays its optimizer state out sharded; `step.unreplicate`
        and checkpoints see one full logical copy.
      axis_name: The replica axis; None (default) uses the one bound by the
        `jdp.parallelize` that runs the step: give it once, there.
      bucket_bytes: Largest bucket of the gradient collectives (25 MiB).
      reduce_dtype: Wire dtype of the gradient collectives (e.g. `jnp.bfloat16`).
      batch_stats_mode: How `jdp.sync_batch_stats` syncs statistics: `"mean"`
        (default) or `"broadcast"`.
      remat: Rematerialise the forward pass in the backward pass instead of
        keeping its intermediates (`jax.checkpoint` around `loss_fn`): None
        (default, keep them), `"full"` (save nothing but the inputs), or a
        `jax.checkpoint_policies` policy such as
        `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`. The numbers
        do not change. Applied to the whole loss it trades compute for memory
        only where the policy keeps fewer values than the backward pass needs at
        once; for per-layer savings also wrap layers in `jax.checkpoint` (or
        `flax.linen.remat`) and compare with `step.memory_analysis`.
      clip_grad_norm: If set, clip the gradients the optimizer sees (averaged,
        unless `grad_sync="none"`) to this global L2 norm (as
        `optax.clip_by_global_norm` would) and report the norm before clipping
        as metric `"grad_norm"`. With `grad_sync="zero"` the norm is computed
        across replicas (a `psum`), which `optax.clip_by_global_norm` inside
        `tx` cannot do.
      skip_nonfinite: Skip a step whose gradients are not finite (a NaN or inf
        loss, an overflow): params and optimizer state stay as they were, on
        every replica (the decision is taken on all replicas' gradients, so it
        is the same everywhere), the state's `skipped_steps` counter grows by
        one and metric `"skipped"` is 1 (0 otherwise). The step counter still
        advances. Needs a state with a `skipped_steps` field (`jdp.TrainState`
        has one). Like `optax.apply_if_finite`, but the decision covers every
        replica and every `grad_sync` (a ZeRO replica sees only slices).
      microbatches: Gradient accumulation (PyTorch DDP's `no_sync()`, Horovod's
        `backward_passes_per_step`, DeepSpeed's `gradient_accumulation_steps`):
        split each replica's batch into this many equal microbatches, process
        them in sequence inside the step (`lax.scan`: the activations of one
        microbatch are live at a time), sum their gradients locally, then
        all-reduce once and update once. For a loss that is a mean over
        examples the result equals the whole batch at once. 1 by default.

    Loss scaling: a state with a flax `DynamicScale` in a `dynamic_scale` field
    (`jdp.TrainState.create(..., dynamic_scale=DynamicScale())`, or a flax
    `TrainState` subclass with that field, as in flax's ImageNet example) is
    honoured: the loss is scaled, the gradients unscaled and averaged, a step
    whose averaged gradients are not finite is skipped on every replica, the
    scale is updated, and metrics gain `"loss_scale"` and `"skipped"`.

    flax NNX: split the model into its `nnx.Param`s (trained) and the rest
    (BatchNorm statistics, RNG streams), `graphdef, params, rest =
    nnx.split(model, nnx.Param, ...)`, pass `jdp.TrainState.create(params=params,
    batch_stats=rest, tx=tx)`, and let `loss_fn(params, rest, batch)` call
    `nnx.merge(graphdef, params, rest)` and return `(loss, nnx.state(model,
    nnx.Not(nnx.Param)))`. A plain `nnx.merge` works: the step hands `loss_fn`
    batch statistics made inside the differentiated function, so BatchNorm may
    update them. Give BatchNorm the replica axis (`nnx.BatchNorm(...,
    axis_name="data")`) to normalise with the global batch's statistics.

    Returns:
      `train_step(state, batch) -> (state, metrics)`, to give to `jdp.parallelize`.

    Raises:
      ValueError: If `grad_sync` or `remat` is an unknown mode, or
        `clip_grad_norm` is not positive. At trace time, if the optimizer state
        holds BMUF state and `grad_sync` is not `"none"` (BMUF must see each
        replica's own gradients), or if `grad_sync="zero"` and the optimizer is
        not element-wise or the state was not placed by `step.replicate`.
      TypeError: If `remat` is neither a mode nor a policy function.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> train_step = jdp.make_train_step(loss_fn, optax.sgd(0.1))
      >>> step = jdp.parallelize(train_step)

      With the optimizer state sharded across the 8 replicas, each holds 1/8
      of Adam's two moments:

      >>> tx = optax.adam(1e-3)
      >>> params = {"w": jnp.zeros((800, 1))}
      >>> batch = {"x": jnp.zeros((8, 800)), "y": jnp.zeros((8, 1))}
      >>> def bytes_per_device(grad_sync):
      ...     train_step = jdp.make_train_step(loss_fn, tx, grad_sync=grad_sync)
      ...     step = jdp.parallelize(train_step)
      ...     state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
      ...     return step.memory_analysis(state, step.shard(batch)).argument_bytes
      >>> bytes_per_device("all_reduce") - bytes_per_device("zero")  # 2 * 7/8 * 3200
      5600

      A flax NNX model with BatchNorm:

      >>> from flax import nnx
      >>> rngs = nnx.Rngs(0)
      >>> layers = nnx.Linear(3, 2, rngs=rngs), nnx.BatchNorm(2, rngs=rngs)
      >>> model = nnx.Sequential(*layers)
      >>> graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      >>> def nnx_loss(params, rest, batch):
      ...     model = nnx.merge(graphdef, params, rest)
      ...     loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
      ...     return loss, nnx.state(model, nnx.Not(nnx.Param))
      >>> tx = optax.sgd(0.1)
      >>> step = jdp.parallelize(jdp.make_train_step(nnx_loss, tx))
      >>> state = jdp.TrainState.create(params=params, batch_stats=rest, tx=tx)
      >>> batch = {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.ones((8, 2))}
      >>> state, metrics = step(step.replicate(state), step.shard(batch))
      >>> one = step.unreplicate(state)
      >>> model = nnx.merge(graphdef, one.params, one.batch_stats)
      >>> bool((model.layers[1].mean[...] != 0).all())  # BatchNorm's statistics
      True

    References:
      Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
      Parameter Models", SC 2020, https://arxiv.org/abs/1910.02054.
      Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016,
      https://arxiv.org/abs/1604.06174.
    """
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"`grad_sync` must be one of {GRAD_SYNCS}; got {grad_sync!r}.")
    if clip_grad_norm is not None:
        _validate.finite_number(
            "clip_grad_norm", clip_grad_norm, above=0, note="a global norm, or None"
        )
    _collectives.check_bucket_bytes(bucket_bytes)
    options = dict(
        axis_name=axis_name,
        bucket_bytes=bucket_bytes,
        reduce_dtype=reduce_dtype,
        clip_grad_norm=clip_grad_norm,
    )
    if grad_sync == "zero":
        update = Update(_zero.update_fn(**options), _zero.layout_fn(tx))
    elif grad_sync == "none":
        update = Update(
            _local_update(clip_grad_norm=clip_grad_norm), must_agree=_agreed_locally
        )
    else:
        update = Update(
            _all_reduce_update(**options),
            apply_synced=lambda g, s, t: _apply(g, s, t, clip_grad_norm),
        )
    _validate.positive_int("microbatches", microbatches)
    if skip_nonfinite:
        update = update._replace(apply=_skipping(update.apply, axis_name=axis_name))
    return build_train_step(
        apply_remat(loss_fn, remat),
        tx,
        value_and_grad=lambda optimizer: jax.value_and_grad,
        update=update,
        has_aux=has_aux,
        axis_name=axis_name,
        batch_stats_mode=batch_stats_mode,
        api="jdp.make_train_step",
        local_grads=grad_sync == "none",
        microbatches=microbatches,
    )


def build_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation | None,
    *,
    value_and_grad: Callable[[optax.GradientTransformation], Callable[..., Any]],
    update: Update,
    has_aux: bool,
    axis_name: _collectives.AxisName,
    batch_stats_mode: str,
    api: str,
    local_grads: bool = False,
    microbatches: int = 1,
) -> TrainStep:
    """Composes a train step from its pieces (see the module docstring).

    Args:
      loss_fn: As for `make_train_step` (remat already applied).
      tx: The optimizer, or None for the state's own.
      value_and_grad: Given the optimizer, returns `value_and_grad(fun,
        has_aux=...)`, differentiating `fun` with respect to its first argument
        (`jax.value_and_grad`, or `jdp.sparse.value_and_grad` for its tables).
      update: How gradients are synchronised and applied.
      has_aux: Whether `loss_fn` returns auxiliary data.
      axis_name: The replica axis.
      batch_stats_mode: How batch statistics are synced.
      api: The public name, for error messages.
      local_grads: Whether the optimizer sees each replica's own gradients (the
        only setting that admits `jdp.bmuf`).
      microbatches: Split the replica's batch into this many microbatches and
        accumulate their gradients (`lax.scan`) before one update.
    """

    def train_step(state, batch):
        optimizer = state.tx if tx is None else tx
        if optimizer is None:
            raise ValueError(
                f"`{api}` got no optimizer: pass `tx` or use a state that "
                "carries one (`jdp.TrainState.create(params=..., tx=...)`)."
            )
        if not local_grads and _bmuf.find_states(state.opt_state):
            raise ValueError(
                f"`{api}` averages gradients across replicas, but the optimizer "
                "contains `jdp.bmuf`, which trains each replica on its own "
                "gradients and syncs the models itself. Use "
                '`jdp.make_train_step(loss_fn, tx, grad_sync="none")`.'
            )
        _check_trainable(state.params, api)
        _check_known_fields(state, api)
        changes = {}
        scale = getattr(state, "dynamic_scale", None)
        if scale is not None:
            loss, aux, new_stats, grads, params, opt_state, extra = _loss_scaled(
                scale,
                loss_fn,
                state,
                batch,
                optimizer,
                update,
                changes,
                has_aux=has_aux,
                microbatches=microbatches,
                axis_name=axis_name,
            )
        else:
            loss, aux, new_stats, grads = _gradients(
                value_and_grad(optimizer),
                loss_fn,
                state,
                batch,
                has_aux=has_aux,
                microbatches=microbatches,
            )
            params, opt_state, extra = update.apply(grads, state, optimizer)
        changes.update(step=state.step + 1, params=params, opt_state=opt_state)
        if "skipped" in extra and getattr(state, "skipped_steps", None) is not None:
            changes["skipped_steps"] = state.skipped_steps + extra["skipped"]
        if new_stats is not None:
            changes["batch_stats"] = _collectives.sync_batch_stats(
                new_stats, mode=batch_stats_mode, axis_name=axis_name
            )
        metrics = {"loss": loss, **extra}
        if has_aux:
            if isinstance(aux, dict):
                metrics.update(aux)
            else:
                metrics["aux"] = aux
        return state.replace(**changes), metrics

    return TrainStep(train_step, update.state_layout, update.must_agree)


# -- gradients ------------------------------------------------------------------


def _gradients(value_and_grad, loss_fn, state, batch, *, has_aux, microbatches):
    """`loss_and_grads` over the whole batch, or accumulated over microbatches.

    With `microbatches=k` the replica's batch is split into `k` equal parts along
    its leading axis and processed in sequence (`lax.scan`, so activations of one
    part are live at a time); gradients are summed and divided by `k`, which for
    a loss that is a mean over examples equals the gradient on the whole batch.
    Batch statistics flow from one part to the next; the loss and floating
    auxiliary values are averaged over the parts.
    """
    if microbatches == 1:
        return loss_and_grads(value_and_grad, loss_fn, state, batch, has_aux=has_aux)
    k = microbatches
    bad = [
        f"{keystr(p)}: {np.shape(x)[0] if np.ndim(x) else 'a scalar'}"
        for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
        if np.ndim(x) == 0 or np.shape(x)[0] % k
    ]
    if bad:
        raise ValueError(
            f"`make_train_step(..., microbatches={k})` splits every batch leaf "
            f"into {k} parts along its leading axis, but these leaves' sizes per "
            f"replica are not multiples of {k}:{format_problems(bad)}\nFix: a "
            f"per-replica batch that is a multiple of {k} (the global batch a "
            f"multiple of {k} x num_replicas)."
        )
    parts = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
    stats = getattr(state, "batch_stats", None)

    def body(carry, part):
        total, stats = carry
        current = state if stats is None else state.replace(batch_stats=stats)
        loss, aux, new_stats, grads = loss_and_grads(
            value_and_grad, loss_fn, current, part, has_aux=has_aux
        )
        total = jax.tree.map(lambda a, g: a + g, total, grads)
        return (total, new_stats if stats is not None else None), (loss, aux)

    zeros = jax.tree.map(jax.numpy.zeros_like, state.params)
    (total, new_stats), (losses, auxs) = lax.scan(body, (zeros, stats), parts)
    grads = jax.tree.map(lambda g: g / k, total)
    aux = jax.tree.map(lambda a: a.mean(0) if is_float(a) else a[-1], auxs)
    return losses.mean(), aux, new_stats, grads


def _loss_scaled(
    scale,
    loss_fn,
    state,
    batch,
    tx,
    update,
    changes,
    *,
    has_aux,
    microbatches,
    axis_name,
):
    """Gradients through a flax `DynamicScale` (float16 loss scaling).

    The scaled loss is differentiated, the gradients unscaled and averaged over
    replicas by `DynamicScale.value_and_grad(axis_name=...)`, so every replica
    sees the same finiteness verdict; a non-finite step leaves params and
    optimizer state unchanged and the scale backs off (the flax ImageNet recipe).
    """
    if update.apply_synced is None:
        raise ValueError(
            "A state with a `dynamic_scale` (loss scaling) needs "
            '`make_train_step(..., grad_sync="all_reduce")`: the loss scaler '
            "averages the gradients itself; sharded or local updates with loss "
            "scaling are not supported."
        )
    if microbatches != 1:
        raise ValueError(
            "A state with a `dynamic_scale` (loss scaling) cannot be combined with "
            "`microbatches`: accumulate in float32 instead, or drop the scaler."
        )
    verdict = {}
    axis = _collectives.resolve_axis(axis_name)

    def scaled_value_and_grad(fun, *, has_aux):
        grad_fn = scale.value_and_grad(fun, has_aux=has_aux, axis_name=axis)

        def value_and_grads(*args):
            verdict["scale"], verdict["finite"], value, grads = grad_fn(*args)
            return value, grads

        return value_and_grads

    loss, aux, new_stats, grads = loss_and_grads(
        scaled_value_and_grad, loss_fn, state, batch, has_aux=has_aux
    )
    params, opt_state, extra = update.apply_synced(grads, state, tx)
    finite = verdict["finite"]
    keep = lambda new, old: jax.tree.map(  # noqa: E731
        lambda n, o: jax.numpy.where(finite, n, o), new, old
    )
    changes["dynamic_scale"] = verdict["scale"]
    extra = {
        **extra,
        "loss_scale": scale.scale,
        "skipped": 1 - finite.astype(jax.numpy.int32),
    }
    return (
        loss,
        aux,
        new_stats,
        grads,
        keep(params, state.params),
        keep(opt_state, state.opt_state),
        extra,
    )


def loss_and_grads(value_and_grad, loss_fn, state, batch, *, has_aux):
    """`(loss, aux, new_batch_stats, grads)` of one replica's `loss_fn`.

    A state with `batch_stats` calls `loss_fn(params, batch_stats, batch) ->
    (loss, new_batch_stats)` (or `(loss, (new_batch_stats, aux))` with
    `has_aux`); otherwise `loss_fn(params, batch)`. `aux` and `new_batch_stats`
    are None when absent.
    """
    loss_fn = _fresh_arguments(loss_fn)
    batch_stats = getattr(state, "batch_stats", None)
    if batch_stats is None:
        out, grads = value_and_grad(loss_fn, has_aux=has_aux)(state.params, batch)
        loss, aux = out if has_aux else (out, None)
        return loss, aux, None, grads
    (loss, rest), grads = value_and_grad(loss_fn, has_aux=True)(
        state.params, batch_stats, batch
    )
    new_stats, aux = rest if has_aux else (rest, None)
    return loss, aux, new_stats, grads


def _fresh_arguments(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`loss_fn` with the arguments it is not differentiated by rebuilt inside.

    `jax.value_and_grad` hands the arguments it does not differentiate (batch
    statistics, the batch) to the function as the very objects it was given. A
    flax NNX `Variable` remembers the trace it was made in and refuses updates
    from another one, so a `loss_fn` that `nnx.merge`s the batch statistics and
    runs BatchNorm in training mode would fail with "Cannot mutate BatchStat
    from a different trace level". Rebuilding those pytrees inside the
    differentiated function (same leaves, new nodes) makes them this trace's
    own, as `nnx.merge(..., copy=True)` would; other pytrees are unaffected.
    """

    @functools.wraps(loss_fn)
    def with_fresh_arguments(params, *rest):
        return loss_fn(params, *jax.tree.map(lambda x: x, rest))

    return with_fresh_arguments


def apply_remat(loss_fn: Callable[..., Any], remat: Any) -> Callable[..., Any]:
    """`loss_fn` under `jax.checkpoint` as `remat` asks (validated here)."""
    if remat is None:
        return loss_fn
    if isinstance(remat, str):
        if remat != "full":
            raise ValueError(
                f"`remat` must be one of {REMAT_MODES} or a "
                f"`jax.checkpoint_policies` policy; got {remat!r}."
            )
        return jax.checkpoint(loss_fn)
    if not callable(remat):
        raise TypeError(
            "`remat` must be None, 'full' or a `jax.checkpoint_policies` policy "
            f"(a function); got a {type(remat).__name__}."
        )
    return jax.checkpoint(loss_fn, policy=remat)


#: The state fields a train step reads and writes (static fields, such as a flax
#: `TrainState`'s `apply_fn` and `tx`, are not part of the pytree).
KNOWN_FIELDS = (
    "step",
    "params",
    "opt_state",
    "batch_stats",
    "skipped_steps",
    "dynamic_scale",
)


def _check_known_fields(state: PyTree, api: str) -> None:
    """Refuses a state field the step would carry along unchanged at every step.

    A dataclass state (a flax `struct`, flax's `TrainState` and its subclasses)
    may hold only the fields the step updates, static fields and fields that
    hold no arrays (None): an `ema_params` or a dropout key the step never
    touched would otherwise train silently wrong.
    """
    if not dataclasses.is_dataclass(state):
        return
    unknown = [
        f.name
        for f in dataclasses.fields(state)
        if f.metadata.get("pytree_node", True)
        and f.name not in KNOWN_FIELDS
        and jax.tree.leaves(getattr(state, f.name))
    ]
    if unknown:
        name = unknown[0]
        raise ValueError(
            f"`{api}` updates a state's {', '.join(f'`{k}`' for k in KNOWN_FIELDS)}; "
            f"this {type(state).__name__} also has {', '.join(map(repr, unknown))}, "
            "which the step would leave unchanged at every step. Update it in a "
            "step of your own around this one, e.g. `def step(state, batch): new, "
            f"metrics = train_step(state.replace({name}=None), batch); return "
            f"new.replace({name}=...), metrics`, or remove it from the state."
        )


def _check_trainable(params: PyTree, api: str) -> None:
    """Gradients need floating-point params: name the leaves that are not."""
    bad = [
        f"{keystr(path)}: {jax.numpy.result_type(x)}"
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if not is_float(x)
    ]
    if bad:
        raise TypeError(
            f"`{api}`: the state's params must be floating-point (they are "
            f"differentiated), but these leaves are not:{format_problems(bad)}\n"
            "Fix: keep integer state (counters, ids) and PRNG keys out of `params`, "
            "e.g. in `batch_stats` or another field of the state." + _nnx_hint(params)
        )


def _nnx_hint(params: PyTree) -> str:
    """How to split a flax NNX model, when `params` holds NNX `Variable`s."""
    from flax import nnx  # only on this error path

    def is_variable(x):
        return isinstance(x, nnx.Variable)

    if not any(map(is_variable, jax.tree.leaves(params, is_leaf=is_variable))):
        return ""
    return (
        "\nWith flax NNX, train the `nnx.Param`s and carry the rest (BatchNorm "
        "statistics, RNG streams) as batch statistics: `graphdef, params, rest = "
        "nnx.split(model, nnx.Param, ...)`, `jdp.TrainState.create(params=params, "
        "batch_stats=rest, tx=tx)`, and a `loss_fn(params, rest, batch)` that "
        "`nnx.merge`s them and returns `(loss, nnx.state(model, "
        "nnx.Not(nnx.Param)))`."
    )


# -- synchronising and applying gradients ---------------------------------------------


def _apply(grads, state, tx, clip_grad_norm):
    """`tx` applied to `grads` (clipped first if asked); returns the step's parts."""
    extra = {}
    if clip_grad_norm is not None:
        grads, extra["grad_norm"] = _clip_by_global_norm(grads, clip_grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state, extra


def _all_reduce_update(*, axis_name, bucket_bytes, reduce_dtype, clip_grad_norm):
    def apply(grads, state, tx):
        grads = _collectives.all_reduce_gradients(
            grads,
            axis_name=axis_name,
            bucket_bytes=bucket_bytes,
            reduce_dtype=reduce_dtype,
        )
        return _apply(grads, state, tx, clip_grad_norm)

    return apply


def _local_update(*, clip_grad_norm):
    def apply(grads, state, tx):
        if isinstance(state.opt_state, optax.MultiStepsState):
            # Its `jdp.sync_gradients` then all-reduces once per update.
            update = functools.partial(_transforms.update_multisteps, tx)
            tx = optax.GradientTransformation(tx.init, update)
        # BMUF syncs the updated params after the update (cheaper than inside
        # the optimizer, and every replica then holds exactly the same bits).
        with _bmuf.merge_after_update() as merges:
            params, opt_state, extra = _apply(grads, state, tx, clip_grad_norm)
        params, opt_state = _bmuf.merge_updated(
            params, state.opt_state, opt_state, merges
        )
        return params, opt_state, extra

    return apply


def _skipping(apply, *, axis_name):
    """`apply` that leaves params and optimizer state alone for non-finite grads.

    Every replica's own gradients are checked and the verdict is combined over
    replicas (one scalar collective), so all replicas take the same branch: an
    average of gradients is finite exactly when every replica's is (barring an
    overflow of the sum).
    """

    def skipping(grads, state, tx):
        if getattr(state, "skipped_steps", None) is None:
            raise ValueError(
                "`jdp.make_train_step(..., skip_nonfinite=True)` counts skipped "
                "steps in the state's `skipped_steps` field, which this state does "
                f"not have (or holds None): {type(state).__name__}. Use "
                "`jdp.TrainState.create(...)`, or add a `skipped_steps` field "
                "(an int32 zero) to your state."
            )
        leaves = [g for g in jax.tree.leaves(grads) if is_float(g)]
        finite = jax.numpy.array(True)
        for g in leaves:
            finite &= jax.numpy.all(jax.numpy.isfinite(g))
        axis = _collectives.resolve_axis(axis_name)
        finite = lax.pmin(finite.astype(jax.numpy.int32), axis) > 0

        def run(_):
            params, opt_state, extra = apply(grads, state, tx)
            return params, opt_state, extra

        def skip(_):
            shapes = jax.eval_shape(run, None)
            extra = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes[2])
            return state.params, state.opt_state, extra

        params, opt_state, extra = lax.cond(finite, run, skip, None)
        return (
            params,
            opt_state,
            {**extra, "skipped": 1 - finite.astype(jax.numpy.int32)},
        )

    return skipping


def _agreed_locally(state: PyTree) -> PyTree:
    """What replicas that train on their own gradients still agree on.

    The step counter and batch statistics (synced every step), and the global
    parts of `jdp.bmuf`'s state; not the params or other optimizer state.
    """
    if not hasattr(state, "replace"):
        return None
    return state.replace(params=None, opt_state=_bmuf.agreed_parts(state.opt_state))


def _clip_by_global_norm(grads: PyTree, max_norm: float) -> tuple[PyTree, jax.Array]:
    """`optax.clip_by_global_norm` on the floating leaves; also returns the norm."""
    floats = [g for g in jax.tree.leaves(grads) if is_float(g)]
    norm = optax.tree.norm(floats)
    clipped = jax.tree.map(
        lambda g: _zero.clip_to_norm(g, norm, max_norm) if is_float(g) else g, grads
    )
    return clipped, norm
