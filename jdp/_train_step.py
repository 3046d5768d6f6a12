"""`jdp.TrainState` and `jdp.make_train_step` (Caffe2's `Parallelize_GPU`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import optax
from flax import struct

from jdp import _bmuf, _collectives, _zero
from jdp._tree import is_float

PyTree = Any

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
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation,
        batch_stats: PyTree = None,
    ) -> TrainState:
        """Makes a state at step 0 with `tx.init(params)` as optimizer state."""
        return cls(
            step=jax.numpy.zeros((), jax.numpy.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=batch_stats,
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


def _contains_bmuf_state(opt_state: PyTree) -> bool:
    return bool(_bmuf.find_states(opt_state))


def make_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation | None = None,
    *,
    has_aux: bool = False,
    all_reduce: bool = True,
    axis_name: str = "data",
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
    batch_stats_mode: Literal["mean", "broadcast"] = "mean",
    remat: Literal["full"] | Callable[..., Any] | None = None,
    shard_optimizer_state: bool = False,
    clip_grad_norm: float | None = None,
) -> Callable[[PyTree, PyTree], tuple[PyTree, dict[str, jax.Array]]]:
    """Builds the per-replica training step for `jdp.parallelize`.

    The step computes `loss_fn` and its gradients on the replica's slice of the
    batch, averages the gradients over replicas with `jdp.all_reduce_gradients`
    (bucketed, reverse leaf order), applies `tx`, syncs batch statistics when the
    state has them, and returns `{"loss": ...}` plus the auxiliary metrics. Because
    every replica's loss is a mean over its slice and the gradients are averaged,
    N replicas on a global batch of B examples take the same step as one device on
    all B (the seed's loss scale `1 / (devices * shards)`, written as a mean).

    Args:
      loss_fn: `loss_fn(params, batch) -> loss` (or `-> (loss, aux)` with
        `has_aux`). When the state has `batch_stats` (not None), it is called as
        `loss_fn(params, batch_stats, batch)` and returns `(loss, new_batch_stats)`
        (or `(loss, (new_batch_stats, aux))` with `has_aux`).
      tx: The optax optimizer; None uses the state's own `tx` (flax `TrainState`).
      has_aux: Whether `loss_fn` returns auxiliary data; a dict of scalars becomes
        extra metrics, anything else is returned under `"aux"`.
      all_reduce: Average gradients across replicas (default). False keeps each
        replica's own gradients, for optimizers that communicate themselves
        (`jdp.bmuf`).
      axis_name: The replica axis given to `jdp.parallelize`.
      bucket_bytes: Bucket size for `jdp.all_reduce_gradients` (25 MiB).
      reduce_dtype: Wire dtype for the gradient all-reduce (e.g. `jnp.bfloat16`).
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
      shard_optimizer_state: ZeRO stages 1 and 2 (PyTorch's
        `ZeroRedundancyOptimizer`, DeepSpeed ZeRO-1/2): gradients are
        reduce-scattered instead of all-reduced, each replica keeps and updates
        only its 1/N slice of the (flattened, padded) optimizer state and
        parameters, and the updated parameters are all-gathered. Same numbers
        as the default for element-wise optimizers (SGD, momentum, Adam, AdamW,
        RMSProp, Lion, Adagrad, with schedules); others are refused with a
        message. `step.replicate` lays the optimizer state out sharded (the step
        carries a `jdp_state_layout` hook for it); `step.unreplicate` and
        checkpoints see one full logical copy.
      clip_grad_norm: If set, clip the averaged gradients to this global L2 norm
        before the optimizer (as `optax.clip_by_global_norm` would) and report
        the norm before clipping as metric `"grad_norm"`. With
        `shard_optimizer_state` the norm is computed across replicas (a `psum`),
        which `optax.clip_by_global_norm` inside `tx` cannot do.

    Returns:
      `train_step(state, batch) -> (state, metrics)`, to give to `jdp.parallelize`.

    Raises:
      ValueError: If `remat` is an unknown mode, `clip_grad_norm` is not positive,
        or `shard_optimizer_state=True` with `all_reduce=False`. At trace time, if
        `all_reduce=True` and the optimizer state holds BMUF state (BMUF must see
        each replica's own gradients), or if `shard_optimizer_state=True` and the
        optimizer is not element-wise or the state was not placed by
        `step.replicate`.
      TypeError: If `remat` is neither a mode nor a policy function.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> train_step = jdp.make_train_step(loss_fn, optax.sgd(0.1))
      >>> step = jdp.parallelize(train_step)

      With the optimizer state sharded across replicas:

      >>> tx = optax.adam(1e-3)
      >>> zero_step = jdp.parallelize(
      ...     jdp.make_train_step(loss_fn, tx, shard_optimizer_state=True)
      ... )
      >>> state = zero_step.replicate(
      ...     jdp.TrainState.create(params={"w": jnp.zeros((3, 1))}, tx=tx)
      ... )
      >>> state.opt_state.chunks[0].mu["w"].shape  # (replicas, ceil(3 / 8))
      (8, 1)

    References:
      Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
      Parameter Models", SC 2020, https://arxiv.org/abs/1910.02054.
      Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016,
      https://arxiv.org/abs/1604.06174.
    """
    loss_fn = _apply_remat(loss_fn, remat)
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(
            f"`clip_grad_norm` must be a positive global norm or None, got "
            f"{clip_grad_norm!r}."
        )
    if shard_optimizer_state and not all_reduce:
        raise ValueError(
            "`jdp.make_train_step(..., shard_optimizer_state=True)` averages the "
            "gradients itself (a reduce-scatter) and cannot be combined with "
            "`all_reduce=False`: optimizers that keep each replica's own gradients "
            "(`jdp.bmuf`) need a full optimizer state on every replica."
        )

    def train_step(state, batch):
        optimizer = state.tx if tx is None else tx
        if optimizer is None:
            raise ValueError(
                "`make_train_step` got no optimizer: pass `tx` or use a state that "
                "carries one (`jdp.TrainState.create(params=..., tx=...)`)."
            )
        if all_reduce and _contains_bmuf_state(state.opt_state):
            raise ValueError(
                "`jdp.make_train_step(..., all_reduce=True)` would average gradients "
                "across replicas, but the optimizer contains `jdp.bmuf`, which "
                "trains each replica on its own gradients and syncs the models "
                "itself. Use `jdp.make_train_step(loss_fn, tx, all_reduce=False)`."
            )
        loss, aux, new_stats, grads = loss_and_grads(
            _dense_value_and_grad, loss_fn, state, batch, has_aux=has_aux
        )
        grad_norm = None
        if shard_optimizer_state:
            new_params, opt_state, grad_norm = _zero.sharded_update(
                grads,
                state.opt_state,
                state.params,
                optimizer,
                axis_name=axis_name,
                bucket_bytes=bucket_bytes,
                reduce_dtype=reduce_dtype,
                clip_grad_norm=clip_grad_norm,
            )
        else:
            if all_reduce:
                grads = _collectives.all_reduce_gradients(
                    grads,
                    axis_name=axis_name,
                    bucket_bytes=bucket_bytes,
                    dtype=reduce_dtype,
                )
            if clip_grad_norm is not None:
                grads, grad_norm = _clip_by_global_norm(grads, clip_grad_norm)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            new_params = optax.apply_updates(state.params, updates)
            if not all_reduce:
                # BMUF: after a block sync every replica holds the same bits.
                new_params = _bmuf.snap_to_block_start(new_params, opt_state)
        return finish_step(
            state,
            new_params,
            opt_state,
            new_stats,
            loss,
            aux,
            has_aux=has_aux,
            batch_stats_mode=batch_stats_mode,
            axis_name=axis_name,
            extra_metrics={} if grad_norm is None else {"grad_norm": grad_norm},
        )

    if shard_optimizer_state:
        setattr(
            train_step,
            _zero.LAYOUT_HOOK,
            functools.partial(_zero.state_layout, tx=tx),
        )
    return train_step


def _dense_value_and_grad(fun, *, has_aux):
    return jax.value_and_grad(fun, has_aux=has_aux)


def loss_and_grads(value_and_grad, loss_fn, state, batch, *, has_aux):
    """`(loss, aux, new_batch_stats, grads)` of one replica's `loss_fn`.

    `value_and_grad(fun, has_aux=...)` differentiates `fun` with respect to its
    first argument (`jax.value_and_grad`, or `jdp.sparse.value_and_grad` bound to
    its tables). A state with `batch_stats` calls
    `loss_fn(params, batch_stats, batch) -> (loss, new_batch_stats)` (or
    `(loss, (new_batch_stats, aux))` with `has_aux`); otherwise
    `loss_fn(params, batch)`. `aux` and `new_batch_stats` are None when absent.
    """
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


def finish_step(
    state,
    params,
    opt_state,
    new_stats,
    loss,
    aux,
    *,
    has_aux: bool,
    batch_stats_mode: str,
    axis_name,
    extra_metrics: dict[str, Any] | None = None,
):
    """The step's new state (step + 1, synced batch stats) and its metrics.

    Metrics are `{"loss": loss}`, then `extra_metrics`, then `aux` (merged when
    it is a dict, else under `"aux"`).
    """
    changes = dict(step=state.step + 1, params=params, opt_state=opt_state)
    if new_stats is not None:
        changes["batch_stats"] = _collectives.sync_batch_stats(
            new_stats, mode=batch_stats_mode, axis_name=axis_name
        )
    metrics = {"loss": loss, **(extra_metrics or {})}
    if has_aux:
        if isinstance(aux, dict):
            metrics.update(aux)
        else:
            metrics["aux"] = aux
    return state.replace(**changes), metrics


def _apply_remat(loss_fn: Callable[..., Any], remat: Any) -> Callable[..., Any]:
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


def _clip_by_global_norm(grads: PyTree, max_norm: float) -> tuple[PyTree, jax.Array]:
    """`optax.clip_by_global_norm` on the floating leaves; also returns the norm."""
    floats = [g for g in jax.tree.leaves(grads) if is_float(g)]
    norm = optax.tree.norm(floats)
    clipped = jax.tree.map(
        lambda g: _zero.clip_to_norm(g, norm, max_norm) if is_float(g) else g, grads
    )
    return clipped, norm
