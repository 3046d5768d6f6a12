"""`jdp.TrainState` and `jdp.make_train_step` (Caffe2's `Parallelize_GPU`).

A train step is composed of pieces rather than switched by flags:

- the loss, whose parameters say whether it trains batch statistics;
- how gradients are synchronised: ONE piece, `sync=` (a `jdp.Sync`: averaged
  by an all-reduce, compressed, kept local for optimizers that communicate
  themselves such as `jdp.bmuf`, or one of your own); the step then applies
  the optimizer once. `jdp.zero()` and `jdp.sparse.rows()` apply the optimizer
  themselves (a sharded optimizer state, sparse rows);
- what the step does around them, once for every piece: skipping non-finite
  steps (`skip_nonfinite`), syncing batch statistics (`batch_stats`), loss
  scaling;
- how the state is laid out across replicas and which part of it replicas must
  agree on, declared as data (`state_layout` and `must_agree` of the returned
  `TrainStep`), which `step.replicate`, checkpoints and the divergence guard
  follow.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import struct
from jax import lax

from jdp import (
    _collectives,
    _jax_compat,
    _metrics,
    _replica_parts,
    _sync,
    _transforms,
    _validate,
)
from jdp._layout import StateLayout
from jdp._tree import format_problems, is_float, keystr
from jdp.sparse._lookup import IndexedRows

PyTree = Any

#: `jdp.all_reduce()`, the default piece (made once: a `Sync` is immutable).
_DEFAULT_SYNC = _sync.all_reduce()


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
        (`jdp.make_train_step(..., skip_nonfinite=True)`, or a loss scaler's
        overflow; an int32 array).
      dynamic_scale: A flax `DynamicScale` for float16 training (loss scaling),
        or None.
      rng: A PRNG key (typed or raw) from which `jdp.make_train_step` derives
        each replica's key for each step, for a `loss_fn` with an `rng`
        parameter (dropout); or None. It does not change: the key of a step is
        `fold_in(fold_in(rng, step), replica)`, so a restored checkpoint draws
        the same numbers again.
      sync_state: The state of a sync piece that keeps one (e.g. the error
        buffers of `jdp.all_reduce(wire=..., error_feedback=True)`), made by
        `create(..., sync=piece)`; or None.
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
    rng: jax.Array | None = None
    sync_state: PyTree = None
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation,
        batch_stats: PyTree = None,
        dynamic_scale: Any = None,
        rng: jax.Array | None = None,
        sync: _sync.Sync | None = None,
    ) -> TrainState:
        """Makes a state at step 0 with `tx.init(params)` as optimizer state.

        Pass the train step's `sync` piece when it keeps state of its own
        (`sync.init` is set, e.g. `jdp.all_reduce(wire=..., error_feedback=
        True)`): the state then holds `sync_state=sync.init(params)`.
        """
        if sync is not None and not isinstance(sync, (_sync.Sync, _sync.OwnUpdate)):
            raise TypeError(
                "`jdp.TrainState.create`: `sync` must be a `jdp.Sync` (the piece "
                f"given to `jdp.make_train_step`), or None; got {type(sync).__name__}."
            )
        sync_state = None
        if isinstance(sync, _sync.Sync) and sync.init is not None:
            sync_state = sync.init(params)
            if not jax.tree.leaves(sync_state):
                sync_state = None
        return cls(
            step=jax.numpy.zeros((), jax.numpy.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=batch_stats,
            skipped_steps=jax.numpy.zeros((), jax.numpy.int32),
            dynamic_scale=dynamic_scale,
            rng=rng,
            sync_state=sync_state,
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


class LossSpec(NamedTuple):
    """How a train step calls its loss (what `jdp.check_equivalence` runs again)."""

    loss_fn: Callable[..., Any]
    has_aux: bool
    microbatches: int
    keywords: tuple[str, ...]  # the `LOSS_KEYWORDS` the loss declares
    axis_name: _collectives.AxisName | None


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A per-replica train step and the layout of the state it expects.

    What `jdp.make_train_step` returns: call it as `step_fn(state, batch)`.
    `state_layout`, when set, maps the abstract logical state and the replica
    count to the per-replica layout; `step.replicate` follows it. `must_agree`,
    when set, maps a state to the part of it replicas must agree on (others set
    to None); `jdp.parallelize`'s `check_sync` compares only that part.
    `loss` says how the step calls its loss, for `jdp.check_equivalence`.
    """

    step_fn: Callable[[PyTree, PyTree], tuple[PyTree, dict[str, jax.Array]]]
    state_layout: StateLayout | None = None
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
    clipping is `optax.clip_by_global_norm` in `tx` (with `jdp.zero`, its
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
        for optimizers that communicate themselves: `jdp.bmuf`, or
        `jdp.sync_gradients` inside `optax.MultiSteps`); or `jdp.zero()` (the
        optimizer state sharded over replicas) or `jdp.sparse.rows()` (sparse
        embedding gradients), which apply the optimizer themselves.
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
        metric `"skipped"` is 1. With `jdp.zero()` each replica's own
        gradients are checked, before they are reduced. (`optax.apply_if_finite`
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
      TypeError: If `sync` is not a `jdp.Sync` (nor `jdp.zero()` or
        `jdp.sparse.rows()`), `skip_nonfinite` is not a bool, or `loss_fn`'s
        parameters cannot be read.
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
            "`jdp.powersgd()` or `jdp.partition(...)` (or `jdp.zero()`, "
            f"`jdp.sparse.rows()`); got {type(sync).__name__}."
        )
    _validate.positive_int("microbatches", microbatches)
    _validate.boolean("skip_nonfinite", skip_nonfinite)
    _sync.check_batch_stats(batch_stats)
    takes_stats = _takes_batch_stats(loss_fn)
    keywords = _loss_keywords(loss_fn)
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
        _check_trainable(state.params, api)
        _check_known_fields(state, api)
        if not own:
            _check_piece(sync, optimizer, state, axis, api)
        _check_batch_stats(state, takes_stats, api, loss_fn)
        loss_kwargs = _loss_kwargs(state, keywords, axis, api)
        value_and_grad = (
            sync.value_and_grad(optimizer)
            if own and sync.value_and_grad is not None
            else jax.value_and_grad
        )
        changes = {}
        scale = getattr(state, "dynamic_scale", None)
        if scale is not None:
            _check_loss_scaling(sync, microbatches)
            value_and_grad, verdict = _scaled(scale)
        out = _gradients(
            value_and_grad,
            loss_fn,
            state,
            batch,
            has_aux=has_aux,
            microbatches=microbatches,
            loss_kwargs=loss_kwargs,
        )
        loss, grads = _normalise(out, axis)
        skip = skip_nonfinite or scale is not None
        update = _own_update if own else _synced_update
        params, opt_state, extra, sync_state = update(
            sync, grads, state, optimizer, axis, skip, counted=scale is None
        )
        if sync_state is not None:
            changes["sync_state"] = sync_state
        if scale is not None:
            changes["dynamic_scale"] = _next_scale(scale, extra["skipped"] == 0)
            extra["loss_scale"] = scale.scale
            _warn_if_collapsed(changes["dynamic_scale"].scale, axis)
        loss, extra = _kept_loss(out, loss, extra, axis)
        aux, new_stats = out.aux, out.new_stats
        changes.update(step=state.step + 1, params=params, opt_state=opt_state)
        if "skipped" in extra and getattr(state, "skipped_steps", None) is not None:
            changes["skipped_steps"] = state.skipped_steps + extra["skipped"]
        if new_stats is not None:
            new_stats = _collectives.sync_batch_stats(
                new_stats, mode=batch_stats, axis_name=axis
            )
            if "skipped" in extra:
                new_stats = _keep_finite_stats(new_stats, state.batch_stats, extra)
            changes["batch_stats"] = new_stats
        metrics = {"loss": loss, **extra}
        if has_aux:
            if isinstance(aux, dict):
                metrics.update(aux)
            else:
                metrics["aux"] = aux
        return state.replace(**changes), metrics

    spec = LossSpec(loss_fn, has_aux, microbatches, keywords, axis_name)
    return TrainStep(train_step, *_declared(sync, tx), spec)


