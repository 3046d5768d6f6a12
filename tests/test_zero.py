"""ZeRO stages 1 and 2: `make_train_step(..., sync=jdp.zero())`."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    init_mlp,
    make_batches,
    mlp_loss,
    run_steps,
    single_device_train,
)
from jax.sharding import PartitionSpec as P

import jdp
from jdp import _layout, _zero

GLOBAL_BATCH = 32
# Leaf sizes 104, 13, 91, 7, 28, 4: most are not divisible by 8 (or 4, or 3).
SIZES = (8, 13, 7, 4)


def params0():
    return init_mlp(jax.random.key(0), sizes=SIZES)


def zero_step(tx, devices=None, **kw):
    return jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.zero(**kw)),
        devices=devices,
    )


def test_matches_plain_synchronous_training(backend):
    tx = optax.adam(1e-2)
    batches = make_batches(20, GLOBAL_BATCH)
    init = jdp.TrainState.create(params=params0(), tx=tx)
    plain = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), backend=backend)
    zero = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.zero()), backend=backend
    )
    plain_state, plain_losses = run_steps(plain, plain.replicate(init), batches)
    zero_state, zero_losses = run_steps(zero, zero.replicate(init), batches)
    got = zero.unreplicate(zero_state)
    want = plain.unreplicate(plain_state)
    # One full logical copy, structured exactly like the plain optimizer state.
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert_trees_close(got.params, want.params, rtol=1e-5)
    assert_trees_close(got.opt_state, want.opt_state, rtol=1e-5)
    assert int(got.step) == 20
    np.testing.assert_allclose(zero_losses, plain_losses, rtol=1e-5)
    expected, expected_opt = single_device_train(mlp_loss, params0(), tx, batches)
    assert_trees_close(got.params, expected, rtol=1e-5)
    assert_trees_close(got.opt_state, expected_opt, rtol=1e-5)
    jdp.assert_replicas_in_sync(zero_state)


def _path_mask(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "w", params)


OPTIMIZERS = {
    "nesterov": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
    "adamw_schedule_mask": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6),
        weight_decay=0.1,
        mask=_path_mask,
    ),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.5),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_elementwise_optimizers_match_single_device(name):
    tx = OPTIMIZERS[name]()
    batches = make_batches(6, 24, seed=1)
    step = zero_step(tx, devices=jax.devices()[:3])
    state, _ = run_steps(
        step, step.replicate(jdp.TrainState.create(params=params0(), tx=tx)), batches
    )
    expected, expected_opt = single_device_train(mlp_loss, params0(), tx, batches)
    got = step.unreplicate(state)
    assert_trees_close(got.params, expected, rtol=1e-5)
    assert_trees_close(got.opt_state, expected_opt, rtol=1e-5)


def test_scalar_and_tiny_parameters():
    """Leaves smaller than the replica count: most replicas hold only padding."""

    def loss(params, batch):
        pred = batch["x"][:, :5] @ params["w"] * params["s"] + params["v"]
        return jnp.mean((pred - batch["y"][:, :3]) ** 2)

    params = {"s": jnp.float32(1.5), "v": jnp.zeros(3), "w": jnp.ones((5, 3)) / 5}
    tx = optax.adam(1e-2)
    batches = make_batches(4, 16, seed=4)
    step = jdp.parallelize(jdp.make_train_step(loss, tx, sync=jdp.zero()))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    assert state.opt_state.chunks[0].mu["s"].shape == (8, 1)
    assert _layout.logical_like(state).opt_state[0].mu["s"].shape == ()
    state, _ = run_steps(step, state, batches)
    expected, expected_opt = single_device_train(loss, params, tx, batches)
    got = step.unreplicate(state)
    assert got.opt_state[0].mu["s"].shape == ()
    assert_trees_close(got.params, expected, rtol=1e-5)
    assert_trees_close(got.opt_state, expected_opt, rtol=1e-5)


def _device_bytes(tree):
    """Bytes each device holds of `tree`, from the arrays' addressable shards."""
    per_device = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per_device[shard.device] = (
                per_device.get(shard.device, 0) + shard.data.nbytes
            )
    return per_device


