"""`jdp.make_train_step`: a per-replica train step composed of pieces."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jdp import _collectives, _loss, _replica_parts, _step_checks, _sync, _validate
from jdp._buckets import after
from jdp._tree import PyTree, is_float
from jdp.sparse import _lookup
from jdp.sparse import _train_step as _sparse

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
    """What `jdp.make_train_step` returns: `step_fn` and what it declares.

    `must_agree` maps a state to the part replicas must agree on (the rest
    None), which `check_sync` compares; `loss` is for `jdp.check_equivalence`.
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
    sync: _sync.Sync = _DEFAULT_SYNC,
    has_aux: bool = False,
    microbatches: int = 1,
    axis_name: _collectives.AxisName | None = None,
    skip_nonfinite: bool = False,
    batch_stats: _sync.BatchStatsMode = "mean",
) -> TrainStep:
    """Builds the per-replica training step for `jdp.parallelize`.

    The step differentiates `loss_fn` on the replica's slice of the batch, syncs
    the gradients as `sync` says (by default averaged over replicas), applies
    `tx` and syncs batch statistics. A state with a flax `DynamicScale` in
    `dynamic_scale` gets loss scaling. See the Sync guide (docs/guides/sync.md).

    Args:
      loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with
        `has_aux`); for a state with `batch_stats`, `loss_fn(params, batch_stats,
        batch) -> (loss, new_batch_stats)` (`(loss, (new_batch_stats, aux))`).
        The loss may be `jdp.weighted(...)`; a parameter named `rng` receives a
        per-replica key from the state's `rng`, one named `step` the step counter.
      tx: The optax optimizer; None uses the state's own `tx`.
      sync: A `jdp.Sync` (default `jdp.all_reduce()`).
      has_aux: Whether `loss_fn` returns auxiliary data; a dict of scalars becomes
        extra metrics, anything else is returned under `"aux"`.
      microbatches: Split each replica's batch into this many microbatches, run
        in sequence, then sync and update once (gradient accumulation).
      axis_name: The replica axis; None (default) uses `jdp.parallelize`'s.
      skip_nonfinite: Skip, on every replica, a step whose synced gradients are
        not finite (counted in `skipped_steps`, metric `"skipped"`).
      batch_stats: How `state.batch_stats` are synced: `"mean"` (default) or
        `"broadcast"` (see `jdp.sync_batch_stats`).

    Returns:
      `train_step(state, batch) -> (state, metrics)`, `metrics` holding `"loss"`.

    Raises:
      TypeError: If `sync`, `skip_nonfinite` or `loss_fn`'s parameters are not
        of a kind the step takes.
      ValueError: If `microbatches` or `batch_stats` is invalid; at trace time,
        if `loss_fn` does not match the state, or `sync` refuses the optimizer
        (e.g. it averages beside `jdp.bmuf`) or the state.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> tx, params = optax.sgd(0.1), {"w": jnp.zeros((3, 1))}
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
      >>> state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 1))}
      >>> state, metrics = step(state, step.shard(batch))
      >>> float(metrics["loss"]), int(step.unreplicate(state).step)
      (1.0, 1)
    """
    if not isinstance(sync, _sync.Sync):
        raise TypeError(
            "`sync` must be a `jdp.Sync`, e.g. `jdp.all_reduce()`, `jdp.local()`, "
            "`jdp.powersgd()`, `jdp.partition(...)` or `jdp.sparse.rows()`; "
            f"got {type(sync).__name__}."
        )
    _validate.positive_int("microbatches", microbatches)
    _validate.boolean("skip_nonfinite", skip_nonfinite)
    _sync.check_batch_stats(batch_stats)
    takes_stats = _loss.takes_batch_stats(loss_fn)
    keywords = _loss.loss_keywords(loss_fn)
    api = "jdp.make_train_step"
    rows = isinstance(sync, _sync.TakesRows)

    def train_step(state, batch):
        _step_checks.check_train_state(state, api)
        if (optimizer := getattr(state, "tx", None) if tx is None else tx) is None:
            raise ValueError(
                f"`{api}` got no optimizer: pass `tx` or use a state that "
                "carries one (`jdp.TrainState.create(params=..., tx=...)`)."
            )
        axis = _collectives.resolve_axis(axis_name)
        _step_checks.check_trainable(state.params, api)
        _step_checks.check_known_fields(state, api)
        _step_checks.check_piece(sync, optimizer, state, axis, api)
        _loss.check_batch_stats(state, takes_stats, api, loss_fn)
        loss_kwargs = _loss.loss_kwargs(state, keywords, axis, api)
        value_and_grad = (
            _sparse.differentiate(optimizer) if rows else jax.value_and_grad
        )
        if (scale := getattr(state, "dynamic_scale", None)) is not None:
            _loss.check_loss_scaling(rows, microbatches)
            value_and_grad = _loss.scaled(scale)
        out = _loss.gradients(
            value_and_grad, loss_fn, state, batch, has_aux=has_aux,
            microbatches=microbatches, loss_kwargs=loss_kwargs,
        )  # fmt: skip
        loss, grads = _loss.normalise(out, axis)
        skip = skip_nonfinite or scale is not None
        params, opt_state, extra, sync_state = _update(
            sync, grads, state, optimizer, axis, skip, counted=scale is None, rows=rows
        )
        changes = {"step": state.step + 1, "params": params, "opt_state": opt_state}
        if sync_state is not None:
            changes["sync_state"] = sync_state
        if scale is not None:
            finite = extra["skipped"] == 0
            if (dropped := extra.get("dropped_replicas")) is not None:
                # A replica the piece left out overflowed (most likely at this
                # scale): the scale backs off too, or it would be left out for good.
                finite &= lax.pmax(dropped, axis) == 0
            changes["dynamic_scale"] = _loss.next_scale(scale, finite)
            extra["loss_scale"] = scale.scale
            _loss.warn_if_collapsed(changes["dynamic_scale"].scale, axis)
        loss, extra = _loss.kept_loss(out, loss, extra, axis)
        aux, new_stats = out.aux, out.new_stats
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
            aux = aux if isinstance(aux, dict) else {"aux": aux}
            # An aux "loss" is the flax recipes' own loss metric (without the
            # weight penalty, say): it replaces the step's. The step's other
            # metrics report what it did, and stay.
            if taken := sorted(set(aux) & (set(metrics) - {"loss"}), key=str):
                raise ValueError(
                    f"`{api}`: `loss_fn`'s auxiliary metrics {taken} have the names of "
                    "metrics the step reports about itself (skipped steps, the loss "
                    "scale, dropped replicas), which they would hide. Rename them."
                )
            metrics.update(aux)
        return state.replace(**changes), metrics

    spec = LossSpec(loss_fn, has_aux, microbatches, keywords, axis_name)
    agreed = _replica_parts.must_agree if sync.averages else _sync.agreed_locally
    return TrainStep(train_step, sync.must_agree or agreed, spec)