def _check_piece(sync, tx, state, axis, api) -> None:
    """A `jdp.Sync`'s checks against the state and the optimizer (traced)."""
    _check_sync_state(state, sync, api)
    if sync.averages:
        _check_axes(sync, tx, state, axis, api)
    else:
        _warn_if_never_synced(tx, state, axis)


def _declared(sync, tx) -> tuple[StateLayout | None, Callable | None]:
    """`(state_layout, must_agree)` of a step with piece `sync`."""
    if isinstance(sync, _sync.OwnUpdate):
        return (None if sync.state_layout is None else sync.state_layout(tx)), None
    if sync.must_agree is not None:
        return None, sync.must_agree
    if sync.averages:
        return None, _replica_parts.must_agree
    return None, _sync.agreed_locally


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
    """A piece that applies the optimizer itself (`jdp.zero`).

    With `skip`, a step whose own gradients are not finite on any replica is
    skipped.
    """
    if not skip:
        return (*sync.apply(grads, state, tx, axis), None)
    ok = lax.pmin(_sync.finite(grads).astype(np.int32), axis) > 0
    run = lambda: sync.apply(grads, state, tx, axis)  # noqa: E731
    return (*_sync.unless_nonfinite(ok, run, state, counted=counted), None)


def _warn_if_never_synced(tx, state, axis) -> None:
    """Warns when replicas train on their own gradients and nothing syncs them."""
    num = _collectives.axis_size(axis, "jdp.make_train_step")
    if num < 2 or _replica_parts.trains_locally(state.opt_state):
        return
    if not _optimizer_axes(tx, state):
        warnings.warn(
            "The sync piece leaves each replica its own gradients (`jdp.local()`, "
            "or a `jdp.partition` label), and this optimizer never communicates "
            "(no `jdp.bmuf`, no `jdp.sync_gradients`): the "
            f"{num} replicas train {num} different models. Use "
            "`sync=jdp.all_reduce()` for synchronous training, an optimizer that "
            "syncs (`jdp.bmuf(tx, sync_period=...)`), or, in a `jdp.partition`, "
            "the label `'per_replica'` where different models are meant.",
            UserWarning,
            stacklevel=4,
        )


