import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    init_mlp,
    linear_loss,
    make_batches,
    mlp_loss,
    single_device_train,
)

import jdp

IN, OUT = 6, 3
LR, MOMENTUM = 0.05, 0.9


# -- a linear model whose gradients numpy can compute -------------------------


def linear_params(seed=0):
    return helpers.linear_params(IN, OUT, seed)


def linear_batches(num_steps, batch_size, seed=1):
    return helpers.teacher_batches(num_steps, batch_size, IN, OUT, seed)


# -- the numpy reference, written from the paper's formulas -------------------


def np_grad(p, x, y):
    d = 2 * (x @ p["w"] + p["b"] - y) / y.size
    return {"w": x.T @ d, "b": d.sum(0)}


def tree(fn, *ts):
    return {k: fn(*(t[k] for t in ts)) for k in ts[0]}


def np_mean(ts):
    return {k: np.mean([t[k] for t in ts], axis=0) for k in ts[0]}


def reference_bmuf(
    params,
    batches,
    *,
    num,
    sync_period,
    block_momentum=None,
    block_learning_rate=1.0,
    nesterov=False,
    inner_state_at_sync="keep",
    warmup_steps=0,
):
    """BMUF on `num` simulated replicas, momentum-SGD inner, in float64."""
    eta = 1 - 1 / num if block_momentum is None else block_momentum
    zeta = block_learning_rate
    p0 = tree(lambda a: np.asarray(a, np.float64), params)
    local = [dict(p0) for _ in range(num)]
    mom = [tree(np.zeros_like, p0) for _ in range(num)]
    g = dict(p0)  # W(t), the global model
    v = tree(np.zeros_like, p0)  # Delta(t)
    start = dict(p0)  # W_g(t-1), where every replica began the block
    for t, batch in enumerate(batches):
        xs = np.split(batch["x"].astype(np.float64), num)
        ys = np.split(batch["y"].astype(np.float64), num)
        grads = [np_grad(local[i], xs[i], ys[i]) for i in range(num)]
        if t < warmup_steps:
            grads = [np_mean(grads)] * num
        for i in range(num):
            mom[i] = tree(lambda gr, m: gr + MOMENTUM * m, grads[i], mom[i])
            local[i] = tree(lambda p, m: p - LR * m, local[i], mom[i])
        if t < warmup_steps:
            g = dict(local[0])
            start = dict(local[0])
            continue
        if (t - warmup_steps + 1) % sync_period:
            continue
        avg = np_mean(local)  # W-bar(t)
        delta = tree(lambda a, s: a - s, avg, start)  # G(t)
        v = tree(lambda v, d: eta * v + zeta * d, v, delta)  # Delta(t)
        g = tree(lambda g, v: g + v, g, v)  # W(t)
        start = tree(lambda g, v: g + eta * v, g, v) if nesterov else dict(g)
        local = [dict(start) for _ in range(num)]
        if inner_state_at_sync == "reset":
            mom = [tree(np.zeros_like, m) for m in mom]
        elif inner_state_at_sync == "average":
            mom = [np_mean(mom)] * num
    stack = lambda ts: {k: np.stack([t[k] for t in ts]) for k in ts[0]}  # noqa: E731
    return stack(local), g, v, stack(mom)


def run_bmuf(params, batches, *, devices, backend="shard_map", **kw):
    tx = jdp.bmuf(optax.sgd(LR, momentum=MOMENTUM), **kw)
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=jdp.local()),
        devices=devices,
        backend=backend,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return step, state


