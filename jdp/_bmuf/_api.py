"""`jdp.bmuf` and `jdp.bmuf_global_params`: the public transform and its reader.

`bmuf` checks its options, builds the state and runs the local step; the sync
itself is `_block.merge` or, with `fragments`, `delay` or `mix`,
`_streaming.merge`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp import _collectives, _wire
from jdp._bmuf import _block, _streaming
from jdp._bmuf._average import mean
from jdp._bmuf._deferred import MERGES_ARG
from jdp._bmuf._fragments import plan, take
from jdp._bmuf._options import InnerStateAtSync, OnBadReplica, Options, check
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
    *,
    sync_period: int,
    block_learning_rate: float = 1.0,
    block_momentum: float | None = None,
    nesterov: bool = False,
    inner_state_at_sync: InnerStateAtSync = "keep",
    warmup_steps: int = 0,
    outer: optax.GradientTransformation | None = None,
    fragments: int = 1,
    delay: int = 0,
    mix: float = 0.0,
    wire: _wire.Wire | None = None,
    on_bad_replica: OnBadReplica | None = None,
    bad_replica_max_norm: float | None = None,
    axis_name: _collectives.AxisName | None = None,
) -> optax.GradientTransformation:
    r"""Blockwise model-update filtering: local training, periodic filtered merge.

    Every step, each replica applies `inner` to its OWN gradients (no all-reduce:
    use `jdp.make_train_step(loss_fn, tx, sync=jdp.local())`). Every
    `sync_period`-th step, after that local update, the block update runs. With
    `start` the model every replica began the block from (the initial params for
    the first block), in the notation of Chen & Huo:

    - `avg = mean over replicas of the locally updated params`, W̄(t): one
      all-reduce of the parameters, the only communication;
    - `delta = avg - start`, G(t);
    - `v = block_momentum * v + block_learning_rate * delta`, Δ(t);
    - `g = g + v`, W(t), the global model;
    - every replica's params, and the next block's `start`, become `g`
      (classical block momentum, CBM: Caffe2's broadcast of the master's
      model), or `g + block_momentum * v` with `nesterov=True` (the paper's
      Nesterov-like block momentum, NBM).

    `block_momentum=0, block_learning_rate=1` is plain model averaging; with
    `sync_period=1` and plain SGD that is synchronous SGD. The sync sits in a
    `lax.cond`: the parameter all-reduce runs on sync steps only (see
    `step.collectives`, field `in_conditional`). In `jdp.make_train_step` it
    runs after the parameter update, on the updated params, so a step that does
    not sync costs what the local step costs; in a hand-written step
    (`tx.update` then `optax.apply_updates`, as flax's
    `TrainState.apply_gradients`) it runs inside the optimizer, with the same
    results and more temporary memory (the gradients and, on sync steps, the
    recomputed local params).

    The state holds `g` and `v`, and `start` only where it differs from `g`
    (`nesterov=True`): classical block momentum and `outer` keep no third copy
    of the parameters. `start` is stored rather than recomputed from `g` and `v`
    so that every replica lands on exactly the same bits after a sync.

    Other implementations' "Nesterov" variants are NOT the paper's NBM. Caffe2's
    `nesterov=True` sets the next block's start to `W(t) - block_momentum * Δ(t)`
    (the look-ahead with its sign flipped). fairseq's `use_nbm=True` adds
    `block_momentum * s` to its smoothed update and then makes that point the
    new global model, which is exactly CBM with a block learning rate scaled by
    `1 + block_momentum`. Both agree with the paper (and with jdp) for CBM.

    Streaming DiLoCo (`fragments`, `delay`, `mix`) syncs one fragment of the
    parameters at a time, spreads its all-reduce over `delay` steps and mixes
    the merged fragment with the local one; the defaults are the block sync
    above, unchanged. See the BMUF guide for the exact schedule.

    Must be the LAST transform of a chain (its updates move the params to the
    merged model on sync steps): `optax.chain(optax.clip_by_global_norm(1.0),
    jdp.bmuf(optax.sgd(0.1, momentum=0.9), sync_period=8))`.

    After a sync, `jdp.make_train_step` leaves every replica's params exactly
    equal to the block start. In a hand-written step the updates of a sync step
    are `new_params - params`, so `optax.apply_updates` reaches the merged model
    up to float rounding (exactly when old and new values are within a factor of
    2 of each other); replicas may then differ by an ulp, which the next sync
    erases. The global model `g` itself is identical on every replica.

    Args:
      inner: The local optimizer, any optax transform (e.g.
        `optax.sgd(0.1, momentum=0.9)`), applied every step to the replica's own
        gradients.
      sync_period: Steps per block, τ (an int >= 1): the replicas sync every
        `sync_period` steps.
      block_learning_rate: ζ, the block learning rate (> 0; 1.0 by default).
      block_momentum: η, the block momentum in [0, 1); `None` (default) means
        `1 - 1 / num_replicas` with every replica of every host counted (the
        Caffe2 default; 0 with one replica). Over a run of only tens of blocks
        with an adaptive `inner` (Adam), a smaller value can train better: see
        the README's BMUF section.
      nesterov: Start the next block from the look-ahead `g + η v` (the
        paper's NBM) instead of `g` (CBM, default).
      inner_state_at_sync: What happens to `inner`'s state at a sync: `"keep"`
        it (default); `"reset"` its floating leaves (momentum, moments) to their
        initial values while integer leaves (step counts, so learning-rate
        schedules continue) are kept, as Caffe2's `reset_momentum_sgd`; or
        `"average"` its floating leaves across replicas (fairseq's
        `average_sync`; one more all-reduce, on sync steps only).
      warmup_steps: For the first `warmup_steps` updates the gradients are
        averaged across replicas before `inner` (synchronous SGD, like PyTorch's
        post-local-SGD warmup), so the replicas stay identical; `g` is the
        model at the end of warmup and blocks count from there. 0 by default.
      outer: Optional outer optimizer replacing the block filter: at a sync it
        is applied to the block start with the pseudo-gradient `start - avg`,
        and its result becomes `g`, the params and the next start. DiLoCo is
        `outer=optax.sgd(0.7, momentum=0.9, nesterov=True)`;
        `optax.sgd(ζ, momentum=η)` equals the default CBM filter and
        `optax.sgd(ζ, momentum=η, nesterov=True)` the paper's NBM (its `g` is
        then the look-ahead point). Cannot be combined with
        `block_learning_rate`, `block_momentum` or `nesterov`.
      fragments: Streaming DiLoCo's fragments, F (an int >= 1 dividing
        `sync_period`; torchft's `len(model_fragments)`): the parameters are
        split into F fragments of nearly equal bytes (leaves in tree order, a
        leaf cut along its first axis where needed; a function of the shapes
        alone), each with its own slices of `g`, `start` and `v` (or its own
        `outer` state). One fragment syncs every `sync_period / F` updates,
        round-robin from fragment 0, so each syncs every `sync_period` updates.
        1 (default): the whole model at once.
      delay: τ, the number of updates over which a fragment's all-reduce is
        spread (0 <= τ <= `sync_period / fragments`; torchft's
        `fragment_sync_delay`, the paper's overlap τ). The fragment's local
        params are taken τ updates before its sync, all-reduced one chunk per
        update during the next τ updates (from a buffer in the state, so that
        the collective does not wait for the step's gradients), and merged at
        the sync; the local progress of those τ updates is kept by `mix` only.
        0 (default): taken and all-reduced at the sync.
      mix: α in [0, 1), how much of the local fragment to keep at its sync
        (torchft's `fragment_update_alpha`, the paper's α): the local slices
        become `(1 - α) * new + α * local`, `new` being what they become
        without it (`g`, or `start` with `nesterov=True`). 0.0 (default).
      wire: A compressed exchange for the syncs: `jdp.wire.bf16()`,
        `jdp.wire.int8()` or `jdp.wire.fp8()` (see `jdp.wire`). Each replica's
        outer pseudo-gradient `start - params` (of the whole model, a fragment
        or a chunk) is quantised and averaged by an all-to-all and an
        all-gather of the narrow type, and the sync uses `start` minus that
        mean (torchft's `should_quantize`). None (default): the params are
        all-reduced in their own type.
      on_bad_replica: `"drop"`: at a block sync, a replica whose locally
        updated params are not finite (a NaN or inf gradient during the block),
        or moved farther than `bad_replica_max_norm` from the block start, is
        left out of the average: the sync averages the other replicas' params
        (each replica multiplies its contribution by its validity bit, and the
        count of valid replicas rides in the same all-reduce), and every
        replica, the dropped ones included, starts the next block from the new
        model; a dropped replica's floating `inner` state is reset (with
        `inner_state_at_sync="average"`, the valid replicas' mean is taken).
        If no replica is valid, the block update is skipped: `g`, `start` and
        `v` (or the `outer` state) stay as they were and every replica restarts
        from the previous block start. The state's `dropped` counts the
        replicas left out. For `fragments=1, delay=0, mix=0` and without `wire`.
        None (default): every replica is averaged, as is.
      bad_replica_max_norm: With `on_bad_replica="drop"`, also drop a replica
        whose params' L2 distance (over all floating leaves) from the block
        start exceeds this (a finite number > 0). None (default): finiteness
        alone.
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.

    Returns:
      An `optax.GradientTransformation` whose state is a `jdp.BMUFState`. Its
      `update(updates, state, params)` requires `params`.

    Raises:
      TypeError: If `sync_period`, `warmup_steps`, `fragments` or `delay` is not
        an int, `mix` not a number, or
        `block_learning_rate` or `block_momentum` is not a number.
      ValueError: At construction, for a `sync_period` not divisible by
        `fragments`, a `delay` above `sync_period / fragments`, a `mix` outside
        [0, 1), `fragments` < 1 or a negative `delay`, `inner_state_at_sync` other
        than "keep" with `fragments` > 1; for a `sync_period` < 1, a
        `block_momentum` outside [0, 1), a `block_learning_rate` <= 0 (or either
        of them NaN or infinite), a
        negative `warmup_steps`, an unknown `inner_state_at_sync`, or `outer`
        combined with the block-filter options; for an `on_bad_replica` other
        than None or "drop", a `bad_replica_max_norm` that is not a finite
        number > 0 or is given without `on_bad_replica="drop"`, or
        `on_bad_replica` combined with `fragments` > 1, `delay`, `mix` or
        `wire`; at update time, for `params=None`.
      TypeError: If `inner` or `outer` is not an optax transform, or `wire` not
        a wire format.
      RuntimeError: At update time, if `axis_name` is not bound (called outside
        `jdp.parallelize`).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> tx = jdp.bmuf(optax.sgd(0.2), sync_period=4, block_momentum=0.5)
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
      https://doi.org/10.1109/ICASSP.2016.7472805.

      Douillard et al., "DiLoCo: Distributed Low-Communication Training of
      Language Models", 2023, https://arxiv.org/abs/2311.08105.

      Douillard et al., "Streaming DiLoCo with overlapping communication:
      Towards a Distributed Free Lunch", 2025, https://arxiv.org/abs/2501.18512
      (`fragments`, `delay`, `mix`); torchft's `torchft/local_sgd.py`,
      `DiLoCo(model_fragments, ..., fragment_sync_delay, fragment_update_alpha)`.
    """
    options = Options(
        block_learning_rate=block_learning_rate,
        block_momentum=block_momentum,
        nesterov=nesterov,
        inner_state_at_sync=inner_state_at_sync,
        warmup_steps=warmup_steps,
        outer=outer,
        fragments=fragments,
        delay=delay,
        mix=mix,
        sync_period=sync_period,
        wire=wire,
        on_bad_replica=on_bad_replica,
        bad_replica_max_norm=bad_replica_max_norm,
    )
    check(inner, sync_period, options)
    stores_start = options.stores_start
    streaming = options.streaming
    period = sync_period // fragments  # steps between two fragment syncs
    axis = axis_name

    def init_fn(params):
        if streaming:  # refuses a tree too small to split
            pieces = plan(params, fragments, delay).fragments
        if outer is None:
            velocity = jax.tree.map(jnp.zeros_like, params)
        elif streaming:  # one outer state per fragment, over its slices
            leaves = [jnp.asarray(x) for x in jax.tree.leaves(params)]
            velocity = tuple(outer.init(take(leaves, f)) for f in pieces)
        else:
            velocity = outer.init(params)
        return BMUFState(
            count=jnp.zeros((), jnp.int32),
            global_params=jax.tree.map(jnp.asarray, params),
            start=jax.tree.map(jnp.asarray, params) if stores_start else None,
            velocity=velocity,
            inner_state=inner.init(params),
            synced=jnp.zeros((), jnp.bool_),
            pending=jax.tree.map(jnp.array, params) if delay else None,
            dropped=jnp.zeros((), jnp.int32) if on_bad_replica else None,
        )

    merge = functools.partial(
        _streaming.merge if streaming else _block.merge,
        inner=inner,
        axis=axis,
        options=options,
    )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        communicate = extra_args.get(_collectives.COLLECTIVES_ARG, True)
        count = state.count
        if warmup_steps and communicate:
            axis_name = _collectives.resolve_axis(axis)
            updates = lax.cond(
                count < warmup_steps,
                lambda u: mean(u, axis_name),
                lambda u: u,
                updates,
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
            # The caller applies `inner`'s updates and then runs the block sync
            # on the updated params (`merge_updated`), or discards the result.
            if merges is not None:
                merges.append(merge)
            return inner_updates, new_state
        # A hand-written step applies the updates after this returns: run the
        # block sync here, on the locally updated params, and return the
        # difference to the model every replica starts the next block from.
        local = optax.apply_updates(params, inner_updates)
        merged, new_state = merge(local, state, new_state)
        out_updates = jax.tree.map(
            lambda m, p, u: (
                jnp.where(is_sync, (m - p).astype(u.dtype), u) if is_float(u) else u
            ),
            merged,
            params,
            inner_updates,
        )
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
