"""`jdp.metrics.sum` / `gather`, `jdp.replica_key` and the one bound axis name."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import jdp


def test_sum_keeps_integer_counts_exact(backend):
    def eval_step(state, batch):
        return {
            "correct": jdp.metrics.sum(jnp.sum(batch > 2)),
            "seen": jdp.metrics.sum(jnp.ones_like(batch, jnp.bool_).sum()),
            "mean": jnp.mean(batch),
        }

    step = jdp.parallelize(eval_step, backend=backend, devices=jax.devices()[:4])
    out = step(step.replicate({}), step.shard(np.arange(8)))
    assert out["correct"].dtype == jnp.int32 and int(out["correct"]) == 5
    assert int(out["seen"]) == 8
    assert float(out["mean"]) == 3.5


def test_gather_returns_every_example_in_batch_order(backend):
    def predict(state, batch):
        return {"pred": jdp.metrics.gather(batch["x"] * 2), "n": jnp.float32(1)}

    step = jdp.parallelize(predict, backend=backend, devices=jax.devices()[:4])
    x = np.arange(43, dtype=np.float32)  # not a multiple of 4: padded
    batch, mask = step.shard({"x": x}, pad=True)
    out = step(step.replicate({}), batch)
    assert out["pred"].shape == (44,)
    kept = np.asarray(out["pred"])[np.asarray(mask).reshape(-1)]
    np.testing.assert_array_equal(kept, 2 * x)


def test_gather_of_a_scalar_gives_one_value_per_replica():
    step = jdp.parallelize(
        lambda s, b: {"first": jdp.metrics.gather(b[0])}, devices=jax.devices()[:4]
    )
    out = step(step.replicate({}), step.shard(np.arange(8.0)))
    np.testing.assert_array_equal(out["first"], [0.0, 2.0, 4.0, 6.0])


def test_replica_key_differs_per_replica_and_repeats(backend):
    def step_fn(state, batch):
        mask = jax.random.bernoulli(jdp.replica_key(state["key"]), 0.5, (16,))
        return state, {"mask": jdp.metrics.gather(mask[None])}

    def masks(backend):
        step = jdp.parallelize(step_fn, backend=backend, devices=jax.devices()[:4])
        state = step.replicate({"key": jax.random.key(7)})
        return np.asarray(step(state, step.shard(np.zeros(4)))[1]["mask"])

    got = masks(backend)
    assert got.shape == (4, 16)
    assert len({row.tobytes() for row in got}) == 4  # every replica its own mask
    np.testing.assert_array_equal(got, masks("pmap"))  # same on both backends
    np.testing.assert_array_equal(got, masks(backend))  # and on every run


class BN(nn.Module):
    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(4)(x)
        return nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)


def test_one_axis_name_given_to_parallelize_reaches_everything(backend):
    variables = BN().init(jax.random.key(0), jnp.ones((2, 3)), train=False)
    tx = optax.sgd(0.1)

    def loss_fn(params, batch_stats, batch, axis_name="batch"):
        out, upd = BN(axis_name=axis_name).apply(
            {"params": params, "batch_stats": batch_stats},
            batch,
            train=True,
            mutable=["batch_stats"],
        )
        return jnp.mean(out**2), upd["batch_stats"]

    # axis_name only here: make_train_step, sync_batch_stats and BatchNorm use it.
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx), backend=backend, axis_name="batch"
    )
    state = step.replicate(
        jdp.TrainState.create(
            params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
        )
    )
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    state, metrics = step(state, step.shard(x))
    jdp.assert_replicas_in_sync(state)
    # BatchNorm normalised over the global batch: the same as one device on all 16.
    single = jax.jit(lambda p, s: loss_fn(p, s, x, axis_name=None))
    loss, stats = single(variables["params"], variables["batch_stats"])
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    assert_trees_close(step.unreplicate(state).batch_stats, stats, rtol=1e-5)


def test_every_in_step_helper_uses_the_axis_given_to_parallelize(backend):
    """With `axis_name="batch"` given once, to `jdp.parallelize`: the gradient
    all-reduce, broadcast, batch-stats sync, replica keys, metric reductions and
    BMUF all run over it, and give what they give over the default axis."""
    n = 4

    def probe(state, batch):
        key = jdp.replica_key(jax.random.key(0))
        return state, {
            "mean": jdp.all_reduce_gradients({"x": batch})["x"].sum(),
            "root": jdp.broadcast(batch, root=1).sum(),
            "stats": jdp.sync_batch_stats({"s": batch})["s"].sum(),
            "keys": jdp.metrics.gather(jax.random.uniform(key, (1,))),
            "total": jdp.metrics.sum(batch.sum()),
        }

    x = np.arange(8.0, dtype=np.float32)
    results = []
    for axis in ("batch", "data"):
        step = jdp.parallelize(
            probe, devices=jax.devices()[:n], backend=backend, axis_name=axis
        )
        _, metrics = step(step.replicate({}), step.shard(x))
        results.append(jax.tree.map(np.asarray, metrics))
    assert_trees_close(results[0], results[1], rtol=0, atol=0)
    assert float(results[0]["total"]) == x.sum()
    assert len(set(results[0]["keys"].tolist())) == n

    tx = jdp.bmuf(optax.sgd(0.1), sync_period=2)
    train = jdp.make_train_step(
        lambda p, b: jnp.mean((b * p["w"] - 1.0) ** 2), tx, sync=jdp.local()
    )
    step = jdp.parallelize(
        train, devices=jax.devices()[:n], backend=backend, axis_name="batch"
    )
    state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros(())}, tx=tx))
    for _ in range(2):  # the second step syncs the block
        state, _ = step(state, step.shard(x))
    jdp.assert_replicas_in_sync(state.params)


def test_replica_key_outside_a_step_says_so():
    with pytest.raises(RuntimeError, match=r"jdp\.replica_key.*not bound"):
        jdp.replica_key(jax.random.key(0))


# -- metrics of a step with microbatches -------------------------------------------


def _counting_loss(params, batch):
    pred = batch["x"] @ params["w"]
    loss = jnp.mean((pred - batch["y"]) ** 2)
    return loss, {
        "examples": jdp.metrics.sum(jnp.asarray(batch["x"].shape[0], jnp.int32)),
        "abs_error": jdp.metrics.sum(jnp.sum(jnp.abs(pred - batch["y"]))),
        "pred": jdp.metrics.gather(pred[:, 0]),
        "parts": jnp.asarray(1, jnp.int32),
    }


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_microbatch_metrics_are_the_whole_batch(backend, microbatches):
    """Sums over every microbatch and replica, gathers in batch order, the loss
    and a parameter-dependent sum inside the loss's aux (once a JAX tracer
    error) as on the whole batch at once."""
    params = {"w": jnp.arange(6.0).reshape(3, 2) / 10}
    x = np.arange(48.0, dtype=np.float32).reshape(16, 3) / 10
    batch = {"x": x, "y": np.ones((16, 2), np.float32)}
    step = jdp.parallelize(
        jdp.make_train_step(
            _counting_loss, optax.sgd(0.0), has_aux=True, microbatches=microbatches
        ),
        backend=backend,
        devices=jax.devices()[:4],
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=optax.sgd(0.0)))
    _, metrics = step(state, step.shard(batch))
    pred = x @ np.asarray(params["w"])
    assert metrics["examples"].dtype == jnp.int32 and int(metrics["examples"]) == 16
    np.testing.assert_allclose(
        float(metrics["abs_error"]), np.abs(pred - 1).sum(), rtol=1e-5
    )
    np.testing.assert_allclose(np.asarray(metrics["pred"]), pred[:, 0], rtol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), ((pred - 1) ** 2).mean(), 1e-5)
    assert float(metrics["parts"]) == 1.0


def test_a_sum_marked_around_a_step_with_microbatches_sums_them(backend):
    """The aux of the loss unmarked, `jdp.metrics.sum` put on the step's metric by
    a step around it: summed over microbatches and replicas, not their mean."""

    def loss_fn(params, batch):
        real = batch["x"][:, 0] > 0
        loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
        return loss, {"tokens": jnp.sum(real), "frac": jnp.mean(real)}

    tx = optax.sgd(0.1)
    train_step = jdp.make_train_step(loss_fn, tx, has_aux=True, microbatches=2)

    def step_fn(state, batch):
        state, metrics = train_step(state, batch)
        return state, {**metrics, "tokens": jdp.metrics.sum(metrics["tokens"])}

    step = jdp.parallelize(step_fn, backend=backend, devices=jax.devices()[:4])
    state = step.replicate(jdp.TrainState.create(params={"w": jnp.ones(3)}, tx=tx))
    x = np.ones((16, 3), np.float32)
    x[[0, 5, 6, 13], 0] = 0.0  # 12 real rows, spread over the microbatches
    _, metrics = step(state, step.shard({"x": x}))
    assert metrics["tokens"].dtype == jnp.int32 and int(metrics["tokens"]) == 12
    assert float(metrics["frac"]) == 0.75  # unmarked: still the mean


def test_an_unmarked_array_in_the_aux_of_microbatches_is_refused():
    def loss_fn(params, batch):
        pred = batch["x"] @ params["w"]
        return jnp.mean((pred - batch["y"]) ** 2), {"pred": pred}

    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, optax.sgd(0.1), has_aux=True, microbatches=2),
        devices=jax.devices()[:2],
    )
    tx = optax.sgd(0.1)
    state = step.replicate(jdp.TrainState.create(params={"w": jnp.ones((3, 2))}, tx=tx))
    batch = {"x": np.ones((8, 3), np.float32), "y": np.ones((8, 2), np.float32)}
    with pytest.raises(ValueError, match=r"\['pred'\] has shape \(2, 2\).*gather"):
        step(state, step.shard(batch))


def test_batch_statistics_update_once_per_step_with_microbatches(backend):
    """A running average updated by each microbatch from the step's start and
    averaged: the whole batch's update (for equal parts), not k updates."""

    def loss_fn(params, stats, batch):
        loss = jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        mean = jnp.mean(batch["x"], axis=0)
        return loss, {
            "mean": 0.9 * stats["mean"] + 0.1 * mean,
            "calls": stats["calls"] + 1,
        }

    tx = optax.sgd(0.0)
    x = np.arange(48.0, dtype=np.float32).reshape(16, 3)
    batch = {"x": x, "y": np.ones((16, 2), np.float32)}
    results = []
    for k in (1, 4):
        step = jdp.parallelize(
            jdp.make_train_step(loss_fn, tx, microbatches=k),
            backend=backend,
            devices=jax.devices()[:2],
        )
        stats = {"mean": jnp.zeros(3), "calls": jnp.zeros((), jnp.int32)}
        state = jdp.TrainState.create(
            params={"w": jnp.ones((3, 2))}, tx=tx, batch_stats=stats
        )
        state, _ = step(step.replicate(state), step.shard(batch))
        results.append(step.unreplicate(state).batch_stats)
    whole, parts = results
    np.testing.assert_allclose(parts["mean"], 0.1 * x.mean(0), rtol=1e-6)
    np.testing.assert_allclose(parts["mean"], whole["mean"], rtol=1e-6)
    assert int(parts["calls"]) == 4  # integer state carries from part to part