def check_against_reference(state, params, batches, num, **kw):
    want_params, want_g, want_v, want_mom = reference_bmuf(
        params, batches, num=num, **kw
    )
    got = jax.device_get(state)
    bmuf_state = got.opt_state
    # float32 against float64, values of order 1 over about 10 steps with (block)
    # momentum: about 100 float32 ulps of such a value, on any CPU.
    tol = dict(rtol=1e-5, atol=1e-5)
    assert_trees_close(got.params, want_params, **tol)
    for i in range(num):  # g and v are the same on every replica
        assert_trees_close(
            jax.tree.map(lambda x, i=i: x[i], bmuf_state.global_params),
            want_g,
            **tol,
        )
        assert_trees_close(
            jax.tree.map(lambda x, i=i: x[i], bmuf_state.velocity),
            want_v,
            **tol,
        )
    assert_trees_close(bmuf_state.inner_state[0].trace, want_mom, **tol)
    assert int(bmuf_state.count[0]) == len(batches)


#: Each setting in `jdp.bmuf`'s spelling, and the NumPy reference's.
OPTIONS = {
    "default": ({}, {}),
    "nesterov": ({"outer": jdp.block_momentum(nesterov=True)}, {"nesterov": True}),
    "keep": (
        {"inner_state_at_sync": "keep", "outer": jdp.block_momentum(momentum=0.5)},
        {"inner_state_at_sync": "keep", "block_momentum": 0.5},
    ),
    "reset": ({"inner_state_at_sync": "reset"},) * 2,
    "average": ({"inner_state_at_sync": "average"},) * 2,
    "warmup": ({"warmup_steps": 2},) * 2,
    "momentum0": ({"outer": jdp.block_momentum(momentum=0.0)}, {"block_momentum": 0.0}),
    "nesterov_eta_zeta": (
        {"outer": jdp.block_momentum(1.3, 0.6, nesterov=True)},
        {"nesterov": True, "block_momentum": 0.6, "block_learning_rate": 1.3},
    ),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_numpy_reference(option):
    kw, reference = OPTIONS[option]
    sync_period = 3
    # Three blocks, plus one local step so the replicas differ at the end.
    batches = linear_batches(kw.get("warmup_steps", 0) + 3 * sync_period + 1, 16)
    params = linear_params()
    _, state = run_bmuf(
        params, batches, devices=jax.devices()[:4], sync_period=sync_period, **kw
    )
    check_against_reference(
        state, params, batches, num=4, sync_period=sync_period, **reference
    )
    assert not jdp.replicas_in_sync(state.params, atol=1e-4)


def test_matches_numpy_reference_on_every_layout(backend, devices):
    # Two blocks of 2 steps and one more; default block momentum 1 - 1/N.
    batches = linear_batches(5, 16)
    params = linear_params()
    _, state = run_bmuf(
        params, batches, devices=devices, backend=backend, sync_period=2
    )
    check_against_reference(state, params, batches, num=len(devices), sync_period=2)


def test_replicas_merge_on_sync_steps_and_differ_between():
    batches = linear_batches(4, 16)
    step, state = run_bmuf(
        linear_params(), batches[:3], devices=jax.devices()[:4], sync_period=3
    )
    # Just synced: the global model and the params are bit-identical on every
    # replica, and the params are exactly the block start (g, classical momentum).
    jdp.assert_replicas_in_sync(jdp.bmuf_global_params(state))
    jdp.assert_replicas_in_sync(state.params)
    np.testing.assert_array_equal(
        np.asarray(step.unreplicate(state).params["w"]),
        np.asarray(step.unreplicate(jdp.bmuf_global_params(state))["w"]),
    )
    state, _ = step(state, step.shard(batches[3]))
    assert not jdp.replicas_in_sync(state.params, atol=1e-4)


# -- equivalences --------------------------------------------------------------


def test_sync_period_one_model_averaging_is_synchronous_sgd(backend, devices):
    params, batches = linear_params(), linear_batches(3, 16)
    sgd = optax.sgd(0.1)
    bmuf = jdp.bmuf(sgd, 1, outer=jdp.block_momentum(learning_rate=1.0, momentum=0.0))
    step_b = jdp.parallelize(
        jdp.make_train_step(linear_loss, bmuf, sync=jdp.local()),
        devices=devices,
        backend=backend,
    )
    step_s = jdp.parallelize(
        jdp.make_train_step(linear_loss, sgd), devices=devices, backend=backend
    )
    state_b = step_b.replicate(jdp.TrainState.create(params=params, tx=bmuf))
    state_s = step_s.replicate(jdp.TrainState.create(params=params, tx=sgd))
    for batch in batches:  # step for step
        state_b, metrics_b = step_b(state_b, step_b.shard(batch))
        state_s, metrics_s = step_s(state_s, step_s.shard(batch))
        np.testing.assert_allclose(metrics_b["loss"], metrics_s["loss"], rtol=1e-5)
        assert_trees_close(
            step_b.unreplicate(state_b).params,
            step_s.unreplicate(state_s).params,
            rtol=1e-5,
        )
        jdp.assert_replicas_in_sync(state_b.params)


def test_sync_leaves_mlp_replicas_bit_identical(backend):
    """p + (start - p) is not exactly `start` in floats; the step snaps to it."""
    params = init_mlp(jax.random.key(3))
    tx = jdp.bmuf(
        optax.sgd(0.05, momentum=0.9), 2, outer=jdp.block_momentum(nesterov=True)
    )
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), backend=backend
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for i, batch in enumerate(make_batches(4, 32)):
        state, _ = step(state, step.shard(batch))
        assert jdp.replicas_in_sync(state.params) == (i % 2 == 1)
    start = [
        s
        for s in jax.tree.leaves(
            state.opt_state, is_leaf=lambda x: isinstance(x, jdp.BMUFState)
        )
        if isinstance(s, jdp.BMUFState)
    ][0].start
    assert_trees_close(state.params, start, rtol=0, atol=0)


