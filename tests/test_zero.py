"""ZeRO stages 1 and 2: `make_train_step(loss_fn, jdp.zero(tx), sync=jdp.local())`."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import dynamic_scale as flax_dynamic_scale
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


def zero_step(tx, devices=None, backend="pmap", **kw):
    return jdp.parallelize(
        jdp.make_train_step(mlp_loss, jdp.zero(tx, **kw), sync=jdp.local()),
        devices=devices,
        backend=backend,
    )


def zero_init(tx, params=None, **kw):
    """The whole initial state of a `jdp.zero(tx, **kw)` step."""
    params = params0() if params is None else params
    return jdp.TrainState.create(params=params, tx=jdp.zero(tx, **kw))


def test_matches_plain_synchronous_training(backend):
    tx = optax.adam(1e-2)
    batches = make_batches(20, GLOBAL_BATCH)
    plain = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), backend=backend)
    zero = zero_step(tx, backend=backend)
    plain_init = jdp.TrainState.create(params=params0(), tx=tx)
    plain_state, plain_losses = run_steps(plain, plain.replicate(plain_init), batches)
    zero_state, zero_losses = run_steps(zero, zero.replicate(zero_init(tx)), batches)
    got = zero.unreplicate(zero_state)
    want = plain.unreplicate(plain_state)
    # One whole copy: the wrapped optimizer's state, structured as the plain one.
    assert isinstance(got.opt_state, _zero.ZeroState)
    assert jax.tree.structure(got.opt_state.chunks) == jax.tree.structure(
        want.opt_state
    )
    assert_trees_close(got.params, want.params, rtol=1e-5)
    assert_trees_close(got.opt_state.chunks, want.opt_state, rtol=1e-5)
    assert int(got.step) == 20
    np.testing.assert_allclose(zero_losses, plain_losses, rtol=1e-5)
    expected, expected_opt = single_device_train(mlp_loss, params0(), tx, batches)
    assert_trees_close(got.params, expected, rtol=1e-5)
    assert_trees_close(got.opt_state.chunks, expected_opt, rtol=1e-5)
    jdp.assert_replicas_in_sync(zero_state)


def test_a_hand_written_step_and_a_multi_transform_label():
    """The wrapper is an optax transform: it works outside `make_train_step`, and
    for one label of `optax.multi_transform` (the rest trained by plain SGD)."""
    adam = optax.adam(1e-2)
    labels = {"layer0": "zero", "layer1": "plain", "layer2": "plain"}
    batches = make_batches(5, 24, seed=5)

    def hand_written(tx):
        def step_fn(state, batch):
            params, opt_state = state
            grads = jax.grad(mlp_loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), {}

        step = jdp.parallelize(step_fn, devices=jax.devices()[:3])
        state = step.replicate((params0(), tx.init(params0())))
        for batch in batches:
            state, _ = step(state, step.shard(batch))
        return step.unreplicate(state)

    params, opt_state = hand_written(jdp.zero(adam))
    assert opt_state.chunks[0].mu["layer0"]["w"].shape == (8, 13)  # whole again
    expected, _ = single_device_train(mlp_loss, params0(), adam, batches)
    # A hand-written step gives each replica its own gradients: jdp.zero averages.
    assert_trees_close(params, expected, rtol=1e-5)

    mixed = optax.multi_transform(
        {"zero": jdp.zero(adam), "plain": optax.chain(jdp.sync_gradients(), adam)},
        labels,
    )
    oracle = optax.multi_transform({"zero": adam, "plain": adam}, labels)
    params, opt_state = hand_written(mixed)
    expected, _ = single_device_train(mlp_loss, params0(), oracle, batches)
    assert_trees_close(params, expected, rtol=1e-5)


def test_averaging_piece_beside_it_is_refused():
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, jdp.zero(optax.sgd(0.1))),
        devices=jax.devices()[:2],
    )
    state = step.replicate(zero_init(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"averages the gradients.*sync=jdp\.local"):
        step(state, step.shard(make_batches(1, 4)[0]))


def test_it_wraps_an_optimizer():
    with pytest.raises(ValueError, match=r"wraps the optimizer.*got no optimizer"):
        jdp.zero()
    with pytest.raises(ValueError, match=r"jdp\.zero\(tx\), sync=jdp\.local.*got str"):
        jdp.zero("adam")


def test_loss_scaling_and_skipped_steps():
    """Under a power-of-two loss scale the update is the unscaled run's, and a
    non-finite step is skipped with the sharded state kept."""
    tx = optax.adam(1e-2)
    batches = make_batches(3, 16, seed=6)
    batches[1]["x"][0, 0] = np.inf
    step = zero_step(tx, devices=jax.devices()[:4])
    state = step.replicate(
        zero_init(tx).replace(
            dynamic_scale=flax_dynamic_scale.DynamicScale(scale=2.0**4)
        )
    )
    plain = zero_step(tx, devices=jax.devices()[:4])
    plain_state = plain.replicate(zero_init(tx))
    skipped = []
    for batch in batches:
        state, metrics = step(state, step.shard(batch))
        plain_state, _ = plain(plain_state, plain.shard(batch))
        skipped.append(int(metrics["skipped"]))
    assert skipped == [0, 1, 0]
    got = step.unreplicate(state)
    assert int(got.skipped_steps) == 1 and float(got.dynamic_scale.scale) == 8.0
    expected, expected_opt = single_device_train(
        mlp_loss, params0(), tx, [batches[0], batches[2]]
    )
    assert_trees_close(got.params, expected, rtol=1e-5)
    assert_trees_close(got.opt_state.chunks, expected_opt, rtol=1e-5)


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
    state, _ = run_steps(step, step.replicate(zero_init(tx)), batches)
    expected, expected_opt = single_device_train(mlp_loss, params0(), tx, batches)
    got = step.unreplicate(state)
    assert_trees_close(got.params, expected, rtol=1e-5)
    assert_trees_close(got.opt_state.chunks, expected_opt, rtol=1e-5)


def test_scalar_and_tiny_parameters():
    """Leaves smaller than the replica count: most replicas hold only padding."""

    def loss(params, batch):
        pred = batch["x"][:, :5] @ params["w"] * params["s"] + params["v"]
        return jnp.mean((pred - batch["y"][:, :3]) ** 2)

    params = {"s": jnp.float32(1.5), "v": jnp.zeros(3), "w": jnp.ones((5, 3)) / 5}
    tx = optax.adam(1e-2)
    batches = make_batches(4, 16, seed=4)
    step = jdp.parallelize(jdp.make_train_step(loss, jdp.zero(tx), sync=jdp.local()))
    state = step.replicate(zero_init(tx, params))
    assert state.opt_state.chunks[0].mu["s"].shape == (8, 1)
    assert _layout.logical_like(state).opt_state.chunks[0].mu["s"].shape == ()
    state, _ = run_steps(step, state, batches)
    expected, expected_opt = single_device_train(loss, params, tx, batches)
    got = step.unreplicate(state)
    assert got.opt_state.chunks[0].mu["s"].shape == ()
    assert_trees_close(got.params, expected, rtol=1e-5)
    assert_trees_close(got.opt_state.chunks, expected_opt, rtol=1e-5)


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
    plain = jdp.parallelize(jdp.make_train_step(mlp_loss, tx))
    zero = zero_step(tx)
    n = zero.num_replicas
    plain_bytes = _device_bytes(
        plain.replicate(jdp.TrainState.create(params=params, tx=tx)).opt_state
    )
    zero_state = zero.replicate(zero_init(tx))
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
    batch = make_batches(1, GLOBAL_BATCH)[0]
    plain = jdp.parallelize(jdp.make_train_step(mlp_loss, tx))
    zero = zero_step(tx)
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params0()))
    padded = 4 * sum(math.ceil(x.size / 8) * 8 for x in jax.tree.leaves(params0()))

    plain_init = plain.replicate(jdp.TrainState.create(params=params0(), tx=tx))
    plain_ops = plain.collectives(plain_init, plain.shard(batch))
    assert [c.kind for c in plain_ops if c.bytes >= param_bytes] == ["all-reduce"]

    ops = zero.collectives(zero.replicate(zero_init(tx)), zero.shard(batch))
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
    step = zero_step(tx, devices=jax.devices()[:2], bucket_bytes=256)
    init = zero_init(tx, bucket_bytes=256)
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
    step = zero_step(tx, devices=jax.devices()[:2], reduce_dtype=jnp.bfloat16)
    init = zero_init(tx)
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
    """Save one whole copy on 8 replicas, resume on 3 (sharded) or 2 (plain)."""
    tx = optax.adam(1e-2)
    batches = make_batches(8, 24, seed=2)
    init = zero_init(tx)
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

    # The wrapped optimizer's state alone continues without ZeRO.
    two = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), devices=jax.devices()[:2])
    plain_saved = saved.replace(opt_state=saved.opt_state.chunks, tx=tx)
    plain, _ = run_steps(two, two.replicate(plain_saved), batches[4:])

    expected, expected_opt = single_device_train(mlp_loss, params0(), tx, batches)
    for step, final in ((three, resumed), (two, plain)):
        got = step.unreplicate(final)
        opt = got.opt_state.chunks if step is three else got.opt_state
        assert_trees_close(got.params, expected, rtol=1e-5)
        assert_trees_close(opt, expected_opt, rtol=1e-5)


def test_a_none_parameter(tmp_path):
    """A None in the params (a layer without bias) stopped the first step inside
    the replica check: "zip() argument 2 is shorter than argument 1"."""

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    params = {"w": jnp.ones((8, 4)) / 8, "b": None}
    tx = optax.adam(1e-2)
    batches = make_batches(3, 16, seed=4)
    step = jdp.parallelize(jdp.make_train_step(loss, jdp.zero(tx), sync=jdp.local()))
    state, _ = run_steps(step, step.replicate(zero_init(tx, params)), batches)
    expected, expected_opt = single_device_train(loss, params, tx, batches)
    got = step.unreplicate(state)
    assert_trees_close(got.params, expected, rtol=1e-5)
    assert_trees_close(got.opt_state.chunks, expected_opt, rtol=1e-5)
    jdp.assert_replicas_in_sync(step.broadcast(state))
    with jdp.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(3, state)
        restored = step.unreplicate(manager.restore(state))
    assert_trees_close(restored.params, got.params)
    assert_trees_close(restored.opt_state.chunks, got.opt_state.chunks)


def test_multi_steps_around_it_accumulates_each_replicas_gradients():
    """`optax.MultiSteps(jdp.zero(tx))`: the accumulated gradients differ between
    replicas by design, and the replica check raised a ReplicaDivergenceError on
    them at the first step."""
    tx = optax.adam(1e-2)
    multi = optax.MultiSteps(jdp.zero(tx), every_k_schedule=2)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, multi, sync=jdp.local()), check_sync=1
    )
    state = step.replicate(jdp.TrainState.create(params=params0(), tx=multi))
    batches = make_batches(4, GLOBAL_BATCH, seed=2)
    state, _ = run_steps(step, state, batches)
    oracle = optax.MultiSteps(tx, every_k_schedule=2)
    expected, _ = single_device_train(mlp_loss, params0(), oracle, batches)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)


def test_checkpoint_manager_roundtrip_into_another_replica_count(tmp_path):
    tx = optax.adam(1e-2)
    init = zero_init(tx)
    eight = zero_step(tx)
    state, _ = run_steps(eight, eight.replicate(init), make_batches(2, 24))
    with jdp.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(2, state)
        four = zero_step(tx, devices=jax.devices()[:4])
        restored = manager.restore(four.replicate(init))
    assert restored.opt_state.chunks[0].mu["layer0"]["w"].shape == (4, 26)
    assert_trees_close(four.unreplicate(restored), eight.unreplicate(state))


def test_replicas_in_sync_skips_slices_and_broadcast_keeps_them():
    tx = optax.adam(1e-2)
    step = zero_step(tx, devices=jax.devices()[:4])
    state = step.replicate(zero_init(tx))
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
    params = jax.tree.map(lambda x: x.at[1].add(1.0), after.params)
    with pytest.raises(AssertionError, match=r"replica 1 differs"):
        jdp.assert_replicas_in_sync(after.replace(params=params))


def test_clip_grad_norm_matches_optax_chain():
    """The global norm is computed across replicas (a psum of slice norms)."""
    tx = optax.adam(1e-2)
    oracle_tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    batches = make_batches(3, 16, seed=3)
    expected, _ = single_device_train(mlp_loss, params0(), oracle_tx, batches)
    step = zero_step(tx, devices=jax.devices()[:2], clip_grad_norm=0.05)
    state = step.replicate(zero_init(tx, clip_grad_norm=0.05))
    norms = []
    for batch in batches:
        state, _ = step(state, step.shard(batch))
        norms.append(float(step.unreplicate(state).opt_state.grad_norm))
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)
    first = optax.tree.norm(jax.grad(mlp_loss)(params0(), batches[0]))
    np.testing.assert_allclose(norms[0], first, rtol=1e-5)
    assert norms[0] > 0.05  # clipping was active
    assert zero_init(tx).opt_state.grad_norm is None  # kept only when clipping


def _replicate_and_call(tx, params=None):
    step = zero_step(tx, devices=jax.devices()[:2])
    state = step.replicate(zero_init(tx, params))
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
        zero_init(optax.adafactor(1e-3, min_dim_size_to_factor=4))


def test_refuses_mask_chosen_by_shape():
    tx = optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    with pytest.raises(ValueError, match=r"mask chosen\s+by `ndim` or shape"):
        _replicate_and_call(tx)


def test_refuses_optimizer_state_masked_by_shape():
    tx = optax.masked(optax.adam(1e-3), lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    with pytest.raises(
        ValueError, match=r"structure depends on the parameters' shapes"
    ):
        zero_init(tx)


def test_refuses_optimizer_that_communicates():
    tx = optax.chain(jdp.sync_gradients(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"communicates across replicas itself"):
        _replicate_and_call(tx)


def test_a_sync_that_is_not_a_piece_is_refused():
    with pytest.raises(TypeError, match=r"`sync` must be a `jdp.Sync`.*got str"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), sync="zero")


def test_clip_grad_norm_must_be_a_positive_finite_number():
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"`clip_grad_norm` must be a finite number"):
        jdp.zero(tx, clip_grad_norm=0.0)
    with pytest.raises(ValueError, match=r"`clip_grad_norm`.*got inf"):
        jdp.zero(tx, clip_grad_norm=float("inf"))


def test_refuses_integer_parameters():
    params = {"w": jnp.ones((3,)), "n": jnp.zeros((2,), jnp.int32)}
    with pytest.raises(
        ValueError, match=r"(?s)floating-point parameters only.*\['n'\]: int32"
    ):
        zero_init(optax.sgd(0.1), params)


def test_a_state_not_laid_out_by_replicate_is_caught():
    """A whole state placed by hand, or slices for another replica count."""
    tx = optax.sgd(0.1, momentum=0.9)
    step = zero_step(tx, devices=jax.devices()[:2])
    batch = step.shard(make_batches(1, 4)[0])
    whole = jax.tree.map(
        lambda x: jax.device_put(jnp.stack([x, x]), step.sharding), zero_init(tx)
    )
    with pytest.raises(ValueError, match=r"one full logical copy.*of 2 replicas"):
        step(whole, batch)
    four = zero_step(tx, devices=jax.devices()[:4]).replicate(zero_init(tx))
    with pytest.raises(ValueError, match=r"not replicated by this step's"):
        step(step.replicate(zero_init(tx)).replace(opt_state=four.opt_state), batch)


def test_place_like_rejects_a_sharded_host_copy():
    tx = optax.adam(1e-3)
    step = zero_step(tx, devices=jax.devices()[:2])
    state = step.replicate(zero_init(tx))
    with pytest.raises(ValueError, match=r"got a sharded one"):
        _layout.place_like(state, state)


def relaid(state, old, new, holds=True):
    """A replicated `jdp.zero` TrainState of `old` moved onto `new`'s replicas, as
    `jdp.distributed.live` does when the replica set changes: whole leaves keep
    each device's copy, the optimizer-state slices are re-laid out."""
    devices = list(new.mesh.devices.flat)

    def rewrap(x):  # a new device gets a copy (as a replacement is sent one)
        held = {s.device: s.data for s in x.addressable_shards}
        copies = [
            held.get(d, jax.device_put(x.addressable_data(0), d)) for d in devices
        ]
        return jax.make_array_from_single_device_arrays(
            (len(devices),) + x.shape[1:], new.sharding, copies
        )

    summer = jdp.parallelize(
        lambda tree, _: (jax.lax.psum(tree, new.axis_name), {}),
        devices=devices,
        donate_state=False,
    )

    def total(tree):
        return summer(tree, summer.shard(jnp.zeros(len(devices))))[0]

    opt_state = state.opt_state.relayout(rewrap, new.sharding, holds, total)
    return jax.tree.map(rewrap, state.replace(opt_state=None)).replace(
        opt_state=opt_state
    )


