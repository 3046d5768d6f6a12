import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    CompileCounter,
    assert_trees_close,
    init_mlp,
    make_batches,
    mlp_apply,
    mlp_loss,
    single_device_train,
)
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jdp

GLOBAL_BATCH = 32


def train(step, params, tx, batches):
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    losses = []
    for batch in batches:
        state, metrics = step(state, step.shard(batch))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize(
    "tx_name", ["sgd_momentum", "adam"], ids=["sgd_momentum", "adam"]
)
def test_matches_single_device(backend, devices, tx_name):
    tx = {"sgd_momentum": optax.sgd(0.05, momentum=0.9), "adam": optax.adam(1e-2)}[
        tx_name
    ]
    params = init_mlp(jax.random.key(0))
    batches = make_batches(20, GLOBAL_BATCH)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx), backend=backend, devices=devices
    )
    state, losses = train(step, params, tx, batches)
    expected, _ = single_device_train(mlp_loss, params, tx, batches)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)
    assert int(step.unreplicate(state).step) == 20
    jdp.assert_replicas_in_sync(state)
    # Metrics come back averaged: one value equal to the loss on the global batch.
    assert np.shape(losses[0]) == ()
    np.testing.assert_allclose(losses[0], mlp_loss(params, batches[0]), rtol=1e-5)


def test_gradients_are_the_global_mean_not_scaled_by_replicas(backend):
    """Catches the check_vma pitfall: grads summed implicitly, then pmean'd on top."""
    params = init_mlp(jax.random.key(1))
    batch = make_batches(1, GLOBAL_BATCH)[0]

    def grad_step(state, batch):
        grads = jax.grad(mlp_loss)(state, batch)
        return state, {"g": jdp.all_reduce_gradients(grads)["layer0"]["w"].sum()}

    step = jdp.parallelize(grad_step, backend=backend)
    _, metrics = step(step.replicate(params), step.shard(batch))
    expected = jax.grad(mlp_loss)(params, batch)["layer0"]["w"].sum()
    np.testing.assert_allclose(metrics["g"], expected, rtol=1e-5)


def test_the_pitfall_this_layout_avoids_is_real():
    """With check_vma=True and a P() param, a pmean on top multiplies grads by N."""
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    w = jax.device_put(jnp.float32(1.0), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.arange(1.0, 9.0), NamedSharding(mesh, P("data")))

    def body(w, x):
        g = jax.grad(lambda w: jnp.mean(w * x))(w)
        return lax.pmean(g, "data")

    naive = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    )(w, x)
    # The true gradient of mean(w * x) over all 8 examples is mean(x) = 4.5.
    assert float(naive) == pytest.approx(8 * 4.5)

    def step_fn(state, batch):
        g = jax.grad(lambda w: jnp.mean(w * batch))(state)
        return state, {"g": jdp.all_reduce_gradients(g)}

    step = jdp.parallelize(step_fn)
    _, metrics = step(step.replicate(jnp.float32(1.0)), step.shard(np.arange(1.0, 9.0)))
    assert float(metrics["g"]) == pytest.approx(4.5)


def test_compiles_once_in_a_loop(backend):
    traces = []

    def loss_fn(params, batch):
        traces.append(1)
        return mlp_loss(params, batch)

    tx = optax.sgd(0.1)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), backend=backend)
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    batches = [step.shard(b) for b in make_batches(6, GLOBAL_BATCH)]
    with CompileCounter() as first:
        state, _ = step(state, batches[0])
    with CompileCounter() as rest:
        for batch in batches[1:]:
            state, _ = step(state, batch)
    assert first.count >= 1
    assert rest.count == 0, "the step recompiled on the state it returned"
    assert len(traces) == 1