# These compare BMUF with its inner optimizer alone under `jdp.local()`: an
# optimizer that never communicates, on purpose (jdp warns about it elsewhere).
_LOCAL_ALONE = pytest.mark.filterwarnings(
    r"ignore:`jdp.local\(\)` applies the optimizer:UserWarning"
)


@_LOCAL_ALONE
def test_steps_between_syncs_are_the_local_step_bit_for_bit(backend):
    """A plain BMUF step applies `inner` exactly as `sync=jdp.local()` alone does.

    (`jdp.make_train_step` runs the sync after the update, in a conditional that
    takes the updated params: that may not change a bit.)
    """
    params = init_mlp(jax.random.key(4))
    batches = make_batches(5, 32)
    inner = optax.sgd(0.05, momentum=0.9)
    states = []
    for tx in (inner, jdp.bmuf(inner, sync_period=6)):
        step = jdp.parallelize(
            jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), backend=backend
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        for batch in batches:
            state, _ = step(state, step.shard(batch))
        states.append(state)
    local, bmuf = states
    assert not jdp.replicas_in_sync(bmuf.params)
    assert_trees_close(bmuf.params, local.params, rtol=0, atol=0)
    assert_trees_close(bmuf.opt_state.inner_state, local.opt_state, rtol=0, atol=0)


def optax_path_step(state, batch, loss_fn=None):
    """A hand-written step: `tx.update` and `optax.apply_updates`, as flax's
    `TrainState.apply_gradients` does; `jdp.bmuf` then syncs inside the optimizer."""
    grads = jax.grad(loss_fn or linear_loss)(state.params, batch)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), {}


PATH_OPTIONS = {
    **{name: kw for name, (kw, _) in OPTIONS.items()},
    "outer": {"outer": optax.sgd(0.7, momentum=0.9, nesterov=True)},
    "multi_steps": {},
}