AVERAGES_WITH_BMUF_MSG = (
    "`{api}` averages gradients across replicas, but the optimizer contains "
    "`jdp.bmuf`, which trains each replica on its own gradients and syncs the "
    "models itself (the sync piece averages over {piece}; the optimizer syncs "
    "over {bmuf}). Use `jdp.make_train_step(loss_fn, tx, sync=jdp.local())`; or, "
    "on a host mesh (`jdp.parallelize(..., axis_name=('host', 'device'))`), "
    "hierarchical local SGD: average over some axes every step and let "
    "`jdp.bmuf` sync over the others, e.g. `sync=jdp.all_reduce(axis_name="
    "'device')` with `jdp.bmuf(inner, sync_period=..., axis_name='host')`."
)


def _check_axes(sync, tx, state, axis, api) -> None:
    """An averaging piece's axes, against the step's and the optimizer's."""
    if _replica_parts.trains_locally(state.opt_state):
        _check_hierarchical(sync, tx, state, axis, api)
    else:
        _check_every_axis_synced(sync, tx, state, axis, api)


def _check_hierarchical(sync, tx, state, axis, api) -> None:
    """Allows an averaging piece with `jdp.bmuf` only as hierarchical local SGD.

    The piece must average over a strict subset of the step's axes (e.g.
    `"device"` of `("host", "device")`), and the optimizer must sync over every
    other axis (`jdp.bmuf(..., axis_name="host")`); anything else trains on
    gradients averaged where `jdp.bmuf` expects each replica's own, or leaves
    replicas that never sync.
    """
    step_axes = _axes(axis)
    if len(step_axes) < 2:  # a flat mesh: no axis left for `jdp.bmuf`
        raise ValueError(
            AVERAGES_WITH_BMUF_MSG.format(
                api=api,
                piece=", ".join(map(repr, sorted(step_axes))),
                bmuf="the same axis",
            )
        )
    piece = _piece_axes(sync, state, axis)
    optimizer = _optimizer_axes(tx, state)
    rest = step_axes - piece
    if piece and rest and rest <= optimizer:
        return
    raise ValueError(
        AVERAGES_WITH_BMUF_MSG.format(
            api=api, piece=_names(piece), bmuf=_names(optimizer)
        )
    )


def _check_every_axis_synced(sync, tx, state, axis, api) -> None:
    """Refuses an averaging piece that leaves some of the step's axes unsynced.

    On a host mesh, `jdp.all_reduce(axis_name="device")` averages within each
    host; unless the optimizer syncs the other axes (`jdp.bmuf(...,
    axis_name="host")`, checked by `_check_hierarchical`, or a
    `jdp.sync_gradients` of its own), the hosts train models of their own. A
    piece that moves nothing at all is left to the divergence guard.
    """
    step_axes = _axes(axis)
    if len(step_axes) < 2:
        return
    piece = _piece_axes(sync, state, axis)
    rest = step_axes - piece
    if not piece or not rest or rest <= _optimizer_axes(tx, state):
        return
    raise ValueError(
        f"`{api}`: the sync piece averages the gradients over {_names(piece)} "
        f"only, of the step's axes {_names(step_axes)}, and nothing syncs "
        f"{_names(rest)}: the replicas along {_names(rest)} (on a host mesh, the "
        "hosts) are never synced and would train models of their own. Average "
        "over every axis (`jdp.all_reduce()`: by default the step's axes), or "
        "let `jdp.bmuf` sync the others, hierarchical local SGD: "
        f"`jdp.bmuf(inner, sync_period=..., axis_name={sorted(rest)[0]!r})` "
        "with this piece."
    )


def _piece_axes(sync, state, axis) -> set[str]:
    """The mesh axes over which `sync.update` moves gradients (traced only)."""
    grads = jax.tree.map(lambda p: p if is_float(p) else None, state.params)
    held = getattr(state, "sync_state", None)
    piece_state = sync.initial_state(state.params) if held is None else held
    return _moving_axes(
        lambda g: sync.update(g, piece_state, state.params, axis)[:2], grads
    )


