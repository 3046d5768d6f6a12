"""`jdp.bmuf`: blockwise model-update filtering (BMUF) as an optax transform.

Caffe2's `Parallelize_GPU_BMUF` as one pure `optax.GradientTransformation`:
every replica trains on its own gradients for a block of steps without
communicating, then the replicas' models are averaged (one all-reduce of the
parameters, inside a `lax.cond` so that it runs on sync steps only) and merged
into a global model with a momentum filter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jdp import _collectives, _replica_parts, _validate, _wire
from jdp._tree import is_float

PyTree = Any
InnerStateAtSync = Literal["keep", "reset", "average"]
OnBadReplica = Literal["drop"]

NO_PARAMS_MSG = (
    "`jdp.bmuf` needs the current parameters: call `tx.update(grads, opt_state, "
    "params)` (optax's `update(updates, state, params)`), as `jdp.make_train_step` "
    "and `flax.training.train_state.TrainState.apply_gradients` do; got "
    "`params=None`."
)


#: The optimizer's extra argument (optax's `**extra_args`) through which a train
#: step that applies the updates itself asks `jdp.bmuf` to leave its block sync to
#: it: a list into which the update puts the sync (see `merge_updated`).
MERGES_ARG = "jdp_bmuf_merges"


class _Options(NamedTuple):
    """`jdp.bmuf`'s block-filter options, as given (checked by `_check_options`)."""

    block_learning_rate: float
    block_momentum: float | None
    nesterov: bool
    inner_state_at_sync: InnerStateAtSync
    warmup_steps: int
    outer: optax.GradientTransformation | None
    fragments: int = 1
    delay: int = 0
    mix: float = 0.0
    sync_period: int = 1
    wire: _wire.Wire | None = None
    on_bad_replica: OnBadReplica | None = None
    bad_replica_max_norm: float | None = None

    @property
    def stores_start(self) -> bool:
        """Whether the state keeps `start` (else the block start is `g`)."""
        return self.nesterov and self.outer is None

    @property
    def streaming(self) -> bool:
        """Whether the schedule is Streaming DiLoCo's (else today's block sync)."""
        return self.fragments > 1 or self.delay > 0 or self.mix > 0