@pytest.mark.parametrize("option", list(PATH_OPTIONS))
def test_train_step_and_optax_path_agree(option):
    """`make_train_step` syncs after the update; a hand-written step inside the
    optimizer. Both are the same algorithm (every option, and under MultiSteps)."""
    kw = dict(PATH_OPTIONS[option])
    tx = jdp.bmuf(optax.sgd(LR, momentum=MOMENTUM), sync_period=3, **kw)
    every = 2 if option == "multi_steps" else 1
    if option == "multi_steps":
        tx = optax.MultiSteps(tx, every_k_schedule=every).gradient_transformation()
    # Warmup, four blocks of 3 updates, and one more update.
    batches = linear_batches((kw.get("warmup_steps", 0) + 4 * 3 + 1) * every, 16)
    states = []
    for fn in (jdp.make_train_step(linear_loss, tx, sync=jdp.local()), optax_path_step):
        step = jdp.parallelize(fn, devices=jax.devices()[:4], check_sync=1)
        state = step.replicate(jdp.TrainState.create(params=linear_params(), tx=tx))
        for batch in batches:
            state, _ = step(state, step.shard(batch))
        states.append(state)
    # The runs ended one update after a sync: the replicas differ again.
    assert not jdp.replicas_in_sync(states[0].params, atol=1e-5)
    merged, in_optimizer = jax.device_get(states)
    assert_trees_close(merged.params, in_optimizer.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(merged.opt_state, in_optimizer.opt_state, rtol=1e-5, atol=1e-6)
    assert int(find_bmuf_state(merged.opt_state).count[0]) > 0


def test_gradient_accumulation_keeps_the_block_sync():
    """`microbatches=2` around BMUF: one update per step, the same blocks."""
    tx = jdp.bmuf(optax.sgd(LR, momentum=MOMENTUM), sync_period=3)
    batches = linear_batches(7, 16)
    states = []
    for kw in ({}, {"microbatches": 2}):
        step = jdp.parallelize(
            jdp.make_train_step(linear_loss, tx, sync=jdp.local(), **kw),
            devices=jax.devices()[:4],
        )
        state = step.replicate(jdp.TrainState.create(params=linear_params(), tx=tx))
        for batch in batches:
            state, _ = step(state, step.shard(batch))
        states.append(jax.device_get(state))
    whole, accumulated = states
    assert_trees_close(accumulated.params, whole.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(
        find_bmuf_state(accumulated.opt_state).global_params,
        find_bmuf_state(whole.opt_state).global_params,
        rtol=1e-5,
        atol=1e-6,
    )
    assert int(find_bmuf_state(accumulated.opt_state).count[0]) == len(batches)


@_LOCAL_ALONE
def test_a_step_without_sync_keeps_no_parameter_sized_temporary():
    """The sync runs on the updated params: compiled, a BMUF step needs no more
    temporary memory than the local step (inside the optimizer it holds the
    gradients and the recomputed local params across the conditional: 3x the
    params more)."""
    params = {
        "w1": jnp.full((256, 1024), 0.01, jnp.float32),
        "w2": jnp.full((1024, 4), 0.01, jnp.float32),
    }

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    batch = {"x": np.ones((16, 256), np.float32), "y": np.ones((16, 4), np.float32)}
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    inner = optax.adam(1e-3)
    temp = {}
    for name, tx in [("local", inner), ("bmuf", jdp.bmuf(inner, sync_period=4))]:
        step = jdp.parallelize(
            jdp.make_train_step(loss_fn, tx, sync=jdp.local()),
            devices=jax.devices()[:4],
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        analysis = step.memory_analysis(state, step.shard(batch))
        temp[name] = analysis.temp_bytes
    assert temp["bmuf"] <= temp["local"] + param_bytes // 8, (temp, param_bytes)


def test_one_replica_is_the_inner_optimizer_alone(backend):
    # With one replica the default block momentum is 1 - 1/1 = 0.
    params = init_mlp(jax.random.key(2))
    batches = make_batches(7, 8)
    inner = optax.adam(1e-2)
    tx = jdp.bmuf(inner, sync_period=3)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:1],
        backend=backend,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    want, want_opt = single_device_train(mlp_loss, params, inner, batches)
    got = step.unreplicate(state)
    assert_trees_close(got.params, want, rtol=1e-5)
    assert_trees_close(got.opt_state.inner_state, want_opt, rtol=1e-5)


def run_generic(tx, params, batches, num=4):
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:num],
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return jax.device_get(state)


def test_outer_sgd_momentum_equals_the_block_filter():
    params, batches = linear_params(), linear_batches(10, 16)
    inner = optax.sgd(LR, momentum=MOMENTUM)
    eta, zeta = 0.6, 1.3
    default = run_generic(
        jdp.bmuf(inner, 3, outer=jdp.block_momentum(zeta, momentum=eta)),
        params,
        batches,
    )
    outer = run_generic(
        jdp.bmuf(inner, sync_period=3, outer=optax.sgd(zeta, momentum=eta)),
        params,
        batches,
    )
    assert_trees_close(outer.params, default.params, rtol=1e-5)
    assert_trees_close(
        outer.opt_state.global_params, default.opt_state.global_params, rtol=1e-5
    )
    # optax's trace holds -Delta / zeta.
    assert_trees_close(
        jax.tree.map(lambda m: -zeta * m, outer.opt_state.velocity[0].trace),
        default.opt_state.velocity,
        rtol=1e-5,
        atol=1e-6,
    )


def test_outer_nesterov_sgd_equals_the_papers_nesterov_block_momentum():
    params, batches = linear_params(), linear_batches(10, 16)
    inner = optax.sgd(LR, momentum=MOMENTUM)
    eta = 0.75
    nbm = run_generic(
        jdp.bmuf(inner, 3, outer=jdp.block_momentum(momentum=eta, nesterov=True)),
        params,
        batches,
    )
    outer = run_generic(
        jdp.bmuf(
            inner, sync_period=3, outer=optax.sgd(1.0, momentum=eta, nesterov=True)
        ),
        params,
        batches,
    )
    assert_trees_close(outer.params, nbm.params, rtol=1e-5)
    # The outer optimizer's model is the look-ahead point W(t) + eta * Delta(t).
    lookahead = jax.tree.map(
        lambda g, v: g + eta * v,
        nbm.opt_state.global_params,
        nbm.opt_state.velocity,
    )
    assert_trees_close(outer.opt_state.global_params, lookahead, rtol=1e-5)
    # ... and it differs from classical block momentum.
    cbm = run_generic(
        jdp.bmuf(inner, 3, outer=jdp.block_momentum(momentum=eta)), params, batches
    )
    with pytest.raises(AssertionError):
        assert_trees_close(cbm.params, nbm.params, rtol=1e-3)


def test_composes_in_a_chain_with_clipping():
    params, batches = linear_params(), linear_batches(7, 16)
    sgd = optax.sgd(LR, momentum=MOMENTUM)
    clip = optax.clip_by_global_norm(0.05)
    chained = run_generic(
        optax.chain(clip, jdp.bmuf(sgd, sync_period=3)), params, batches
    )
    inside = run_generic(
        jdp.bmuf(optax.chain(clip, sgd), sync_period=3), params, batches
    )
    unclipped = run_generic(jdp.bmuf(sgd, sync_period=3), params, batches)
    assert_trees_close(chained.params, inside.params, rtol=1e-6)
    assert_trees_close(
        jdp.bmuf_global_params(chained), jdp.bmuf_global_params(inside), rtol=1e-6
    )
    with pytest.raises(AssertionError):  # the clipping really acted
        assert_trees_close(chained.params, unclipped.params, rtol=1e-3)


def test_reset_zeroes_accumulators_and_keeps_counters():
    params = linear_params()
    tx = jdp.bmuf(optax.adam(1e-2), sync_period=3, inner_state_at_sync="reset")
    state = run_generic(tx, params, linear_batches(3, 16))
    adam = state.opt_state.inner_state[0]
    assert np.all(adam.count == 3)  # schedules continue
    for leaf in jax.tree.leaves((adam.mu, adam.nu)):
        np.testing.assert_array_equal(leaf, 0.0)
    state = run_generic(tx, params, linear_batches(4, 16))  # one step later
    assert np.all(state.opt_state.inner_state[0].count == 4)
    assert all(np.any(x != 0) for x in jax.tree.leaves(state.opt_state.inner_state))


@pytest.mark.parametrize("mode", ["reset", "average"])
def test_hyperparameters_held_in_the_state_survive_a_sync(mode):
    """A learning rate set in `optax.inject_hyperparams`' state went back to its
    initial value at every sync with `inner_state_at_sync="reset"`."""
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    tx = jdp.bmuf(inner, sync_period=3, inner_state_at_sync=mode)
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:4],
    )
    state = jdp.TrainState.create(params=linear_params(), tx=tx)
    injected = state.opt_state.inner_state
    hyperparams = dict(injected.hyperparams, learning_rate=jnp.float32(0.5))
    state = state.replace(
        opt_state=state.opt_state._replace(
            inner_state=injected._replace(hyperparams=hyperparams)
        )
    )
    state = step.replicate(state)
    for batch in linear_batches(3, 16):
        state, _ = step(state, step.shard(batch))
    injected = jax.device_get(state.opt_state.inner_state)
    np.testing.assert_array_equal(injected.hyperparams["learning_rate"], 0.5)
    if mode == "reset":  # the moments were reset all the same
        adam = injected.inner_state[0]
        assert all(np.all(x == 0) for x in jax.tree.leaves((adam.mu, adam.nu)))