def _optimizer_axes(tx, state) -> set[str]:
    """The mesh axes over which optimizer `tx` moves values (traced only)."""
    grads = jax.tree.map(lambda p: p if is_float(p) else None, state.params)
    return _moving_axes(
        lambda g: _transforms.update(tx, g, state.opt_state, state.params), grads
    )


def _names(axes) -> str:
    return ", ".join(repr(a) for a in sorted(axes)) or "no axis"


def _axes(axis) -> set[str]:
    """The mesh axis names in `axis` (a name or a tuple; positional axes dropped)."""
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    return {a for a in axes if isinstance(a, str)}


def _moving_axes(fn, *args) -> set[str]:
    """The mesh axes over which `fn`'s collectives move floating-point values.

    Traced, nothing runs. Collectives of scalar integers or booleans (a
    finiteness verdict agreed over the step's axis) do not count; arrays of
    integers do (a wire format's int8 codes are gradients too).
    """
    found: set[str] = set()

    def values(v) -> bool:
        dtype = getattr(v.aval, "dtype", None)
        if dtype is None or dtype == jax.numpy.bool_:
            return False
        return jax.numpy.issubdtype(dtype, jax.numpy.inexact) or v.aval.size > 1

    for eqn in _jax_compat.equations(jax.make_jaxpr(fn)(*args)):
        axes = _jax_compat.collective_axes(eqn)
        if axes and any(values(v) for v in eqn.outvars):
            found.update(_axes(axes))
    return found


#: Parameters a `loss_fn` may declare by name to receive them from the step.
LOSS_KEYWORDS = ("rng", "step")


def _loss_keywords(loss_fn: Callable[..., Any]) -> tuple[str, ...]:
    """The `LOSS_KEYWORDS` `loss_fn` declares (it was read before, so it can be)."""
    params = inspect.signature(loss_fn).parameters
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(k for k in LOSS_KEYWORDS if k in params and params[k].kind in keyword)


def _takes_batch_stats(loss_fn: Callable[..., Any]) -> bool:
    """Whether `loss_fn` is `(params, batch_stats, batch)` (else `(params, batch)`).

    Read from its required positional parameters: two or three, not counting
    the `LOSS_KEYWORDS` it declares (`rng`, `step`).
    """
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError) as e:
        raise TypeError(
            "`jdp.make_train_step` reads `loss_fn`'s parameters to tell "
            "`loss_fn(params, batch)` from `loss_fn(params, batch_stats, batch)`, "
            f"but cannot read them from {loss_fn!r} ({e}). Wrap it in a `def` "
            "with those parameters."
        ) from e
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = signature.parameters.values()
    required = [
        p
        for p in params
        if p.kind in kinds and p.default is p.empty and p.name not in LOSS_KEYWORDS
    ]
    var = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    if len(required) in (2, 3) and not (var and len(required) < 3):
        return len(required) == 3
    raise TypeError(
        "`jdp.make_train_step` needs `loss_fn(params, batch)` or, for a state "
        "with batch statistics, `loss_fn(params, batch_stats, batch)`; got a "
        f"`loss_fn{signature}` with {len(required)} required positional "
        "parameter(s)" + (" and *args" if var else "") + ". Wrap it in a `def` "
        "with those parameters." + _rng_hint(signature)
    )


def _rng_hint(signature: inspect.Signature, always: bool = False) -> str:
    """A sentence for a loss whose PRNG key parameter is not named `rng`.

    flax's examples call it `dropout_rng`; jdp passes a key only to `rng`, and
    takes any other parameter for the batch statistics or the batch.
    """
    keys = [
        name
        for name in signature.parameters
        if name not in LOSS_KEYWORDS
        and any(word in name.lower() for word in ("rng", "key", "seed"))
    ]
    if keys:
        return (
            f" If `{keys[0]}` is a PRNG key (for dropout), name it `rng`: the step "
            "hands this replica's key only to a parameter named `rng` (drawn from "
            "the state's `rng`, `jdp.TrainState.create(..., rng=key)`), and takes "
            "any other parameter for the batch statistics or the batch."
        )
    if always:
        return (
            " (A parameter that receives a PRNG key must be named `rng`; any other "
            "is taken for the batch statistics or the batch.)"
        )
    return ""


def _check_batch_stats(
    state: PyTree, takes_stats: bool, api: str, loss_fn: Callable[..., Any]
) -> None:
    """`loss_fn`'s parameters and the state's `batch_stats` must go together."""
    has_stats = getattr(state, "batch_stats", None) is not None
    if takes_stats and not has_stats:
        signature = inspect.signature(loss_fn)  # read before, so it can be
        raise ValueError(
            f"`{api}`: `loss_fn{signature}` takes three parameters, read as "
            "`(params, batch_stats, batch)`, but the state has no `batch_stats` "
            "(None). Pass `jdp.TrainState.create(..., batch_stats=...)`, or write "
            "`loss_fn(params, batch)`." + _rng_hint(signature, always=True)
        )
    if has_stats and not takes_stats:
        raise ValueError(
            f"`{api}`: the state has `batch_stats`, but `loss_fn` takes two "
            "parameters, `(params, batch)`, so they would never be updated. Write "
            "`loss_fn(params, batch_stats, batch) -> (loss, new_batch_stats)`, or "
            "create the state without `batch_stats`."
        )