def test_a_value_every_replica_holds_alike_comes_back_exactly(backend):
    values = np.float32([0.1, 1 / 3, 2e-5, 7.123457, 1e-3 * 3])

    def step_fn(state, batch):
        return {f"v{i}": jnp.asarray(v) for i, v in enumerate(values)}

    step = jdp.parallelize(step_fn, backend=backend, devices=jax.devices()[:7])
    out = step(step.replicate({}), step.shard(np.zeros(7)))
    got = np.array([out[f"v{i}"] for i in range(len(values))], np.float32)
    assert got.tobytes() == values.tobytes()


@pytest.mark.parametrize(
    "step_fn, error, match",
    [
        (
            lambda s, b: (s, {"m": jdp.metrics.sum(jdp.metrics.gather(b))}),
            TypeError,
            r"\[.m.\] is marked twice \(a `jdp.metrics.sum` of a `jdp.metrics.gather`",
        ),
        (
            lambda s, b: (s, {"w": jdp.metrics.sum(jdp.weighted(b.sum(), 1.0))}),
            TypeError,
            r"\['w'\] is marked twice .*`jdp.weighted`",
        ),
        (
            lambda s, b: ({"x": jdp.metrics.sum(s["x"])}, {}),
            TypeError,
            r"returned a `jdp.metrics.sum` in its state, at \['x'\]",
        ),
        (
            lambda s, b: (s, {"k": jax.random.key(0)}),
            TypeError,
            r"metric \['k'\] is a PRNG key.*key_data",
        ),
    ],
    ids=["nested", "weighted-in-sum", "marker-in-state", "key"],
)
def test_misused_markers_are_named(step_fn, error, match):
    step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
    with pytest.raises(error, match=match):
        step(step.replicate({"x": jnp.ones(2)}), step.shard(jnp.ones(4)))


