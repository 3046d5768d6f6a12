"""`jdp.make_train_step` (Caffe2's `Parallelize_GPU`).

A train step is composed of pieces rather than switched by flags:

- the loss, whose parameters say whether it trains batch statistics;
- how gradients are synchronised: ONE piece, `sync=` (a `jdp.Sync`: averaged
  by an all-reduce, compressed, kept local for optimizers that communicate
  themselves such as `jdp.bmuf`, or one of your own); the step then applies
  the optimizer once. `jdp.sparse.rows()` applies the optimizer itself (sparse
  rows);
- what the step does around them, once for every piece: skipping non-finite
  steps (`skip_nonfinite`), syncing batch statistics (`batch_stats`), loss
  scaling;
- which part of the state replicas must agree on, declared as data
  (`must_agree` of the returned `TrainStep`), which checkpoints and the
  divergence guard follow.

"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax import lax

from jdp import (
    _collectives,
    _loss,
    _replica_parts,
    _step_checks,
    _sync,
    _validate,
)

PyTree = Any

AVERAGED_TWICE_MSG = (
    "`{api}`: the optimizer averages the gradients across replicas itself "
    "(`jdp.zero` reduce-scatters them), and so does the sync piece. Give the "
    "optimizer each replica's own gradients: `jdp.make_train_step(loss_fn, "
    "jdp.zero(tx), sync=jdp.local())`."
)

#: `jdp.all_reduce()`, the default piece (made once: a `Sync` is immutable).
_DEFAULT_SYNC = _sync.all_reduce()


class LossSpec(NamedTuple):
    """How a train step calls its loss (what `jdp.check_equivalence` runs again)."""

    loss_fn: Callable[..., Any]
    has_aux: bool
    microbatches: int
    keywords: tuple[str, ...]  # the `LOSS_KEYWORDS` the loss declares
    axis_name: _collectives.AxisName | None


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A per-replica train step and what it declares about its state.

    What `jdp.make_train_step` returns: call it as `step_fn(state, batch)`.
    `must_agree`,
    when set, maps a state to the part of it replicas must agree on (others set
    to None); `jdp.parallelize`'s `check_sync` compares only that part.
    `loss` says how the step calls its loss, for `jdp.check_equivalence`.
    """

    step_fn: Callable[[PyTree, PyTree], tuple[PyTree, dict[str, jax.Array]]]
    must_agree: Callable[[PyTree], PyTree] | None = None
    loss: LossSpec | None = None

    def __call__(self, state: PyTree, batch: PyTree):
        return self.step_fn(state, batch)

    @property
    def __name__(self) -> str:
        return getattr(self.step_fn, "__name__", "train_step")


