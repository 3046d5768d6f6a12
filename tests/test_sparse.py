import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import jdp

FEATURES = 3  # ids per example


def init_params(seed, num_rows, dim, hidden=16):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.normal(size=shape)).astype(np.float32)

    return {
        "embed": normal(num_rows, dim, scale=0.1),
        "mlp": {
            "w1": normal(FEATURES * dim, hidden, scale=1 / np.sqrt(FEATURES * dim)),
            "b1": np.zeros(hidden, np.float32),
            "w2": normal(hidden, 1, scale=1 / np.sqrt(hidden)),
            "b2": np.zeros(1, np.float32),
        },
    }


def loss_fn(params, batch):
    emb = jdp.sparse.lookup(params["embed"], batch["ids"])  # (B, FEATURES, dim)
    x = emb.reshape(emb.shape[0], -1)
    mlp = params["mlp"]
    h = jnp.tanh(x @ mlp["w1"] + mlp["b1"])
    pred = (h @ mlp["w2"] + mlp["b2"])[:, 0]
    return jnp.mean((pred - batch["y"]) ** 2)


def make_batches(num_steps, batch_size, num_rows, *, seed=0, hot=10):
    """Ids with many repeats: half from `hot` popular rows, half from anywhere."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(num_steps):
        ids = rng.integers(0, num_rows, size=(batch_size, FEATURES))
        popular = rng.random(ids.shape) < 0.5
        ids = np.where(popular, rng.integers(0, hot, size=ids.shape), ids)
        batches.append(
            {
                "ids": ids.astype(np.int32),
                "y": rng.normal(size=batch_size).astype(np.float32),
            }
        )
    return batches


def train(train_step, params, tx, batches, *, backend="shard_map", **kwargs):
    step = jdp.parallelize(train_step, backend=backend, **kwargs)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return step, state


LR = 0.5
BIG_ROWS, BIG_DIM = 100_000, 32


@pytest.fixture(scope="module")
def big_problem():
    params = init_params(0, BIG_ROWS, BIG_DIM)
    batches = make_batches(20, 64, BIG_ROWS)
    step, state = train(
        jdp.make_train_step(loss_fn, optax.sgd(LR)), params, optax.sgd(LR), batches
    )
    return params, batches, step.unreplicate(state).params


@pytest.mark.parametrize("combine", [False, True], ids=["concat", "combine"])
def test_sparse_sgd_matches_dense_sgd_on_a_100k_table(big_problem, combine):
    params, batches, dense = big_problem
    tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": jdp.sparse.sgd(LR)})
    step, state = train(
        jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows(combine=combine)),
        params,
        tx,
        batches,
    )
    jdp.assert_replicas_in_sync(state)
    got = step.unreplicate(state).params
    assert_trees_close(got, dense, rtol=1e-5, atol=1e-7)
    # Non-trivial: the touched rows moved, the others did not.
    touched = np.unique(np.concatenate([b["ids"].ravel() for b in batches]))
    moved = np.flatnonzero(
        np.any(np.asarray(got["embed"]) != np.asarray(params["embed"]), axis=1)
    )
    assert set(moved) <= set(touched) and len(moved) > 0.9 * len(touched)


SMALL_ROWS, SMALL_DIM = 1000, 8


def _small_run(sync, tx, **kwargs):
    """Params after 3 steps of `loss_fn` on a small table, on 4 devices."""
    params = init_params(3, SMALL_ROWS, SMALL_DIM)
    batches = make_batches(3, 16, SMALL_ROWS, seed=3)
    step, state = train(
        jdp.make_train_step(loss_fn, tx, sync=sync, **kwargs),
        params,
        tx,
        batches,
        devices=jax.devices()[:4],
    )
    jdp.assert_replicas_in_sync(state)
    return params, batches, step.unreplicate(state).params


def _row_tx(lr=LR):
    return jdp.sparse.optimizer(optax.sgd(lr), {"embed": jdp.sparse.sgd(lr)})


def test_rows_is_one_label_of_a_partition():
    """Beside `jdp.all_reduce()`: the same params as `jdp.sparse.rows()` alone."""
    _, _, alone = _small_run(jdp.sparse.rows(), _row_tx())
    labels = {"embed": "tables", "mlp": "dense"}
    pieces = {"tables": jdp.sparse.rows(), "dense": jdp.all_reduce()}
    _, _, mixed = _small_run(jdp.partition(labels, pieces), _row_tx())
    assert_trees_close(mixed, alone, rtol=1e-6, atol=1e-7)


def test_a_table_under_another_piece_of_a_partition_gets_its_dense_gradient():
    """The table's rows, densified for `jdp.all_reduce()`, equal the dense path."""
    params, _, dense = _small_run(jdp.all_reduce(), optax.sgd(LR))
    labels = {"embed": "dense", "mlp": "rows"}
    pieces = {"dense": jdp.all_reduce(), "rows": jdp.sparse.rows()}
    _, _, mixed = _small_run(jdp.partition(labels, pieces), _row_tx())
    assert_trees_close(mixed, dense, rtol=1e-5, atol=1e-7)
    assert not np.allclose(mixed["embed"], params["embed"])