# -- gradients ------------------------------------------------------------------


class _Gradients(NamedTuple):
    """One replica's loss, gradients and what came with them."""

    loss: jax.Array  # the loss, or a `jdp.weighted` loss's total
    weight: jax.Array | None  # a `jdp.weighted` loss's weight, else None
    aux: PyTree
    new_stats: PyTree
    grads: PyTree


def _loss_kwargs(state, keywords, axis_name, api) -> Callable[[Any], dict]:
    """`part -> {keyword: value}` for the `LOSS_KEYWORDS` the loss declares.

    `step` is the state's step counter; `rng` this replica's key for this step
    (and microbatch `part`, unless None): `fold_in` of the state's `rng` with
    the step, the part and the replica index.
    """
    if "rng" in keywords and getattr(state, "rng", None) is None:
        raise ValueError(
            f"`{api}`: `loss_fn` takes `rng`, but the state has no `rng` (None). "
            "Create it with a key, e.g. `jdp.TrainState.create(..., "
            "rng=jax.random.key(0))`; the step then hands `loss_fn` a key of its "
            "own on every replica and step."
        )

    def kwargs(part):
        out = {}
        if "step" in keywords:
            out["step"] = state.step
        if "rng" in keywords:
            key = jax.random.fold_in(state.rng, state.step)
            if part is not None:
                key = jax.random.fold_in(key, part)
            out["rng"] = _collectives.replica_key(key, axis_name=axis_name)
        return out

    return kwargs


def _gradients(
    value_and_grad, loss_fn, state, batch, *, has_aux, microbatches, loss_kwargs
):
    """`loss_and_grads` over the whole batch, or accumulated over microbatches.

    With `microbatches=k` the replica's batch is split into `k` equal parts along
    its leading axis and processed in sequence (`lax.scan`, so activations of one
    part are live at a time). For a loss that is a mean over examples, gradients
    and losses are averaged over the parts, which equals the whole batch at once;
    for a `jdp.weighted` loss, totals, weights and gradients are summed, which
    is exact whatever the parts' weights. Sparse row gradients (`jdp.sparse.
    rows()`) are concatenated over the parts (the sum of their scatter-adds),
    not accumulated in a dense table. Every part starts from the step's
    batch statistics: their floating leaves (BatchNorm's running averages) end
    as the mean over the parts, one update per step as with the whole batch,
    while the others (RNG counters) carry from one part to the next, so each
    part draws its own dropout masks. Auxiliary values are combined as
    `_combine_parts` says.
    """
    if microbatches == 1:
        return loss_and_grads(
            value_and_grad,
            loss_fn,
            state,
            batch,
            has_aux=has_aux,
            kwargs=loss_kwargs(None),
        )
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

    def part_grads(index, part):
        return loss_and_grads(
            value_and_grad,
            loss_fn,
            state,
            part,
            has_aux=has_aux,
            kwargs=loss_kwargs(index),
        ).grads

    if value_and_grad is jax.value_and_grad:
        zeros = jax.tree.map(jax.numpy.zeros_like, state.params)
    else:  # a sync piece's own: its gradients may hold sparse rows
        first = jax.tree.map(lambda x: x[0], parts)
        shapes = jax.eval_shape(part_grads, jax.numpy.uint32(0), first)
        zeros = jax.tree.map(
            lambda s: jax.numpy.zeros(s.shape, s.dtype), _split_rows(shapes)[0]
        )

    def body(carry, indexed):
        index, part = indexed
        total, carried = carry
        current = state
        if stats is not None:  # floats from the step's start, the rest carried
            current = state.replace(
                batch_stats=jax.tree.map(
                    lambda s, c: s if is_float(s) else c, stats, carried
                )
            )
        out = loss_and_grads(
            value_and_grad,
            loss_fn,
            current,
            part,
            has_aux=has_aux,
            kwargs=loss_kwargs(index),
        )
        dense, rows = _split_rows(out.grads)
        total = jax.tree.map(lambda a, g: a + g, total, dense)
        carried = carried if stats is None else out.new_stats
        return (total, carried), out._replace(grads=rows)

    indices = jax.numpy.arange(k, dtype=jax.numpy.uint32)
    (total, carried), outs = lax.scan(body, (zeros, stats), (indices, parts))
    new_stats = None
    if stats is not None:
        new_stats = jax.tree.map(
            lambda per_part, c: per_part.mean(0) if is_float(per_part) else c,
            outs.new_stats,
            carried,
        )
    aux = _combine_parts(outs.aux, k)
    # Sparse rows of the parts are concatenated: their scatter-add is the sum.
    rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), outs.grads)
    if outs.weight is not None:
        grads = _join_rows(total, rows)
        return _Gradients(outs.loss.sum(0), outs.weight.sum(0), aux, new_stats, grads)
    grads = jax.tree.map(lambda g: g / k if is_float(g) else g, _join_rows(total, rows))
    return _Gradients(outs.loss.mean(0), None, aux, new_stats, grads)


