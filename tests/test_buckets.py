import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import (
    assert_trees_close,
    init_mlp,
    make_batches,
    mlp_loss,
    single_device_train,
)

import jdp
from jdp import _buckets


def test_plan_reverse_and_limits():
    shapes = [(10,), (20,), (5,), (100,)]
    dtypes = [np.float32] * 4
    plan = _buckets.plan_buckets(shapes, dtypes, bucket_bytes=120, reverse=True)
    # Leaf 3 (400 B) exceeds the limit and travels alone; then [2, 1] (100 B), [0].
    assert [b.indices for b in plan] == [(3,), (2, 1), (0,)]
    assert [4 * sum(b.sizes) for b in plan] == [400, 100, 40]
    fwd = _buckets.plan_buckets(shapes, dtypes, bucket_bytes=120, reverse=False)
    assert [b.indices for b in fwd] == [(0, 1), (2,), (3,)]


def test_plan_sends_large_leaves_alone_and_keeps_packing_small_ones():
    shapes = [(10,), (100,), (5,), (20,), (200,)]
    dtypes = [np.float32] * 5
    plan = _buckets.plan_buckets(
        shapes, dtypes, bucket_bytes=None, reverse=True, alone_bytes=400
    )
    # Leaves 4 (800 B) and 1 (400 B) travel alone, in the order they are reached;
    # the small leaves 3, 2 and 0 still share one bucket.
    assert [b.indices for b in plan] == [(4,), (1,), (3, 2, 0)]
    plan = _buckets.plan_buckets(shapes, dtypes, bucket_bytes=None, alone_bytes=None)
    assert [b.indices for b in plan] == [(4, 3, 2, 1, 0)]


def test_plan_groups_by_dtype_and_skips_empty():
    shapes = [(4,), (0,), (4,), (4,)]
    dtypes = [np.float32, np.float32, np.float16, np.float32]
    plan = _buckets.plan_buckets(shapes, dtypes, bucket_bytes=None)
    assert {(b.indices, b.dtype.name) for b in plan} == {
        ((3, 0), "float32"),
        ((2,), "float16"),
    }


def test_pack_unpack_roundtrip():
    blocks = [
        jnp.arange(6.0).reshape(2, 3),
        jnp.full((2, 1), 7.0),
        jnp.ones((2, 4)),
    ]
    packed = _buckets.pack(blocks)
    assert packed.shape == (2, 8)
    parts = _buckets.unpack(packed, [3, 1, 4])
    assert [p.shape for p in parts] == [(2, 3), (2, 1), (2, 4)]
    for part, x in zip(parts, blocks, strict=True):
        np.testing.assert_array_equal(part, x)


def test_all_computed_keeps_every_bit_and_holds_only_large_float_leaves():
    big = np.arange(128 * 128, dtype=np.float32).reshape(128, 128)  # 64 KiB
    big[0, 0], big[0, 1], big[1, 0] = -0.0, np.nan, -np.inf
    tree = {
        "big": big,
        "small": np.full(3, -0.0, np.float32),
        "count": np.arange(20000, dtype=np.int32),  # large, not a float
        "empty": np.zeros((0, 4), np.float32),
    }
    out = jax.jit(_buckets.all_computed)(tree)
    for key, value in tree.items():
        assert out[key].shape == value.shape and out[key].dtype == value.dtype, key
        np.testing.assert_array_equal(
            np.asarray(out[key]).view(np.uint8), value.view(np.uint8), err_msg=key
        )
    held = jax.make_jaxpr(_buckets.all_computed)(tree)
    # One in-place update of one element, for the one float leaf of 64 KiB or more.
    assert str(held).count("dynamic_update_slice") == 1
    assert _buckets.all_computed({"small": tree["small"]})["small"] is tree["small"]


def test_a_local_step_on_one_device_updates_its_weights_without_copying_them():
    # XLA may update a weight while the backward pass still reads it, and then
    # copies it first (every step); the gradients held until all are computed
    # order the update after the last read, as an all-reduce of them would.
    params = init_mlp(jax.random.key(0), sizes=(16, 256, 256, 4))
    tx = optax.sgd(0.1, momentum=0.9)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), devices=jax.devices()[:1]
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batch = step.shard(make_batches(1, 8, in_dim=16, out_dim=4)[0])
    text = step.lower(state, batch).compile().as_text()
    copied = [line for line in text.splitlines() if " copy(" in line]
    assert not [line for line in copied if "[256,256]" in line], copied
    host_batch = jax.device_get(batch)
    new, _ = step(state, batch)
    oracle, _ = single_device_train(mlp_loss, params, tx, [host_batch])
    assert_trees_close(step.unreplicate(new).params, oracle, rtol=1e-6)
