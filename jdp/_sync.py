"""`jdp.Sync` pieces (`all_reduce`, `local`) and `jdp.sync_gradients`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp import _bmuf, _collectives, _layout, _replica_parts, _transforms, _wire
from jdp._tree import PyTree, finite, float_map
from jdp.sparse._lookup import densify, is_rows

BatchStatsMode = Literal["mean", "broadcast"]
OnBadReplica = Literal["drop"]


class Sync(NamedTuple):
    """A gradient sync piece, for `jdp.make_train_step(..., sync=piece)`.

    Like optax's `GradientTransformation`: two pure functions, plus what the step
    needs to know about their gradients. See the Sync guide (docs/guides/sync.md).

    Attributes:
      init: `init(params) -> state`, the train state's `sync_state`; None for a
        piece without state (per-replica fields: `jdp.declare_per_replica`).
      update: `update(grads, state, params, axis_name) -> (grads, state,
        metrics)`, run on one replica's gradients inside the step.
      averages: Whether the returned gradients are synced (True), or left for
        the optimizer to sync (False, as `jdp.local()`).
      must_agree: None, or `must_agree(train_state)`: the train state with the
        parts that may differ between replicas set to None.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> def summed(grads, state, params, axis_name):  # sum instead of average
      ...     return jax.lax.psum(grads, axis_name), state, {}
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch * params["w"] - 1.0) ** 2)
      >>> tx, sync = optax.sgd(0.1), jdp.Sync(None, summed)
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


class TakesRows(Sync):
    """A `Sync` whose `update` takes tables' gradients as `jdp.sparse.IndexedRows`."""

    __slots__ = ()


def check_batch_stats(batch_stats: Any) -> None:
    """A clear error unless `batch_stats` is a known mode."""
    if batch_stats not in get_args(BatchStatsMode):
        raise ValueError(
            f"`batch_stats` must be one of {get_args(BatchStatsMode)}; got "
            f"{batch_stats!r}."
        )


def apply_tx(grads, state, tx) -> tuple[PyTree, PyTree, dict[str, jax.Array]]:
    """`tx` applied to `grads`: `(params, opt_state, {})`; a `jdp.bmuf` merges after."""
    merges: list = []
    updates, opt_state = _transforms.update(
        tx, grads, state.opt_state, state.params, **{_bmuf.MERGES_ARG: merges}
    )
    params = optax.apply_updates(state.params, updates)
    return (*_merged(params, state.opt_state, opt_state, merges), {})