def test_each_device_holds_one_slice_of_the_optimizer_state():
    tx = optax.adam(1e-2)
    params = params0()
    init = jdp.TrainState.create(params=params, tx=tx)
    plain = jdp.parallelize(jdp.make_train_step(mlp_loss, tx))
    zero = zero_step(tx)
    n = zero.num_replicas
    plain_bytes = _device_bytes(plain.replicate(init).opt_state)
    zero_state = zero.replicate(init)
    zero_bytes = _device_bytes(zero_state.opt_state)
    assert set(zero_bytes) == set(jax.devices())
    sizes = [x.size for x in jax.tree.leaves(params)]
    # Adam: mu and nu per parameter element (float32), plus an int32 count.
    full = 2 * 4 * sum(sizes) + 4
    sliced = 2 * 4 * sum(math.ceil(s / n) for s in sizes) + 4
    padding = 2 * 4 * sum(math.ceil(s / n) * n - s for s in sizes)
    for device in jax.devices():
        assert plain_bytes[device] == full
        assert zero_bytes[device] == sliced
        assert zero_bytes[device] <= (full + padding) / n + 4
    # Every replica's slice lives on its own device, sharded over the mesh.
    mu_w = zero_state.opt_state.chunks[0].mu["layer0"]["w"]
    assert mu_w.sharding.spec == P("data") and mu_w.shape == (n, math.ceil(104 / n))
    assert [s.data.shape for s in mu_w.addressable_shards] == [(1, 13)] * n
    # The slices are different parts of the logical state, not copies.
    zero_state, _ = run_steps(zero, zero_state, make_batches(1, GLOBAL_BATCH))
    rows = np.asarray(zero_state.opt_state.chunks[0].mu["layer0"]["w"])
    assert not np.allclose(rows[0], rows[1])


def test_collectives_are_reduce_scatter_and_all_gather():
    tx = optax.adam(1e-2)
    init = jdp.TrainState.create(params=params0(), tx=tx)
    batch = make_batches(1, GLOBAL_BATCH)[0]
    plain = jdp.parallelize(jdp.make_train_step(mlp_loss, tx))
    zero = zero_step(tx)
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params0()))
    padded = 4 * sum(math.ceil(x.size / 8) * 8 for x in jax.tree.leaves(params0()))

    plain_ops = plain.collectives(plain.replicate(init), plain.shard(batch))
    assert [c.kind for c in plain_ops if c.bytes >= param_bytes] == ["all-reduce"]

    ops = zero.collectives(zero.replicate(init), zero.shard(batch))
    kinds = [c.kind for c in ops]
    assert kinds.count("reduce-scatter") == 1 and kinds.count("all-gather") == 1
    # What is left of all-reduce is the scalar loss metric.
    assert all(c.bytes <= 8 for c in ops if c.kind == "all-reduce")
    scatter = next(c for c in ops if c.kind == "reduce-scatter")
    assert scatter.bytes == padded and scatter.result_bytes == padded // 8
    gather = next(c for c in ops if c.kind == "all-gather")
    assert gather.result_bytes == padded


def test_small_buckets_give_one_collective_pair_per_bucket():
    tx = optax.sgd(0.1)
    init = jdp.TrainState.create(params=params0(), tx=tx)
    step = zero_step(tx, devices=jax.devices()[:2], bucket_bytes=256)
    batches = make_batches(3, 8)
    ops = step.collectives(
        step.replicate(init), step.shard(batches[0]), stage="lowered"
    )
    assert sum(c.kind == "reduce-scatter" for c in ops) > 1
    assert sum(c.kind == "reduce-scatter" for c in ops) == sum(
        c.kind == "all-gather" for c in ops
    )
    state, _ = run_steps(step, step.replicate(init), batches)
    expected, _ = single_device_train(mlp_loss, params0(), tx, batches)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)


def test_reduce_dtype_sets_the_reduce_scatter_wire_type():
    tx = optax.adam(1e-2)
    init = jdp.TrainState.create(params=params0(), tx=tx)
    step = zero_step(tx, devices=jax.devices()[:2], reduce_dtype=jnp.bfloat16)
    batches = make_batches(3, 8)
    ops = step.collectives(
        step.replicate(init), step.shard(batches[0]), stage="lowered"
    )
    assert [c.dtype for c in ops if c.kind == "reduce-scatter"] == ["bf16"]
    assert [c.dtype for c in ops if c.kind == "all-gather"] == ["f32"]
    state, _ = run_steps(step, step.replicate(init), batches)
    expected, _ = single_device_train(mlp_loss, params0(), tx, batches)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=2e-2, atol=2e-3)