def _hand_written_run(piece, params, batches):
    """Params after a step of one's own: `jdp.sparse.value_and_grad`, then `piece`
    through `jdp.sync_gradients` and the row optimizer."""
    grad_fn = jdp.sparse.value_and_grad(loss_fn, ["embed"])

    def hand_written(state, batch):
        loss, grads = grad_fn(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    chained = optax.chain(jdp.sync_gradients(piece), _row_tx())
    step, state = train(
        hand_written, params, chained, batches, devices=jax.devices()[:4]
    )
    return step.unreplicate(state).params


def test_rows_through_sync_gradients_in_a_hand_written_step():
    """`jdp.sparse.value_and_grad` + the adapter: the step `make_train_step` runs."""
    params, batches, expected = _small_run(jdp.sparse.rows(), _row_tx())
    got = _hand_written_run(jdp.sparse.rows(), params, batches)
    assert_trees_close(got, expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(got["embed"], params["embed"])


def test_sparse_adagrad_matches_optax_adagrad():
    params = init_params(1, SMALL_ROWS, SMALL_DIM)
    batches = make_batches(6, 32, SMALL_ROWS, seed=1, hot=4)
    oracle_tx = optax.adagrad(0.3)
    step, state = train(
        jdp.make_train_step(loss_fn, oracle_tx),
        params,
        oracle_tx,
        batches,
        backend="pmap",
    )
    expected = step.unreplicate(state).params
    tx = jdp.sparse.optimizer(optax.adagrad(0.3), {"embed": jdp.sparse.adagrad(0.3)})
    step, state = train(
        jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows()),
        params,
        tx,
        batches,
        backend="pmap",
    )
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5, atol=1e-7)
    acc = np.asarray(step.unreplicate(state).opt_state.tables["embed"].sum_of_squares)
    assert acc.shape == (SMALL_ROWS, SMALL_DIM) and np.count_nonzero(acc != 0.1) > 0
    # The same optimizer under `jdp.make_train_step` (dense table gradients).
    step, state = train(jdp.make_train_step(loss_fn, tx), params, tx, batches)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5, atol=1e-7)
    # No dense optimizer state was allocated for the table.
    assert step.unreplicate(state).opt_state.dense[0].sum_of_squares["embed"] is None


def gather_step(combine):
    def step_fn(state, batch):
        ids, rows = jdp.sparse.all_gather_rows(
            batch["ids"], batch["rows"], combine=combine
        )
        return state, {"ids": ids.astype(jnp.float32), "rows": rows}

    return step_fn


def test_all_gather_rows_concatenates_replicas_in_order():
    devices = jax.devices()[:4]
    ids = np.array([[3, 1], [1, 1], [7, 3], [0, 9]], np.int32)  # 2 ids per replica
    rows = np.arange(8 * 3, dtype=np.float32).reshape(4, 2, 3)
    step = jdp.parallelize(gather_step(False), devices=devices)
    out = step(step.replicate({}), step.shard({"ids": ids, "rows": rows}))[1]
    np.testing.assert_array_equal(out["ids"], ids.ravel())
    np.testing.assert_array_equal(out["rows"], rows.reshape(8, 3))


def test_all_gather_rows_combines_duplicates_within_and_across_replicas():
    devices = jax.devices()[:4]
    ids = np.array([[3, 1], [1, 1], [7, 3], [0, 9]], np.int32)
    rows = np.arange(8 * 3, dtype=np.float32).reshape(4, 2, 3)
    step = jdp.parallelize(gather_step(True), devices=devices)
    out = step(step.replicate({}), step.shard({"ids": ids, "rows": rows}))[1]
    flat_ids, flat_rows = ids.ravel(), rows.reshape(8, 3)
    unique = np.unique(flat_ids)
    expected_rows = np.stack([flat_rows[flat_ids == u].sum(0) for u in unique])
    pad = 8 - len(unique)
    np.testing.assert_array_equal(out["ids"], np.concatenate([unique, [-1] * pad]))
    np.testing.assert_allclose(out["rows"][: len(unique)], expected_rows)
    np.testing.assert_array_equal(out["rows"][len(unique) :], 0)


def test_all_gather_rows_errors():
    with pytest.raises(RuntimeError, match="jdp.sparse.all_gather_rows.*not bound"):
        jdp.sparse.all_gather_rows(jnp.arange(2), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"rows of shape \(3, 4\) do not start"):
        jdp.sparse.combine_rows(jnp.arange(2), jnp.ones((3, 4)))
    with pytest.raises(TypeError, match="ids must be integers"):
        jdp.sparse.combine_rows(jnp.ones(2), jnp.ones((2, 4)))