def test_donation_deletes_old_state_and_loops(backend):
    tx = optax.adam(1e-3)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), backend=backend)
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    batch = step.shard(make_batches(1, GLOBAL_BATCH)[0])
    old = state
    for _ in range(3):
        state, _ = step(state, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(old))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_no_donation_keeps_old_state(backend):
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx), backend=backend, donate_state=False
    )
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    new, _ = step(state, step.shard(make_batches(1, GLOBAL_BATCH)[0]))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_donated_shard_map_step_updates_buffers_in_place(monkeypatch):
    """The donated state is updated where it lies: no whole-buffer copies."""
    monkeypatch.setattr(jdp._backends, "VIEW_MIN_BYTES", 0)  # small leaves, too
    tx = optax.sgd(0.1, momentum=0.9)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), backend="shard_map")
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    batch = step.shard(make_batches(1, GLOBAL_BATCH)[0])
    text = step.lower(state, batch).compile().as_text()
    assert text.count(" copy(") == 0, "XLA copies the donated state every step"

    def pointers(tree):
        return [
            x.addressable_shards[0].data.unsafe_buffer_pointer()
            for x in jax.tree.leaves(tree)
            if x.ndim > 1
        ]

    state, _ = step(state, batch)  # the first step moves out of `replicate`'s buffers
    before = pointers((state.params, state.opt_state))
    state, _ = step(state, batch)
    assert pointers((state.params, state.opt_state)) == before


SHAPES = {
    "scalar": (),
    "one": (1,),
    "row": (1, 4),
    "vec": (3,),
    "empty": (0, 3),
    "cube": (2, 1, 5),
    "unit": (1, 1),
    "big": (64, 512),  # 128 KiB: above the size from which the step uses views
    "big_row": (1, 64, 512),
}


@pytest.mark.parametrize("view_min_bytes", [0, None], ids=["all_views", "default"])
def test_donated_step_keeps_every_leaf_shape(backend, view_min_bytes, monkeypatch):
    """Leaves of every per-replica shape come back as a non-donated step gives."""
    if view_min_bytes is not None:  # every leaf that can be viewed is
        monkeypatch.setattr(jdp._backends, "VIEW_MIN_BYTES", view_min_bytes)
    tree = {
        k: np.arange(np.prod(s), dtype=np.float32).reshape(s) for k, s in SHAPES.items()
    }
    tree["count"] = np.int32(3)
    tree["key"] = jax.random.key(0)
    tree["keys"] = jax.random.split(jax.random.key(1), 3)

    def step_fn(state, batch):
        new = {k: v * 2 + batch.sum() for k, v in state.items() if k in SHAPES}
        new["count"] = state["count"] + 1
        new["key"] = jax.random.split(state["key"])[0]
        new["keys"] = jax.vmap(lambda k: jax.random.split(k)[1])(state["keys"])
        new["extra"] = state["extra"] + lax.axis_index("data")
        return new, {}

    def run(donate):
        step = jdp.parallelize(
            step_fn,
            backend=backend,
            devices=jax.devices()[:4],
            donate_state=donate,
            check_sync=None,  # the replicas' values differ on purpose
        )
        state = step.replicate(dict(tree, extra=np.zeros((2, 3), np.float32)))
        batch = step.shard(np.arange(8.0, dtype=np.float32))
        for _ in range(2):
            old = state
            state, _ = step(state, batch)
        return old, state

    old, got = run(True)
    _, want = run(False)
    assert [k for k, x in old.items() if not x.is_deleted()] == []
    for path, x in jax.tree_util.tree_leaves_with_path(want):
        y = got
        for p in path:
            y = y[p.key]
        assert y.shape == x.shape and y.dtype == x.dtype, path
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim), path
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=str(path))
    assert np.asarray(got["extra"])[:, 0, 0].tolist() == [0, 2, 4, 6]


def test_donating_a_state_with_a_shared_leaf_is_refused(backend):
    """One array in two leaves would be donated twice (PjRt then crashes)."""
    step = jdp.parallelize(lambda s, b: (s, {}), backend=backend)
    placed = step.replicate({"w": np.ones((64, 64), np.float32)})["w"]
    batch = step.shard(np.zeros(8, np.float32))
    with pytest.raises(
        ValueError, match=r"\['w_tied'\]\['b'\] is the same array as \['w'\]"
    ):
        step({"w": placed, "w_tied": {"b": placed}}, batch)
    assert not placed.is_deleted()
    keep = jdp.parallelize(lambda s, b: (s, {}), backend=backend, donate_state=False)
    new, _ = keep({"w": placed, "w_tied": {"b": placed}}, batch)
    np.testing.assert_array_equal(np.asarray(new["w_tied"]["b"]), np.asarray(placed))