def test_logical_copy_restores_into_another_replica_count():
    """Save one logical copy on 8 replicas, resume on 3 (sharded) or 2 (plain)."""
    tx = optax.adam(1e-2)
    batches = make_batches(8, 24, seed=2)
    init = jdp.TrainState.create(params=params0(), tx=tx)
    eight = zero_step(tx)
    state, _ = run_steps(eight, eight.replicate(init), batches[:4])
    saved = jax.device_get(_layout.logical_copy(state))  # what a checkpoint holds
    assert jax.tree.structure(saved) == jax.tree.structure(init)

    three = zero_step(tx, devices=jax.devices()[:3])
    like = three.replicate(init)
    assert _layout.logical_like(like) == jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), init
    )
    resumed = _layout.place_like(saved, like)
    assert resumed.opt_state.chunks[0].mu["layer0"]["w"].shape == (3, 35)
    resumed, _ = run_steps(three, resumed, batches[4:])

    two = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), devices=jax.devices()[:2])
    plain, _ = run_steps(two, two.replicate(saved), batches[4:])

    expected, expected_opt = single_device_train(mlp_loss, params0(), tx, batches)
    for step, final in ((three, resumed), (two, plain)):
        got = step.unreplicate(final)
        assert_trees_close(got.params, expected, rtol=1e-5)
        assert_trees_close(got.opt_state, expected_opt, rtol=1e-5)


def test_checkpoint_manager_roundtrip_into_another_replica_count(tmp_path):
    tx = optax.adam(1e-2)
    init = jdp.TrainState.create(params=params0(), tx=tx)
    eight = zero_step(tx)
    state, _ = run_steps(eight, eight.replicate(init), make_batches(2, 24))
    with jdp.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(2, state)
        four = zero_step(tx, devices=jax.devices()[:4])
        restored = manager.restore(four.replicate(init))
    assert_trees_close(four.unreplicate(restored), eight.unreplicate(state))


def test_replicas_in_sync_skips_slices_and_broadcast_keeps_them():
    tx = optax.adam(1e-2)
    step = zero_step(tx, devices=jax.devices()[:4])
    state = step.replicate(jdp.TrainState.create(params=params0(), tx=tx))
    state, _ = run_steps(step, state, make_batches(2, 8))
    assert jdp.replicas_in_sync(state)  # slices differ, but by design
    before = step.unreplicate(state)
    after = step.broadcast(state)
    assert_trees_close(step.unreplicate(after), before, rtol=0, atol=0)
    # A real desync (params, or a whole leaf such as the count) is still caught.
    adam_state, rest = after.opt_state.chunks
    off = adam_state._replace(count=adam_state.count + jnp.arange(4, dtype=jnp.int32))
    bad = after.replace(opt_state=after.opt_state.replace(chunks=(off, rest)))
    with pytest.raises(AssertionError, match=r"\.count: replica 1 differs"):
        jdp.assert_replicas_in_sync(bad)


def test_clip_grad_norm_matches_optax_chain():
    """The global norm is computed across replicas (a psum of slice norms)."""
    tx = optax.adam(1e-2)
    oracle_tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    batches = make_batches(3, 16, seed=3)
    init = jdp.TrainState.create(params=params0(), tx=tx)
    expected, _ = single_device_train(mlp_loss, params0(), oracle_tx, batches)
    # ZeRO computes the norm across slices; `jdp.all_reduce` leaves clipping to
    # optax in `tx`, which sees the averaged gradients.
    for sync, step_tx in ((jdp.zero(clip_grad_norm=0.05), tx), (None, oracle_tx)):
        train_step = jdp.make_train_step(
            mlp_loss, step_tx, sync=sync or jdp.all_reduce()
        )
        step = jdp.parallelize(train_step, devices=jax.devices()[:2])
        state = step.replicate(
            init.replace(tx=step_tx, opt_state=step_tx.init(params0()))
        )
        norms = []
        for batch in batches:
            state, metrics = step(state, step.shard(batch))
            norms.append(float(metrics.get("grad_norm", np.nan)))
        assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)
        if sync is not None:
            first = optax.tree.norm(jax.grad(mlp_loss)(params0(), batches[0]))
            np.testing.assert_allclose(norms[0], first, rtol=1e-5)
            assert norms[0] > 0.05  # clipping was active


def _replicate_and_call(tx, params=None):
    step = zero_step(tx, devices=jax.devices()[:2])
    state = step.replicate(jdp.TrainState.create(params=params or params0(), tx=tx))
    return step(state, step.shard(make_batches(1, 4)[0]))


