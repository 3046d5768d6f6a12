"""`jdp.bmuf` and `jdp.bmuf_global_params`: the public transform and its reader."""

from __future__ import annotations

import functools
from typing import Any

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
from jdp._bmuf._state import BMUFState, find_states
from jdp._tree import is_float

PyTree = Any

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
    r"""Blockwise model-update filtering: local training, periodic filtered merge.

    Every step, each replica applies `inner` to its OWN gradients (no all-reduce:
    use `jdp.make_train_step(loss_fn, tx, sync=jdp.local())`). Every
    `sync_period`-th step, after that local update, the block update runs (in
    Chen & Huo's notation, `start` the model every replica began the block from):

    - `avg`, W̄(t): the replicas' mean of their params, one all-reduce of the
      parameters, the only communication (how: `average`);
    - `outer` updates the global model `g` with the pseudo-gradient
      `start - avg`; by default `jdp.block_momentum()`, the classical block
      filter `v = η * v + ζ * (avg - start)`, Δ(t), then `g = g + v`, W(t);
    - every replica's params, and the next `start`, become `g` (classical block
      momentum, CBM, as Caffe2), or `g + η * v` with
      `jdp.block_momentum(nesterov=True)` (the paper's Nesterov-like block
      momentum, NBM; not Caffe2's `nesterov=True` nor fairseq's `use_nbm`).

    `outer=jdp.block_momentum(momentum=0.0)` is plain model averaging; DiLoCo is
    `outer=optax.sgd(0.7, momentum=0.9, nesterov=True)`; `streaming=` gives
    Streaming DiLoCo. The sync sits in a `lax.cond`, so its all-reduce runs on
    sync steps only (`step.collectives`, field `in_conditional`).
    `jdp.make_train_step` runs it after the parameter update and leaves every
    replica's params exactly at the block start; a hand-written step
    (`tx.update` then `optax.apply_updates`) runs it inside the optimizer, with
    more temporary memory, and reaches the block start up to float rounding,
    which the next sync erases. `g` is identical on every replica.

    Must be the LAST transform of a chain, e.g. `optax.chain(
    optax.clip_by_global_norm(1.0), jdp.bmuf(optax.sgd(0.1), sync_period=8))`.

    Args:
      inner: The local optimizer, any optax transform, applied every step to
        the replica's own gradients.
      sync_period: Steps per block, τ (an int >= 1).
      outer: The outer optimizer, an optax transform applied at a sync to the
        block start with the pseudo-gradient `start - avg`. None (default):
        `jdp.block_momentum()`, block learning rate 1 and block momentum
        `1 - 1 / num_replicas`.
      warmup_steps: For the first `warmup_steps` updates (0 by default) the
        gradients are averaged across replicas before `inner` (synchronous SGD,
        like PyTorch's post-local-SGD warmup); blocks count from there.
      inner_state_at_sync: What happens to `inner`'s state at a sync: `"keep"`
        it (default); `"reset"` its floating leaves (momenta) to their initial
        values, keeping step counts (Caffe2's `reset_momentum_sgd`); or
        `"average"` its floating leaves across replicas (fairseq's
        `average_sync`; one more all-reduce).
      streaming: Streaming DiLoCo's schedule, a `jdp.Streaming`. None
        (default): the whole model at every sync.
      average: How the replicas' params are averaged at a sync, a
        `jdp.BlockAverage` (a compressed exchange, dropping bad replicas).
        None (default): the plain mean, in the params' own type.
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.

    Returns:
      An `optax.GradientTransformation` whose state is a `jdp.BMUFState`. Its
      `update(updates, state, params)` requires `params`.

    Raises:
      TypeError: If `sync_period` or `warmup_steps` is not an int, `inner` or
        `outer` not an optax transform, `streaming` not a `jdp.Streaming` or
        `average` not a `jdp.BlockAverage`.
      ValueError: At construction, for a `sync_period` < 1 or not divisible by
        the `streaming` fragments, a streaming `delay` above `sync_period /
        fragments`, an `inner_state_at_sync` other than "keep" with fragments
        > 1, a negative `warmup_steps`, an unknown `inner_state_at_sync`, or
        `on_bad_replica="drop"` with a streaming schedule; at update time, for
        `params=None`.
      RuntimeError: At update time, if `axis_name` is not bound (called outside
        `jdp.parallelize`).

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

    References:
      Chen & Huo, "Scalable training of deep learning machines by incremental
      block training with intra-block parallel optimization and blockwise
      model-update filtering", ICASSP 2016,
      https://doi.org/10.1109/ICASSP.2016.7472805. Douillard et al., "DiLoCo:
      Distributed Low-Communication Training of Language Models", 2023,
      https://arxiv.org/abs/2311.08105, and "Streaming DiLoCo with overlapping
      communication", 2025, https://arxiv.org/abs/2501.18512 (torchft's
      `DiLoCo`).
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

    merge = functools.partial(
        _streaming.merge if options.streaming else _block.merge,
        inner=inner,
        axis=axis_name,
        options=options,
    )

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
            count=count + jnp.ones((), jnp.int32),
            inner_state=inner_state,
            synced=is_sync,
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

        def sync_updates(m, p, u):
            if not is_float(u):
                return u
            return jnp.where(is_sync, (m - p).astype(u.dtype), u)

        out_updates = jax.tree.map(sync_updates, merged, params, inner_updates)
        return out_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def bmuf_global_params(state: PyTree) -> PyTree:
    """Returns the global model `g` of `jdp.bmuf`: the model to evaluate and export.

    Between syncs the replicas' params differ; `g` (the paper's W(t)) is the
    merged model, equal on every replica.

    Args:
      state: A `jdp.BMUFState`, or any pytree holding exactly one (an optimizer
        state from `optax.chain`, a `jdp.TrainState`, a replicated state, or
        flax NNX's `nnx.state` of a model and an `nnx.Optimizer`).

    Returns:
      `global_params` as stored: replicated (leading replica axis) if `state` is;
      take one copy with `step.unreplicate`. From an NNX state, an NNX state of
      the parameters: `nnx.update(model, g)` loads it into the model.

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
    return found[0].global_params