def test_value_and_grad_rows_scatter_to_the_dense_gradient():
    params = init_params(3, 50, 4)
    batch = make_batches(1, 8, 50, seed=3, hot=3)[0]

    def two_lookups(params, batch):  # the same table read twice
        extra = jdp.sparse.lookup(params["embed"], batch["ids"][:, 0]).sum()
        return loss_fn(params, batch) + 0.1 * extra

    loss, grads = jax.jit(jdp.sparse.value_and_grad(two_lookups, ["embed"]))(
        params, batch
    )
    dense_loss, dense = jax.jit(jax.value_and_grad(two_lookups))(params, batch)
    np.testing.assert_allclose(loss, dense_loss, rtol=1e-6)
    sparse = grads["embed"]
    assert isinstance(sparse, jdp.sparse.IndexedRows)
    assert sparse.ids.shape == (8 * FEATURES + 8,)
    scattered = jnp.zeros_like(params["embed"]).at[sparse.ids].add(sparse.rows)
    np.testing.assert_allclose(scattered, dense["embed"], rtol=1e-5, atol=1e-7)
    assert_trees_close(grads["mlp"], dense["mlp"], rtol=1e-5)


def test_value_and_grad_with_aux_and_nested_table_path():
    params = {"tower": {"emb": jnp.ones((10, 2))}, "w": jnp.ones(2)}

    def fn(p, ids):
        x = jdp.sparse.lookup(p["tower"]["emb"], ids) @ p["w"]
        return x.sum(), {"n": ids.size}

    (loss, aux), grads = jdp.sparse.value_and_grad(
        fn, [("tower", "emb")], has_aux=True
    )(params, jnp.array([1, 1, 4]))
    assert float(loss) == 6.0 and aux["n"] == 3
    np.testing.assert_array_equal(grads["tower"]["emb"].ids, [1, 1, 4])
    np.testing.assert_allclose(grads["tower"]["emb"].rows, np.ones((3, 2)))
    np.testing.assert_allclose(grads["w"], [3.0, 3.0])


def test_value_and_grad_errors():
    params = {"embed": jnp.ones((10, 2)), "w": jnp.ones(2)}
    with pytest.raises(
        ValueError, match=r"(?s)no parameter leaf at table path\(s\) \['emb'\].*embed"
    ):
        jdp.sparse.value_and_grad(lambda p, i: p["w"].sum(), ["emb"])(params, 0)

    def dense_read(p, ids):
        return jnp.take(p["embed"], ids, axis=0).sum()

    with pytest.raises(TypeError, match=r"tables \['embed'\] are trained sparsely"):
        jdp.sparse.value_and_grad(dense_read, ["embed"])(params, jnp.arange(2))
    with pytest.raises(TypeError, match="'embed' is trained sparsely here"):
        jdp.sparse.value_and_grad(lambda p, i: (p["embed"] * 2).sum(), ["embed"])(
            params, 0
        )
    with pytest.raises(TypeError, match="ids must be integers"):
        jdp.sparse.lookup(params["embed"], jnp.ones(2))
    # A table the loss does not read gets an empty gradient, not an error.
    _, grads = jdp.sparse.value_and_grad(lambda p, i: p["w"].sum(), ["embed"])(
        params, 0
    )
    assert grads["embed"].ids.shape == (0,) and grads["embed"].rows.shape == (0, 2)


def test_out_of_range_ids_read_zeros_and_never_update_on_both_paths():
    params = init_params(4, SMALL_ROWS, SMALL_DIM)
    batches = make_batches(3, 16, SMALL_ROWS, seed=4)
    for b in batches:  # keep the last row unused: -1 must not wrap around to it
        b["ids"][b["ids"] == SMALL_ROWS - 1] = 0
    batches[1]["ids"][0, 0] = SMALL_ROWS + 5
    batches[2]["ids"][3, 1] = -1
    rows = jdp.sparse.lookup(params["embed"], jnp.array([SMALL_ROWS, -1, 2]))
    np.testing.assert_array_equal(rows[:2], 0)
    np.testing.assert_array_equal(rows[2], params["embed"][2])
    step, state = train(
        jdp.make_train_step(loss_fn, optax.sgd(LR)), params, optax.sgd(LR), batches
    )
    dense = step.unreplicate(state).params
    tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": jdp.sparse.sgd(LR)})
    step, state = train(
        jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows(combine=True)),
        params,
        tx,
        batches,
    )
    sparse = step.unreplicate(state).params
    assert_trees_close(sparse, dense, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(sparse["embed"][-1], params["embed"][-1])


def test_check_ids_raises_a_clear_error():
    params = init_params(5, SMALL_ROWS, SMALL_DIM)
    good, bad = make_batches(2, 16, SMALL_ROWS, seed=5)
    bad["ids"][2, 0] = SMALL_ROWS + 7
    bad["ids"][9, 2] = -3
    tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": jdp.sparse.sgd(LR)})
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows(check_ids=True)),
        donate_state=False,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    state, _ = step(state, step.shard(good))
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"2 id\(s\) out of range \[0, 1000\) for table 'embed'.*first: 1007",
    ):
        jax.block_until_ready(step(state, step.shard(bad)))
    state, metrics = step(state, step.shard(good))  # the state survived
    assert int(step.unreplicate(state).step) == 2 and np.isfinite(metrics["loss"])