def _merged(params, old_state, opt_state, merges):
    """`jdp.bmuf`'s block sync on the updated params it holds (its label's, masked)."""
    if not merges:
        return params, opt_state
    for start in _replica_parts.restart_params(old_state):
        if jax.tree.structure(start) == jax.tree.structure(params):
            break
        try:
            masked = jax.tree.map(
                lambda s, p: s if _transforms.is_masked(s) else p, start, params,
                is_leaf=_transforms.is_masked,
            )  # fmt: skip
        except ValueError:
            continue
        merged, opt_state = _bmuf.merge_updated(masked, old_state, opt_state, merges)
        params = jax.tree.map(
            lambda s, p, m: p if _transforms.is_masked(s) else m, start, params,
            merged, is_leaf=_transforms.is_masked,
        )  # fmt: skip
        return params, opt_state
    return _bmuf.merge_updated(params, old_state, opt_state, merges)


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

    The default piece of `jdp.make_train_step`: a bucketed all-reduce of the
    gradients, or a compressed exchange with `wire`. See the Sync and
    Compression guides (docs/guides/).

    Args:
      bucket_bytes: Largest bucket of the all-reduce (25 MiB); None for one
        bucket per dtype.
      reduce_dtype: Wire dtype of the all-reduce (e.g. `jnp.bfloat16`).
      wire: A compressed exchange instead: `jdp.wire.bf16()`, `int8()`, `fp8()`.
      error_feedback: With `wire`: feed what quantisation dropped into the next
        step (per-replica buffers, the piece's state).
      axis_name: The mesh axis (or axes) to average over; None: the step's.
      on_bad_replica: `"drop"`: average only the replicas whose gradients are
        finite (metric `"dropped_replicas"`); None (default): every replica.

    Returns:
      A `jdp.Sync`.

    Raises:
      ValueError: If `bucket_bytes`, `reduce_dtype` (not a real floating-point
        type) or `on_bad_replica` is invalid, `error_feedback` lacks a
        `wire`, or `wire` is combined with
        `reduce_dtype` or `on_bad_replica`.
      TypeError: If `wire` is not a wire format.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> tx, sync = optax.sgd(0.1), jdp.all_reduce(wire=jdp.wire.int8())
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=sync),
      ...                        devices=jax.devices()[:4])
      >>> params = {"w": jnp.zeros((512, 1))}
      >>> state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
      >>> batch = step.shard({"x": jnp.ones((8, 512)), "y": jnp.ones((8, 1))})
      >>> sorted(c.kind for c in step.collectives(state, batch) if c.dtype == "s8")
      ['all-gather', 'all-to-all']
    """
    _collectives.check_bucket_bytes(bucket_bytes)
    _collectives.check_reduce_dtype(reduce_dtype)
    _wire.check_options(wire, error_feedback, reduce_dtype, "jdp.all_reduce")
    _check_on_bad_replica(on_bad_replica, wire)
    if on_bad_replica is not None:
        return _dropping(bucket_bytes, reduce_dtype, axis_name)
    if wire is not None:
        return _compressed(wire, error_feedback, axis_name)

    def update(grads, state, params, step_axis):
        grads = _dense(grads, params)
        del params
        # One replica: the mean is the gradient itself, bit for bit, and
        # XLA:CPU would still copy every gradient through a collective.
        plain = axis_name is None and reduce_dtype is None
        if plain and _collectives.axis_size(step_axis, "jdp.all_reduce") == 1:
            return grads, state, {}
        grads = _collectives.all_reduce(
            grads, axis_name=step_axis if axis_name is None else axis_name,
            bucket_bytes=bucket_bytes, reduce_dtype=reduce_dtype, api="jdp.all_reduce",
        )  # fmt: skip
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


#: The metric under which `on_bad_replica="drop"` tells the step this replica's
#: share of the loss (`num_replicas / kept`, 0 if dropped); never returned.
KEPT = "_jdp_kept_share"


def _dense(grads: PyTree, params: PyTree) -> PyTree:
    """Tables' sparse rows (`jdp.sparse.value_and_grad`) as dense gradients.

    Each replica's rows hold its own ids: averaged element by element, they would
    mix rows of different ids.
    """
    if not any(map(is_rows, jax.tree.leaves(grads, is_leaf=is_rows))):
        return grads
    if params is None:
        raise ValueError(
            "`jdp.all_reduce`: the gradients hold a table's sparse rows "
            "(`jdp.sparse.value_and_grad`), which it averages as dense gradients, "
            "but got no params to size the table. Pass them: `tx.update(grads, "
            "opt_state, params)`; or sync the rows as rows: "
            "`jdp.sync_gradients(jdp.sparse.rows())`."
        )
    return jax.tree.map(
        lambda g, p: densify(g, p) if is_rows(g) else g, grads, params, is_leaf=is_rows
    )


def _dropping(bucket_bytes, reduce_dtype, axis_name) -> Sync:
    """`jdp.all_reduce(on_bad_replica="drop")`: the mean of the valid replicas."""

    def update(grads, state, params, step_axis):
        grads = _dense(grads, params)
        del params
        axis = step_axis if axis_name is None else axis_name
        num = _collectives.axis_size(axis, "jdp.all_reduce")
        valid = finite(grads)
        masked = float_map(lambda g: jnp.where(valid, g, jnp.zeros_like(g)), grads)
        options = dict(bucket_bytes=bucket_bytes, reduce_dtype=reduce_dtype)
        if reduce_dtype is None:
            # The bit is the last leaf: one more value in the same all-reduce.
            total, share = _collectives.all_reduce(
                (masked, valid.astype(jnp.float32)), axis_name=axis,
                api="jdp.all_reduce", **options,
            )  # fmt: skip
            count = jnp.round(share * num).astype(jnp.int32)
        else:  # counted apart: 399/400 in bfloat16 rounds to 1
            total = _collectives.all_reduce(
                masked, axis_name=axis, api="jdp.all_reduce", **options
            )
            count = lax.psum(valid.astype(jnp.int32), axis)
        # No valid replica: a NaN average, which the step skips with
        # `skip_nonfinite=True` (a zero would still move momentum and decay).
        scale = jnp.where(count > 0, num / jnp.maximum(count, 1), jnp.nan)
        scale32 = scale.astype(jnp.float32)
        grads = float_map(lambda g: (g * scale32).astype(g.dtype), total)
        share = jnp.where(count > 0, jnp.where(valid, scale, 0.0), 1.0)
        return grads, state, {"dropped_replicas": num - count, KEPT: share}

    return Sync(None, update)


def _compressed(wire, error_feedback, axis_name) -> Sync:
    """`jdp.all_reduce(wire=...)`: the compressed exchange."""

    def update(grads, state, params, step_axis):
        grads = _dense(grads, params)
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

    For optimizers that communicate themselves: `jdp.bmuf`, `jdp.zero`, or
    `jdp.sync_gradients` inside `optax.MultiSteps`. With an optimizer that never
    communicates the replicas train different models, and the step warns.

    Example:
      >>> import optax, jdp
      >>> tx = jdp.bmuf(optax.sgd(0.1), sync_period=8)
      >>> sync = jdp.local()  # jdp.make_train_step(loss_fn, tx, sync=sync)
    """
    own = lambda grads, state, params, axis_name: (grads, state, {})  # noqa: E731
    return Sync(None, own, averages=False)


