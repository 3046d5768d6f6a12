"""The sync pieces (`jdp.Sync`) and the declarations they and optimizer states make."""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import init_mlp, make_batches, mlp_loss, single_device_train

import jdp
from jdp import _replica_parts


def train(train_step, tx, batches, *, backend="shard_map", devices=4, params=None):
    step = jdp.parallelize(train_step, backend=backend, devices=jax.devices()[:devices])
    params = init_mlp(jax.random.key(0)) if params is None else params
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for b in batches:
        state, metrics = step(state, step.shard(b))
    return step, state, metrics


def test_the_default_piece_is_a_hand_written_all_reduce_step_bit_for_bit(backend):
    tx = optax.adam(1e-2)
    batches = make_batches(4, 32)

    def hand_written(state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(state.params, batch)
        grads = jdp.all_reduce_gradients(grads)
        return state.apply_gradients(grads=grads), {"loss": loss}

    _, piece, _ = train(jdp.make_train_step(mlp_loss, tx), tx, batches, backend=backend)
    step, hand, _ = train(hand_written, tx, batches, backend=backend)
    chex.assert_trees_all_equal(jax.device_get(piece), jax.device_get(hand))
    expected, _ = single_device_train(
        mlp_loss, init_mlp(jax.random.key(0)), tx, batches
    )
    chex.assert_trees_all_close(
        step.unreplicate(piece).params, expected, rtol=1e-5, atol=1e-6
    )


def test_one_replica_sends_nothing_and_holds_no_more_than_the_local_step(backend):
    """On one device the default piece is `jdp.local()`: no all-reduce of the
    gradients (XLA:CPU copies them through it), the same temporaries, the same
    bits; on two it does send them."""
    tx = optax.sgd(0.1, momentum=0.9)
    batches = make_batches(3, 16)

    def compiled(sync, devices):
        step = jdp.make_train_step(mlp_loss, tx, sync=sync)
        step, state, _ = train(step, tx, batches, backend=backend, devices=devices)
        batch = step.shard(batches[0])
        floats = [
            c
            for c in step.collectives(state, batch)
            if c.kind == "all-reduce" and c.bytes > 4  # not the loss's scalar
        ]
        mem = step.memory_analysis(state, batch)
        return floats, mem.temp_bytes, jax.device_get(step.unreplicate(state))

    sent, temp, state = compiled(jdp.all_reduce(), 1)
    _, local_temp, local_state = compiled(jdp.local(), 1)
    assert sent == []
    assert temp <= local_temp
    chex.assert_trees_all_equal(state, local_state)
    sent_by_two, _, _ = compiled(jdp.all_reduce(), 2)
    assert sent_by_two


def test_local_with_sync_gradients_in_tx_is_the_all_reduce_piece(backend):
    base = optax.sgd(0.1, momentum=0.9)
    chained = optax.chain(jdp.sync_gradients(), base)
    batches = make_batches(4, 32)
    _, a, _ = train(
        jdp.make_train_step(mlp_loss, chained, sync=jdp.local()),
        chained,
        batches,
        backend=backend,
    )
    _, b, _ = train(jdp.make_train_step(mlp_loss, base), base, batches, backend=backend)
    chex.assert_trees_all_equal(jax.device_get(a.params), jax.device_get(b.params))


def _aif(tx):
    return optax.apply_if_finite(tx, max_consecutive_errors=3)


@pytest.mark.parametrize(
    ("make_tx", "collective"),
    [
        (lambda: _aif(optax.chain(jdp.sync_gradients(), optax.adam(1e-2))), "psum"),
        (lambda: _aif(jdp.bmuf(optax.adam(1e-2), sync_period=2)), "psum"),
        (lambda: _aif(jdp.zero(optax.adam(1e-2))), "reduce_scatter"),
    ],
    ids=["sync_gradients", "bmuf", "zero"],
)
def test_a_branch_on_local_gradients_around_a_collective_is_refused(
    backend, make_tx, collective
):
    """A replica with a NaN gradient skipped the all-reduce the others waited in:
    the process hung, then XLA aborted it (no Python error)."""
    tx = make_tx()
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()),
        backend=backend,
        devices=jax.devices()[:4],
    )
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    with pytest.raises(
        ValueError,
        match=rf"decides on each replica's own gradients.*\({collective}.*"
        r"optax.chain\(jdp.sync_gradients\(\), optax.apply_if_finite",
    ):
        step(state, step.shard(make_batches(1, 32)[0]))


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.chain(jdp.sync_gradients(), _aif(optax.adam(1e-2))),
        lambda: jdp.bmuf(_aif(optax.adam(1e-2)), sync_period=1),
    ],
    ids=["sync_then_check", "bmuf_of_checked"],
)
def test_deciding_after_the_sync_skips_a_nan_on_every_replica(make_tx):
    tx = make_tx()
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), devices=jax.devices()[:4]
    )
    params = init_mlp(jax.random.key(0))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batch = make_batches(1, 32)[0]
    batch["x"][3, 0] = np.nan  # on replica 0 only
    state, _ = step(state, step.shard(batch))
    jdp.assert_replicas_in_sync(state.params)
    # sync_gradients averages the NaN into every replica's gradient, which all
    # skip; bmuf's inner step skips on replica 0 and the sync averages it in.
    got = step.unreplicate(state).params
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(got))


