"""Dropping a bad replica, against NumPy references: in `jdp.bmuf`'s average
(`average=jdp.BlockAverage(on_bad_replica="drop")`) and in
`jdp.all_reduce(on_bad_replica="drop")`."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp

NUM = 4  # replicas
ROWS = 2  # batch rows per replica
DIM = 5
LR = 0.1


def data_loss(params, batch):
    """A loss whose gradient is the batch: the mean of this replica's rows."""
    return jnp.sum(jnp.mean(batch["g"], axis=0) * params["w"])


def make_grads(num_steps, seed=0, bad=None):
    """Per-step batches `(NUM * ROWS, DIM)`; `bad`: {step: replica} gets a NaN."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(num_steps):
        g = rng.normal(size=(NUM * ROWS, DIM)).astype(np.float32)
        if bad and t in bad:
            g[bad[t] * ROWS, 1] = np.nan
        out.append(g)
    return out


def reference_bmuf(w0, grads, *, sync_period, block_momentum, max_norm=None):
    """BMUF with plain SGD inside, averaging only the valid replicas (float64)."""
    g = np.asarray(w0, np.float64)
    v = np.zeros_like(g)
    local = [g.copy() for _ in range(NUM)]
    dropped = 0
    for t, batch in enumerate(grads):
        for r in range(NUM):
            local[r] = local[r] - LR * batch[r * ROWS : (r + 1) * ROWS].mean(0)
        if (t + 1) % sync_period:
            continue
        valid = [
            np.all(np.isfinite(p))
            and (max_norm is None or np.linalg.norm(p - g) <= max_norm)
            for p in local
        ]
        dropped += NUM - sum(valid)
        if any(valid):
            avg = np.mean([p for p, ok in zip(local, valid, strict=True) if ok], axis=0)
            v = block_momentum * v + (avg - g)
            g = g + v
        local = [g.copy() for _ in range(NUM)]
    return g, dropped


#: Dropping bad replicas, and plain model averaging (block momentum 0).
DROP = jdp.BlockAverage(on_bad_replica="drop")
AVERAGING = jdp.block_momentum(momentum=0.0)


def run_bmuf(backend, grads, **kw):
    tx = jdp.bmuf(optax.sgd(LR), **kw)
    step = jdp.parallelize(
        jdp.make_train_step(data_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:NUM],
        backend=backend,
    )
    w0 = np.linspace(-1, 1, DIM).astype(np.float32)
    state = step.replicate(jdp.TrainState.create(params={"w": w0}, tx=tx))
    for g in grads:
        state, _ = step(state, step.shard({"g": g}))
    return w0, state


@pytest.mark.parametrize("block_momentum", [0.0, 0.5])
def test_bmuf_drops_the_replica_with_a_nan_gradient(backend, block_momentum):
    rng = np.random.default_rng(7)
    sync_period, blocks = 4, 3
    # A NaN at a random step of the second block, in a random replica.
    bad = {int(rng.integers(4, 8)): int(rng.integers(NUM))}
    grads = make_grads(sync_period * blocks, bad=bad)
    w0, state = run_bmuf(
        backend,
        grads,
        sync_period=sync_period,
        outer=jdp.block_momentum(momentum=block_momentum),
        average=DROP,
    )
    params = np.asarray(state.params["w"])
    assert np.all(np.isfinite(params))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
    np.testing.assert_array_equal(params, np.broadcast_to(params[0], params.shape))
    g = np.asarray(jdp.bmuf_global_params(state.opt_state)["w"])
    expected, dropped = reference_bmuf(
        w0, grads, sync_period=sync_period, block_momentum=block_momentum
    )
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(params[0], expected, rtol=1e-5, atol=1e-6)
    assert dropped == 1
    assert np.all(np.asarray(state.opt_state.dropped) == 1)


def test_bmuf_keeps_the_model_when_every_replica_is_bad(backend):
    grads = make_grads(8)
    grads[5][:] = np.nan  # every replica, second block
    w0, state = run_bmuf(
        backend,
        grads,
        sync_period=4,
        outer=jdp.block_momentum(momentum=0.5),
        average=DROP,
    )
    g = np.asarray(jdp.bmuf_global_params(state.opt_state)["w"])
    expected, dropped = reference_bmuf(w0, grads[:4], sync_period=4, block_momentum=0.5)
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.params["w"])[0], expected, rtol=1e-5)
    assert np.all(np.asarray(state.opt_state.dropped) == NUM)


def test_bmuf_drops_a_replica_that_moved_too_far():
    grads = make_grads(4)
    grads[2][3 * ROWS : 4 * ROWS] *= 100.0  # replica 3 jumps, finite
    w0, state = run_bmuf(
        "shard_map",
        grads,
        sync_period=4,
        outer=AVERAGING,
        average=jdp.BlockAverage(on_bad_replica="drop", bad_replica_max_norm=5.0),
    )
    expected, dropped = reference_bmuf(
        w0, grads, sync_period=4, block_momentum=0.0, max_norm=5.0
    )
    assert dropped == 1
    g = np.asarray(jdp.bmuf_global_params(state.opt_state)["w"])
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(state.opt_state.dropped) == 1)


def test_diloco_drops_the_bad_replica():
    grads = make_grads(8, bad={6: 1})
    outer = optax.sgd(1.0)  # the plain filter with momentum 0
    w0, state = run_bmuf("shard_map", grads, sync_period=4, outer=outer, average=DROP)
    expected, _ = reference_bmuf(w0, grads, sync_period=4, block_momentum=0.0)
    g = np.asarray(jdp.bmuf_global_params(state.opt_state)["w"])
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(state.opt_state.dropped) == 1)


def test_bmuf_without_the_option_spreads_the_nan():
    grads = make_grads(4, bad={1: 0})
    _, state = run_bmuf("shard_map", grads, sync_period=4, outer=AVERAGING)
    assert np.all(np.isnan(np.asarray(state.params["w"])[:, 1]))
    assert state.opt_state.dropped is None


def collectives(tx, sync, stage="compiled", **kw):
    step = jdp.parallelize(
        jdp.make_train_step(data_loss, tx, sync=sync, **kw),
        devices=jax.devices()[:NUM],
    )
    params = {"w": jnp.zeros(DIM)}
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    return step.collectives(state, step.shard({"g": make_grads(1)[0]}), stage=stage)


def test_bmuf_count_rides_in_the_parameter_all_reduce():
    plain = collectives(jdp.bmuf(optax.sgd(LR), sync_period=4), jdp.local())
    tx = jdp.bmuf(optax.sgd(LR), sync_period=4, average=DROP)
    drop = collectives(tx, jdp.local())
    assert len(drop) == len(plain)
    synced = [c for c in drop if c.in_conditional]
    assert len(synced) == 1
    assert synced[0].bytes == sum(c.bytes for c in plain if c.in_conditional) + 4


def test_all_reduce_count_rides_in_the_gradient_all_reduce():
    def exchanges(ops):  # the collectives that carry the gradients
        return [c for c in ops if (DIM,) in c.shapes]

    tx = optax.sgd(LR)
    plain = collectives(tx, jdp.all_reduce())
    skip = collectives(tx, jdp.all_reduce(), skip_nonfinite=True)
    drop = collectives(tx, jdp.all_reduce(on_bad_replica="drop"), skip_nonfinite=True)
    assert len(exchanges(drop)) == len(exchanges(plain)) == 1
    # The count is a scalar of the gradients' all-reduce in the compiled program.
    assert sorted(exchanges(drop)[0].shapes) == [(), (DIM,)]
    # The metrics that depend on the result ("skipped", "dropped_replicas") are
    # computed after it: beside the step's scalar verdict of `skip_nonfinite`,
    # no further collective.
    assert len(drop) == len(skip)
    others = [c for c in drop if c not in exchanges(drop)]
    assert all(set(c.shapes) == {()} for c in others)


# -- the synchronous path --------------------------------------------------------


def run_all_reduce(backend, grads, skip_nonfinite=False, **kw):
    tx = optax.sgd(LR)
    sync = jdp.all_reduce(**kw)
    step = jdp.parallelize(
        jdp.make_train_step(data_loss, tx, sync=sync, skip_nonfinite=skip_nonfinite),
        devices=jax.devices()[:NUM],
        backend=backend,
    )
    w0 = np.linspace(-1, 1, DIM).astype(np.float32)
    state = step.replicate(jdp.TrainState.create(params={"w": w0}, tx=tx))
    state, metrics = step(state, step.shard({"g": grads}))
    return w0, step.unreplicate(state), step.unreplicate(metrics)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_all_reduce_averages_the_finite_replicas(backend, skip_nonfinite):
    (grads,) = make_grads(1, bad={0: 2})
    w0, state, metrics = run_all_reduce(
        backend, grads, on_bad_replica="drop", skip_nonfinite=skip_nonfinite
    )
    per_replica = grads.reshape(NUM, ROWS, DIM).mean(1)
    expected = w0 - LR * np.mean(np.delete(per_replica, 2, axis=0), axis=0)
    np.testing.assert_allclose(state.params["w"], expected, rtol=1e-6, atol=1e-7)
    assert int(metrics["dropped_replicas"]) == 1
    assert int(metrics.get("skipped", 0)) == 0
    assert ("skipped" in metrics) == skip_nonfinite
    assert int(state.skipped_steps) == 0


def test_all_reduce_reports_the_loss_of_the_kept_replicas(backend):
    (grads,) = make_grads(1, bad={0: 2})
    w0, _, metrics = run_all_reduce(backend, grads, on_bad_replica="drop")
    per_replica = grads.reshape(NUM, ROWS, DIM).mean(1).astype(np.float64) @ w0
    expected = np.mean(np.delete(per_replica, 2))  # replica 2's loss is NaN
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-6)
    assert sorted(metrics) == ["dropped_replicas", "loss"]


def test_all_reduce_drops_the_bad_replicas_weight_too():
    # A weighted loss on 8 replicas of weights 1..8; replica 2's gradient is NaN.
    num, bad = 8, 2
    rng = np.random.default_rng(3)
    g = rng.normal(size=(num * ROWS, DIM)).astype(np.float32)
    g[bad * ROWS, 1] = np.nan
    m = np.repeat(np.arange(1, num + 1, dtype=np.float32) / ROWS, ROWS)

    def weighted_loss(params, batch):
        total = jnp.sum(batch["m"][:, None] * batch["g"] * params["w"])
        return jdp.weighted(total, jnp.sum(batch["m"]))

    tx = optax.sgd(LR)
    sync = jdp.all_reduce(on_bad_replica="drop")
    step = jdp.parallelize(
        jdp.make_train_step(weighted_loss, tx, sync=sync),
        devices=jax.devices()[:num],
    )
    w0 = np.linspace(-1, 1, DIM).astype(np.float32)
    state = step.replicate(jdp.TrainState.create(params={"w": w0}, tx=tx))
    state, metrics = step(state, step.shard({"g": g, "m": m}))
    kept = np.arange(num * ROWS) // ROWS != bad
    g64, m64 = g[kept].astype(np.float64), m[kept].astype(np.float64)
    expected = w0 - LR * (m64[:, None] * g64).sum(0) / m64.sum()
    got = step.unreplicate(state).params["w"]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert int(step.unreplicate(metrics)["dropped_replicas"]) == 1
    # The loss: the kept replicas' totals over their weights.
    total = (m64[:, None] * g64 * w0.astype(np.float64)).sum()
    np.testing.assert_allclose(float(metrics["loss"]), total / m64.sum(), rtol=1e-5)


def test_all_reduce_with_every_replica_valid_is_the_plain_mean(backend):
    (grads,) = make_grads(1)
    _, plain, _ = run_all_reduce(backend, grads)
    _, drop, metrics = run_all_reduce(backend, grads, on_bad_replica="drop")
    np.testing.assert_array_equal(drop.params["w"], plain.params["w"])
    assert int(metrics["dropped_replicas"]) == 0


def test_all_reduce_skips_the_step_when_every_replica_is_bad(backend):
    (grads,) = make_grads(1)
    grads[::ROWS, 0] = np.inf
    w0, state, metrics = run_all_reduce(
        backend, grads, on_bad_replica="drop", skip_nonfinite=True
    )
    np.testing.assert_array_equal(state.params["w"], w0)
    assert int(metrics["dropped_replicas"]) == NUM
    assert int(metrics["skipped"]) == 1
    assert int(state.skipped_steps) == 1
    # Without the step's `skip_nonfinite`, no replica left is a NaN average,
    # as documented: nothing is silently applied as if it were a gradient.
    _, state, metrics = run_all_reduce(backend, grads, on_bad_replica="drop")
    assert np.isnan(state.params["w"]).all()
    assert int(metrics["dropped_replicas"]) == NUM


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"on_bad_replica": "skip"}, "`on_bad_replica` must be None .* got 'skip'"),
        ({"bad_replica_max_norm": 1.0}, "needs `on_bad_replica='drop'`"),
        (
            {"on_bad_replica": "drop", "bad_replica_max_norm": 0.0},
            "`bad_replica_max_norm` must be a finite number > 0",
        ),
        (
            {"on_bad_replica": "drop", "bad_replica_max_norm": -1.0},
            "`bad_replica_max_norm` must be a finite number > 0",
        ),
        (
            {"on_bad_replica": "drop", "wire": jdp.wire.bf16()},
            r"use `jdp.BlockAverage\(wire=None, on_bad_replica='drop'\)`",
        ),
    ],
)
def test_a_bad_block_average_names_its_field(kw, match):
    with pytest.raises(ValueError, match=match):
        jdp.BlockAverage(**kw)


@pytest.mark.parametrize(
    "streaming, match",
    [
        (jdp.Streaming(fragments=2), "block sync only.*fragments=2"),
        (jdp.Streaming(delay=1), "block sync only.*delay=1.*Use `streaming=None`"),
    ],
)
def test_bmuf_refuses_dropping_with_a_streaming_schedule(streaming, match):
    with pytest.raises(ValueError, match=match):
        jdp.bmuf(optax.sgd(LR), 4, streaming=streaming, average=DROP)


def test_all_reduce_refuses_bad_options():
    with pytest.raises(ValueError, match="`on_bad_replica` must be None .* 'all'"):
        jdp.all_reduce(on_bad_replica="all")
    with pytest.raises(ValueError, match="use `wire=None` with it"):
        jdp.all_reduce(on_bad_replica="drop", wire=jdp.wire.int8())


@pytest.mark.parametrize("inner_state_at_sync", ["keep", "reset", "average"])
def test_a_dropped_replica_restarts_with_a_clean_inner_state(inner_state_at_sync):
    # With momentum, the bad replica's accumulator turns NaN too: unless it is
    # reset (or replaced by the valid replicas' mean), the replica would be bad
    # again in the next block and be dropped a second time.
    tx = jdp.bmuf(
        optax.sgd(LR, momentum=0.9),
        sync_period=4,
        outer=AVERAGING,
        inner_state_at_sync=inner_state_at_sync,
        average=DROP,
    )
    step = jdp.parallelize(
        jdp.make_train_step(data_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:NUM],
    )
    state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros(DIM)}, tx=tx))
    for g in make_grads(12, bad={1: 2}):
        state, _ = step(state, step.shard({"g": g}))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
    assert np.all(np.asarray(state.opt_state.dropped) == 1)
    params = np.asarray(state.params["w"])
    np.testing.assert_array_equal(params, np.broadcast_to(params[0], params.shape))


def test_loss_scaling_backs_off_for_a_dropped_replica_too():
    """A replica whose float16 gradients overflow only at the loss scale was
    dropped at every step: nothing was skipped, so the scale never backed off
    and the replica's data never trained."""
    from flax.training.dynamic_scale import DynamicScale

    x = np.ones((8, 4), np.float32)
    x[6:] *= 100.0  # replica 3 of 4: larger, float16-safe, activations

    def loss(p, b):  # float16 compute, float32 params
        y = b.astype(jnp.float16) @ p["w"].astype(jnp.float16)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    tx = optax.sgd(1e-6)
    sync = jdp.all_reduce(on_bad_replica="drop")
    step = jdp.parallelize(
        jdp.make_train_step(loss, tx, sync=sync), devices=jax.devices()[:4]
    )
    params = {"w": np.full((4, 1), 0.05, np.float32)}
    state = step.replicate(
        jdp.TrainState.create(params=params, tx=tx, dynamic_scale=DynamicScale())
    )
    dropped = []
    for _ in range(16):
        state, metrics = step(state, step.shard(x))
        dropped.append(float(metrics["dropped_replicas"]))
    assert dropped[0] == 1.0 and dropped[-1] == 0.0, dropped
    assert float(step.unreplicate(state).dynamic_scale.scale) < 2.0**16