def test_shard_layouts(backend):
    step = jdp.parallelize(
        lambda s, b: (s, {}), backend=backend, devices=jax.devices()[:4]
    )
    batch = step.shard({"x": np.zeros((8, 3), np.float32)})
    expected = (4, 2, 3) if backend == "pmap" else (8, 3)
    assert batch["x"].shape == expected
    assert len(batch["x"].addressable_shards) == 4
    state = step.replicate({"w": np.ones((5,), np.float32), "n": 3})
    assert state["w"].shape == (4, 5)
    assert state["n"].dtype == jnp.int32
    one = step.unreplicate(state)
    assert one["w"].shape == (5,)
    assert len(one["w"].devices()) == 1


def test_shard_not_divisible_names_leaf_and_sizes():
    step = jdp.parallelize(lambda s, b: (s, {}))
    with pytest.raises(
        ValueError, match=r"\['x'\] has leading size 10.*num_replicas=8"
    ):
        step.shard({"x": np.zeros((10, 2)), "y": np.zeros((10,))})
    with pytest.raises(ValueError, match=r"\['s'\] is a scalar"):
        step.shard({"s": 1.0})


def test_state_not_replicated_error(backend):
    step = jdp.parallelize(lambda s, b: (s, {}), backend=backend)
    batch = step.shard(np.zeros((8,), np.float32))
    with pytest.raises(ValueError, match=r"\['w'\].*call|step\.replicate"):
        step({"w": np.ones(3, np.float32)}, batch)
    other = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"step\.replicate\(other\.unreplicate"):
        step(other.replicate({"w": np.ones(3, np.float32)}), batch)


def test_batch_not_sharded_error():
    step = jdp.parallelize(lambda s, b: (s, {}))
    state = step.replicate({"w": 1.0})
    with pytest.raises(ValueError, match=r"(?s)\['x'\].*step\.shard"):
        step(state, {"x": np.zeros((8,), np.float32)})


def test_forward_only_step_keeps_state(backend):
    params = init_mlp(jax.random.key(0))

    def eval_step(params, batch):
        return {"mse": jnp.mean((mlp_apply(params, batch["x"]) - batch["y"]) ** 2)}

    step = jdp.parallelize(eval_step, backend=backend)
    state = step.replicate(params)
    batch = make_batches(1, GLOBAL_BATCH)[0]
    metrics = step(state, step.shard(batch))
    assert set(metrics) == {"mse"}
    np.testing.assert_allclose(metrics["mse"], mlp_loss(params, batch), rtol=1e-5)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    metrics = step(state, step.shard(batch))  # still usable