# -- communication -------------------------------------------------------------


@pytest.mark.parametrize("stage", ["compiled", "lowered"])
def test_parameter_all_reduce_runs_only_in_the_sync_branch(backend, stage):
    params = init_mlp(jax.random.key(0))
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    tx = jdp.bmuf(optax.sgd(0.1, momentum=0.9), sync_period=4)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), backend=backend
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batch = step.shard(make_batches(1, 16)[0])
    ops = step.collectives(state, batch, stage=stage)
    assert {c.kind for c in ops} == {"all-reduce"}
    every_step = [c for c in ops if not c.in_conditional]
    sync_only = [c for c in ops if c.in_conditional]
    # The loss metric only: its sum and replica 0's value (exact when alike).
    assert sum(c.bytes for c in every_step) == 8
    assert sum(c.bytes for c in sync_only) == param_bytes


def test_average_inner_state_all_reduces_it_on_sync_steps_too():
    params = init_mlp(jax.random.key(0))
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    tx = jdp.bmuf(
        optax.sgd(0.1, momentum=0.9), sync_period=4, inner_state_at_sync="average"
    )
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx, sync=jdp.local()))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    ops = step.collectives(state, step.shard(make_batches(1, 16)[0]), stage="lowered")
    assert sum(c.bytes for c in ops if c.in_conditional) == 2 * param_bytes
    assert sum(c.bytes for c in ops if not c.in_conditional) == 8  # the loss