def test_a_piece_of_ones_own_plugs_in():
    """A `jdp.Sync` written by a user: sum the gradients instead of averaging."""

    def summed(grads, state, params, axis_name):
        return jax.lax.psum(grads, axis_name), state, {}

    tx = optax.sgd(0.01)
    batches = make_batches(3, 32)
    _, got, _ = train(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.Sync(None, summed)), tx, batches
    )
    # Summing over 4 replicas is averaging with a 4x learning rate.
    _, want, _ = train(jdp.make_train_step(mlp_loss, optax.sgd(0.04)), tx, batches)
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-5, atol=1e-7)


# -- a piece of one's own, with per-replica state, everywhere a piece goes ----------


@jdp.declare_per_replica("error")
class TopKState(NamedTuple):
    error: dict  # what this replica's top-k left out, added back next step


def top_k(fraction):
    """Top-k sparsification with error feedback: the docs' example piece."""

    def init(params):
        return TopKState(jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params, axis_name):
        def one(g, e):
            x = (g + e).reshape(-1)
            _, idx = jax.lax.top_k(jnp.abs(x), max(1, int(fraction * x.size)))
            kept = jnp.zeros_like(x).at[idx].set(x[idx]).reshape(g.shape)
            return kept, g + e - kept

        out = jax.tree.map(one, grads, state.error)
        kept, error = jax.tree.transpose(
            jax.tree.structure(grads), jax.tree.structure((0, 0)), out
        )
        return jax.lax.pmean(kept, axis_name), TopKState(error), {}

    return jdp.Sync(init, update)


def train_with(sync, tx, batches, *, check_sync=1, devices=4):
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=sync),
        devices=jax.devices()[:devices],
        check_sync=check_sync,
    )
    params = init_mlp(jax.random.key(0))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    for b in batches:
        state, _ = step(state, step.shard(b))
    return step, state


def test_a_piece_of_ones_own_with_per_replica_state_trains():
    tx = optax.sgd(0.1)
    batches = make_batches(4, 32)
    # Keeping everything is the plain average; its error stays zero.
    _, every = train_with(top_k(1.0), tx, batches)
    _, plain, _ = train(jdp.make_train_step(mlp_loss, tx), tx, batches)
    chex.assert_trees_all_close(every.params, plain.params, rtol=1e-6, atol=1e-7)
    # A quarter: the error buffers differ between replicas, declared so, and
    # the divergence guard (every step) compares only the rest.
    step, some = train_with(top_k(0.25), tx, batches)
    error = jax.device_get(some.sync_state.error)
    assert not jdp.replicas_in_sync(some.sync_state)
    assert jdp.replicas_in_sync(some.params)
    assert any(float(np.abs(e).max()) > 0 for e in jax.tree.leaves(error))
    assert not np.allclose(
        jax.tree.leaves(step.unreplicate(some).params)[0],
        jax.tree.leaves(step.unreplicate(plain).params)[0],
    )