def test_padded_eval_ignores_padding(backend):
    params = init_mlp(jax.random.key(0))
    batch = make_batches(1, 13)[0]

    def eval_step(params, batch):
        data, mask = batch
        err = jnp.sum((mlp_apply(params, data["x"]) - data["y"]) ** 2, axis=-1)
        return {"sum": jnp.sum(err * mask), "count": jnp.sum(mask)}

    step = jdp.parallelize(eval_step, backend=backend)
    data, mask = step.shard(batch, pad=True)
    assert int(np.asarray(mask).sum()) == 13 and mask.size == 16
    m = step(step.replicate(params), (data, mask))
    expected = np.mean(np.sum((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, -1))
    np.testing.assert_allclose(m["sum"] / m["count"], expected, rtol=1e-5)


def test_shard_pad_needs_one_batch_size():
    step = jdp.parallelize(lambda s, b: (s, {}))
    with pytest.raises(ValueError, match="one leading batch size"):
        step.shard({"x": np.zeros((5,)), "y": np.zeros((6,))}, pad=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="`backend` must be one of"):
        jdp.parallelize(lambda s, b: (s, {}), backend="vmap")
    with pytest.raises(ValueError, match="`devices` is empty"):
        jdp.parallelize(lambda s, b: (s, {}), devices=[])
    step = jdp.parallelize(lambda s, b: 3.0)
    with pytest.raises(TypeError, match=r"must return `\(state, metrics\)`"):
        step(step.replicate({}), step.shard(np.zeros(8)))


def test_step_broadcast_outside_a_step(backend):
    step = jdp.parallelize(
        lambda s, b: (s, {}), backend=backend, devices=jax.devices()[:4]
    )
    state = step.replicate({"w": jnp.zeros(3), "i": jnp.int32(0)})
    local = jax.device_put(
        np.arange(4 * 3, dtype=np.float32).reshape(4, 3), step.sharding
    )
    state = {"w": local, "i": state["i"]}
    assert not jdp.replicas_in_sync(state)
    synced = step.broadcast(state, root=2)
    jdp.assert_replicas_in_sync(synced)
    np.testing.assert_array_equal(step.unreplicate(synced)["w"], [6.0, 7.0, 8.0])


def test_step_broadcast_compiles_once_for_repeated_calls(backend):
    step = jdp.parallelize(
        lambda s, b: (s, {}), backend=backend, devices=jax.devices()[:4]
    )
    state = step.replicate({"w": jnp.zeros(3)})
    step.broadcast(state)
    with CompileCounter() as again:
        for _ in range(3):
            state = step.broadcast(state)
    assert again.count == 0


def test_collectives_report(backend):
    tx = optax.sgd(0.1)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), backend=backend)
    params = init_mlp(jax.random.key(0))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batch = step.shard(make_batches(1, GLOBAL_BATCH)[0])
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    compiled = step.collectives(state, batch)
    assert {c.kind for c in compiled} == {"all-reduce"}
    # Gradients (one bucket) plus the loss metric; XLA:CPU may combine them.
    # The loss metric: its sum and replica 0's value (exact when alike).
    assert sum(c.bytes for c in compiled) == grad_bytes + 8
    assert all(not c.in_conditional for c in compiled)
    assert compiled[0].replica_groups == (tuple(range(8)),)
    lowered = step.collectives(state, batch, stage="lowered")
    # One process: a psum per gradient leaf, last layer first, then the loss
    # (its sum, and replica 0's value).
    leaf_bytes = [x.size * 4 for x in jax.tree.leaves(params)]
    assert [c.bytes for c in lowered] == leaf_bytes[::-1] + [4, 4]
    with pytest.raises(ValueError, match="`stage`"):
        step.collectives(state, batch, stage="optimized")


def test_back_to_back_steps_without_reading_results(backend):
    """XLA:CPU can deadlock on queued collective steps; jdp keeps one in flight."""
    step = jdp.parallelize(
        lambda s, b: (s + jax.lax.pmean(b.sum(), "data"), {}), backend=backend
    )
    state = step.replicate(jnp.float32(0.0))
    batch = step.shard(np.ones(8, np.float32))
    for _ in range(300):
        state, _ = step(state, batch)
    np.testing.assert_allclose(step.unreplicate(state), 300.0)


# -- misuse that used to crash, hang or pass in silence ------------------------


def sgd_step(backend, **kw):
    tx = optax.sgd(0.1)

    def loss_fn(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), backend=backend, **kw)
    state = step.replicate(
        jdp.TrainState.create(params={"w": jnp.zeros((3, 1))}, tx=tx)
    )
    batch = step.shard(
        {"x": np.ones((8, 3), np.float32), "y": np.ones((8, 1), np.float32)}
    )
    return step, state, batch


def test_reusing_a_donated_state_is_an_error_not_a_crash(backend):
    step, state, batch = sgd_step(backend)
    new, _ = step(state, batch)
    with pytest.raises(
        ValueError, match=r"(?s)donated to an earlier step.*\.params\['w'\].*returned"
    ):
        step(state, batch)
    with pytest.raises(
        ValueError, match=r"(?s)^`step\.unreplicate`: .*donated.*\.params\['w'\]"
    ):
        step.unreplicate(state)  # JAX's own error named neither leaf nor cause
    new, _ = step(new, batch)  # the returned state goes on
    assert np.isfinite(float(step.unreplicate(new).params["w"][0, 0]))


