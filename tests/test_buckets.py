import jax.numpy as jnp
import numpy as np

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