def test_a_piece_of_ones_own_in_a_partition_beside_all_reduce_and_local_bmuf():
    names = {"layer0": "embed", "layer1": "dense", "layer2": "head"}
    labels = lambda p: {k: names[k] for k in p}  # noqa: E731
    adam = optax.adam(1e-2)
    tx = optax.multi_transform(
        {"dense": adam, "head": adam, "embed": jdp.bmuf(adam, sync_period=2)},
        labels,
    )
    pieces = {"dense": top_k(0.5), "head": jdp.all_reduce(), "embed": jdp.local()}
    step, state = train_with(jdp.partition(labels, pieces), tx, make_batches(4, 32))
    assert set(state.sync_state) == {"dense"}
    error = state.sync_state["dense"].error  # None where the label is another
    assert jax.tree.leaves(error["layer0"]) == []
    assert jax.tree.leaves(error["layer2"]) == []
    assert jax.tree.leaves(error["layer1"])
    assert not jdp.replicas_in_sync(error["layer1"])  # each replica's own
    assert jdp.replicas_in_sync(state.params)  # 4 steps end on a block sync
    # The piece acts: with "dense" all-reduced instead, its params differ.
    plain = {"dense": jdp.all_reduce(), "head": jdp.all_reduce(), "embed": jdp.local()}
    _, other = train_with(jdp.partition(labels, plain), tx, make_batches(4, 32))
    assert not np.allclose(
        jax.device_get(state.params["layer1"]["w"]),
        jax.device_get(other.params["layer1"]["w"]),
    )


def test_a_piece_of_ones_own_in_a_hand_written_step_through_sync_gradients():
    base = optax.sgd(0.1, momentum=0.9)
    batches = make_batches(3, 32)
    _, piece = train_with(top_k(0.25), base, batches)
    tx = optax.chain(jdp.sync_gradients(top_k(0.25)), base)

    def hand_written(state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    _, hand, _ = train(hand_written, tx, batches)
    chex.assert_trees_all_close(hand.params, piece.params, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(
        hand.opt_state[0].error, piece.sync_state.error, rtol=1e-6, atol=1e-7
    )


def test_sync_gradients_refuses_what_is_not_a_piece():
    with pytest.raises(TypeError, match=r"turns a `jdp.Sync`.*got GradientTransf"):
        jdp.sync_gradients(optax.sgd(0.1))


def test_bmuf_in_a_hand_written_step_runs_the_same_block_sync():
    """The optax path (sync inside the optimizer) and `jdp.local()` agree."""
    tx = jdp.bmuf(
        optax.sgd(0.1, momentum=0.9), 3, outer=jdp.block_momentum(momentum=0.5)
    )
    batches = make_batches(7, 32)

    def hand_written(state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    step, piece, _ = train(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), tx, batches
    )
    _, hand, _ = train(hand_written, tx, batches)
    # The hand-written step reaches the merged model through
    # `optax.apply_updates` (up to an ulp), which the next blocks carry along.
    chex.assert_trees_all_close(
        jdp.bmuf_global_params(piece), jdp.bmuf_global_params(hand), rtol=1e-5
    )
    chex.assert_trees_all_close(piece.params, hand.params, rtol=1e-5, atol=1e-6)
    assert int(step.unreplicate(piece).opt_state.count) == 7


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: jdp.make_train_step(mlp_loss, batch_stats="sum"),
            r"`batch_stats` must be one of",
        ),
        (lambda: jdp.all_reduce(bucket_bytes=0), r"`bucket_bytes`"),
        (lambda: jdp.zero(optax.sgd(0.1), bucket_bytes=-1), r"`bucket_bytes`"),
        (lambda: jdp.sparse.rows(bucket_bytes=0), r"`bucket_bytes`"),
    ],
)
def test_bad_piece_options_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# -- the loss's parameters say whether it takes batch statistics ------------------


def stats_loss(params, batch_stats, batch):
    return mlp_loss(params, batch), batch_stats


def test_a_loss_that_takes_no_stats_refuses_a_state_with_stats():
    tx = optax.sgd(0.1)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), devices=jax.devices()[:2])
    state = jdp.TrainState.create(
        params=init_mlp(jax.random.key(0)), tx=tx, batch_stats={"n": jnp.zeros(2)}
    )
    with pytest.raises(ValueError, match=r"state has `batch_stats`.*two\s+parameters"):
        step(step.replicate(state), step.shard(make_batches(1, 4)[0]))


def test_a_loss_that_takes_stats_refuses_a_state_without():
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(stats_loss, tx), devices=jax.devices()[:2]
    )
    state = jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    with pytest.raises(ValueError, match=r"takes three parameters.*no `batch_stats`"):
        step(step.replicate(state), step.shard(make_batches(1, 4)[0]))


