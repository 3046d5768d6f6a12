"""`jdp.partition`: a sync piece per label of the params."""

import json
import warnings

import helpers
import jax
import numpy as np
import optax
import pytest
from helpers import init_mlp, linear_grads, linear_loss, make_batches, mlp_loss

import jdp
from jdp import _partition

NUM = 4
IN, OUT = 5, 2
LR, H = 0.1, 3


def devices():
    return jax.devices()[:NUM]


def mlp_labels(params):
    # The first layer is "embed", the rest "dense".
    return {k: ("embed" if k == "layer0" else "dense") for k in params}


def run(train_step, params, tx, batches, *, check_sync=1, sync=None):
    step = jdp.parallelize(train_step, devices=devices(), check_sync=check_sync)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    state, history = helpers.params_history(step, state, batches)
    return step, state, history


def assert_same_bits(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def mlp():
    params = init_mlp(jax.random.key(0))
    assert set(params) == {"layer0", "layer1", "layer2"}
    return params, make_batches(2 * H, 16)


# -- equivalences, bit for bit ---------------------------------------------------


def test_every_label_all_reduced_is_plain_all_reduce(mlp):
    params, batches = mlp
    tx = optax.adam(1e-2)
    _, _, plain = run(jdp.make_train_step(mlp_loss, tx), params, tx, batches)
    shared = jdp.all_reduce()
    for pieces in (
        {"dense": jdp.all_reduce(), "embed": jdp.all_reduce()},
        {"dense": shared, "embed": shared},  # one all-reduce for both
    ):
        sync = jdp.partition(mlp_labels, pieces)
        _, _, got = run(
            jdp.make_train_step(mlp_loss, tx, sync=sync), params, tx, batches
        )
        for a, b in zip(plain, got, strict=True):
            assert_same_bits(a, b)


def test_every_label_local_with_bmuf_is_plain_bmuf(mlp):
    params, batches = mlp
    tx = jdp.bmuf(optax.adam(1e-2), sync_period=H)
    step = jdp.make_train_step(mlp_loss, tx, sync=jdp.local())
    _, _, plain = run(step, params, tx, batches)
    sync = jdp.partition(mlp_labels, {"dense": jdp.local(), "embed": jdp.local()})
    _, state, got = run(
        jdp.make_train_step(mlp_loss, tx, sync=sync), params, tx, batches
    )
    for a, b in zip(plain, got, strict=True):
        assert_same_bits(a, b)
    assert jdp.replicas_in_sync(state.params)  # 2H steps end on a sync


def test_a_label_without_leaves_is_the_plain_piece(mlp):
    # Every leaf "dense": the "embed" label, with its `jdp.bmuf`, holds nothing.
    params, batches = mlp
    labels = {k: "dense" for k in params}
    adam = optax.adam(1e-2)
    plain_tx = optax.multi_transform({"dense": adam}, labels)
    _, plain_state, plain = run(
        jdp.make_train_step(mlp_loss, plain_tx), params, plain_tx, batches
    )
    tx = optax.multi_transform(
        {"dense": adam, "embed": jdp.bmuf(adam, sync_period=H)}, labels
    )
    sync = jdp.partition(labels, {"dense": jdp.all_reduce(), "embed": jdp.local()})
    _, state, got = run(
        jdp.make_train_step(mlp_loss, tx, sync=sync), params, tx, batches
    )
    for a, b in zip(plain, got, strict=True):
        assert_same_bits(a, b)
    dense = plain_state.opt_state.inner_states["dense"]
    assert_same_bits(state.opt_state.inner_states["dense"], dense)


def test_a_partition_moves_the_bytes_of_plain_all_reduce(mlp):
    params, batches = mlp
    tx = optax.adam(1e-2)

    def grad_bytes(sync):
        step = jdp.parallelize(
            jdp.make_train_step(mlp_loss, tx, sync=sync), devices=devices()
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        ops = step.collectives(state, step.shard(batches[0]))
        return sum(c.bytes for c in ops)

    sync = jdp.partition(
        mlp_labels, {"dense": jdp.all_reduce(), "embed": jdp.all_reduce()}
    )
    assert grad_bytes(sync) == grad_bytes(jdp.all_reduce()) > 0


# -- a dense part all-reduced, a local part with BMUF: against NumPy --------------


def linear_params(seed=0):
    return helpers.linear_params(IN, OUT, seed)


def linear_batches(steps, per_replica=4, seed=1):
    return helpers.noise_batches(steps, NUM * per_replica, IN, OUT, seed)


LINEAR_LABELS = {"w": "dense", "b": "bias"}


def reference(params, batches, *, bias):
    """`w` on averaged gradients; `b` per `bias`: `"bmuf"` (own gradients,
    averaged every H steps), `"own"` (never synced) or `"root"` (replica 0's
    gradients on every replica)."""
    reps = [{k: v.astype(np.float64) for k, v in params.items()}] * NUM
    history = []
    for t, batch in enumerate(batches, start=1):
        xs = np.split(batch["x"].astype(np.float64), NUM)
        ys = np.split(batch["y"].astype(np.float64), NUM)
        gs = [linear_grads(p, x, y) for p, x, y in zip(reps, xs, ys, strict=True)]
        w_grad = np.mean([g["w"] for g in gs], axis=0)
        new = []
        for r, p in enumerate(reps):
            b_grad = gs[0]["b"] if bias == "root" else gs[r]["b"]
            new.append({"w": p["w"] - LR * w_grad, "b": p["b"] - LR * b_grad})
        if bias == "bmuf" and t % H == 0:
            mean = np.mean([p["b"] for p in new], axis=0)
            new = [{**p, "b": mean} for p in new]
        reps = new
        history.append(reps)
    return history


def check_against(history, expected):
    for got, want in zip(history, expected, strict=True):
        for r in range(NUM):
            for k in got:
                np.testing.assert_allclose(got[k][r], want[r][k], rtol=2e-5, atol=1e-6)


def test_dense_all_reduced_and_bias_local_with_bmuf_match_numpy():
    params, batches = linear_params(), linear_batches(2 * H + 1)
    bmuf = jdp.bmuf(
        optax.sgd(LR), H, outer=jdp.block_momentum(learning_rate=1.0, momentum=0.0)
    )
    tx = optax.multi_transform({"dense": optax.sgd(LR), "bias": bmuf}, LINEAR_LABELS)
    sync = jdp.partition(
        LINEAR_LABELS, {"dense": jdp.all_reduce(), "bias": jdp.local()}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the bias syncs through jdp.bmuf: no warning
        _, _, history = run(
            jdp.make_train_step(linear_loss, tx, sync=sync), params, tx, batches
        )
    check_against(history, reference(params, batches, bias="bmuf"))
    for t, got in enumerate(history, start=1):
        assert all(np.array_equal(got["w"][r], got["w"][0]) for r in range(NUM))
        # Exactly the same bits after a block sync; different in between.
        assert (t % H == 0) == all(
            np.array_equal(got["b"][r], got["b"][0]) for r in range(NUM)
        )


def test_per_replica_label_is_never_synced_and_not_guarded(tmp_path):
    params, batches = linear_params(), linear_batches(H)
    tx = optax.sgd(LR)
    sync = jdp.partition(
        lambda p: {"w": "dense", "b": "head"},
        {"dense": jdp.all_reduce(), "head": "per_replica"},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # meant to be local: no warning
        step, state, history = run(  # check_sync=1: the guard runs every call
            jdp.make_train_step(linear_loss, tx, sync=sync), params, tx, batches
        )
    check_against(history, reference(params, batches, bias="own"))
    assert not jdp.replicas_in_sync(state.params["b"])
    # Checkpoints keep every replica's own head.
    with jdp.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(H, state, parallel=step)
        fresh = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        restored = manager.restore(fresh, step=H)
    assert_same_bits(jax.device_get(restored.params), jax.device_get(state.params))


def test_broadcast_label_applies_replica_0s_gradients():
    params, batches = linear_params(), linear_batches(H)
    tx = optax.sgd(LR)
    sync = jdp.partition(
        LINEAR_LABELS, {"dense": jdp.all_reduce(), "bias": "broadcast"}
    )
    _, state, history = run(
        jdp.make_train_step(linear_loss, tx, sync=sync), params, tx, batches
    )
    check_against(history, reference(params, batches, bias="root"))
    assert jdp.replicas_in_sync(state)


def test_a_local_label_whose_optimizer_never_syncs_warns():
    params, batches = linear_params(), linear_batches(1)
    tx = optax.sgd(LR)
    sync = jdp.partition(
        LINEAR_LABELS, {"dense": jdp.all_reduce(), "bias": jdp.local()}
    )
    with pytest.warns(UserWarning, match=r"never communicates.*'per_replica'"):
        run(jdp.make_train_step(linear_loss, tx, sync=sync), params, tx, batches)


def test_a_local_label_no_leaf_carries_does_not_warn():
    """Every leaf all-reduced: "the replicas train different models" was a false
    warning, from a `jdp.local()` label that no leaf carries."""
    params, batches = linear_params(), linear_batches(1)
    tx = optax.sgd(LR)
    labels = {k: "dense" for k in params}
    sync = jdp.partition(labels, {"dense": jdp.all_reduce(), "bias": jdp.local()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(jdp.make_train_step(linear_loss, tx, sync=sync), params, tx, batches)


def test_the_guard_still_catches_a_dense_label_that_diverges():
    # A hand-broken "dense" label: all-reduced over nothing (each replica's own).
    params, batches = linear_params(), linear_batches(1)
    tx = optax.sgd(LR)
    own = jdp.Sync(None, lambda g, s, p, axis: (g, s, {}))
    sync = jdp.partition(LINEAR_LABELS, {"dense": own, "bias": "per_replica"})
    with pytest.raises(jdp.ReplicaDivergenceError, match=r"\['w'\]"):
        run(jdp.make_train_step(linear_loss, tx, sync=sync), params, tx, batches)


# -- pieces with state, metrics --------------------------------------------------


def test_a_stateful_piece_keeps_its_state_under_its_label():
    params, batches = linear_params(), linear_batches(3)
    tx = optax.sgd(LR)

    def trained(sync):
        step = jdp.make_train_step(linear_loss, tx, sync=sync)
        _, state, history = run(step, params, tx, batches, sync=sync)
        return state, history

    plain = jdp.powersgd(rank=1, min_compression_rate=0.0)
    plain_state, want = trained(plain)
    # One piece object for both labels: one group, the plain piece bit for bit.
    state, got = trained(jdp.partition(LINEAR_LABELS, {"dense": plain, "bias": plain}))
    for a, b in zip(want, got, strict=True):
        assert_same_bits(a, b)
    assert_same_bits(state.sync_state["bias+dense"], plain_state.sync_state)
    # PowerSGD on "dense" only: its state (error buffers differ per replica,
    # declared, so the guard of every step passes) under its label.
    pieces = {"dense": plain, "bias": jdp.all_reduce()}
    state, _ = trained(jdp.partition(LINEAR_LABELS, pieces))
    assert set(state.sync_state) == {"dense"}
    assert not jdp.replicas_in_sync(state.sync_state["dense"].error)
    assert jdp.replicas_in_sync(state.params)


def test_a_piece_that_drops_bad_replicas_reports_under_its_label():
    params, batches = linear_params(), linear_batches(1)
    tx = optax.sgd(LR)
    drop = jdp.all_reduce(on_bad_replica="drop")
    sync = jdp.partition(LINEAR_LABELS, {"dense": jdp.all_reduce(), "bias": drop})
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=sync), devices=devices()
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    _, metrics = step(state, step.shard(batches[0]))
    assert int(metrics["bias/dropped_replicas"]) == 0
    assert "dropped_replicas" not in metrics


# -- labels across processes --------------------------------------------------------


class Store(dict):
    """A key-value store with the coordination client's two methods."""

    def key_value_set(self, key, value, allow_overwrite=False):
        self[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        return self[key]


def test_labels_that_differ_between_processes_name_the_leaf():
    mine = [("['b']", "bias"), ("['w']", "dense")]
    theirs = [("['b']", "bias"), ("['w']", "embed")]
    store = Store()
    # The other process published first, under the key this trace will use.
    store[f"{_following_key()}/1"] = json.dumps(theirs)
    with pytest.raises(
        ValueError,
        match=r"leaf \['w'\] is labelled 'dense' on process 0, 'embed' on process 1",
    ):
        _partition.agree_across_processes(
            mine, client=store, process=0, processes=[0, 1]
        )
    store[f"{_following_key()}/1"] = json.dumps(mine)
    _partition.agree_across_processes(mine, client=store, process=0, processes=[0, 1])


def _following_key() -> str:
    """The key the next trace outside a step will use (this call takes one)."""
    used = _partition._next_key(None)
    prefix, count = used.rsplit("/", 1)
    return f"{prefix}/{int(count) + 1}"


def test_each_set_of_devices_counts_its_own_traces():
    # A replacement joins on devices never used before, where its first trace meets
    # the others' first trace there, whatever each traced before.
    first, second = jax.devices()[:2], jax.devices()[2:4]
    a0, a1 = _partition._next_key(first), _partition._next_key(first)
    b0 = _partition._next_key(second)
    assert a0.rsplit("/", 1)[0] == a1.rsplit("/", 1)[0] != b0.rsplit("/", 1)[0]
    assert int(a1.rsplit("/", 1)[1]) == int(a0.rsplit("/", 1)[1]) + 1
    assert b0.endswith("/0")
    assert _partition._next_key(tuple(reversed(first))).endswith("/0")


def test_differing_labels_compares_paths_and_lengths():
    same = json.dumps([["['a']", "x"]])
    assert _partition.differing_labels({0: same, 1: same}) is None
    longer = json.dumps([["['a']", "x"], ["['b']", "y"]])
    assert "leaf ['b']" in _partition.differing_labels({0: same, 1: longer})


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pieces, error, match",
    [
        ([jdp.all_reduce()], TypeError, r"`pieces` must be a mapping"),
        ({}, ValueError, r"`pieces` is empty"),
        ({1: jdp.all_reduce()}, TypeError, r"labels must be str; got 1"),
        ({"a": "sometimes"}, TypeError, r"label 'a' must be.*per_replica.*'sometimes'"),
        ({"a": optax.sgd(0.1)}, TypeError, r"label 'a' must be a `jdp.Sync`"),
        # It applies the optimizer itself: not a gradient piece.
        ({"a": jdp.zero(optax.sgd(0.1))}, TypeError, r"label 'a' must be a `jdp.Sync`"),
    ],
)
def test_bad_pieces_are_refused(pieces, error, match):
    with pytest.raises(error, match=match):
        jdp.partition(LINEAR_LABELS, pieces)


@pytest.mark.parametrize(
    "labels, pieces, match",
    [
        (
            LINEAR_LABELS,
            {"dense": jdp.all_reduce()},
            r"leaf \['b'\] is labelled 'bias', which has no piece",
        ),
        (
            {"w": "dense", "other": "dense"},
            {"dense": jdp.all_reduce()},
            r"`labels` must have the params' structure",
        ),
    ],
)
def test_bad_labels_fail_at_the_first_step(labels, pieces, match):
    params, batches = linear_params(), linear_batches(1)
    tx = optax.sgd(LR)
    sync = jdp.partition(labels, pieces)
    with pytest.raises(ValueError, match=match):
        run(jdp.make_train_step(linear_loss, tx, sync=sync), params, tx, batches)