@pytest.mark.parametrize(
    "tx",
    [
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        optax.apply_if_finite(optax.adam(1e-3), 3),
        optax.lamb(1e-3),
    ],
    ids=["clip_by_global_norm", "apply_if_finite", "lamb"],
)
def test_refuses_optimizers_that_reduce_whole_parameters(tx):
    with pytest.raises(
        ValueError, match=r"reduces over whole parameters.*clip_grad_norm"
    ):
        _replicate_and_call(tx)


def test_refuses_factored_optimizer_state():
    with pytest.raises(ValueError, match=r"not one value per parameter element"):
        _replicate_and_call(optax.adafactor(1e-3, min_dim_size_to_factor=4))


def test_refuses_mask_chosen_by_shape():
    tx = optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    with pytest.raises(ValueError, match=r"mask chosen\s+by `ndim` or shape"):
        _replicate_and_call(tx)


def test_refuses_optimizer_state_masked_by_shape():
    tx = optax.masked(optax.adam(1e-3), lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    with pytest.raises(
        ValueError, match=r"structure depends on the parameters' shapes"
    ):
        _replicate_and_call(tx)


def test_refuses_optimizer_that_communicates():
    tx = optax.chain(jdp.sync_gradients(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"communicates across replicas itself"):
        _replicate_and_call(tx)


def test_a_sync_that_is_not_a_piece_is_refused():
    with pytest.raises(TypeError, match=r"`sync` must be a `jdp.Sync`.*got str"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), sync="zero")


def test_clip_grad_norm_must_be_a_positive_finite_number():
    with pytest.raises(ValueError, match=r"`clip_grad_norm` must be a finite number"):
        jdp.zero(clip_grad_norm=0.0)
    with pytest.raises(ValueError, match=r"`clip_grad_norm`.*got inf"):
        jdp.zero(clip_grad_norm=float("inf"))


def test_refuses_integer_parameters():
    params = {"w": jnp.ones((3,)), "n": jnp.zeros((2,), jnp.int32)}
    with pytest.raises(
        ValueError, match=r"(?s)floating-point parameters only.*\['n'\]: int32"
    ):
        zero_step(optax.sgd(0.1)).replicate(
            jdp.TrainState.create(params=params, tx=optax.sgd(0.1))
        )


def test_wrapped_step_without_its_state_layout_is_caught():
    tx = optax.adam(1e-3)
    inner = jdp.make_train_step(mlp_loss, tx, sync=jdp.zero())
    wrapped = jdp.parallelize(lambda s, b: inner(s, b), devices=jax.devices()[:2])
    state = wrapped.replicate(jdp.TrainState.create(params=params0(), tx=tx))
    with pytest.raises(
        ValueError,
        match=r"`opt_state` is a full optimizer state.*"
        r"functools\.wraps",
    ):
        wrapped(state, wrapped.shard(make_batches(1, 4)[0]))
    # `functools.wraps` keeps the declared layout, and the step works.
    kept = jdp.parallelize(
        functools.wraps(inner)(lambda s, b: inner(s, b)), devices=jax.devices()[:2]
    )
    state = kept.replicate(jdp.TrainState.create(params=params0(), tx=tx))
    state, _ = jax.block_until_ready(kept(state, kept.shard(make_batches(1, 4)[0])))
    assert isinstance(state.opt_state, _zero.ShardedOptState)


def test_slices_for_another_replica_count_are_caught():
    tx = optax.sgd(0.1, momentum=0.9)
    params = {"w": jnp.ones((10,))}
    four = _zero.opt_state_layout(tx.init(params), params, tx, 4)  # slices of 3

    def body(x):
        opt = four.replace(
            chunks=jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), four.chunks)
        )
        _zero.sharded_update(
            params,
            opt,
            params,
            tx,
            axis_name="data",
            bucket_bytes=None,
            reduce_dtype=None,
            clip_grad_norm=None,
        )
        return x

    two = jdp.parallelize(lambda s, b: (body(s), {}), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"laid out for another\s+number of replicas"):
        two(two.replicate({"x": jnp.zeros(1)}), two.shard(jnp.zeros(2)))


def test_place_like_rejects_a_sharded_host_copy():
    tx = optax.adam(1e-3)
    step = zero_step(tx, devices=jax.devices()[:2])
    state = step.replicate(jdp.TrainState.create(params=params0(), tx=tx))
    with pytest.raises(ValueError, match=r"got an already sharded one"):
        _layout.place_like(state, state)