def sync_gradients(
    sync: Any = None, *, axis_name: _collectives.AxisName | None = None
) -> optax.GradientTransformationExtraArgs:
    """Any sync piece as an optax transform; put it first in an `optax.chain`.

    For a step that does not sync its gradients itself (a hand-written step, or
    `sync=jdp.local()`); inside `optax.MultiSteps` it communicates only on the
    micro-steps that update. The piece's metrics are dropped.

    Args:
      sync: A `jdp.Sync`; None for `jdp.all_reduce()`.
      axis_name: Replica axis; None (default) uses `jdp.parallelize`'s.

    Returns:
      An `optax.GradientTransformationExtraArgs`.

    Raises:
      TypeError: If `sync` is not a `jdp.Sync`.

    Example:
      >>> import optax, jdp
      >>> tx = optax.chain(jdp.sync_gradients(jdp.powersgd(rank=4)),
      ...                  optax.adam(1e-3))  # with `sync=jdp.local()`
    """
    sync = all_reduce() if sync is None else sync
    if not isinstance(sync, Sync):
        raise TypeError(
            "`jdp.sync_gradients` turns a `jdp.Sync` (e.g. `jdp.all_reduce()`, "
            f"`jdp.powersgd(rank=4)`) into an optax transform; got "
            f"{type(sync).__name__}."
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


def unless_nonfinite(ok, run, state, *, counted: bool = True):
    """`run()`'s `(params, opt_state, metrics)` if `ok` (agreed), else the state's."""
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
            lambda s, x: jnp.asarray(x, s.dtype), shapes[:2],
            (state.params, state.opt_state),
        )  # fmt: skip
        return (*kept, extra)

    params, opt_state, extra = lax.cond(ok, run, skip)
    return params, opt_state, {**extra, "skipped": 1 - ok.astype(jnp.int32)}


def agreed_locally(state: PyTree) -> PyTree:
    """What replicas on their own gradients agree on: all but params and local state."""
    if not hasattr(state, "replace"):
        return None
    if syncs_gradients(state.opt_state):  # `jdp.zero`: replicas hold equal params
        # but what `optax.MultiSteps` accumulates before it are their own gradients.
        agree = _replica_parts.must_agree(state)
        return _transforms.without_accumulated(agree, stop_at=_layout.is_custom)
    return state.replace(params=None, opt_state=_replica_parts.agreed(state.opt_state))


def syncs_gradients(opt_state: PyTree) -> bool:
    """Whether the optimizer state declares that it averages gradients itself."""
    nodes = jax.tree.leaves(opt_state, is_leaf=_layout.is_custom)
    return any(_layout.is_custom(x) and x.syncs_gradients for x in nodes)