CHECK_THEN_CONTINUE = """
import jax, jax.numpy as jnp, optax, jdp

def loss_fn(params, batch):
    x = jdp.sparse.lookup(params["embed"], batch["ids"]).sum(axis=1)
    return jnp.mean((x @ params["w"] - batch["y"]) ** 2)

tx = jdp.sparse.optimizer(optax.sgd(0.1), {"embed": jdp.sparse.sgd(0.1)})
sync = jdp.sparse.rows(check_ids=True)
step = jdp.parallelize(
    jdp.make_train_step(loss_fn, tx, sync=sync), devices=jax.devices()[:2],
    donate_state=False,
)
params = {"embed": jnp.ones((10, 4)), "w": jnp.ones(4)}
state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
ids = jnp.arange(16).reshape(4, 4)
try:
    _, metrics = step(state, step.shard({"ids": ids + 5, "y": jnp.zeros(4)}))
    float(metrics["loss"])
except jax.errors.JaxRuntimeError as e:
    assert "IdsOutOfRangeError" in str(e)
    print("caught")
state, metrics = step(state, step.shard({"ids": ids % 10, "y": jnp.zeros(4)}))
print("trained on", float(metrics["loss"]))
"""


def test_a_handled_id_error_is_not_reported_again_at_exit():
    """JAX kept the failed step's token and raised its error from its exit
    handlers, twice ("Exception ignored in atexit callback")."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    done = subprocess.run(
        [sys.executable, "-c", CHECK_THEN_CONTINUE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "caught" and lines[1].startswith("trained on"), done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr
    assert "IdsOutOfRangeError" not in done.stderr, done.stderr


def test_sparse_step_communicates_rows_not_the_table():
    rows, dim, batch = 20_000, 16, 64
    params = init_params(6, rows, dim)
    data = make_batches(1, batch, rows)[0]
    tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": jdp.sparse.sgd(LR)})
    sparse_step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows())
    )
    dense_step = jdp.parallelize(jdp.make_train_step(loss_fn, optax.sgd(LR)))
    table_bytes = rows * dim * 4

    def collectives(step, tx):
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        return step.collectives(state, step.shard(data), stage="lowered")

    dense_ops = collectives(dense_step, optax.sgd(LR))
    sparse_ops = collectives(sparse_step, tx)
    assert sum(c.bytes for c in dense_ops if c.kind == "all-reduce") >= table_bytes
    gathers = [c for c in sparse_ops if c.kind == "all-gather"]
    assert sorted(c.bytes for c in gathers) == sorted(
        [batch * FEATURES * 4, batch * FEATURES * dim * 4]
    )
    assert sum(c.bytes for c in sparse_ops) < table_bytes / 20


def test_sparse_step_with_batch_stats_matches_dense():
    params = init_params(7, SMALL_ROWS, SMALL_DIM)
    batches = make_batches(3, 16, SMALL_ROWS, seed=7)

    def stats_loss(params, stats, batch):
        emb = jdp.sparse.lookup(params["embed"], batch["ids"])
        new = {"mean": 0.9 * stats["mean"] + 0.1 * emb.mean(axis=(0, 1))}
        return loss_fn(params, batch), new

    def run(make, tx):
        step = jdp.parallelize(make(stats_loss, tx))
        state = jdp.TrainState.create(
            params=params, tx=tx, batch_stats={"mean": jnp.zeros(SMALL_DIM)}
        )
        state = step.replicate(state)
        for b in batches:
            state, _ = step(state, step.shard(b))
        return step.unreplicate(state)

    tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": jdp.sparse.sgd(LR)})
    got = run(functools.partial(jdp.make_train_step, sync=jdp.sparse.rows()), tx)
    expected = run(jdp.make_train_step, optax.sgd(LR))
    assert_trees_close(got.params, expected.params, rtol=1e-5, atol=1e-7)
    assert_trees_close(got.batch_stats, expected.batch_stats, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted"])
def test_sparse_step_with_microbatches_matches_one_device(weighted):
    # Each microbatch's rows are concatenated, not added to a dense gradient.
    params = init_params(8, SMALL_ROWS, SMALL_DIM)
    batches = make_batches(2, 16, SMALL_ROWS, seed=8, hot=3)

    def weighted_loss(params, batch):
        mask = (batch["y"] > -0.5).astype(jnp.float32)  # some rows left out
        emb = jdp.sparse.lookup(params["embed"], batch["ids"])
        pred = jnp.tanh(emb.reshape(emb.shape[0], -1) @ params["mlp"]["w1"])
        err = (pred @ params["mlp"]["w2"])[:, 0] - batch["y"]
        return jdp.weighted(jnp.sum(mask * err**2), jnp.sum(mask))

    loss = weighted_loss if weighted else loss_fn
    oracle_tx = optax.sgd(LR)
    step, state = train(
        jdp.make_train_step(loss, oracle_tx),
        params,
        oracle_tx,
        batches,
        devices=jax.devices()[:1],
    )
    expected = step.unreplicate(state).params
    tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": jdp.sparse.sgd(LR)})
    train_step = jdp.make_train_step(loss, tx, sync=jdp.sparse.rows(), microbatches=2)
    step, state = train(train_step, params, tx, batches, devices=jax.devices()[:4])
    got = step.unreplicate(state).params
    assert_trees_close(got, expected, rtol=1e-5, atol=1e-7)
    assert not np.array_equal(got["embed"], params["embed"])


def test_optimizer_errors():
    params = {"embed": jnp.ones((10, 2)), "w": jnp.ones(2)}
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, optax.sgd(0.1), sync=jdp.sparse.rows())
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=optax.sgd(0.1)))
    with pytest.raises(
        TypeError, match="needs an optimizer made by `jdp.sparse.optimizer"
    ):
        step(
            state,
            step.shard({"ids": np.zeros((8, FEATURES), np.int32), "y": np.zeros(8)}),
        )
    with pytest.raises(TypeError, match="table 'embed' needs a row optimizer"):
        jdp.sparse.optimizer(optax.sgd(0.1), {"embed": optax.sgd(0.1)})
    with pytest.raises(
        ValueError, match=r"no parameter leaf at table path\(s\) \['table'\]"
    ):
        jdp.sparse.optimizer(optax.sgd(0.1), {"table": jdp.sparse.sgd(0.1)}).init(
            params
        )
    with pytest.raises(
        ValueError, match=r"rows of shape \(2, 3\) for a table of shape \(10, 2\)"
    ):
        jdp.sparse.sgd(0.1).update(
            jdp.sparse.IndexedRows(jnp.arange(2), jnp.ones((2, 3))),
            None,
            params["embed"],
        )


def test_lookup_inside_a_flax_module():
    import flax.linen as nn

    class Recommender(nn.Module):
        @nn.compact
        def __call__(self, ids):
            table = self.param("embedding", nn.initializers.normal(0.1), (100, 4))
            return nn.Dense(1)(jdp.sparse.lookup(table, ids)).sum()

    model = Recommender()
    ids = jnp.array([5, 2, 5, 99])
    params = model.init(jax.random.key(0), ids)["params"]

    def fn(p, ids):
        return model.apply({"params": p}, ids)

    _, grads = jax.jit(jdp.sparse.value_and_grad(fn, ["embedding"]))(params, ids)
    dense = jax.jit(jax.grad(fn))(params, ids)
    rows = grads["embedding"]
    scattered = jnp.zeros((100, 4)).at[rows.ids].add(rows.rows)
    np.testing.assert_allclose(scattered, dense["embedding"], rtol=1e-6)
    assert_trees_close(grads["Dense_0"], dense["Dense_0"])


# -- lazy optimizers: momentum and Adam ------------------------------------------

LAZY = {
    "momentum": (
        lambda: jdp.sparse.momentum(0.1, 0.9),
        lambda: optax.sgd(0.1, momentum=0.9),
    ),
    "nesterov": (
        lambda: jdp.sparse.momentum(0.1, 0.9, nesterov=True),
        lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    ),
    "adam": (lambda: jdp.sparse.adam(0.05), lambda: optax.adam(0.05)),
}


def row_state(kind, state):
    """The per-row state arrays of a lazy optimizer, and optax's counterparts."""
    if isinstance(state, jdp.sparse.MomentumRowState):
        return {"momentum": state.momentum}
    if isinstance(state, jdp.sparse.AdamRowState):
        return {"count": state.count, "mu": state.mu, "nu": state.nu}
    inner = state[0]  # optax: (TraceState | ScaleByAdamState, EmptyState)
    if kind == "adam":
        return {"count": inner.count, "mu": inner.mu, "nu": inner.nu}
    return {"momentum": inner.trace}