def test_a_key_parameter_not_named_rng_is_told_to_be_named_rng():
    """flax's examples call the dropout key `dropout_rng`: read as a third
    positional parameter, it made the loss a batch-statistics loss."""
    tx = optax.sgd(0.1)

    def loss_fn(params, batch, dropout_rng):
        return mlp_loss(params, batch)

    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:2])
    state = jdp.TrainState.create(
        params=init_mlp(jax.random.key(0)), tx=tx, rng=jax.random.key(1)
    )
    with pytest.raises(
        ValueError,
        match=r"`loss_fn\(params, batch, dropout_rng\)`.*no `batch_stats`.*If "
        r"`dropout_rng` is a PRNG key \(for dropout\), name it `rng`",
    ):
        step(step.replicate(state), step.shard(make_batches(1, 4)[0]))
    # With batch statistics as well, four parameters: refused when made.
    with pytest.raises(TypeError, match=r"4 required.*`dropout_rng`.*name it `rng`"):
        jdp.make_train_step(lambda p, s, b, dropout_rng: 0.0, tx)


def test_stats_flow_through_a_three_parameter_loss():
    tx = optax.sgd(0.1)

    def counting(params, batch_stats, batch):
        return mlp_loss(params, batch), {"n": batch_stats["n"] + 1}

    step = jdp.parallelize(jdp.make_train_step(counting, tx), devices=jax.devices()[:2])
    state = step.replicate(
        jdp.TrainState.create(
            params=init_mlp(jax.random.key(0)), tx=tx, batch_stats={"n": jnp.zeros(())}
        )
    )
    for b in make_batches(3, 4):
        state, _ = step(state, step.shard(b))
    assert float(step.unreplicate(state).batch_stats["n"]) == 3.0


@pytest.mark.parametrize(
    "loss_fn, match",
    [
        (lambda params: 0.0, r"1 required positional parameter"),
        (lambda *args: 0.0, r"0 required positional parameter\(s\) and \*args"),
        (lambda p, s, b, extra: 0.0, r"4 required positional"),
    ],
    ids=["one", "varargs", "four"],
)
def test_a_loss_of_another_shape_is_refused_when_the_step_is_made(loss_fn, match):
    with pytest.raises(TypeError, match=match):
        jdp.make_train_step(loss_fn, optax.sgd(0.1))


def test_defaults_and_wrappers_keep_the_loss_readable():
    def with_default(params, batch, scale=1.0):
        return mlp_loss(params, batch) * scale

    tx = optax.sgd(0.1)
    for loss_fn in (with_default, jax.checkpoint(mlp_loss)):
        _, state, metrics = train(
            jdp.make_train_step(loss_fn, tx), tx, make_batches(1, 8), devices=2
        )
        assert np.isfinite(float(metrics["loss"]))


# -- declarations of per-replica state parts ---------------------------------------


def test_bmuf_state_is_found_in_the_layout_nnx_gives_it():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, jdp.bmuf(optax.adam(1e-3), sync_period=4), wrt=nnx.Param
    )
    state = nnx.state(optimizer)
    (found,) = _replica_parts.find(state)
    assert isinstance(found, jdp.BMUFState)
    assert _replica_parts.trains_locally(state)
    agreed = _replica_parts.agreed(state)
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(agreed)
    ]
    assert any("global_params" in p for p in paths)
    assert not any("inner_state" in p for p in paths)
    (start,) = _replica_parts.restart_params(state)
    chex.assert_trees_all_equal(start, found.global_params)


def test_plain_optimizer_states_declare_nothing():
    state = optax.adam(1e-3).init({"w": jnp.ones(3)})
    assert _replica_parts.find(state) == []
    assert _replica_parts.agreed(state) is None
    assert not _replica_parts.trains_locally(state)


def test_a_declaration_names_fields_the_class_has():
    class ErrorBuffers(NamedTuple):
        error: jax.Array
        count: jax.Array

    with pytest.raises(
        ValueError, match=r"ErrorBuffers has no field\(s\) \['errors'\]"
    ):
        jdp.declare_per_replica("errors")(ErrorBuffers)
    with pytest.raises(TypeError, match=r"takes field names \(str\).*got 1"):
        jdp.declare_per_replica(1)
    with pytest.raises(TypeError, match=r"decorates a NamedTuple class"):
        jdp.declare_per_replica("error")(dict)