def make_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation | None = None,
    *,
    sync: _sync.Sync | _sync.OwnUpdate = _DEFAULT_SYNC,
    has_aux: bool = False,
    microbatches: int = 1,
    axis_name: _collectives.AxisName | None = None,
    skip_nonfinite: bool = False,
    batch_stats: _sync.BatchStatsMode = "mean",
) -> TrainStep:
    """Builds the per-replica training step for `jdp.parallelize`.

    The step computes `loss_fn` and its gradients on the replica's slice of the
    batch, synchronises and applies them as `sync` says (by default
    `jdp.all_reduce()`: averaged over replicas with one bucketed all-reduce, then
    `tx`), syncs batch statistics when the state has them, and returns
    `{"loss": ...}` plus the auxiliary metrics. Because the gradients are
    averaged, N replicas on a global batch of B examples take the same step as
    one device on all B when every replica's loss is a mean over the same number
    of examples (Caffe2's loss scale `1 / (devices * shards)`, written as a
    mean).

    Everything else is composed from the pieces that already do it: gradient
    clipping is `optax.clip_by_global_norm` in `tx` (under `jdp.zero`, its
    `clip_grad_norm`); rematerialisation is `jax.checkpoint` around `loss_fn`
    (e.g. `jax.checkpoint(loss_fn, policy=jax.checkpoint_policies.
    dots_with_no_batch_dims_saveable)`).

    Args:
      loss_fn: `loss_fn(params, batch) -> loss` (or `-> (loss, aux)` with
        `has_aux`). A `loss_fn` with three positional parameters is
        `loss_fn(params, batch_stats, batch) -> (loss, new_batch_stats)` (or
        `(loss, (new_batch_stats, aux))` with `has_aux`) and trains a state with
        `batch_stats` (BatchNorm statistics, NNX's non-trained state); the
        state must then have batch statistics, and a two-parameter `loss_fn`
        a state without. The loss may be `jdp.weighted(total, weight)` (a
        masked or token-weighted loss: divided by the global weight once). A
        `loss_fn` that declares a parameter named `rng` receives this replica's
        PRNG key for this step (and microbatch), derived from the state's
        `rng` (`jdp.TrainState.create(..., rng=key)`): different on every
        replica and step, the same again after a checkpoint restore (linen
        dropout: `model.apply(..., rngs={"dropout": rng})`). One that declares
        `step` receives the state's step counter (for schedules inside the
        loss).
      tx: The optax optimizer; None uses the state's own `tx` (flax `TrainState`).
      sync: How gradients are synchronised: a `jdp.Sync` such as
        `jdp.all_reduce()` (default, PyTorch DDP), `jdp.powersgd(...)`,
        `jdp.partition(...)` or `jdp.local()` (each replica's own gradients,
        for optimizers that communicate themselves: `jdp.bmuf`, `jdp.zero`, or
        `jdp.sync_gradients` inside `optax.MultiSteps`); or `jdp.sparse.rows()`
        (sparse embedding gradients), which applies the optimizer itself.
      has_aux: Whether `loss_fn` returns auxiliary data; a dict of scalars becomes
        extra metrics, anything else is returned under `"aux"`.
      microbatches: Gradient accumulation (PyTorch DDP's `no_sync()`, Horovod's
        `backward_passes_per_step`, DeepSpeed's `gradient_accumulation_steps`):
        split each replica's batch into this many equal microbatches, process
        them in sequence inside the step (`lax.scan`: the activations of one
        microbatch are live at a time), sum their gradients locally, then
        synchronise once and update once. For a loss that is a mean over
        examples the result equals the whole batch at once. 1 by default.
      axis_name: The replica axis; None (default) uses the one bound by the
        `jdp.parallelize` that runs the step: give it once, there.
      skip_nonfinite: Skip a step whose synced gradients are not finite on any
        replica (the verdict is agreed by one scalar collective): params,
        optimizer state, the piece's state and batch statistics stay as they
        were on every replica, the state's `skipped_steps` grows by one and
        metric `"skipped"` is 1. (With `jdp.local()` each replica's own
        gradients are checked.) (`optax.apply_if_finite`
        in `tx` is the optimizer's own way, for a state without a counter.)
      batch_stats: How batch statistics (`state.batch_stats`) are synced every
        step: `"mean"` (default) or `"broadcast"` replica 0's (see
        `jdp.sync_batch_stats`).

    Loss scaling: a state with a flax `DynamicScale` in a `dynamic_scale` field
    (`jdp.TrainState.create(..., dynamic_scale=DynamicScale())`, or a flax
    `TrainState` subclass with that field, as in flax's ImageNet example) is
    honoured: the loss is scaled, the gradients unscaled and synced by the
    piece, a step whose synced gradients are not finite is skipped on every
    replica, the scale is updated, and metrics gain `"loss_scale"` and
    `"skipped"`.

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
      TypeError: If `sync` is not a `jdp.Sync` (nor `jdp.sparse.rows()`),
        `skip_nonfinite` is not a bool, or `loss_fn`'s parameters cannot be
        read.
      ValueError: If `microbatches` is not a positive int or `batch_stats` is
        unknown. At trace time, if
        the optimizer trains replicas locally (`jdp.bmuf`) and `sync` averages
        gradients, if `loss_fn`'s parameters do not match the state's batch
        statistics, or as `sync` refuses the optimizer or state.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> train_step = jdp.make_train_step(loss_fn, optax.sgd(0.1))
      >>> step = jdp.parallelize(train_step)

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
    """
    if not isinstance(sync, (_sync.Sync, _sync.OwnUpdate)):
        raise TypeError(
            "`sync` must be a `jdp.Sync`, e.g. `jdp.all_reduce()`, `jdp.local()`, "
            "`jdp.powersgd()` or `jdp.partition(...)` (or `jdp.sparse.rows()`); "
            f"got {type(sync).__name__}."
        )
    _validate.positive_int("microbatches", microbatches)
    _validate.boolean("skip_nonfinite", skip_nonfinite)
    _sync.check_batch_stats(batch_stats)
    takes_stats = _loss.takes_batch_stats(loss_fn)
    keywords = _loss.loss_keywords(loss_fn)
    api = "jdp.make_train_step"
    own = isinstance(sync, _sync.OwnUpdate)

    def train_step(state, batch):
        optimizer = state.tx if tx is None else tx
        if optimizer is None:
            raise ValueError(
                f"`{api}` got no optimizer: pass `tx` or use a state that "
                "carries one (`jdp.TrainState.create(params=..., tx=...)`)."
            )
        axis = _collectives.resolve_axis(axis_name)
        _step_checks.check_trainable(state.params, api)
        _step_checks.check_known_fields(state, api)
        if not own:
            _check_piece(sync, optimizer, state, axis, api)
        _loss.check_batch_stats(state, takes_stats, api, loss_fn)
        loss_kwargs = _loss.loss_kwargs(state, keywords, axis, api)
        value_and_grad = (
            sync.value_and_grad(optimizer)
            if own and sync.value_and_grad is not None
            else jax.value_and_grad
        )
        changes = {}
        scale = getattr(state, "dynamic_scale", None)
        if scale is not None:
            _loss.check_loss_scaling(sync, microbatches)
            value_and_grad = _loss.scaled(scale)
        out = _loss.gradients(
            value_and_grad,
            loss_fn,
            state,
            batch,
            has_aux=has_aux,
            microbatches=microbatches,
            loss_kwargs=loss_kwargs,
        )
        loss, grads = _loss.normalise(out, axis)
        skip = skip_nonfinite or scale is not None
        update = _own_update if own else _synced_update
        params, opt_state, extra, sync_state = update(
            sync, grads, state, optimizer, axis, skip, counted=scale is None
        )
        if sync_state is not None:
            changes["sync_state"] = sync_state
        if scale is not None:
            changes["dynamic_scale"] = _loss.next_scale(scale, extra["skipped"] == 0)
            extra["loss_scale"] = scale.scale
            _loss.warn_if_collapsed(changes["dynamic_scale"].scale, axis)
        loss, extra = _loss.kept_loss(out, loss, extra, axis)
        aux, new_stats = out.aux, out.new_stats
        changes.update(step=state.step + 1, params=params, opt_state=opt_state)
        if "skipped" in extra and getattr(state, "skipped_steps", None) is not None:
            changes["skipped_steps"] = state.skipped_steps + extra["skipped"]
        if new_stats is not None:
            new_stats = _collectives.sync_batch_stats(
                new_stats, mode=batch_stats, axis_name=axis
            )
            if "skipped" in extra:
                new_stats = _loss.keep_finite_stats(new_stats, state.batch_stats, extra)
            changes["batch_stats"] = new_stats
        metrics = {"loss": loss, **extra}
        if has_aux:
            if isinstance(aux, dict):
                metrics.update(aux)
            else:
                metrics["aux"] = aux
        return state.replace(**changes), metrics

    spec = LossSpec(loss_fn, has_aux, microbatches, keywords, axis_name)
    return TrainStep(train_step, _must_agree(sync), spec)