def test_unreplicating_twice_is_refused_naming_the_leaves(backend):
    """The second call cut each leaf's first shard (the whole array) to its
    first axis: "cannot reshape", or for a leading size of 1 a silent squeeze."""
    step, state, _ = sgd_step(backend)
    one = step.unreplicate(state)
    assert one.params["w"].shape == (3, 1)
    with pytest.raises(
        ValueError,
        match=r"(?s)^`step\.unreplicate` takes a pytree the step replicated.*"
        r"\.params\['w'\]: shape \(3, 1\)",
    ):
        step.unreplicate(one)
    # Leaves without a replica axis to take (scalars, non-arrays) pass through.
    assert step.unreplicate({"n": 3, "s": jnp.ones(())}) == {"n": 3, "s": 1.0}


def test_a_returned_state_donated_by_another_step_is_still_refused(backend):
    """The state a step returned skips the placement checks on its next call,
    unless something deleted it since: another step donating it, say."""
    step, state, batch = sgd_step(backend)
    other, _, _ = sgd_step(backend)
    new, _ = step(state, batch)
    other(new, batch)  # donates `new`
    with pytest.raises(ValueError, match=r"(?s)donated to an earlier step"):
        step(new, batch)


def test_a_step_keeps_no_returned_state_alive(backend):
    step, state, batch = sgd_step(backend)
    state, _ = step(state, batch)
    leaf = weakref.ref(state.params["w"])
    del state
    gc.collect()
    assert leaf() is None


def test_a_forward_only_step_never_donates_a_scalar_leaf(backend):
    def eval_step(state, batch):
        return {"logits": jnp.mean(batch * state["temperature"])}

    step = jdp.parallelize(eval_step, backend=backend, devices=jax.devices()[:4])
    state = step.replicate({"temperature": jnp.float32(2.0)})
    batch = step.shard(np.ones(8, np.float32))
    for _ in range(2):
        assert float(step(state, batch)["logits"]) == 2.0
    assert not state["temperature"].is_deleted()


@pytest.mark.parametrize("donate", [True, False], ids=["donate", "keep"])
def test_a_step_that_changes_a_dtype_is_refused_on_the_first_call(backend, donate):
    def to_bf16(state, batch):
        return {"w": (state["w"] + batch.sum()).astype(jnp.bfloat16)}, {}

    step = jdp.parallelize(to_bf16, backend=backend, donate_state=donate)
    state = step.replicate({"w": jnp.zeros(3)})
    with pytest.raises(TypeError, match=r"\['w'\]: float32\[3\] -> bfloat16\[3\]"):
        step(state, step.shard(np.ones(8, np.float32)))
    assert not state["w"].is_deleted()  # refused before anything was donated


@pytest.mark.parametrize("donate", [True, False], ids=["donate", "keep"])
def test_a_structure_change_on_a_later_shape_is_refused(backend, donate):
    """The first call checks what the step returns; a later call with new shapes
    compiles again, and a step whose returned structure depends on the shapes is
    refused while tracing, before its input is donated."""

    def grows(state, batch):
        new = {"w": state["w"] + batch.sum()}
        if state["w"].shape[-1] > 3:
            new["extra"] = state["w"]
        return new, {}

    step = jdp.parallelize(grows, backend=backend, donate_state=donate)
    batch = step.shard(np.ones(8, np.float32))
    state, _ = step(step.replicate({"w": jnp.zeros(3)}), batch)
    wide = step.replicate({"w": jnp.zeros(5)})
    with pytest.raises(TypeError, match=r"structure changed from .*'w'.* to .*'extra'"):
        step(wide, batch)
    assert not wide["w"].is_deleted()