def _is_rows(x) -> bool:
    return isinstance(x, IndexedRows)


def _split_rows(grads: PyTree) -> tuple[PyTree, PyTree]:
    """`grads` as its dense part and its sparse rows (`IndexedRows`).

    Each of the two has None where the other has a leaf, so that `_join_rows`
    puts them back together.
    """
    dense = jax.tree.map(lambda g: None if _is_rows(g) else g, grads, is_leaf=_is_rows)
    rows = jax.tree.map(lambda g: g if _is_rows(g) else None, grads, is_leaf=_is_rows)
    return dense, rows


def _join_rows(dense: PyTree, rows: PyTree) -> PyTree:
    """The inverse of `_split_rows`."""
    return jax.tree.map(
        lambda r, d: d if r is None else r,
        rows,
        dense,
        is_leaf=lambda x: x is None or _is_rows(x),
    )


def _combine_parts(aux: PyTree, k: int) -> PyTree:
    """The auxiliary values of `k` microbatches (stacked) as one step's.

    `jdp.weighted` values: totals and weights summed; `jdp.metrics.sum`: summed;
    `jdp.metrics.gather`: concatenated in batch order; unmarked scalars:
    averaged (as over replicas). An unmarked array is refused: whether it holds
    one value per example (to concatenate) or something to average, only the
    step's author knows.
    """

    def combine(path, x):
        if isinstance(x, _metrics.Weighted):
            return _metrics.Weighted(x.total.sum(0), x.weight.sum(0))
        if isinstance(x, _metrics.Reduced):
            value = x.value
            if x.how == "sum":
                if value.dtype == jax.numpy.bool_:
                    value = value.astype(jax.numpy.int32)
                return _metrics.Reduced(value.sum(0), "sum")
            if value.ndim >= 2:
                value = value.reshape((-1,) + value.shape[2:])
            return _metrics.Reduced(value, "gather")
        if np.ndim(x) > 1:
            raise ValueError(
                f"`make_train_step(..., microbatches={k})`: the auxiliary value "
                f"{keystr(path)} has shape {np.shape(x)[1:]} per microbatch, and "
                "jdp cannot tell how to combine the microbatches' values. Mark "
                "per-example values `jdp.metrics.gather(x)` (concatenated in batch "
                "order), counts `jdp.metrics.sum(x)`, ratios `jdp.weighted(total, "
                "weight)`, or reduce it to a scalar (averaged)."
            )
        total = x.astype(jax.numpy.int32) if x.dtype == jax.numpy.bool_ else x
        total = total.sum(0)
        if not is_float(x):
            x = x.astype(jax.numpy.result_type(float))
        mean = x.mean(0)
        _collectives.record_total(mean, total)  # a `jdp.metrics.sum` around it
        return mean

    return jax.tree_util.tree_map_with_path(combine, aux, is_leaf=_metrics.is_marker)


def _keep_finite_stats(new: PyTree, old: PyTree, extra: dict) -> PyTree:
    """A skipped step's batch statistics: the new ones where they are finite.

    A loss scaler's overflow (gradients only) leaves the forward pass's
    statistics finite, and flax's recipe keeps them; a NaN or inf in the forward
    pass would make them NaN for good, so a skipped step keeps the old leaf.
    """
    skipped = extra["skipped"] > 0

    def one(n, o):
        if not is_float(n):
            return n
        bad = skipped & ~jax.numpy.all(jax.numpy.isfinite(n))
        return lax.select(bad, o, n)

    return jax.tree.map(one, new, old)