def test_a_declared_state_of_ones_own_is_left_out_of_the_guard():
    """A new per-replica state (error buffers) plugs in without touching jdp."""

    @jdp.declare_per_replica("error")
    class Buffers(NamedTuple):
        error: jax.Array
        count: jax.Array

    try:
        tree = {"opt": Buffers(jnp.arange(3.0), jnp.zeros((), jnp.int32))}
        agreed = _replica_parts.agreed(tree)
        assert agreed["opt"].error is None and agreed["opt"].count is not None
        assert not _replica_parts.trains_locally(tree)
    finally:
        _replica_parts._DECLARED.pop()


# -- silent numbers the pieces now refuse or get right -----------------------------


@pytest.mark.parametrize(
    "tx, warns",
    [
        (optax.adam(1e-2), True),
        (optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), True),
        (jdp.bmuf(optax.sgd(0.1), sync_period=2), False),
        (optax.chain(jdp.sync_gradients(), optax.adam(1e-2)), False),
    ],
    ids=["adam", "multisteps-sgd", "bmuf", "sync_gradients"],
)
@pytest.mark.parametrize("num", [2, 1], ids=["2dev", "1dev"])
def test_local_warns_when_nothing_communicates(tx, warns, num):
    warns = warns and num > 1  # one replica trains one model
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:num],
    )
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(state, step.shard(make_batches(1, 4)[0]))
    messages = [
        str(w.message) for w in caught if "never communicates" in str(w.message)
    ]
    assert bool(messages) == warns, messages
    if warns:
        assert "the 2 replicas train 2 different models" in messages[0]


def test_skip_nonfinite_with_a_float16_wire():
    """Gradients whose float16 sum would overflow are divided first (finite, no
    skip); an infinite gradient on one replica skips the step everywhere."""
    params = {"w": jnp.zeros((), jnp.float32)}

    def loss_fn(params, batch):
        return jnp.sum(params["w"] * batch["g"])

    tx = optax.sgd(1.0)
    sync = jdp.all_reduce(reduce_dtype=jnp.float16)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, sync=sync, skip_nonfinite=True),
        devices=jax.devices()[:4],
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batch = {"g": np.full((4,), 6e4, np.float32)}
    state, metrics = step(state, step.shard(batch))
    # Divided before the narrow wire, the mean is finite: no skip, exact update.
    assert float(metrics["skipped"]) == 0.0
    np.testing.assert_allclose(
        float(step.unreplicate(state).params["w"]), -6e4, rtol=1e-3
    )
    batch = {"g": np.array([6e4, 6e4, 6e4, np.inf], np.float32)}
    state, metrics = step(state, step.shard(batch))
    assert float(metrics["skipped"]) == 1.0
    assert int(step.unreplicate(state).skipped_steps) == 1


# -- complex parameters -----------------------------------------------------------


def complex_loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean(jnp.abs(pred - batch["y"]) ** 2)