@pytest.mark.parametrize("donate", [True, False], ids=["donate", "keep"])
def test_a_dtype_change_is_refused_for_a_later_state_or_batch_too(backend, donate):
    """Only the first state a step saw was checked: a bfloat16 copy of the model,
    or a float32 batch after bfloat16 ones, came back float32 without a word."""

    def sgd(state, batch):
        return {"w": state["w"] - jnp.float32(0.1) * jnp.mean(batch)}, {}

    step = jdp.parallelize(sgd, backend=backend, donate_state=donate)
    batch = step.shard(np.ones(8, np.float32))
    step(step.replicate({"w": jnp.zeros(3)}), batch)
    bf16 = step.replicate({"w": jnp.zeros(3, jnp.bfloat16)})
    with pytest.raises(TypeError, match=r"\['w'\]: bfloat16\[3\] -> float32\[3\]"):
        step(bf16, batch)
    assert not bf16["w"].is_deleted()

    def scaled(state, batch):
        return {"w": state["w"] * jnp.mean(batch)}, {}

    step = jdp.parallelize(scaled, backend=backend, donate_state=donate)
    state = step.replicate({"w": jnp.ones(3, jnp.bfloat16)})
    state, _ = step(state, step.shard(np.ones(8, jnp.bfloat16)))
    with pytest.raises(TypeError, match=r"bfloat16\[3\] -> float32\[3\]"):
        step(state, step.shard(np.ones(8, np.float32)))
    assert not state["w"].is_deleted()


def test_a_batch_the_step_fails_on_leaves_the_state_usable(backend):
    """The shard_map backend donated the state before tracing the new batch
    shape: after the error, the state was gone."""
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx),
        backend=backend,
    )
    params = {"w": jnp.zeros((128, 128))}  # above the view threshold
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    good = step.shard(np.ones((16, 128), np.float32))
    state, _ = step(state, good)
    with pytest.raises(TypeError, match="dot_general"):
        step(state, step.shard(np.ones((16, 64), np.float32)))
    assert not state.params["w"].is_deleted()
    state, metrics = step(state, good)
    assert np.isfinite(float(metrics["loss"]))


def test_replicating_text_names_the_leaf():
    """A str leaf was read as a dtype name: "data type 'resnet50' not understood"."""
    step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
    with pytest.raises(
        TypeError, match=r"(?s)\['arch'\]: a str \('resnet50'\).*static"
    ):
        step.replicate({"w": jnp.ones(3), "arch": "resnet50"})


def test_unreplicating_a_placed_batch_is_refused():
    """It failed inside JAX: "cannot reshape array of shape (8, 3) into (3,)"."""
    step = jdp.parallelize(lambda s, b: (s, {}))
    batch = step.shard({"x": np.ones((64, 3), np.float32)})
    with pytest.raises(ValueError, match=r"split by `step.shard`(.|\n)*\['x'\]"):
        step.unreplicate(batch)


def test_a_step_called_inside_jit_says_so(backend):
    """JAX's "is_deleted() method was called on traced array" came out."""
    step = jdp.parallelize(lambda s, b: (s, {"m": jnp.mean(b)}), backend=backend)
    state, batch = step.replicate({"w": jnp.ones(3)}), step.shard(np.ones(8))
    with pytest.raises(TypeError, match=r"inside a traced function.*Call it outside"):
        jax.jit(step)(state, batch)


def test_an_unbound_axis_name_names_the_bound_one(backend):
    def step_fn(state, batch):
        return state, {"m": lax.pmean(batch.sum(), "batch")}

    step = jdp.parallelize(step_fn, backend=backend)
    with pytest.raises(
        RuntimeError, match=r"(?s)binds the replica axis 'data'.*axis_name='batch'"
    ):
        step(step.replicate({}), step.shard(np.ones(8, np.float32)))


def test_replicating_a_replicated_state_is_refused(backend):
    step, state, _ = sgd_step(backend)
    with pytest.raises(ValueError, match=r"already replicated.*mesh of 8 devices"):
        step.replicate(state)


def test_replicating_a_partly_replicated_state_names_the_replicated_leaves(backend):
    """A trained state with a fresh optimizer state (one copy) was replicated
    again as a whole: params of shape (8, 8, ...) trained without a word."""
    step, state, _ = sgd_step(backend)
    mixed = {"trained": state, "fresh": jnp.zeros(3)}
    with pytest.raises(ValueError, match=r"(?s)some array leaves.*\['trained'\]"):
        step.replicate(mixed)