# -- errors and contracts -------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"sync_period": 0}, "`sync_period`"),
        ({"sync_period": 2, "warmup_steps": -1}, "`warmup_steps`"),
        ({"sync_period": 2, "inner_state_at_sync": "zero"}, "`inner_state_at_sync`"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_arguments_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        jdp.bmuf(optax.sgd(0.1), **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"momentum": 1.0}, "`momentum` must be a finite number >= 0 and < 1"),
        ({"momentum": -0.1}, "`momentum`"),
        ({"momentum": float("nan")}, "`momentum`.*got nan"),
        ({"learning_rate": -1.0}, "`learning_rate`"),
        ({"learning_rate": 0.0}, "`learning_rate` must be a finite number > 0"),
        ({"learning_rate": float("inf")}, "finite number > 0"),
        ({"learning_rate": float("nan")}, "got nan"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_block_momentum_names_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        jdp.block_momentum(**kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"learning_rate": "1"}, r"`learning_rate`.*'1' \(a str\)"),
        ({"momentum": [0.5]}, r"`momentum` must be a finite number"),
        ({"nesterov": "yes"}, r"`nesterov` must be True or False, got 'yes'"),
    ],
)
def test_block_momentum_wrong_types_are_type_errors(kw, match):
    with pytest.raises(TypeError, match=match):
        jdp.block_momentum(**kw)