def _update(sync, grads, state, tx, axis, skip, *, counted, rows):
    """The piece's gradients, then `tx`: `(params, opt_state, metrics, sync_state)`."""
    held = getattr(state, "sync_state", None)
    piece_state = sync.initial_state(state.params) if held is None else held

    def hold() -> bool:  # asked after the piece's update where it can be (its errors)
        # One collective of all the gradients orders them; rows travel apart from
        # the dense gradients, and `jdp.zero`'s collective is in the optimizer.
        if _sync.syncs_gradients(state.opt_state):
            return False
        api = "jdp.make_train_step"
        return rows or not sync.averages or _collectives.axis_size(axis, api) == 1

    # A piece with state (error feedback) reads its own result: it gets held
    # gradients, where a piece without state hands on a held result.
    if held is not None and hold():
        grads = all_computed(grads)
    checked, new_state, extra = sync.update(grads, piece_state, state.params, axis)
    finite = _sync.finite(checked) if skip else None
    if held is None and hold():
        checked = all_computed(checked, finite)
    apply = _sparse.apply if rows else _sync.apply_tx
    run = lambda: apply(checked, state, tx)  # noqa: E731
    if not skip:
        params, opt_state, more = run()
    else:  # a step skipped keeps the piece's state too
        ok = lax.pmin(finite.astype(np.int32), axis) > 0
        params, opt_state, more = _sync.unless_nonfinite(
            ok, run, state, counted=counted
        )
        if held is not None and new_state is not None:
            new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, held)
    return params, opt_state, {**extra, **more}, None if held is None else new_state


#: Gradients of this many bytes or more wait for all the others (`all_computed`).
HELD_BYTES = 1 << 16


def all_computed(grads, made=None):
    """`grads`, bit for bit, those of `HELD_BYTES` or more held until all are made.

    Else XLA may update a parameter while the backward pass still reads it, and copy
    it first (the 39M MLP's step on one CPU device took 1.2x the time). A collective
    of all the gradients orders them too; `jdp.local()`, one replica and `jdp.bmuf`'s
    inner steps have none. `made`: an array computed from every gradient by an
    operation XLA does not fuse into its users (a reduction such as `_tree.finite`),
    or None for a sort of their first elements. (A held gradient that read the
    others directly, or through a computation XLA repeats in each user, could not be
    updated in place: XLA copied every one.)
    """
    # A table's rows (`jdp.sparse.rows`) are waited for, not held.
    leaves, treedef = jax.tree.flatten(grads, is_leaf=_lookup.is_rows)
    floats = [x for x in jax.tree.leaves(leaves) if is_float(x) and x.size]
    big = [
        i
        for i, x in enumerate(leaves)
        if not _lookup.is_rows(x) and is_float(x) and x.nbytes >= HELD_BYTES
    ]
    if not big:
        return grads
    if made is None:
        made = lax.sort(
            jnp.stack([x.reshape(-1)[0].real.astype(jnp.float32) for x in floats])
        )
    for i, x in zip(big, after([leaves[i] for i in big], [made]), strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