def test_step_broadcast_keeps_fields_declared_per_replica():
    """It gave every replica replica 0's error-feedback buffers: each replica then
    added replica 0's leftover to its next gradient."""
    tx = optax.sgd(0.1)
    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    step = jdp.parallelize(
        jdp.make_train_step(
            lambda p, b: jnp.mean((b @ p["w"] - 1) ** 2), tx, sync=sync
        ),
        devices=jax.devices()[:4],
    )
    params = {"w": jnp.zeros((300, 1))}
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    x = np.random.default_rng(0).normal(size=(16, 300)).astype(np.float32)
    for _ in range(2):
        state, _ = step(state, step.shard(x))
    worker = np.asarray(state.sync_state.worker[0])
    assert not np.array_equal(worker[0], worker[1])
    drifted = state.replace(
        params={"w": state.params["w"] * jnp.arange(4.0)[:, None, None]}
    )
    out = step.broadcast(drifted)
    np.testing.assert_array_equal(out.sync_state.worker[0], worker)
    assert jdp.replicas_in_sync(out.params)
    np.testing.assert_array_equal(out.params["w"][3], drifted.params["w"][0])


def test_step_broadcast_handles_typed_prng_keys(backend):
    step = jdp.parallelize(
        lambda s, b: (s, {}), backend=backend, devices=jax.devices()[:4]
    )
    keys = jax.random.split(jax.random.key(0), 4)
    per_replica = jax.random.wrap_key_data(
        jax.device_put(jax.random.key_data(keys), step.sharding)
    )
    out = step.broadcast({"key": per_replica}, root=1)
    data = np.asarray(jax.random.key_data(out["key"]))
    np.testing.assert_array_equal(data, np.broadcast_to(data[1], data.shape))
    np.testing.assert_array_equal(data[0], np.asarray(jax.random.key_data(keys[1])))


class _Counted:
    """A pytree node that counts how often it is flattened and rebuilt."""

    flattens = 0
    unflattens = 0

    def __init__(self, children):
        self.children = children


def _flatten_counted(node):
    _Counted.flattens += 1
    return node.children, None


def _unflatten_counted(_, children):
    _Counted.unflattens += 1
    return _Counted(list(children))


jax.tree_util.register_pytree_node(_Counted, _flatten_counted, _unflatten_counted)


@pytest.mark.parametrize("donate", [True, False], ids=["donate", "keep"])
def test_a_call_traverses_the_state_once_each_way(donate):
    """Once in (jdp's checks and the step share one flatten) and once out (the
    new state is built from the leaves the step returns): as often as `jax.jit`
    itself does. States whose flatten runs in Python (flax NNX modules) pay for
    every traversal."""
    step = jdp.parallelize(
        lambda s, b: (jax.tree.map(lambda x: x + b.sum(), s), {}),
        devices=jax.devices()[:4],
        donate_state=donate,
        check_sync=None,
    )
    state = step.replicate(_Counted([jnp.ones(3), jnp.ones((200, 100))]))
    batch = step.shard(np.ones(8, np.float32))
    state, _ = step(state, batch)  # compiles
    _Counted.flattens = _Counted.unflattens = 0
    for _ in range(3):
        state, _ = step(state, batch)
    assert (_Counted.flattens, _Counted.unflattens) == (3, 3)
    assert float(step.unreplicate(state).children[0][0]) == 1 + 4 * 2  # 2 rows each


def test_an_evaluation_loop_traverses_the_state_once_a_call():
    """A forward-only step checks a state once, then recognises it: the same
    state, passed call after call, is flattened once a call and never rebuilt."""
    step = jdp.parallelize(
        lambda s, b: {"y": s.children[1].sum() * b.sum()}, devices=jax.devices()[:4]
    )
    state = step.replicate(_Counted([jnp.ones(3), jnp.ones((200, 100))]))
    batch = step.shard(np.ones(8, np.float32))
    step(state, batch)  # compiles
    _Counted.flattens = _Counted.unflattens = 0
    for _ in range(3):
        metrics = step(state, batch)
    assert (_Counted.flattens, _Counted.unflattens) == (3, 0)
    assert float(metrics["y"]) == 200 * 100 * 2