def lazy_oracle(params, batches, dense_tx, table_tx, *, lazy=True):
    """One device: `dense_tx` on the MLP; `table_tx` (optax) on the table.

    With `lazy`, `table_tx` sees only the rows the batch touches (valid ids): the
    other rows keep their values and their rows of the optimizer state.
    """
    grad_fn = jax.jit(jax.grad(loss_fn))
    table, mlp = jnp.asarray(params["embed"]), params["mlp"]
    dense_state, table_state = dense_tx.init(mlp), table_tx.init(table)
    num_rows = table.shape[0]
    for batch in batches:
        grads = grad_fn({"embed": table, "mlp": mlp}, batch)
        updates, dense_state = dense_tx.update(grads["mlp"], dense_state, mlp)
        mlp = optax.apply_updates(mlp, updates)
        ids = np.unique(batch["ids"])
        rows = ids[(ids >= 0) & (ids < num_rows)] if lazy else np.arange(num_rows)
        table, table_state = update_rows(
            table_tx, grads["embed"], table_state, table, rows
        )
    return {"embed": table, "mlp": mlp}, table_state


def update_rows(tx, grad, state, table, rows):
    """`tx` (optax) on `table[rows]` only, with those rows of its state."""
    part = jax.tree.map(lambda x: x[rows] if x.ndim else x, state)
    updates, part = tx.update(grad[rows], part, table[rows])
    state = jax.tree.map(lambda x, p: x.at[rows].set(p) if x.ndim else p, state, part)
    return table.at[rows].add(updates), state