def complex_problem(steps=3):
    """A complex linear layer with a real bias, and complex batches of 16."""
    rng = np.random.default_rng(0)

    def draw(*shape):
        return (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(
            np.complex64
        )

    params = {"w": draw(8, 4), "b": rng.normal(size=(4,)).astype(np.float32)}
    batches = [{"x": draw(16, 8), "y": draw(16, 4)} for _ in range(steps)]
    return params, batches


def complex_bmuf(average):
    """BMUF syncing every step with a plain outer step: SGD on the mean gradient."""
    tx = jdp.bmuf(optax.sgd(0.05), 1, outer=optax.sgd(1.0), average=average)
    return jdp.local(), tx, optax.sgd(0.05)


@pytest.mark.parametrize(
    "make, exact",
    [
        (lambda: (jdp.all_reduce(), optax.sgd(0.05)), True),
        (lambda: (jdp.all_reduce(bucket_bytes=None), optax.adam(0.05)), True),
        (lambda: (jdp.local(), jdp.zero(optax.adam(0.05)), optax.adam(0.05)), True),
        (lambda: (jdp.all_reduce(reduce_dtype=jnp.bfloat16), optax.sgd(0.05)), False),
        (lambda: (jdp.all_reduce(wire=jdp.wire.bf16()), optax.sgd(0.05)), False),
        (
            lambda: (
                jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True),
                optax.sgd(0.05),
            ),
            False,
        ),
        (
            lambda: (
                jdp.local(),
                jdp.zero(optax.sgd(0.05), reduce_dtype=jnp.bfloat16),
                optax.sgd(0.05),
            ),
            False,
        ),
        (lambda: complex_bmuf(jdp.BlockAverage()), True),
        (
            lambda: complex_bmuf(
                jdp.BlockAverage(on_bad_replica="drop", bad_replica_max_norm=100.0)
            ),
            True,
        ),
        (lambda: complex_bmuf(jdp.BlockAverage(wire=jdp.wire.bf16())), False),
    ],
    ids=[
        "all_reduce",
        "unbucketed-adam",
        "zero-adam",
        "reduce_dtype-bf16",
        "wire-bf16",
        "wire-int8-error-feedback",
        "zero-bf16",
        "bmuf",
        "bmuf-drop",
        "bmuf-wire-bf16",
    ],  # fmt: skip
)
def test_complex_parameters_train_as_on_one_device(make, exact):
    """Both parts of a complex gradient are averaged, also where the exchange
    sends a real format (which once dropped the imaginary part: the imaginary
    parts of `w` then never moved, 1.45 away from the oracle's after 3 steps)."""
    sync, tx, *oracle_tx = make()
    params, batches = complex_problem()
    step = jdp.parallelize(
        jdp.make_train_step(complex_loss, tx, sync=sync), devices=jax.devices()[:4]
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    for b in batches:
        state, _ = step(state, step.shard(b))
    got = step.unreplicate(state).params
    want, _ = single_device_train(complex_loss, params, (oracle_tx or [tx])[0], batches)
    assert got["w"].dtype == jnp.complex64 and got["b"].dtype == jnp.float32
    # Lossy formats: a few of their rounding steps off; the imaginary parts that
    # did not move were 100x as far.
    tol = dict(rtol=1e-5, atol=1e-5) if exact else dict(rtol=0, atol=3e-2)
    chex.assert_trees_all_close(got, want, **tol)
    moved = np.abs(np.imag(got["w"]) - np.imag(params["w"]))
    assert np.min(moved) > 0


@pytest.mark.parametrize("dtype", [jnp.int8, "int32", jnp.complex64, jnp.bool_])
def test_a_reduce_dtype_that_is_not_a_real_float_is_refused(dtype):
    for make in (
        lambda: jdp.all_reduce(reduce_dtype=dtype),
        lambda: jdp.zero(optax.sgd(0.1), reduce_dtype=dtype),
        lambda: jdp.sparse.rows(reduce_dtype=dtype),
    ):
        with pytest.raises(ValueError, match=r"`reduce_dtype` is the floating-point"):
            make()
    with pytest.raises(ValueError, match=r"e\.g\. `jnp\.bfloat16`, or None; got"):
        jdp.all_reduce_gradients({"g": jnp.ones(2)}, reduce_dtype=dtype)


def test_float16_gradients_average_without_overflow():
    def step_fn(state, batch):
        return state, {"g": jdp.all_reduce_gradients({"g": batch[0]})["g"]}

    step = jdp.parallelize(step_fn, devices=jax.devices()[:8])
    out = step(step.replicate({}), step.shard(np.full((8,), 12000, np.float16)))[1]
    assert out["g"].dtype == jnp.float16 and float(out["g"]) == 12000.0


def test_a_skipped_step_keeps_its_batch_statistics(backend):
    def loss_fn(params, stats, batch):
        loss = jnp.mean((batch["x"] @ params["w"]) ** 2) * batch["scale"][0]
        return loss, {"mean": stats["mean"] + jnp.mean(batch["x"]) * batch["scale"][0]}

    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, skip_nonfinite=True),
        backend=backend,
        devices=jax.devices()[:2],
    )
    state = jdp.TrainState.create(
        params={"w": jnp.ones((3, 1))}, tx=tx, batch_stats={"mean": jnp.zeros(())}
    )
    state = step.replicate(state)
    x = np.ones((4, 3), np.float32)
    bad = {"x": x, "scale": np.array([1.0, 1.0, np.nan, 1.0], np.float32)}
    state, metrics = step(state, step.shard(bad))
    assert float(metrics["skipped"]) == 1.0
    assert float(step.unreplicate(state).batch_stats["mean"]) == 0.0