DROP_COUNT_CHILD = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=300"
import jax, jax.numpy as jnp, numpy as np, optax, jdp
data = np.zeros((300, 1), np.float32)
data[0], data[-1] = 150.0, np.nan  # one bad replica
sync = jdp.all_reduce(on_bad_replica="drop", reduce_dtype=jnp.bfloat16)
tx = optax.sgd(1.0)
step = jdp.parallelize(
    jdp.make_train_step(lambda p, b: jnp.mean(b) * p["w"][0], tx, sync=sync)
)
state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros(1)}, tx=tx))
state, metrics = step(state, step.shard(data))
print(float(metrics["dropped_replicas"]), float(step.unreplicate(state).params["w"][0]))
"""


def test_the_kept_replicas_are_counted_exactly_with_a_narrow_wire():
    """With `reduce_dtype=jnp.bfloat16` the validity bits travelled as 1/N in
    bfloat16: above 256 replicas a dropped one was not counted (299/300 rounds
    to 1) and the mean was over all of them."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run(
        [sys.executable, "-c", DROP_COUNT_CHILD],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    dropped, w = map(float, out.stdout.split())
    assert dropped == 1.0
    np.testing.assert_allclose(w, -150.0 / 299, rtol=1e-6)


def test_a_hand_written_step_drops_the_bad_replica_too():
    tx = jdp.bmuf(optax.sgd(LR), sync_period=4, outer=AVERAGING, average=DROP)

    def train_step(state, batch):
        grads = jax.grad(data_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {}

    step = jdp.parallelize(train_step, devices=jax.devices()[:NUM])
    w0 = np.linspace(-1, 1, DIM).astype(np.float32)
    state = step.replicate(jdp.TrainState.create(params={"w": w0}, tx=tx))
    grads = make_grads(4, bad={3: 0})
    for g in grads:
        state, _ = step(state, step.shard({"g": g}))
    expected, _ = reference_bmuf(w0, grads, sync_period=4, block_momentum=0.0)
    g = np.asarray(jdp.bmuf_global_params(state.opt_state)["w"])
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(state.params["w"]),
        np.broadcast_to(expected, (NUM, DIM)),
        rtol=1e-5,
        atol=1e-6,
    )
    assert np.all(np.asarray(state.opt_state.dropped) == 1)