def test_options_must_be_their_values():
    with pytest.raises(TypeError, match=r"`streaming` must be a `jdp.Streaming` or"):
        jdp.bmuf(optax.sgd(0.1), 2, streaming={"fragments": 2})
    with pytest.raises(TypeError, match=r"`average` must be a `jdp.BlockAverage`"):
        jdp.bmuf(optax.sgd(0.1), 2, average=jdp.wire.bf16())
    with pytest.raises(TypeError, match="positional argument"):
        jdp.bmuf(optax.sgd(0.1), 2, optax.sgd(0.7))  # `outer=` is by name


def test_block_momentum_is_an_optax_transform_and_the_default_outer():
    tx = jdp.block_momentum(1.3, momentum=0.6, nesterov=True)
    assert isinstance(tx, optax.GradientTransformation)
    assert (tx.learning_rate, tx.momentum, tx.nesterov) == (1.3, 0.6, True)
    assert "jdp.block_momentum(learning_rate=1.3" in repr(tx)
    # Alone, its update is the block filter on the pseudo-gradient start - avg:
    # v = 0.6 v + 1.3 (avg - start), and (Nesterov) the step v + 0.6 v.
    v = {"w": jnp.array([0.5, -1.0])}
    pseudo = {"w": jnp.array([0.25, 2.0])}
    updates, new_v = tx.update(pseudo, v)
    want = 0.6 * np.array([0.5, -1.0]) + 1.3 * -np.array([0.25, 2.0])
    np.testing.assert_allclose(new_v["w"], want, rtol=1e-6)
    np.testing.assert_allclose(updates["w"], want + 0.6 * want, rtol=1e-6)
    assert jax.tree.map(float, tx.init({"w": 3.0})) == {"w": 0.0}
    # Its default momentum, 1 - 1 / num_replicas, needs the replica axis.
    with pytest.raises(RuntimeError, match="`jdp.block_momentum` needs the replica"):
        jdp.block_momentum().update(pseudo, v)


def test_the_classical_filter_through_the_outer_path_is_bit_identical():
    """`jdp.block_momentum` run as any other `outer=` (its `init` and `update`
    alone) gives the bits of BMUF's own formula (classical block momentum)."""
    params, batches = linear_params(), linear_batches(10, 16)
    inner = optax.sgd(LR, momentum=MOMENTUM)
    classical = jdp.block_momentum(1.3, momentum=0.6)
    generic = optax.GradientTransformation(classical.init, classical.update)
    runs = [
        run_generic(jdp.bmuf(inner, 3, outer=outer), params, batches)
        for outer in (classical, generic)
    ]
    own, through_outer = (jax.device_get(r) for r in runs)
    for got, want in [
        (through_outer.params, own.params),
        (through_outer.opt_state.global_params, own.opt_state.global_params),
        (through_outer.opt_state.velocity, own.opt_state.velocity),
    ]:
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"sync_period": 2.5}, "`sync_period` must be an int"),
        ({"sync_period": True}, "`sync_period` must be an int"),
        ({"warmup_steps": "1"}, "`warmup_steps` must be an int"),
    ],
)
def test_wrong_types_are_type_errors(kw, match):
    with pytest.raises(TypeError, match=match):
        jdp.bmuf(optax.sgd(0.1), **{"sync_period": 2, **kw})


