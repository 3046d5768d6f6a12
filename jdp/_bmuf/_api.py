"""`jdp.bmuf` and `jdp.bmuf_global_params`: the public transform and its reader."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp import _collectives
from jdp._bmuf import _block, _streaming
from jdp._bmuf._average import mean
from jdp._bmuf._deferred import MERGES_ARG
from jdp._bmuf._fragments import plan, take
from jdp._bmuf._options import BlockAverage, InnerStateAtSync, Streaming, check, record
from jdp._bmuf._state import BMUFState, find_states, float_map
from jdp._tree import PyTree, fill_empty

NO_PARAMS_MSG = (
    "`jdp.bmuf` needs the current parameters: call `tx.update(grads, opt_state, "
    "params)` (optax's `update(updates, state, params)`), as `jdp.make_train_step` "
    "and `flax.training.train_state.TrainState.apply_gradients` do; got "
    "`params=None`."
)


def bmuf(
    inner: optax.GradientTransformation,
    sync_period: int,
    *,
    outer: optax.GradientTransformation | None = None,
    warmup_steps: int = 0,
    inner_state_at_sync: InnerStateAtSync = "keep",
    streaming: Streaming | None = None,
    average: BlockAverage | None = None,
    axis_name: _collectives.AxisName | None = None,
) -> optax.GradientTransformation:
    """Blockwise model-update filtering (BMUF, DiLoCo): local steps, periodic merge.

    Every step, each replica applies `inner` to its own gradients (build the
    step with `jdp.make_train_step(loss_fn, tx, sync=jdp.local())`). Every
    `sync_period`-th step the replicas' params are averaged (one all-reduce, run
    on sync steps only) and `outer` merges the mean into the global model `g`,
    the same on every replica, from which every replica starts the next block.
    Must be the last transform of an `optax.chain`. The BMUF guide
    (docs/guides/bmuf.md) gives the block update, DiLoCo, Streaming DiLoCo and
    the references.

    Args:
      inner: The local optimizer, any optax transform.
      sync_period: Steps per block (an int >= 1).
      outer: The outer optimizer, applied at a sync to the pseudo-gradient
        `start - avg`. None (default): `jdp.block_momentum()`.
      warmup_steps: Updates at the start whose gradients are averaged across
        replicas before `inner` (synchronous SGD); blocks count from there.
      inner_state_at_sync: What a sync does to `inner`'s state: `"keep"` it
        (default), `"reset"` its floating leaves (momenta; step counts kept),
        or `"average"` them across replicas (one more all-reduce).
      streaming: Streaming DiLoCo's schedule, a `jdp.Streaming`. None
        (default): the whole model at every sync.
      average: How the params are averaged at a sync, a `jdp.BlockAverage`.
        None (default): the plain mean, in the params' own type.
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.

    Returns:
      An `optax.GradientTransformation` whose state is a `jdp.BMUFState`. Its
      `update(updates, state, params)` requires `params`.

    Raises:
      TypeError: If an argument has the wrong type.
      ValueError: At construction, for an invalid value or combination (the
        BMUF guide lists them); at update time, for `params=None`.
      RuntimeError: At update time, outside `jdp.parallelize`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> tx = jdp.bmuf(optax.sgd(0.2), 4, outer=jdp.block_momentum(momentum=0.5))
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)
      >>> train_step = jdp.make_train_step(loss_fn, tx, sync=jdp.local())
      >>> step = jdp.parallelize(train_step, devices=jax.devices()[:4])
      >>> state = step.replicate(jdp.TrainState.create(params={"w": 0.0}, tx=tx))
      >>> batch = step.shard({"x": jnp.ones(16), "y": 2 * jnp.ones(16)})
      >>> for _ in range(80):  # 20 blocks
      ...     state, metrics = step(state, batch)
      >>> g = step.unreplicate(jdp.bmuf_global_params(state))  # the global model
      >>> round(float(g["w"]), 2)
      2.0
    """
    options = record(
        sync_period, outer, warmup_steps, inner_state_at_sync, streaming, average
    )
    check(inner, options)
    outer = options.outer  # None for the classical block filter
    period = sync_period // options.fragments  # steps between two fragment syncs

    def init_fn(params):
        if options.streaming:  # refuses a tree too small to split
            fragments = plan(params, options.fragments, options.delay).fragments
        if outer is None:
            velocity = jax.tree.map(jnp.zeros_like, params)
        elif options.streaming:  # one outer state per fragment, over its slices
            leaves = [jnp.asarray(x) for x in jax.tree.leaves(params)]
            velocity = tuple(outer.init(take(leaves, f)) for f in fragments)
        else:
            velocity = outer.init(params)
        return BMUFState(
            count=jnp.zeros((), jnp.int32),
            global_params=jax.tree.map(jnp.asarray, params),
            start=jax.tree.map(jnp.asarray, params) if options.stores_start else None,
            velocity=velocity,
            inner_state=inner.init(params),
            synced=jnp.zeros((), jnp.bool_),
            pending=jax.tree.map(jnp.array, params) if options.delay else None,
            dropped=jnp.zeros((), jnp.int32) if options.on_bad_replica else None,
        )

    sync = _streaming.merge if options.streaming else _block.merge
    merge = functools.partial(sync, inner=inner, axis=axis_name, options=options)

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        communicate = extra_args.get(_collectives.COLLECTIVES_ARG, True)
        count = state.count
        if warmup_steps and communicate:
            axis = _collectives.resolve_axis(axis_name)
            updates = lax.cond(
                count < warmup_steps, lambda u: mean(u, axis), lambda u: u, updates
            )
        is_sync = (count >= warmup_steps) & ((count - warmup_steps + 1) % period == 0)
        inner_updates, inner_state = inner.update(updates, state.inner_state, params)
        new_state = state._replace(
            count=count + jnp.int32(1), inner_state=inner_state, synced=is_sync
        )
        merges = extra_args.get(MERGES_ARG)
        if merges is not None or not communicate:
            # The caller runs the sync on the params it updates (`merge_updated`),
            # or discards the result.
            if merges is not None:
                merges.append(merge)
            return inner_updates, new_state
        # A hand-written step: sync here on the locally updated params and
        # return the difference to the next block's start.
        local = optax.apply_updates(params, inner_updates)
        merged, new_state = merge(local, state, new_state)

        def sync_updates(u, m, p):
            return jnp.where(is_sync, (m - p).astype(u.dtype), u)

        return float_map(sync_updates, inner_updates, merged, params), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def bmuf_global_params(state: PyTree) -> PyTree:
    """Returns the global model `g` of `jdp.bmuf`: the model to evaluate and export.

    Between syncs the replicas' params differ; `g` is the same on every replica.

    Args:
      state: A `jdp.BMUFState`, or any pytree holding exactly one (an optax
        chain's state, a `jdp.TrainState`, a replicated state, or flax NNX's
        `nnx.state` of a model and an `nnx.Optimizer`).

    Returns:
      `global_params` as stored: replicated if `state` is (take one copy with
      `step.unreplicate`); from an NNX state, an NNX state of the parameters
      (`nnx.update(model, g)` loads it). Under `optax.multi_transform`, the
      parameters of the other labels are the state's `params`.

    Raises:
      ValueError: If `state` holds no `jdp.BMUFState`, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
      ...                  jdp.bmuf(optax.sgd(0.1), sync_period=4))
      >>> state = jdp.TrainState.create(params={"w": jnp.ones(2)}, tx=tx)
      >>> jdp.bmuf_global_params(state)["w"]
      Array([1., 1.], dtype=float32)
    """
    found = find_states(state)
    if len(found) != 1:
        raise ValueError(
            "`jdp.bmuf_global_params` expects a state holding exactly one "
            f"`jdp.BMUFState` (the optimizer state of `jdp.bmuf`), found {len(found)}."
            " Pass the training state or optimizer state whose optimizer contains "
            "one `jdp.bmuf`."
        )
    # Under `optax.multi_transform` (or `masked`) the other labels' params are
    # the state's own: synchronous, equal on every replica.
    params = state.get("params") if isinstance(state, dict) else None
    params = getattr(state, "params", params)
    g = found[0].global_params
    return g if params is None else fill_empty(g, params)