def test_the_dropped_count_is_checkpointed_and_agreed(tmp_path):
    from jdp.checkpoint import CheckpointManager

    tx = jdp.bmuf(optax.sgd(LR), sync_period=4, outer=AVERAGING, average=DROP)
    # `check_sync=1`: the divergence guard compares the agreed parts of the
    # state (`dropped` among them) after every call.
    step = jdp.parallelize(
        jdp.make_train_step(data_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:NUM],
        check_sync=1,
    )
    init = jdp.TrainState.create(params={"w": jnp.zeros(DIM)}, tx=tx)
    state = step.replicate(init)
    for g in make_grads(4, bad={0: 1}):
        state, _ = step(state, step.shard({"g": g}))
    with CheckpointManager(tmp_path) as manager:
        manager.save(4, state)
        restored = manager.restore(step.replicate(init))
    assert int(step.unreplicate(restored).opt_state.dropped) == 1
    np.testing.assert_array_equal(
        step.unreplicate(restored).params["w"], step.unreplicate(state).params["w"]
    )


@pytest.mark.parametrize(
    "kw", [{"outer": jdp.block_momentum(momentum=0.5, nesterov=True)}, {}]
)
def test_bmuf_with_every_replica_valid_matches_the_plain_sync_bit_for_bit(kw):
    grads = make_grads(8)
    _, plain = run_bmuf("shard_map", grads, sync_period=4, **kw)
    _, drop = run_bmuf("shard_map", grads, sync_period=4, average=DROP, **kw)
    for a, b in zip(
        jax.tree.leaves(plain.opt_state),
        jax.tree.leaves(drop.opt_state)[:-1],
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain.params["w"], drop.params["w"])
    assert np.all(np.asarray(drop.opt_state.dropped) == 0)