def test_inner_and_outer_must_be_transforms():
    with pytest.raises(TypeError, match="`inner` must be an optax transform"):
        jdp.bmuf(0.1, sync_period=2)
    with pytest.raises(TypeError, match="`outer` must be an optax transform"):
        jdp.bmuf(optax.sgd(0.1), sync_period=2, outer="sgd")


def test_update_needs_params_and_a_bound_axis():
    tx = jdp.bmuf(optax.sgd(0.1), sync_period=2)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs the current parameters"):
        tx.update(params, state)
    with pytest.raises(RuntimeError, match="`jdp.bmuf` needs the replica axis 'data'"):
        tx.update(params, state, params)


def test_all_reducing_train_step_refuses_bmuf_state():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), jdp.bmuf(optax.sgd(0.1), sync_period=2)
    )
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx), devices=jax.devices()[:2]
    )
    state = step.replicate(jdp.TrainState.create(params=linear_params(), tx=tx))
    with pytest.raises(ValueError, match="sync=jdp.local()"):
        step(state, step.shard(linear_batches(1, 4)[0]))


def test_train_step_refuses_two_bmufs_in_one_optimizer():
    inner = optax.sgd(0.1)
    tx = optax.chain(jdp.bmuf(inner, sync_period=2), jdp.bmuf(inner, sync_period=3))
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:2],
    )
    state = step.replicate(jdp.TrainState.create(params=linear_params(), tx=tx))
    with pytest.raises(ValueError, match=r"contains 2 `jdp.bmuf` states; use one"):
        step(state, step.shard(linear_batches(1, 4)[0]))


def find_bmuf_state(state):
    found = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jdp.BMUFState))
        if isinstance(x, jdp.BMUFState)
    ]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("wrapper", ["plain", "multi_steps"])
def test_contract_jittable_and_state_stable(wrapper):
    """Jit under a vmapped replica axis; state structure, shapes, dtypes stable."""
    tx = jdp.bmuf(
        optax.adam(1e-2), sync_period=2, warmup_steps=1, inner_state_at_sync="reset"
    )
    every = 1
    if wrapper == "multi_steps":  # gradient accumulation around BMUF
        every = 2
        tx = optax.MultiSteps(tx, every_k_schedule=every).gradient_transformation()
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2, jnp.bfloat16)}
    num = 3
    stacked = jax.tree.map(lambda x: jnp.stack([x] * num), params)
    state = jax.vmap(tx.init)(stacked)
    count = find_bmuf_state(state).count
    assert count.dtype == jnp.int32 and count.shape == (num,)

    @jax.jit
    def update(grads, state, params):
        def one(g, s, p):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.vmap(one, axis_name="data")(grads, state, params)

    spec = jax.tree.map(lambda x: (x.shape, x.dtype), (stacked, state))
    p = stacked
    for i in range(4):
        # Different gradients on every replica, so the sync has work to do.
        grads = jax.tree.map(
            lambda x, i=i: (
                (x + i)
                * jnp.arange(1.0, num + 1, dtype=x.dtype)[
                    (slice(None),) + (None,) * (x.ndim - 1)
                ]
            ),
            p,
        )
        p, state = update(grads, state, p)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), (p, state)) == spec
    assert int(find_bmuf_state(state).count[0]) == 4 // every
    assert update._cache_size() == 1
    # The last BMUF update was a sync: replicas agree up to float rounding.
    jdp.assert_replicas_in_sync(p, atol=1e-2)
    assert not jdp.replicas_in_sync(grads, atol=1e-2)


def test_global_params_accessor_errors():
    with pytest.raises(ValueError, match="found 0"):
        jdp.bmuf_global_params(optax.sgd(0.1).init({"w": jnp.ones(2)}))
    two = optax.chain(
        jdp.bmuf(optax.sgd(0.1), sync_period=2), jdp.bmuf(optax.sgd(0.1), sync_period=2)
    )
    with pytest.raises(ValueError, match="found 2"):
        jdp.bmuf_global_params(two.init({"w": jnp.ones(2)}))
