import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batches, mlp_loss

import jdp
from jdp import _collectives


def per_replica_tree(num):
    """A tree whose values differ per replica: mixed dtypes, scalars, empty, ints."""
    rng = np.random.default_rng(0)
    return {
        "a": rng.normal(size=(num, 3, 5)).astype(np.float32),
        "b": rng.normal(size=(num,)).astype(np.float32),  # a scalar per replica
        "c": rng.normal(size=(num, 7)).astype(np.float16),
        "empty": np.zeros((num, 0, 4), np.float32),
        "count": np.arange(num, dtype=np.int32),
        "flag": np.arange(num) % 2 == 0,
    }


def run_per_replica(fn, tree, backend, num):
    """Runs fn on each replica's slice of `tree` (leading axis = replica)."""
    step = jdp.parallelize(
        lambda s, b: (fn(s), {}),
        backend=backend,
        devices=jax.devices()[:num],
        check_sync=None,  # replicas hold different values on purpose
    )
    placed = jax.tree.map(lambda x: jax.device_put(x, step.sharding), tree)
    out, _ = step(placed, step.shard(np.zeros(num, np.float32)))
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("flatten", [False, True], ids=["tuple", "flat"])
@pytest.mark.parametrize("bucket_bytes", [None, 16, 25 * 2**20])
def test_all_reduce_equals_pmean(backend, bucket_bytes, flatten):
    num = 4
    tree = per_replica_tree(num)
    got = run_per_replica(
        lambda t: jdp.all_reduce_gradients(
            t, bucket_bytes=bucket_bytes, flatten=flatten
        ),
        tree,
        backend,
        num,
    )
    for key in ("a", "b", "c"):
        expected = np.broadcast_to(
            tree[key].astype(np.float32).mean(0), tree[key].shape
        )
        np.testing.assert_allclose(
            got[key].astype(np.float32), expected, rtol=1e-3 if key == "c" else 1e-6
        )
        assert got[key].dtype == tree[key].dtype
    assert got["empty"].shape == tree["empty"].shape
    # Integer and boolean leaves are not averaged: each replica keeps its own.
    np.testing.assert_array_equal(got["count"], tree["count"])
    np.testing.assert_array_equal(got["flag"], tree["flag"])


def test_bf16_wire_dtype_keeps_result_dtype(backend):
    num = 4
    tree = {"w": np.random.default_rng(1).normal(size=(num, 64)).astype(np.float32)}
    got = run_per_replica(
        lambda t: jdp.all_reduce_gradients(t, reduce_dtype=jnp.bfloat16),
        tree,
        backend,
        num,
    )
    assert got["w"].dtype == np.float32
    np.testing.assert_allclose(got["w"][0], tree["w"].mean(0), rtol=2e-2, atol=2e-2)


def lowered_all_reduces(tree, **options):
    """The all-reduces a step issuing all_reduce_gradients(tree) lowers to."""

    def step_fn(state, batch):
        return jdp.all_reduce_gradients(state, **options), {}

    step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
    state = step.replicate(tree)
    batch = step.shard(np.zeros(2, np.float32))
    return step, state, batch, step.collectives(state, batch, stage="lowered")


def test_buckets_count_and_reverse_order_in_hlo():
    # Five f32 leaves of 400-416 bytes, in pytree order l0..l4.
    tree = {f"l{i}": jnp.full((100 + i,), float(i)) for i in range(5)}
    sizes = [4 * (100 + i) for i in range(5)]
    _, _, _, ops = lowered_all_reduces(tree, bucket_bytes=900, flatten=True)
    # Reverse order, at most 900 bytes: [l4, l3], [l2, l1], [l0]; one flat psum each.
    assert [c.kind for c in ops] == ["all-reduce"] * 3
    assert [c.shapes for c in ops] == [((207,),), ((203,),), ((100,),)]
    assert [c.bytes for c in ops] == [
        sizes[4] + sizes[3],
        sizes[2] + sizes[1],
        sizes[0],
    ]
    assert [c.order for c in ops] == [0, 1, 2]
    _, _, _, fwd = lowered_all_reduces(
        tree, bucket_bytes=900, reverse=False, flatten=True
    )
    assert [c.bytes for c in fwd] == [
        sizes[0] + sizes[1],
        sizes[2] + sizes[3],
        sizes[4],
    ]
    _, _, _, one = lowered_all_reduces(tree, bucket_bytes=None, flatten=True)
    assert [c.bytes for c in one] == [sum(sizes)]