@_replica_parts.declare(
    local=("inner_state", "pending"),
    required=("count", "synced", "global_params"),
    trains_locally=True,
)
class BMUFState(NamedTuple):
    """State of `jdp.bmuf`.

    Each replica holds its own copy; `count`, `global_params`, `start`, `velocity`
    and `synced` are equal on every replica, `inner_state` differs between syncs.

    Attributes:
      count: Number of updates applied so far, warmup included (int32, shape ()).
      global_params: The global model `g`, the paper's W(t): what to evaluate and
        export (read it with `jdp.bmuf_global_params`). During warmup it follows
        the (identical) replicas' parameters.
      start: With `nesterov=True`, the model every replica began the current
        block from, `g + block_momentum * v` (the initial params for the first
        block); after a sync every replica's params equal it. None otherwise:
        the block start is then `g` itself.
      velocity: The block velocity `v`, the paper's Δ(t), shaped like the params
        and zero until the first sync; with `outer`, the outer optimizer's state
        instead (with `fragments`, `delay` or `mix` set: a tuple of one outer
        state per fragment, each over the list of that fragment's slices).
      inner_state: The state of the `inner` optimizer.
      synced: Whether the last update ended a block, or with `fragments` > 1 a
        fragment's sync (bool, shape ()).
      pending: With `delay` >= 1, the fragment sync in flight, shaped like the
        params: the fragment's slices hold this replica's local params from
        `delay` steps before its sync, and each chunk already all-reduced holds
        the replicas' mean instead. None otherwise.
      dropped: With `on_bad_replica="drop"`, how many replicas' blocks were left
        out of the average so far, summed over syncs (int32, shape (), equal on
        every replica). None otherwise.
    """

    count: jax.Array  # int32, shape ()
    global_params: PyTree
    start: PyTree
    velocity: PyTree
    inner_state: optax.OptState
    synced: jax.Array  # bool, shape ()
    pending: PyTree = None
    dropped: jax.Array | None = None  # int32, shape ()

    #: The checkpoint's warning when `restart_local` reset `pending`.
    RESTART_NOTE = (
        "The fragment sync in flight (`delay`) restarts from the block start too: "
        "its snapshot is the block start, so that sync applies no local progress."
    )

    def restart_params(self) -> PyTree:
        """The block start: where every replica begins after a re-layout."""
        return self.global_params if self.start is None else self.start

    def restart_local(self) -> BMUFState:
        """`pending` set to the block start: a restore into another replica count.

        The snapshot in flight holds each replica's own params (or, for chunks
        already all-reduced, their mean); with another replica count every
        replica restarts from the block start, and so does the snapshot, so
        that the coming fragment sync applies no local progress rather than one
        replica's.
        """
        if self.pending is None:
            return self
        return self._replace(
            pending=jax.tree.map(
                lambda s, p: np.asarray(s, dtype=np.result_type(p)).reshape(
                    np.shape(p)
                ),
                self.restart_params(),
                self.pending,
            )
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
    options = _Options(
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
    _check_options(inner, sync_period, options)
    stores_start = options.stores_start
    streaming = options.streaming
    period = sync_period // fragments  # steps between two fragment syncs
    axis = axis_name

    def init_fn(params):
        if outer is None:
            velocity = jax.tree.map(jnp.zeros_like, params)
        elif streaming:
            plan = _plan(params, fragments, delay)
            leaves = [jnp.asarray(x) for x in jax.tree.leaves(params)]
            velocity = tuple(outer.init(_take(leaves, f)) for f in plan.fragments)
        else:
            velocity = outer.init(params)
        if streaming:
            _plan(params, fragments, delay)  # refuses a tree too small to split
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
        _merge_streaming if streaming else _merge,
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
                lambda u: _mean(u, axis_name),
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


def _merge(params, old_state, state, *, inner, axis, options):
    """`jdp.bmuf`'s block sync, the one implementation, on locally updated params.

    Args:
      params: The params after this step's local (inner) update.
      old_state: The `BMUFState` before the update.
      state: The `BMUFState` the update returned (`count` and `synced` advanced).
      inner: The inner optimizer (for `inner_state_at_sync="reset"`).
      axis: The replica axis as given to `jdp.bmuf` (None: the bound one).
      options: The block-filter options.

    Returns:
      `(params, state)`: on a step that ends a block, every replica's params are
      exactly the next block's start and the state holds the new global model
      and velocity; otherwise both as given (during warmup `g` follows the
      replicas).
    """
    at_sync, warmup_steps = options.inner_state_at_sync, options.warmup_steps
    stores_start = options.stores_start
    axis_name = _collectives.resolve_axis(axis)
    eta = _eta(axis_name, options.block_momentum)
    applied = state.count != old_state.count  # not an accumulation micro-step
    g, start = state.global_params, state.start
    if warmup_steps:

        def follow_replicas(operands):
            params, g, _ = operands
            g = _cast_like(params, g)
            return g, (g if stores_start else None)

        g, start = lax.cond(
            applied & (old_state.count < warmup_steps),
            follow_replicas,
            lambda operands: operands[1:],
            (params, g, start),
        )

    def sync(operands):
        params, g, start, v, inner_state = operands
        avg = _average_params(
            params, start if stores_start else g, axis_name, options.wire
        )
        g, start, v = _block_update(
            g,
            start,
            v,
            avg,
            eta,
            options.block_learning_rate,
            options.nesterov,
            options.outer,
        )
        target = start if stores_start else g
        if at_sync != "keep":
            inner_state = _inner_state_at_sync(
                inner_state, target, inner, at_sync, axis_name
            )
        return _cast_like(target, params), g, start, v, inner_state

    if options.on_bad_replica is not None:
        sync = functools.partial(
            _sync_dropping, inner=inner, axis_name=axis_name, eta=eta, options=options
        )
        params, g, start, v, inner_state, dropped = lax.cond(
            applied & state.synced,
            sync,
            lambda operands: operands,
            (params, g, start, state.velocity, state.inner_state, state.dropped),
        )
        return params, state._replace(
            global_params=g,
            start=start,
            velocity=v,
            inner_state=inner_state,
            dropped=dropped,
        )

    # Only what the sync changes crosses the conditional; everything in it is
    # already in memory (the updated params are the step's output), so a step
    # that does not sync pays nothing for it.
    keeps = at_sync == "keep"
    params, g, start, v, inner_state = lax.cond(
        applied & state.synced,
        sync,
        lambda operands: operands,
        (params, g, start, state.velocity, None if keeps else state.inner_state),
    )
    return params, state._replace(
        global_params=g,
        start=start,
        velocity=v,
        inner_state=state.inner_state if keeps else inner_state,
    )


def _sync_dropping(operands, *, inner, axis_name, eta, options):
    """The block sync with `on_bad_replica="drop"`: invalid replicas left out.

    Each replica's validity bit (finite params, within `bad_replica_max_norm`
    of the block start) multiplies its contribution, and the bit rides as one
    more float32 leaf in the same all-reduce: the mean of the contributions
    divided by the mean of the bits is the valid replicas' mean. With every
    replica valid the divisor is exactly 1, so the result is the plain mean.
    """
    params, g, start, v, inner_state, dropped = operands
    stores_start, at_sync = options.stores_start, options.inner_state_at_sync
    ref = start if stores_start else g
    valid = _replica_valid(params, ref, options.bad_replica_max_norm)
    num = _collectives.axis_size(axis_name, "jdp.bmuf")
    masked = _float_map(lambda x: jnp.where(valid, x, jnp.zeros_like(x)), params)
    total, share = _mean((masked, valid.astype(jnp.float32)), axis_name)
    any_valid = share > 0
    avg = _float_map(lambda x: (x / share).astype(x.dtype), total)
    new = _block_update(
        g,
        start,
        v,
        avg,
        eta,
        options.block_learning_rate,
        options.nesterov,
        options.outer,
    )
    # No valid replica: the block update is skipped, the previous model kept.
    g, start, v = jax.tree.map(
        lambda n, o: jnp.where(any_valid, n, o), new, (g, start, v)
    )
    target = start if stores_start else g
    initial = inner.init(target)
    if at_sync == "average":
        kept = _float_map(lambda x: jnp.where(valid, x, jnp.zeros_like(x)), inner_state)
        kept = _mean(kept, axis_name)
        kept = _float_map(lambda x: (x / share).astype(x.dtype), kept)
        inner_state = jax.tree.map(
            lambda k, i: jnp.where(any_valid, k, i) if is_float(k) else k,
            kept,
            _reset(inner_state, initial),
        )
    elif at_sync == "reset":
        inner_state = _reset(inner_state, initial)
    else:  # a dropped replica's own accumulators may be what went bad
        inner_state = jax.tree.map(
            lambda x, i: jnp.where(valid, x, i) if is_float(x) else x,
            inner_state,
            _reset(inner_state, initial),
        )
    count = jnp.round(share * num).astype(jnp.int32)
    dropped = dropped + (num - count)
    return _cast_like(target, params), g, start, v, inner_state, dropped


def _replica_valid(params, ref, max_norm) -> jax.Array:
    """This replica's validity bit: finite params, within `max_norm` of `ref`."""
    valid = jnp.array(True)
    squares = jnp.zeros((), jnp.float32)
    for x, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        if is_float(x):
            valid &= jnp.all(jnp.isfinite(x))
            if max_norm is not None:
                d = x.astype(jnp.float32) - jnp.asarray(r).astype(jnp.float32)
                squares += jnp.sum(d * d)
    if max_norm is not None:
        valid &= jnp.sqrt(squares) <= max_norm
    return valid


def _merge_streaming(params, old_state, state, *, inner, axis, options):
    """The fragment syncs of Streaming DiLoCo (`fragments`, `delay`, `mix`).

    Same arguments and results as `_merge`. Counting the updates after warmup
    from 1, with `P = sync_period // fragments` and `τ = delay`, update `n`:

    1. all-reduces chunk `j` of the fragment in flight, if `n` is one of the `τ`
       updates that end at that fragment's sync: the chunk of the state's
       `pending` buffer (this replica's snapshot, taken `τ` updates earlier)
       becomes the replicas' mean; the operand comes from the state, never from
       this step's gradients;
    2. syncs fragment `(n // P - 1) mod fragments` if `P` divides `n`: the outer
       update of its slices of `g` (and `start`, `v` or its outer state), then
       its local slices become `lerp(target, local, mix)`;
    3. with `τ >= 1`, snapshots the local slices of the fragment whose sync
       falls `τ` updates later into `pending`.

    Each is a `lax.cond` per fragment or chunk on int32 counters, over the
    leaves it touches alone: one compiled step, which copies nothing when
    nothing is due.
    """
    fragments, delay = options.fragments, options.delay
    stores_start, outer = options.stores_start, options.outer
    at_sync, warmup_steps = options.inner_state_at_sync, options.warmup_steps
    period = options.sync_period // fragments
    axis_name = _collectives.resolve_axis(axis)
    eta = _eta(axis_name, options.block_momentum)
    plan = _plan(params, fragments, delay)
    treedef = jax.tree.structure(params)
    flat, tree = jax.tree.leaves, functools.partial(jax.tree.unflatten, treedef)
    applied = state.count != old_state.count  # not an accumulation micro-step
    g, start, pending = state.global_params, state.start, state.pending
    if warmup_steps:

        def follow_replicas(operands):
            params, g, _, pending = operands
            g = _cast_like(params, g)
            pending = None if pending is None else _cast_like(params, pending)
            return g, (g if stores_start else None), pending

        g, start, pending = lax.cond(
            applied & (old_state.count < warmup_steps),
            follow_replicas,
            lambda operands: operands[1:],
            (params, g, start, pending),
        )
    active = applied & (old_state.count >= warmup_steps)
    n = state.count - warmup_steps  # this update's number, from 1 after warmup
    phase = (n - 1) % period + 1  # 1 .. period; `period`: a sync step
    fragment = ((n - 1) // period) % fragments  # whose sync ends this window

    p_leaves, g_leaves = flat(params), flat(g)
    s_leaves = flat(start) if stores_start else None
    v_leaves = flat(state.velocity) if outer is None else None
    velocity = state.velocity
    pend = flat(pending) if delay else None
    wire = options.wire

    if delay:  # 1. One chunk of the fragment in flight, from the state.
        in_flight = active & (phase > period - delay)
        chunk = fragment * delay + (phase - (period - delay) - 1)
        pend, ref = _reduce_chunks(
            in_flight, chunk, plan, pend, s_leaves if stores_start else g_leaves,
            axis_name, wire,
        )  # fmt: skip
        if stores_start:
            s_leaves = ref
        else:
            g_leaves = ref

    # 2. The sync of one fragment.
    keeps = at_sync == "keep"
    is_sync = active & (phase == period)
    leaves = (p_leaves, g_leaves, s_leaves, v_leaves, pend)
    (p_leaves, g_leaves, s_leaves, v_leaves, pend), velocity, inner_state = (
        _sync_fragments(
            [is_sync & (fragment == f) for f in range(fragments)], plan, leaves,
            velocity, None if keeps else state.inner_state, tree,
            inner=inner, eta=eta, axis_name=axis_name, options=options,
        )
    )  # fmt: skip
    params, g = tree(p_leaves), tree(g_leaves)
    start = tree(s_leaves) if stores_start else None
    v = tree(v_leaves) if outer is None else velocity

    if delay:  # 3. The fragment whose sync is `delay` updates ahead.
        ahead = n + delay
        due = active & (ahead % period == 0)
        pend = _snapshots(due, (ahead // period - 1) % fragments, plan, pend, p_leaves)
        pending = tree(pend)
    return params, state._replace(
        global_params=g,
        start=start,
        velocity=v,
        inner_state=state.inner_state if keeps else inner_state,
        pending=pending,
    )


def _sync_fragments(dues, plan, leaves, velocity, inner_state, tree, *,
                    inner, eta, axis_name, options):  # fmt: skip
    """The sync of the fragment `f` whose `dues[f]` holds (at most one).

    `leaves` are the flat leaf lists `(params, g, start, v, pending)` (None
    where the state has none); returns them updated, with the outer states
    (`velocity` with `outer=`) and the inner state (None unless
    `inner_state_at_sync` acts on it).

    Each fragment's sync is two conditionals: the first computes its outer
    step (`v`, or with `outer=` its new `g`), the second writes `g`, `start`
    and the local params from it. Each buffer is then updated in place by a
    conditional ordered (through what it reads) after every other reader of its
    old value, so XLA copies nothing, and a step without a sync does nothing
    (with `nesterov=True` and no `outer=`, XLA still copies a leaf per fragment
    there).
    """
    p_leaves, g_leaves, s_leaves, v_leaves, pend = leaves
    delay, alpha, wire, outer = options.delay, options.mix, options.wire, options.outer
    stores_start, at_sync = options.stores_start, options.inner_state_at_sync
    keeps = at_sync == "keep"

    def adopt(pieces, local, target, inner_state):
        local_f, new = _take(local, pieces), _take(target, pieces)
        if alpha:  # torchft's `lerp(target, local, alpha)`
            new = _float_map(
                lambda t, x: t + alpha * (x.astype(t.dtype) - t), new, local_f
            )
        if not keeps:  # one fragment: every leaf with elements is in it
            inner_state = _inner_state_at_sync(
                inner_state, tree(_put(target, pieces, new)), inner, at_sync,
                axis_name,
            )  # fmt: skip
        return _put(local, pieces, _cast_like(new, local_f)), inner_state

    for f, pieces in enumerate(plan.fragments):
        due = dues[f]
        source = pend if delay else p_leaves  # what the replicas average
        if outer is not None:

            def outer_update(pieces, written, read, extra):
                local, g = written
                (source,) = read
                state_f, inner_state = extra
                g_f = _take(g, pieces)
                avg = _take(source, pieces) if delay else _average_params(
                    _take(source, pieces), g_f, axis_name, wire
                )  # fmt: skip
                g_f, _, state_f = _block_update(
                    g_f, None, state_f, avg, eta, 1.0, False, outer
                )
                g = _put(g, pieces, g_f)
                local, inner_state = adopt(pieces, local, g, inner_state)
                return [local, g], (state_f, inner_state)

            (p_leaves, g_leaves), (v_f, inner_state) = _when(
                due, pieces, outer_update, [p_leaves, g_leaves], [source],
                (velocity[f], inner_state),
            )  # fmt: skip
            velocity = velocity[:f] + (v_f,) + velocity[f + 1 :]
            continue

        def velocity_update(pieces, written, read, extra):
            (v,), (ref, source) = written, read
            ref_f = _take(ref, pieces)
            avg = _take(source, pieces) if delay else _average_params(
                _take(source, pieces), ref_f, axis_name, wire
            )  # fmt: skip
            v_f = _float_map(
                lambda v, a, s: eta * v + options.block_learning_rate * (a - s),
                _take(v, pieces), avg, ref_f,
            )  # fmt: skip
            return [_put(v, pieces, v_f)], extra

        def global_update(pieces, written, read, inner_state):
            local, g, start = written
            (v,) = read
            v_f = _take(v, pieces)
            g_f = _float_map(lambda g, v: g + v, _take(g, pieces), v_f)
            g = _put(g, pieces, g_f)
            if stores_start:
                s_f = _lookahead(g_f, v_f, eta)
                start = _put(start, pieces, _cast_like(s_f, _take(start, pieces)))
            local, inner_state = adopt(
                pieces, local, start if stores_start else g, inner_state
            )
            return [local, g, start], inner_state

        (v_leaves,), _ = _when(
            due, pieces, velocity_update, [v_leaves],
            [s_leaves if stores_start else g_leaves, source],
        )  # fmt: skip
        (p_leaves, g_leaves, s_leaves), inner_state = _when(
            due, pieces, global_update, [p_leaves, g_leaves, s_leaves], [v_leaves],
            inner_state,
        )  # fmt: skip
    return (p_leaves, g_leaves, s_leaves, v_leaves, pend), velocity, inner_state


def _reduce_chunks(in_flight, chunk, plan, pending, ref, axis_name, wire):
    """`pending` (flat leaves) with chunk number `chunk` averaged, if `in_flight`.

    Returns `(pending, ref)`. Only a `wire` format reads `ref` (the block
    start); it then passes through the conditionals unchanged, which orders
    them before the sync that writes it (a buffer read beside the chain that
    updates it in place would be copied on every step).
    """

    def reduce(pieces, written, read, extra):
        pending, ref = written
        avg = _average_params(
            _take(pending, pieces),
            None if ref is None else _take(ref, pieces),
            axis_name,
            wire,
        )
        return [_put(pending, pieces, avg), ref], extra

    delay = len(plan.chunks[0])
    through = ref if wire is not None else None
    for f, chunks in enumerate(plan.chunks):
        for j, pieces in enumerate(chunks):
            if not pieces:  # a fragment of fewer rows than `delay`
                continue
            due = in_flight & (chunk == f * delay + j)
            (pending, through), _ = _when(due, pieces, reduce, [pending, through], [])
    return pending, (ref if wire is None else through)


def _snapshots(due, which, plan, pending, local):
    """`pending` (flat leaves) with fragment `which` copied from `local`, if `due`."""

    def snapshot(pieces, written, read, extra):
        (pending,), (local,) = written, read
        taken = _cast_like(_take(local, pieces), _take(pending, pieces))
        return [_put(pending, pieces, taken)], extra

    for f, pieces in enumerate(plan.fragments):
        (pending,), _ = _when(due & (which == f), pieces, snapshot, [pending], [local])
    return pending


def _when(pred, pieces, fn, written, read, extra=None):
    """`fn` under a `lax.cond` on the leaves that `pieces` touch, else nothing.

    `written` and `read` are lists of flat leaf lists (or None); only the leaves
    the pieces touch cross the conditional, so that XLA can update them in place
    and a step that does not take it copies nothing.
    `fn(pieces, written, read, extra) -> (written, extra)` sees those leaves
    alone, the pieces renumbered to match.

    Returns:
      `(written, extra)`: the lists with the touched leaves replaced.
    """
    ids = sorted({p.leaf for p in pieces})
    where = {leaf: i for i, leaf in enumerate(ids)}
    local = tuple(p._replace(leaf=where[p.leaf]) for p in pieces)

    def sub(trees):
        return [None if t is None else [t[i] for i in ids] for t in trees]

    with jax.named_scope(f"bmuf_{fn.__name__}"):  # names it in profiles and HLO
        new, extra = lax.cond(
            pred,
            lambda ops: fn(local, ops[0], ops[1], ops[2]),
            lambda ops: (ops[0], ops[2]),
            (sub(written), sub(read), extra),
        )
    out = []
    for t, leaves in zip(written, new, strict=True):
        if t is not None:
            t = list(t)
            for i, x in zip(ids, leaves, strict=True):
                t[i] = x
        out.append(t)
    return out, extra


class _Piece(NamedTuple):
    """Rows `start:stop` (first axis) of leaf number `leaf`; `whole`: all of it."""

    leaf: int
    start: int
    stop: int
    whole: bool


class _Plan(NamedTuple):
    """The fragments (tuples of pieces) and, per fragment, its `delay` chunks."""

    fragments: tuple[tuple[_Piece, ...], ...]
    chunks: tuple[tuple[tuple[_Piece, ...], ...], ...]


def _plan(params: PyTree, fragments: int, delay: int) -> _Plan:
    """The split of `params` into fragments and chunks: a function of the shapes."""
    shapes = tuple(
        (tuple(jnp.shape(x)), jnp.dtype(jnp.result_type(x)).itemsize)
        for x in jax.tree.leaves(params)
    )
    return _plan_of_shapes(shapes, fragments, delay)


@functools.lru_cache(maxsize=64)
def _plan_of_shapes(shapes, fragments: int, delay: int) -> _Plan:
    rows = [shape[0] if shape else 1 for shape, _ in shapes]
    row_bytes = [itemsize * int(math.prod(shape[1:])) for shape, itemsize in shapes]
    pieces = tuple(
        _Piece(i, 0, r, True) for i, r in enumerate(rows) if r and row_bytes[i]
    )
    frags = _split(pieces, rows, row_bytes, fragments)
    empty = [f for f, pieces in enumerate(frags) if not pieces]
    if empty:
        total = sum(rows[p.leaf] for p in pieces)
        raise ValueError(
            f"`jdp.bmuf`: cannot split the parameters into `fragments={fragments}` "
            f"fragments: they have {total} rows (first-axis slices) in all, and "
            f"fragment {empty[0]} would be empty. Use fewer fragments."
        )
    chunks = tuple(_split(f, rows, row_bytes, delay) for f in frags) if delay else ()
    return _Plan(frags, chunks)


def _split(pieces, rows, row_bytes, parts: int) -> tuple[tuple[_Piece, ...], ...]:
    """`pieces` cut at row boundaries into `parts` runs of nearly equal bytes."""
    total = sum((p.stop - p.start) * row_bytes[p.leaf] for p in pieces)
    cuts = [total * k / parts for k in range(1, parts)] + [math.inf]
    groups: list[list[_Piece]] = [[] for _ in range(parts)]
    offset, group = 0, 0

    def emit(leaf, a, b):
        if b > a:
            groups[group].append(_Piece(leaf, a, b, a == 0 and b == rows[leaf]))

    for p in pieces:
        size = (p.stop - p.start) * row_bytes[p.leaf]
        row = p.start
        while cuts[group] < offset + size:
            cut = p.start + round((cuts[group] - offset) / row_bytes[p.leaf])
            cut = min(max(cut, row), p.stop)
            emit(p.leaf, row, cut)
            row, group = cut, group + 1
        emit(p.leaf, row, p.stop)
        offset += size
    return tuple(tuple(g) for g in groups)


def _take(leaves, pieces) -> list:
    """The pieces' slices of `leaves`, in order."""
    return [
        leaves[p.leaf] if p.whole else leaves[p.leaf][p.start : p.stop] for p in pieces
    ]


def _put(leaves, pieces, values) -> list:
    """`leaves` with the pieces' slices replaced by `values`."""
    leaves = list(leaves)
    for p, value in zip(pieces, values, strict=True):
        x = leaves[p.leaf]
        value = jnp.asarray(value).astype(jnp.result_type(x))
        if p.whole:
            leaves[p.leaf] = value
        else:
            leaves[p.leaf] = lax.dynamic_update_slice_in_dim(x, value, p.start, 0)
    return leaves


def _average_params(local, ref, axis_name, wire=None):
    """The replicas' mean of their `local` params at a sync: the one place.

    Every block or fragment sync averages the replicas' params here: the block
    sync on the whole tree, a fragment's sync with `delay=0`, and each chunk of
    a delayed one. `ref` (the same structure) is the block start every replica
    began from: with a `wire` format the outer pseudo-gradient `ref - local` is
    what is compressed and averaged (`_wire.mean`), and the result is `ref`
    minus that mean; without one, the params themselves are averaged.
    """
    if wire is None:
        return _mean(local, axis_name)
    pseudo = _float_map(lambda r, x: r - x.astype(r.dtype), ref, local)
    mean, _ = _wire.mean(pseudo, wire=wire, axis_name=axis_name, api="jdp.bmuf")
    return _float_map(lambda r, d: r - d, ref, mean)


def _inner_state_at_sync(inner_state, target, inner, mode, axis_name):
    """`inner`'s state after a sync: reset for the block start `target`, or averaged."""
    if mode == "reset":
        return _reset(inner_state, inner.init(target))
    return _mean(inner_state, axis_name)


def _eta(axis_name, block_momentum):
    """The block momentum: `block_momentum`, or `1 - 1 / num_replicas` for None."""
    num = _collectives.axis_size(axis_name, "jdp.bmuf")
    return 1.0 - 1.0 / num if block_momentum is None else block_momentum


def _block_update(g, start, v, avg, eta, block_learning_rate, nesterov, outer):
    """The block update of a sync step: returns the new `g`, `start` and `v`.

    `avg` is the mean of the replicas' locally updated params; `start` is None
    unless `nesterov` (without `outer`), the block start then being `g`.
    """
    if outer is not None:
        pseudo = _float_map(lambda s, a: s - a, g, avg)
        outer_updates, v = outer.update(pseudo, v, g)
        return _cast_like(optax.apply_updates(g, outer_updates), g), start, v
    v = _float_map(
        lambda v, a, s: eta * v + block_learning_rate * (a - s),
        v,
        avg,
        g if start is None else start,
    )
    g = _float_map(lambda g, v: g + v, g, v)
    if nesterov:
        start = _cast_like(_lookahead(g, v, eta), start)
    return g, start, v


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


def _check_options(inner, sync_period, options: _Options) -> None:
    """`jdp.bmuf`'s argument checks (see its Raises section)."""
    block_learning_rate = options.block_learning_rate
    block_momentum = options.block_momentum
    inner_state_at_sync, outer = options.inner_state_at_sync, options.outer
    _check_transform(inner, "inner")
    _wire.check_wire(options.wire, "jdp.bmuf")
    _validate.positive_int("sync_period", sync_period, note="steps per block")
    _validate.finite_number(
        "block_learning_rate",
        block_learning_rate,
        above=0,
        note="1.0 is the usual setting",
    )
    if block_momentum is not None:
        _validate.finite_number(
            "block_momentum",
            block_momentum,
            at_least=0,
            below=1,
            note="or None for the default 1 - 1 / num_replicas",
        )
    _validate.non_negative_int("warmup_steps", options.warmup_steps)
    _check_streaming(sync_period, options)
    _check_bad_replica(options)
    if inner_state_at_sync not in get_args(InnerStateAtSync):
        raise ValueError(
            "`inner_state_at_sync` must be one of 'keep', 'reset', 'average'; got "
            f"{inner_state_at_sync!r}."
        )
    if outer is not None:
        _check_transform(outer, "outer")
        if block_momentum is not None or options.nesterov or block_learning_rate != 1.0:
            raise ValueError(
                "`outer` replaces the block filter, so `block_learning_rate`, "
                "`block_momentum` and `nesterov` cannot be set with it; fold them "
                "into `outer`, e.g. `outer=optax.sgd(block_learning_rate, "
                "momentum=block_momentum, nesterov=True)`."
            )


def _check_bad_replica(options: _Options) -> None:
    """The checks of `on_bad_replica` and `bad_replica_max_norm`."""
    mode, max_norm = options.on_bad_replica, options.bad_replica_max_norm
    if mode is not None and mode not in get_args(OnBadReplica):
        raise ValueError(
            "`on_bad_replica` must be None (average every replica) or 'drop' "
            f"(leave out replicas whose params are not finite); got {mode!r}."
        )
    if max_norm is not None:
        if mode is None:
            raise ValueError(
                "`bad_replica_max_norm` drops replicas that moved too far, which "
                "needs `on_bad_replica='drop'`: pass both."
            )
        _validate.finite_number(
            "bad_replica_max_norm",
            max_norm,
            above=0,
            note="the largest L2 distance from the block start, or None",
        )
    if mode is None:
        return
    if options.streaming:
        raise ValueError(
            "`on_bad_replica='drop'` is supported for the block sync only: "
            f"got `fragments={options.fragments}`, `delay={options.delay}`, "
            f"`mix={options.mix}`. Use `fragments=1, delay=0, mix=0.0`, or "
            "`on_bad_replica=None`."
        )
    if options.wire is not None:
        raise ValueError(
            "`on_bad_replica='drop'` counts the valid replicas in the params' "
            "all-reduce, which a compressed exchange (`wire=`) does not carry: "
            "use `wire=None` with it, or `on_bad_replica=None`."
        )


def _check_streaming(sync_period: int, options: _Options) -> None:
    """The checks of `fragments`, `delay` and `mix` (Streaming DiLoCo)."""
    fragments, delay, mix = options.fragments, options.delay, options.mix
    _validate.positive_int("fragments", fragments, note="1: the whole model at once")
    _validate.non_negative_int("delay", delay)
    if sync_period % fragments:
        raise ValueError(
            f"`sync_period` ({sync_period}) must be divisible by `fragments` "
            f"({fragments}): one fragment syncs every sync_period / fragments "
            "steps, so that each syncs every `sync_period` steps. Use e.g. "
            f"`sync_period={fragments * max(1, round(sync_period / fragments))}`."
        )
    period = sync_period // fragments
    if delay > period:
        raise ValueError(
            f"`delay` ({delay}) must be at most sync_period / fragments "
            f"({sync_period} / {fragments} = {period}): a fragment's all-reduce "
            "must end before the next fragment's begins."
        )
    mix = _validate.finite_number(
        "mix", mix, at_least=0, note="below 1; 0 discards the delayed local steps"
    )
    if mix >= 1:
        why = (
            "each replica would keep its local fragment entirely, so the replicas "
            "would never sync"
            if mix == 1
            else "it would move each replica away from the synced fragment"
        )
        raise ValueError(
            f"`mix` must be a finite number in [0, 1) (the weight of each "
            f"replica's local params in the merged fragment), got {mix!r}: {why}. "
            "Use a value below 1, e.g. `mix=0.5`, or `mix=0.0` (the default)."
        )
    if fragments > 1 and options.inner_state_at_sync != "keep":
        raise ValueError(
            f"`inner_state_at_sync={options.inner_state_at_sync!r}` acts on the "
            f"whole inner state at once, but with `fragments={fragments}` each "
            "sync merges one fragment: use `inner_state_at_sync='keep'` (as "
            "Streaming DiLoCo does) or `fragments=1`."
        )


def _check_transform(tx: Any, name: str) -> None:
    if not (
        callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))
    ):
        raise TypeError(
            f"`{name}` must be an optax transform (with `init` and `update`), e.g. "
            f"`optax.sgd(0.1, momentum=0.9)`; got {type(tx).__name__}."
        )


def _float_map(fn, tree, *rest):
    """Applies `fn` to floating leaves; other leaves keep `tree`'s value."""
    return jax.tree.map(lambda x, *r: fn(x, *r) if is_float(x) else x, tree, *rest)


def _lookahead(g, v, eta):
    return _float_map(lambda g, v: g + eta * v, g, v)


def _cast_like(tree, like):
    return jax.tree.map(
        lambda x, y: jnp.asarray(x).astype(jnp.result_type(y)), tree, like
    )


def _mean(tree, axis_name):
    """Mean over replicas of the floating leaves (integer leaves pass through)."""
    return _collectives.all_reduce_gradients(tree, axis_name=axis_name, reverse=False)


def _reset(state, initial):
    """Floating leaves from `initial` (accumulators), integer leaves kept (counters)."""
    return jax.tree.map(
        lambda cur, init: jnp.asarray(init).astype(cur.dtype) if is_float(cur) else cur,
        state,
        initial,
    )


def merge_updated(
    params: PyTree, old_opt_state: PyTree, opt_state: PyTree, merges: list[Callable]
) -> tuple[PyTree, PyTree]:
    """The block sync of `jdp.bmuf` on updated params, after a deferred update.

    A train step that applies the optimizer itself passes an empty list as the
    optimizer's extra argument `MERGES_ARG` (optax's extra-args protocol, which
    `optax.chain` and `optax.MultiSteps` forward): `jdp.bmuf`'s update then
    applies `inner` alone and puts its block sync into the list, and the step
    calls this on the params it updated. Inside the optimizer (a hand-written
    step) the same sync runs on params the update has to compute first: a
    larger temporary buffer on every step.

    Args:
      params: The params after `optax.apply_updates`.
      old_opt_state: The optimizer state before the update.
      opt_state: The optimizer state the update returned.
      merges: The list given to the optimizer.

    Returns:
      `(params, opt_state)`: on a step that ends a block, every replica's params
      are exactly the next block's start and the state holds the new global model
      and velocity; otherwise both as given.

    Raises:
      ValueError: If the optimizer holds more than one `jdp.bmuf`.
    """
    if not merges:
        return params, opt_state
    old, new = find_states(old_opt_state), find_states(opt_state)
    if len(new) != 1 or len(old) != 1:
        raise ValueError(
            f"The optimizer contains {len(new)} `jdp.bmuf` states; use one "
            "`jdp.bmuf`, as the last transform of the chain."
        )
    params, merged = merges[-1](params, old[0], new[0])
    is_state = lambda x: isinstance(x, BMUFState)  # noqa: E731
    opt_state = jax.tree.map(
        lambda x: merged if is_state(x) else x, opt_state, is_leaf=is_state
    )
    return params, opt_state


def find_states(tree: PyTree) -> list[BMUFState]:
    """Every `BMUFState` inside `tree` (an optimizer or training state), in order.

    States that flax NNX laid out as mappings (`nnx.state` of an `nnx.Optimizer`)
    are found too and returned as `BMUFState`s of their values.
    """
    return [x for x in _replica_parts.find(tree) if isinstance(x, BMUFState)]