def _normalise(out: _Gradients, axis_name) -> tuple[jax.Array, PyTree]:
    """The loss metric and the gradients the sync piece averages.

    For a `jdp.weighted` loss, every replica's summed gradients are scaled by
    `kept / kept_weight`, `kept` counting the replicas whose gradients are
    finite and `kept_weight` their weight, so that the mean over those replicas
    (what the pieces compute: every replica, or the valid ones with
    `on_bad_replica="drop"`) is their sum over their weight, exactly one
    device's per-token mean whatever the split. With every replica finite that
    is `num_replicas / global weight`; a non-finite replica makes the average
    non-finite anyway, unless the piece drops it, and then its weight is not
    counted either. A kept weight of 0 (nothing but padding) gives zero
    gradients. The loss is the global total over the global weight, the same
    on every replica.
    """
    if out.weight is None:
        return out.loss, out.grads
    _collectives.axis_size(axis_name, "jdp.weighted")
    weight = out.weight.astype(out.loss.dtype)
    valid = _sync.finite(out.grads).astype(out.loss.dtype)
    total, weight, kept_weight, kept = lax.psum(
        (out.loss, weight, valid * weight, valid), axis_name
    )
    some = kept_weight > 0
    scale = jax.numpy.where(some, kept / jax.numpy.where(some, kept_weight, 1), 0)
    grads = jax.tree.map(
        lambda g: g * scale.astype(g.dtype) if is_float(g) else g, out.grads
    )
    return jax.numpy.where(some, total / jax.numpy.where(some, weight, 1), 0), grads


def _kept_loss(out: _Gradients, loss: jax.Array, extra: dict, axis_name):
    """`(loss, extra)`: the loss over the replicas a sync piece kept, if it says.

    A piece that leaves bad replicas out (`on_bad_replica="drop"`) puts each
    replica's share under `_sync.KEPT` in its metrics: `num_replicas / kept` on
    a kept replica, 0 on a dropped one (1 everywhere when none was kept), so
    that the metrics' mean over replicas is the kept replicas' mean: a dropped
    replica's NaN does not make the step's loss NaN, and no collective is
    added. A `jdp.weighted` loss: the kept replicas' totals over their weights
    (one scalar sum). Other pieces' metrics are returned as they are.
    """
    if _sync.KEPT not in extra:
        return loss, extra
    extra = dict(extra)
    share = extra.pop(_sync.KEPT)
    kept = share > 0
    if out.weight is None:
        kept_loss = jax.numpy.where(kept, loss * share.astype(loss.dtype), 0)
        return kept_loss.astype(loss.dtype), extra
    zero = jax.numpy.zeros_like(out.loss)
    total, weight = lax.psum(
        (
            jax.numpy.where(kept, out.loss, zero),
            jax.numpy.where(kept, out.weight.astype(out.loss.dtype), zero),
        ),
        axis_name,
    )
    some = weight > 0
    return jax.numpy.where(some, total / jax.numpy.where(some, weight, 1), 0), extra


#: A loss scale below this no longer scales anything up: flax's `DynamicScale`
#: got there by halving on one non-finite step after another.
COLLAPSED_SCALE = 1.0


def _report_collapse(scale) -> None:
    warnings.warn(
        f"The loss scale collapsed to {float(scale):.3g}: flax's `DynamicScale` "
        "halves it on every step whose gradients are not finite, and it got below "
        f"{COLLAPSED_SCALE} (from 2**15 by default), so every recent step was "
        "skipped. Scaling does not cure a loss or gradient that is NaN or inf "
        "whatever the scale: look for NaN/inf in the data, a log of 0 or a "
        "division by 0, or train in float32/bfloat16.",
        RuntimeWarning,
        stacklevel=2,
    )


def _warn_if_collapsed(scale, axis_name) -> None:
    """A host warning (from replica 0, on the steps it happens) for a dead scale."""
    first = lax.axis_index(axis_name) == 0
    lax.cond(
        first & (scale < COLLAPSED_SCALE),
        lambda s: jax.debug.callback(_report_collapse, s),
        lambda s: None,
        scale,
    )


def _check_loss_scaling(sync, microbatches: int) -> None:
    if isinstance(sync, _sync.OwnUpdate):
        raise ValueError(
            "A state with a `dynamic_scale` (loss scaling) needs a `jdp.Sync` "
            "(e.g. `jdp.all_reduce()`): `jdp.zero()` and `jdp.sparse.rows()` "
            "apply the optimizer themselves and do not support loss scaling."
        )
    if microbatches != 1:
        raise ValueError(
            "A state with a `dynamic_scale` (loss scaling) cannot be combined with "
            "`microbatches`: accumulate in float32 instead, or drop the scaler."
        )


def _scaled(scale):
    """`(value_and_grad, None)` through a flax `DynamicScale` (loss scaling).

    The scaled loss is differentiated and the gradients unscaled (to float32)
    by `DynamicScale.value_and_grad`, without its `axis_name`: the sync piece
    syncs them next, and the step decides on the synced gradients, agreed by
    every replica (`_next_scale`).
    """

    def value_and_grad(fun, *, has_aux):
        grad_fn = scale.value_and_grad(fun, has_aux=has_aux)

        def value_and_grads(*args):
            _, _, value, grads = grad_fn(*args)
            return value, grads

        return value_and_grads

    return value_and_grad, None