def test_flat_buffers_leave_large_leaves_uncopied():
    # Packing copies a leaf in and out of a buffer; from ALONE_BYTES on, a leaf
    # costs more to copy than to send as one more array, so it travels as it is.
    big = _collectives.ALONE_BYTES // 4
    tree = {"a": jnp.ones((3,)), "big": jnp.ones((2, big // 2)), "z": jnp.ones((5,))}
    step, state, batch, ops = lowered_all_reduces(tree, bucket_bytes=None, flatten=True)
    assert sorted(c.shapes for c in ops) == [((8,),), ((big,),)]
    text = step.lower(state, batch).as_text()
    assert not re.search(rf"concatenate.*tensor<1x{big + 8}xf32>", text)
    out, _ = step(state, batch)
    np.testing.assert_array_equal(out["big"].addressable_shards[0].data[0], tree["big"])


def test_unflattened_buckets_issue_leaves_last_first():
    tree = {f"l{i}": jnp.full((100 + i,), float(i)) for i in range(5)}
    step, state, batch, ops = lowered_all_reduces(tree, flatten=False)
    # One psum per leaf, last leaf first; XLA's combiner merges them when compiling.
    assert [c.shapes for c in ops] == [
        ((104,),),
        ((103,),),
        ((102,),),
        ((101,),),
        ((100,),),
    ]
    compiled = step.collectives(state, batch)
    assert sum(c.bytes for c in compiled) == sum(c.bytes for c in ops)


def test_default_packing_follows_the_runtime():
    tree = {f"l{i}": jnp.ones((10,)) for i in range(3)}
    _, _, _, ops = lowered_all_reduces(tree)
    # One process: no flat copies (XLA combines the per-leaf all-reduces itself).
    assert len(ops) == 3


def test_bf16_compression_in_lowered_and_compiled_hlo():
    tree = {"w": jnp.ones((256,)), "b": jnp.ones((8,))}
    step, state, batch, ops = lowered_all_reduces(
        tree, reduce_dtype=jnp.bfloat16, flatten=True
    )
    assert [(c.dtype, c.bytes) for c in ops] == [("bf16", 2 * 264)]
    compiled = step.collectives(state, batch)
    # XLA:CPU computes a bf16 all-reduce in f32; GPUs keep bf16. Report what runs.
    assert sum(c.bytes for c in compiled) in (2 * 264, 4 * 264)


def test_unbound_axis_errors():
    with pytest.raises(
        RuntimeError, match=r"jdp\.all_reduce_gradients.*jdp\.parallelize"
    ):
        jdp.all_reduce_gradients({"w": jnp.ones(3)})
    tx = jdp.sync_gradients()
    with pytest.raises(RuntimeError, match=r"jdp\.sync_gradients.*not bound"):
        tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))
    for tx in (
        jdp.sync_gradients(jdp.all_reduce(wire=jdp.wire.int8())),
        jdp.sync_gradients(jdp.all_reduce(wire=jdp.wire.bf16(), error_feedback=True)),
    ):
        with pytest.raises(
            RuntimeError,
            match=r"`jdp\.sync_gradients` needs the replica axis 'data', which is "
            r"not bound here\. Call it inside a step run by `jdp\.parallelize",
        ):
            tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))
    # A train step with a wire piece, called outside `jdp.parallelize`.
    sync = jdp.all_reduce(wire=jdp.wire.int8())
    step = jdp.make_train_step(
        lambda p, b: jnp.sum(p["w"] * b), optax.sgd(0.1), sync=sync
    )
    state = jdp.TrainState.create(params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))
    with pytest.raises(RuntimeError, match=r"`jdp\.all_reduce` needs the replica"):
        step(state, jnp.ones(3))
    with pytest.raises(RuntimeError, match=r"jdp\.broadcast"):
        jdp.broadcast({"w": jnp.ones(3)})
    with pytest.raises(RuntimeError, match=r"jdp\.sync_batch_stats"):
        jdp.sync_batch_stats({"w": jnp.ones(3)})


def test_bad_options():
    with pytest.raises(ValueError, match=r"`bucket_bytes` must be an int >= 1"):
        jdp.all_reduce(bucket_bytes=0)
    with pytest.raises(TypeError, match=r"`bucket_bytes` must be an int.*2\.5"):
        jdp.all_reduce_gradients({}, bucket_bytes=2.5)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        run_per_replica(
            lambda t: jdp.sync_batch_stats(t, mode="median"),
            {"x": np.ones((2, 1), np.float32)},
            "shard_map",
            2,
        )
    with pytest.raises(ValueError, match=r"`root` must be an int in \[0, num_rep"):
        run_per_replica(
            lambda t: jdp.broadcast(t, root=5), {"x": np.ones((2, 1))}, "shard_map", 2
        )


@pytest.mark.parametrize("mode", ["mean", "broadcast"])
def test_sync_batch_stats(backend, mode):
    num = 4
    tree = per_replica_tree(num)
    del tree["empty"]
    got = run_per_replica(
        lambda t: jdp.sync_batch_stats(t, mode=mode), tree, backend, num
    )
    if mode == "mean":
        np.testing.assert_allclose(got["a"][1], tree["a"].mean(0), rtol=1e-6)
        np.testing.assert_array_equal(got["count"], tree["count"])
    else:
        for key in tree:
            np.testing.assert_array_equal(
                got[key], np.broadcast_to(tree[key][0], tree[key].shape)
            )