def test_gathering_nothing_gives_nothing():
    step = jdp.parallelize(
        lambda s, b: {"g": jdp.metrics.gather(b[:0])}, devices=jax.devices()[:2]
    )
    out = step(step.replicate({}), step.shard(jnp.ones((4, 3))))
    assert out["g"].shape == (0, 3)


def test_sums_of_narrow_integers_do_not_wrap(backend):
    def eval_step(state, batch):
        return {"n": jdp.metrics.sum(jnp.sum(batch, dtype=jnp.uint8))}

    step = jdp.parallelize(eval_step, backend=backend, devices=jax.devices()[:8])
    out = step(step.replicate({}), step.shard(np.full(16, 100, np.uint8)))
    assert int(out["n"]) == 1600 and out["n"].dtype == jnp.int32


def test_low_precision_metrics_are_averaged_in_their_dtype(backend):
    """bfloat16 and float8 values (NumPy kind "V", as structured types) were
    refused as "not numeric": a loss computed in bfloat16 stopped the step."""

    def step_fn(state, batch):
        return {
            "bf16": jnp.mean(batch).astype(jnp.bfloat16),
            "fp8": jnp.mean(batch).astype(jnp.float8_e4m3fn),
            "rows": batch.astype(jnp.bfloat16),
        }

    step = jdp.parallelize(step_fn, backend=backend, devices=jax.devices()[:4])
    out = step(step.replicate({}), step.shard(np.arange(4, dtype=np.float32)))
    assert out["bf16"].dtype == jnp.bfloat16 and float(out["bf16"]) == 1.5
    assert out["fp8"].dtype == jnp.float8_e4m3fn and float(out["fp8"]) == 1.5
    assert out["rows"].dtype == jnp.bfloat16 and float(out["rows"][0]) == 1.5


def test_a_bfloat16_loss_trains_and_is_reported():
    def loss_fn(params, batch):
        pred = batch["x"].astype(jnp.bfloat16) @ params["w"]
        return jnp.mean((pred - batch["y"].astype(jnp.bfloat16)) ** 2)

    tx = optax.sgd(0.1)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:4])
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batch = {"x": np.ones((8, 3), np.float32), "y": np.ones((8,), np.float32)}
    state, metrics = step(state, step.shard(batch))
    assert metrics["loss"].dtype == jnp.bfloat16 and float(metrics["loss"]) == 4.0
    # d/dw_i mean((x . w - y)^2) = 2 (3 - 1) x_i = 4 at w = 1: w = 1 - 0.1 * 4
    np.testing.assert_allclose(
        np.float32(step.unreplicate(state).params["w"]), 0.6, atol=1e-2
    )


def test_a_structured_array_is_still_refused_as_a_metric():
    record = np.zeros(2, dtype=[("a", np.float32), ("b", np.int32)])
    step = jdp.parallelize(lambda s, b: {"r": record}, devices=jax.devices()[:2])
    with pytest.raises(TypeError, match=r"metric \['r'\] is a ndarray"):
        step(step.replicate({}), step.shard(jnp.ones(2)))