def _check_piece(sync, tx, state, axis, api) -> None:
    """The piece against the optimizer and the state (traced)."""
    if sync.averages and _sync.syncs_gradients(state.opt_state):
        raise ValueError(AVERAGED_TWICE_MSG.format(api=api))
    _step_checks.check_piece(sync, tx, state, axis, api)


def _must_agree(sync) -> Callable | None:
    """What replicas of a step with piece `sync` must agree on."""
    if isinstance(sync, _sync.OwnUpdate):
        return None
    if sync.must_agree is not None:
        return sync.must_agree
    if sync.averages:
        return _replica_parts.must_agree
    return _sync.agreed_locally


def _synced_update(sync, grads, state, tx, axis, skip, *, counted):
    """A `jdp.Sync`'s gradients, then `tx` once.

    Returns `(params, opt_state, metrics, sync_state)`, the last None when the
    state holds none.

    With `skip`, a step whose synced gradients are not finite on any replica
    (one scalar `pmin` over the step's axis) leaves params, optimizer state and
    the piece's state as they were.
    """
    held = getattr(state, "sync_state", None)
    piece_state = sync.initial_state(state.params) if held is None else held
    synced, new_state, extra = sync.update(grads, piece_state, state.params, axis)
    extra = dict(extra)

    def run():
        return _sync.apply_tx(synced, state, tx)

    if not skip:
        params, opt_state, more = run()
        return params, opt_state, {**extra, **more}, None if held is None else new_state
    ok = lax.pmin(_sync.finite(synced).astype(np.int32), axis) > 0
    params, opt_state, more = _sync.unless_nonfinite(ok, run, state, counted=counted)
    if held is not None:
        new_state = jax.tree.map(
            lambda n, o: jax.numpy.where(ok, n, o), new_state, held
        )
    return params, opt_state, {**extra, **more}, None if held is None else new_state


def _own_update(sync, grads, state, tx, axis, skip, *, counted=True):
    """A piece that applies the optimizer itself (`jdp.sparse.rows`).

    With `skip`, a step whose own gradients are not finite on any replica is
    skipped.
    """
    if not skip:
        return (*sync.apply(grads, state, tx, axis), None)
    ok = lax.pmin(_sync.finite(grads).astype(np.int32), axis) > 0
    run = lambda: sync.apply(grads, state, tx, axis)  # noqa: E731
    return (*_sync.unless_nonfinite(ok, run, state, counted=counted), None)