def test_broadcast_any_root_and_dtype(backend):
    num = 4
    tree = per_replica_tree(num)
    got = run_per_replica(lambda t: jdp.broadcast(t, root=3), tree, backend, num)
    for key in tree:
        np.testing.assert_array_equal(
            got[key], np.broadcast_to(tree[key][3], tree[key].shape)
        )


def test_broadcast_keeps_the_roots_bits(backend):
    # A sum with +0.0 from the other replicas would turn the root's -0.0 into +0.0.
    num = 4
    values = np.array([-0.0, 0.0, -3e-38, np.inf, -np.inf, 1.5], np.float32)
    c64 = values.astype(np.complex64)
    c64.imag = -values[::-1]
    tree = {
        "f32": np.stack([values * (r + 1) for r in range(num)]),
        "c64": np.stack([c64 if r == 1 else -c64 for r in range(num)]),
    }
    got = run_per_replica(lambda t: jdp.broadcast(t, root=1), tree, backend, num)
    for key in tree:
        bits = np.asarray(got[key]).view(np.uint32)
        root = np.broadcast_to(tree[key][1], tree[key].shape).view(np.uint32)
        np.testing.assert_array_equal(bits, root)


def test_sync_gradients_in_a_chain_equals_make_train_step(backend):
    params = init_mlp(jax.random.key(0))
    batches = make_batches(5, 16)
    base = optax.sgd(0.1, momentum=0.9)
    chained = optax.chain(jdp.sync_gradients(jdp.all_reduce(bucket_bytes=512)), base)

    def run(tx, sync):
        step = jdp.parallelize(
            jdp.make_train_step(mlp_loss, tx, sync=sync), backend=backend
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        for b in batches:
            state, _ = step(state, step.shard(b))
        jdp.assert_replicas_in_sync(state)
        return step.unreplicate(state).params

    assert_trees_close(
        run(chained, jdp.local()), run(base, jdp.all_reduce()), rtol=1e-6
    )


def test_sync_gradients_contract():
    tx = jdp.sync_gradients()
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    assert isinstance(state, optax.EmptyState)
    # Inside optax.MultiSteps and under jit with a bound axis (vmap binds one).
    multi = optax.MultiSteps(optax.chain(tx, optax.sgd(1.0)), every_k_schedule=2)
    ms_state = multi.init(params)

    @jax.jit
    def update(g, s):
        return jax.vmap(
            lambda g: multi.update(g, s, params), axis_name="data", in_axes=0
        )(g)

    g = {"w": jnp.stack([jnp.ones(3), 3 * jnp.ones(3)])}
    updates, new_state = update(g, ms_state)
    np.testing.assert_allclose(updates["w"], 0.0)  # accumulating, no update yet
    assert jax.tree.structure(new_state) == jax.tree.structure(
        jax.tree.map(lambda x: x[None], ms_state)
    )
    # The second micro-step applies the replicas' mean gradient, (1 + 3) / 2.
    second = jax.jit(
        jax.vmap(lambda g, s: multi.update(g, s, params), axis_name="data")
    )
    updates, _ = second(g, new_state)
    np.testing.assert_allclose(updates["w"], -2.0)


@pytest.mark.parametrize("flatten", [False, True], ids=["tuple", "flat"])
def test_chained_buckets_sum_bit_for_bit(backend, flatten):
    # Every bucket but the first waits for the one before through a -0.0 added to
    # its first element: no value may change, signed zeros, inf and NaN included.
    num = 4
    rng = np.random.default_rng(2)
    tree = {}
    for i, first in enumerate([-0.0, np.inf, np.nan, -0.0]):
        tree[f"l{i}"] = rng.normal(size=(num, 6)).astype(np.float32)
        tree[f"l{i}"][:, 0] = first
    tree["h"] = rng.normal(size=(num, 5)).astype(np.float16)
    tree["h"][:, 0] = -0.0
    tree["z"] = (rng.normal(size=(num, 3)) + 1j * rng.normal(size=(num, 3))).astype(
        np.complex64
    )
    tree["z"][:, 0] = complex(np.inf, -0.0)

    def psum_mean(x):  # float16 is divided first (`all_reduce`'s overflow rule)
        if x.dtype == np.float16:
            return jax.lax.psum(x / num, "data")
        return jax.lax.psum(x, "data") / num

    got = run_per_replica(
        lambda t: jdp.all_reduce_gradients(t, bucket_bytes=16, flatten=flatten),
        tree,
        backend,
        num,
    )
    want = run_per_replica(lambda t: jax.tree.map(psum_mean, t), tree, backend, num)
    for key, x in want.items():
        bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
        np.testing.assert_array_equal(got[key].view(bits), x.view(bits), err_msg=key)