def every_row_batches(num_steps, num_rows, seed):
    """Batches of `num_rows` examples that each touch every row FEATURES times."""
    rng = np.random.default_rng(seed)
    return [
        {
            "ids": rng.permutation(np.tile(np.arange(num_rows), FEATURES))
            .reshape(num_rows, FEATURES)
            .astype(np.int32),
            "y": rng.normal(size=num_rows).astype(np.float32),
        }
        for _ in range(num_steps)
    ]


@pytest.mark.parametrize(
    "kind, backend",
    [
        ("momentum", "pmap"),
        ("nesterov", "shard_map"),
        ("adam", "pmap"),
        ("adam", "shard_map"),
    ],
)
def test_lazy_optimizers_match_dense_optax_when_every_row_is_touched(kind, backend):
    make_rows, make_optax = LAZY[kind]
    params = init_params(8, 16, 4)
    batches = every_row_batches(4, 16, seed=8)
    expected, expected_state = lazy_oracle(
        params, batches, optax.sgd(LR), make_optax(), lazy=False
    )
    tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": make_rows()})
    step, state = train(
        jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows()),
        params,
        tx,
        batches,
        backend=backend,
    )
    got = step.unreplicate(state)
    assert_trees_close(got.params, expected, rtol=1e-5, atol=1e-6)
    assert_trees_close(
        row_state(kind, got.opt_state.tables["embed"]),
        row_state(kind, expected_state),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "kind, combine, backend",
    [("momentum", False, "pmap"), ("adam", True, "shard_map")],
)
def test_lazy_optimizers_update_only_the_touched_rows_in_a_sparse_step(
    kind, combine, backend
):
    make_rows, make_optax = LAZY[kind]
    num_rows = 200
    params = init_params(9, num_rows, 4)
    batches = make_batches(4, 16, num_rows, seed=9, hot=4)
    for b in batches:  # keep the last row unused: -1 must not wrap around to it
        b["ids"][b["ids"] == num_rows - 1] = 0
    batches[1]["ids"][0, 0] = num_rows + 5
    batches[2]["ids"][3, 1] = -1
    expected, expected_state = lazy_oracle(params, batches, optax.sgd(LR), make_optax())
    tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": make_rows()})
    step, state = train(
        jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows(combine=combine)),
        params,
        tx,
        batches,
        backend=backend,
    )
    got = step.unreplicate(state)
    got_state = row_state(kind, got.opt_state.tables["embed"])
    assert_trees_close(got.params, expected, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_state, row_state(kind, expected_state), atol=1e-6)
    # Rows never touched kept their values and a zero state.
    seen = np.unique(np.concatenate([b["ids"].ravel() for b in batches]))
    never = np.setdiff1d(np.arange(num_rows), seen)
    assert num_rows - 1 in never
    np.testing.assert_array_equal(got.params["embed"][never], params["embed"][never])
    for name in ("momentum", "mu", "nu"):
        if name in got_state:
            np.testing.assert_array_equal(got_state[name][never], 0)
    # Not vacuous: dense momentum / Adam moves the rows that left the batch.
    dense, _ = lazy_oracle(params, batches, optax.sgd(LR), make_optax(), lazy=False)
    last = np.unique(batches[-1]["ids"])
    left = np.setdiff1d(seen[(seen >= 0) & (seen < num_rows)], last)
    assert len(left) > 0
    assert np.all(np.any(dense["embed"][left] != got.params["embed"][left], axis=1))


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_lazy_optimizers_leave_untouched_rows_alone(kind):
    opt = LAZY[kind][0]()
    rng = np.random.default_rng(10)
    table = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
    state = opt.init(table)
    update = jax.jit(opt.update)
    for _ in range(2):  # every row gets a momentum / moments
        grads = jdp.sparse.IndexedRows(
            jnp.arange(8), jnp.asarray(rng.normal(size=(8, 3)))
        )
        table, state = update(grads, state, table)
    rows = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
    new_table, new_state = update(
        jdp.sparse.IndexedRows(jnp.array([4, 1]), rows), state, table
    )
    touched, others = np.array([1, 4]), np.array([0, 2, 3, 5, 6, 7])
    np.testing.assert_array_equal(new_table[others], table[others])
    before, after = row_state(kind, state), row_state(kind, new_state)
    for name in before:
        if name == "count":  # global: counts every update
            assert int(after[name]) == int(before[name]) + 1
            continue
        np.testing.assert_array_equal(after[name][others], before[name][others])
        assert np.all(after[name][touched] != before[name][touched])
    assert np.all(new_table[touched] != table[touched])


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_lazy_optimizers_combine_duplicates_and_skip_invalid_ids(kind):
    opt = LAZY[kind][0]()
    rng = np.random.default_rng(11)
    table = jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)
    warm = jdp.sparse.IndexedRows(jnp.arange(6), jnp.ones((6, 2)))
    update = jax.jit(opt.update)
    table, state = update(warm, opt.init(table), table)
    r = jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)
    noisy = jdp.sparse.IndexedRows(jnp.array([3, -1, 1, 3, 6, 11]), r)
    clean = jdp.sparse.IndexedRows(jnp.array([1, 3]), jnp.stack([r[2], r[0] + r[3]]))
    got = update(noisy, state, table)
    expected = update(clean, state, table)
    assert_trees_close(got, expected, rtol=1e-6, atol=1e-7)
    # A repeated id is one row with the summed gradient, as in the dense
    # gradient: optax's rule on that dense gradient, restricted to rows 1 and 3.
    dense_grad = jnp.zeros_like(table).at[jnp.array([1, 3])].add(clean.rows)
    oracle = LAZY[kind][1]()
    oracle_state = oracle.init(table)
    oracle_state = oracle.update(jnp.ones_like(table), oracle_state, table)[1]
    updates, oracle_state = oracle.update(dense_grad, oracle_state, table)
    new_table, touched, others = got[0], np.array([1, 3]), np.array([0, 2, 4, 5])
    np.testing.assert_allclose(
        new_table[touched], (table + updates)[touched], rtol=1e-5, atol=1e-6
    )
    # Nothing else moved: -1 did not wrap around to row 5, 6 and 11 were dropped.
    np.testing.assert_array_equal(new_table[others], table[others])


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_unsigned_ids_pad_with_no_real_row(kind):
    """uint8 ids padded with -1, which wrapped to 255: the last row of a
    256-row table moved on a step that never touched it."""
    opt = LAZY[kind][0]()
    table = jnp.full((256, 1), -0.1, jnp.float32)
    state = opt.init(table)
    grads = jdp.sparse.IndexedRows(jnp.array([3, 3], jnp.uint8), jnp.ones((2, 1)))
    combined = jdp.sparse.combine_rows(*grads)
    np.testing.assert_array_equal(combined.ids, [3, -1])
    for _ in range(2):
        new_table, state = jax.jit(opt.update)(grads, state, table)
    assert new_table[3, 0] != table[3, 0]
    np.testing.assert_array_equal(np.delete(new_table, 3, 0), np.delete(table, 3, 0))