@pytest.mark.parametrize(
    "tx, fill",
    [(optax.adam(1e-2), 0.0), (optax.adagrad(0.1, initial_accumulator_value=0.5), 0.5)],
)
def test_a_lost_replica_slices_restart_and_the_others_move(tx, fill):
    """Four replicas, then three (the last device gone, the others reordered):
    every element a live replica held keeps its bits; the lost slice restarts
    from the optimizer's initial value (`fills`), and training goes on."""
    devices = jax.devices()
    four = zero_step(tx, devices[:4])
    three = zero_step(tx, [devices[2], devices[0], devices[1]])
    batches = make_batches(4, 12)
    state, _ = run_steps(four, four.replicate(zero_init(tx)), batches[:2])
    before = four.unreplicate(state)
    state = relaid(state, four, three)
    assert state.opt_state.num_shards == 3
    after = three.unreplicate(state)
    pairs = zip(
        jax.tree.leaves(before.opt_state.chunks),
        jax.tree.leaves(after.opt_state.chunks),
        before.opt_state.shapes,
        before.opt_state.fills,
        strict=True,
    )
    for x, y, shape, f in pairs:
        want = np.array(x).reshape(-1)
        if shape is not None:
            assert f == fill
            rows = -(-want.size // 4)
            want[3 * rows :] = fill
        np.testing.assert_array_equal(np.asarray(y).reshape(-1), want)
    assert_trees_close(after.params, before.params, rtol=0, atol=0)
    state, losses = run_steps(three, state, batches[2:])
    assert np.isfinite(losses).all()
    # Nothing is lost when the replica set grows: a device that holds nothing
    # (a replacement) gets its slices from the others.
    grown = relaid(state, three, four)
    np.testing.assert_array_equal(
        jax.tree.leaves(four.unreplicate(grown).opt_state.chunks)[1],
        jax.tree.leaves(three.unreplicate(state).opt_state.chunks)[1],
    )


def test_an_initial_value_that_depends_on_the_params_cannot_restart():
    def keep_params():  # state: one value per parameter element, from the params
        return optax.GradientTransformation(
            lambda params: jax.tree.map(jnp.copy, params), lambda g, s, p=None: (g, s)
        )

    tx = optax.chain(optax.sgd(0.1), keep_params())
    devices = jax.devices()
    four, three = zero_step(tx, devices[:4]), zero_step(tx, devices[:3])
    state = four.replicate(zero_init(tx))
    assert state.opt_state.fills[-1] is None  # its `w` of layer 0, from params
    with pytest.raises(ValueError, match="died with their process.*depends on the"):
        relaid(state, four, three)
    # Growing loses nothing, so any optimizer moves.
    grown = relaid(three.replicate(zero_init(tx)), three, four)
    assert grown.opt_state.num_shards == 4