def _next_scale(scale, finite: jax.Array):
    """The `DynamicScale` after a step whose synced gradients were `finite`.

    flax's own rule (grow after `growth_interval` finite steps, back off
    otherwise), driven by the verdict every replica agreed on: the gradient of
    `x * c` is `c`, finite exactly when `finite`.
    """
    c = jax.numpy.where(finite, 0.0, jax.numpy.nan).astype(jax.numpy.float32)
    new, _, _, _ = scale.value_and_grad(lambda x: x * c)(jax.numpy.float32(0.0))
    return new


def loss_and_grads(
    value_and_grad, loss_fn, state, batch, *, has_aux, kwargs
) -> _Gradients:
    """One replica's `loss_fn`, differentiated.

    A state with `batch_stats` calls `loss_fn(params, batch_stats, batch) ->
    (loss, new_batch_stats)` (or `(loss, (new_batch_stats, aux))` with
    `has_aux`); otherwise `loss_fn(params, batch)`. The loss may be a
    `jdp.weighted(total, weight)`: the total is differentiated, the weight
    returned beside it (no gradient flows into it). `aux` and `new_stats` are
    None when absent. `kwargs` (`rng`, `step`) are passed by name.
    """
    loss_fn = _fresh_arguments(loss_fn)
    with_stats = getattr(state, "batch_stats", None) is not None

    def split(*args):
        out = loss_fn(*args, **kwargs)
        if with_stats:
            loss, rest = out
            new_stats, aux = rest if has_aux else (rest, None)
        else:
            (loss, aux), new_stats = (out if has_aux else (out, None)), None
        weight = None
        if isinstance(loss, _metrics.Weighted):
            loss, weight = loss.total, lax.stop_gradient(loss.weight)
        return loss, (weight, aux, new_stats)

    args = (state.batch_stats, batch) if with_stats else (batch,)
    (loss, (weight, aux, new_stats)), grads = value_and_grad(split, has_aux=True)(
        state.params, *args
    )
    return _Gradients(loss, weight, aux, new_stats, grads)


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
    def with_fresh_arguments(params, *rest, **kwargs):
        return loss_fn(params, *jax.tree.map(lambda x: x, rest), **kwargs)

    return with_fresh_arguments


#: The state fields a train step reads and writes (static fields, such as a flax
#: `TrainState`'s `apply_fn` and `tx`, are not part of the pytree).
KNOWN_FIELDS = (
    "step",
    "params",
    "opt_state",
    "batch_stats",
    "skipped_steps",
    "dynamic_scale",
    "rng",
    "sync_state",
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


def _check_sync_state(state: PyTree, sync: _sync.Sync, api: str) -> None:
    """A piece that keeps state needs the state's `sync_state`, and only it does."""
    held = getattr(state, "sync_state", None)
    keeps = sync.init is not None and jax.tree.leaves(
        jax.eval_shape(sync.init, state.params)
    )
    if keeps and held is None:
        raise ValueError(
            f"`{api}`: this sync piece keeps state of its own (error buffers, "
            "low-rank factors) in the train state's `sync_state`, which this "
            f"{type(state).__name__} does not hold (None or no such field). Create "
            "the state with the piece: `jdp.TrainState.create(params=..., tx=..., "
            "sync=sync)`, passing the same `sync` as to `jdp.make_train_step`."
        )
    if not keeps and jax.tree.leaves(held):
        raise ValueError(
            f"`{api}`: the state holds a `sync_state` (made for a sync piece that "
            "keeps state, e.g. `jdp.all_reduce(error_feedback=True)`), but this "
            "step's sync piece keeps none, so it would be carried along unchanged. "
            "Use the same piece for `jdp.TrainState.create(..., sync=...)` and "
            "`jdp.make_train_step(..., sync=...)`."
        )
    if keeps and held is not None:
        # Another piece's state (e.g. a PowerSGDState for an error-feedback
        # piece): its type differs. Same type, other params: the piece says so.
        want = jax.tree.structure(jax.eval_shape(sync.init, state.params))
        same_type = _describe_sync_state(held) == _describe_sync_state(want)
        if not same_type and jax.tree.structure(held) != want:
            raise TypeError(
                f"`{api}`: the state's `sync_state` was made by another sync "
                f"piece: it holds {_describe_sync_state(held)}, where this step's "
                f"piece keeps {_describe_sync_state(want)}. Create the state with "
                "the same piece as the step: `jdp.TrainState.create(params=..., "
                "tx=..., sync=sync)`, passing the `sync` given to "
                "`jdp.make_train_step`."
            )


def _describe_sync_state(tree: PyTree) -> str:
    """A sync piece's state for a message: its type, e.g. "a PowerSGDState"."""
    if isinstance(tree, jax.tree_util.PyTreeDef):
        node = tree.node_data()
        kind = getattr(node[0], "__name__", None) if node else None
        return f"a {kind}" if kind else f"a tree of structure {tree}"
    return f"a {type(tree).__name__}"


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