@pytest.mark.parametrize(
    ("table_dtype", "ids_dtype"),
    [(jnp.bfloat16, np.int32), (jnp.float32, np.uint8), (jnp.float32, np.int16)],
)
def test_rows_of_a_bfloat16_table_or_narrow_ids_train(table_dtype, ids_dtype):
    """The step stopped on numpy's "mismatch in size of old and new
    data-descriptor" when the ids and the rows had different item sizes."""
    params = jax.tree.map(jnp.asarray, init_params(3, SMALL_ROWS, SMALL_DIM))
    params["embed"] = params["embed"].astype(table_dtype)
    batches = make_batches(2, 16, SMALL_ROWS, seed=3)
    for b in batches:
        b["ids"] = b["ids"].astype(ids_dtype)
    step, state = train(
        jdp.make_train_step(loss_fn, _row_tx(), sync=jdp.sparse.rows()),
        params,
        _row_tx(),
        batches,
        devices=jax.devices()[:4],
    )
    got = step.unreplicate(state).params["embed"]
    assert got.dtype == table_dtype
    assert not np.array_equal(got, params["embed"])


def test_a_step_that_looks_up_no_ids():
    """Empty bags with `skip_nonfinite=True`, and `all_gather_rows` of no ids,
    failed to compile: "all_gather_dim cannot be zero"."""

    def bags(params, batch):
        emb = jdp.sparse.lookup(params["embed"], batch["ids"])  # (B, 0, dim)
        return jnp.mean((emb.sum(axis=(1, 2)) + params["b"] - batch["y"]) ** 2)

    params = {"embed": jnp.ones((5, 2)), "b": jnp.zeros(())}
    tx = jdp.sparse.optimizer(optax.sgd(0.1), {"embed": jdp.sparse.sgd(0.1)})
    batches = [{"ids": np.zeros((8, 0), np.int32), "y": np.ones(8, np.float32)}]
    step, state = train(
        jdp.make_train_step(bags, tx, sync=jdp.sparse.rows(), skip_nonfinite=True),
        params,
        tx,
        batches,
        devices=jax.devices()[:4],
    )
    got = step.unreplicate(state).params
    np.testing.assert_array_equal(got["embed"], params["embed"])
    assert float(got["b"]) > 0
    gathered = jdp.parallelize(gather_step(combine=True), devices=jax.devices()[:4])
    empty = {"ids": np.zeros((4, 0), np.int32), "rows": np.zeros((4, 0, 2))}
    _, out = gathered(gathered.replicate({}), gathered.shard(empty))
    assert out["ids"].shape == (0,) and out["rows"].shape == (0, 2)


def test_a_tables_rows_through_an_averaging_piece_are_densified():
    """`jdp.sync_gradients(jdp.all_reduce())` averaged the rows of different ids
    element by element in a hand-written step: a wrong table, or a divergence
    error that pointed back to `jdp.sync_gradients`."""
    params, batches, expected = _small_run(jdp.sparse.rows(), _row_tx())
    for piece in (jdp.all_reduce(), jdp.all_reduce(wire=jdp.wire.bf16())):
        got = _hand_written_run(piece, params, batches)
        assert_trees_close(got, expected, rtol=1e-2, atol=1e-3)
    sync = jdp.sync_gradients(jdp.all_reduce())

    def no_params(state, batch):
        rows = jdp.sparse.IndexedRows(batch, jnp.ones(batch.shape + (3,)))
        return state, sync.update({"e": rows}, sync.init({"e": jnp.ones(3)}))[0]

    no_params = jdp.parallelize(no_params, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"sparse rows.*no params to size the table"):
        no_params(no_params.replicate({}), no_params.shard(np.arange(4)))


@pytest.mark.parametrize("kind", ["momentum", "nesterov", "adam"])
def test_lazy_optimizers_on_a_dense_gradient_are_dense_optax(kind):
    make_rows, make_optax = LAZY[kind]
    opt, oracle = make_rows(), make_optax()
    rng = np.random.default_rng(12)
    table = expected = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    state, oracle_state = opt.init(table), oracle.init(table)
    update = jax.jit(opt.update)
    for _ in range(3):
        grads = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
        table, state = update(grads, state, table)
        updates, oracle_state = oracle.update(grads, oracle_state, expected)
        expected = optax.apply_updates(expected, updates)
    np.testing.assert_allclose(table, expected, rtol=1e-5, atol=1e-6)
    assert_trees_close(
        row_state(kind, state), row_state(kind, oracle_state), rtol=1e-5, atol=1e-6
    )


def test_adam_bias_correction_uses_the_global_step_count():
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    opt = jdp.sparse.adam(lr, b1=b1, b2=b2, eps=eps)
    table = jnp.zeros((2, 1))
    state = opt.init(table)
    update = jax.jit(opt.update)
    for _ in range(3):  # only row 0
        grads = jdp.sparse.IndexedRows(jnp.array([0]), jnp.array([[1.0]]))
        table, state = update(grads, state, table)
    grads = jdp.sparse.IndexedRows(jnp.array([1]), jnp.array([[2.0]]))
    table, state = update(grads, state, table)  # row 1's first update, t = 4
    t, g = 4, 2.0
    mu_hat = (1 - b1) * g / (1 - b1**t)
    nu_hat = (1 - b2) * g**2 / (1 - b2**t)
    np.testing.assert_allclose(
        table[1, 0], -lr * mu_hat / (np.sqrt(nu_hat) + eps), rtol=1e-4
    )
    assert int(state.count) == 4


HYPERPARAMETER_ERRORS = [
    (
        "momentum",
        {"learning_rate": "0.1", "momentum": 0.9},
        TypeError,
        "`learning_rate` must",
    ),
    (
        "momentum",
        {"learning_rate": -0.1, "momentum": 0.9},
        ValueError,
        "`learning_rate` must",
    ),
    (
        "momentum",
        {"learning_rate": 0.1, "momentum": None},
        TypeError,
        "`momentum` must be",
    ),
    (
        "momentum",
        {"learning_rate": 0.1, "momentum": 1.0},
        ValueError,
        r"`momentum`.*< 1",
    ),
    (
        "momentum",
        {"learning_rate": 0.1, "momentum": -0.5},
        ValueError,
        r"`momentum`.*>= 0",
    ),
    (
        "momentum",
        {"learning_rate": 0.1, "momentum": 0.9, "nesterov": 1},
        TypeError,
        r"`nesterov` must be True or False, got 1 \(an int\)",
    ),
    ("adam", {"learning_rate": float("nan")}, ValueError, "`learning_rate`.*got nan"),
    ("adam", {"learning_rate": float("inf")}, ValueError, "`learning_rate`.*got inf"),
    ("adam", {"learning_rate": True}, TypeError, r"`learning_rate`.*\(a bool\)"),
    ("adam", {"learning_rate": 1e-3, "b1": 1.0}, ValueError, r"`b1`.*< 1.*got 1.0"),
    ("adam", {"learning_rate": 1e-3, "b2": -0.1}, ValueError, r"`b2`.*>= 0"),
    ("adam", {"learning_rate": 1e-3, "b2": "0.9"}, TypeError, "`b2` must be"),
    ("adam", {"learning_rate": 1e-3, "eps": 0.0}, ValueError, r"`eps`.*> 0"),
    ("adam", {"learning_rate": 1e-3, "eps": float("-inf")}, ValueError, "`eps`.*-inf"),
]


@pytest.mark.parametrize(
    "name, kwargs, error, match",
    HYPERPARAMETER_ERRORS,
    ids=[
        f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        for name, kwargs, *_ in HYPERPARAMETER_ERRORS
    ],
)
def test_lazy_optimizer_hyperparameter_errors(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(jdp.sparse, name)(**kwargs)
