"""`jdp.parallelize(..., check_sync=K)`: replicas that drift apart are caught."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import init_mlp, make_batches, mlp_loss
from jax import lax

import jdp


def flax_style_step(tx, *, average):
    """The flax recipe's per-replica step, with or without its `pmean`."""

    def step_fn(state, batch):
        grads = jax.grad(mlp_loss)(state["params"], batch)
        if average:
            grads = lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {}

    return step_fn


def run(step, state, batches):
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return state


def test_a_step_that_forgets_to_average_gradients_is_caught(backend):
    tx = optax.sgd(0.1)
    params = init_mlp(jax.random.key(0))
    step = jdp.parallelize(flax_style_step(tx, average=False), backend=backend)
    state = step.replicate({"params": params, "opt_state": tx.init(params)})
    with pytest.raises(jdp.ReplicaDivergenceError) as info:
        run(step, state, make_batches(1, 16))
    err = info.value
    assert "does not average its gradients" in str(err)
    assert err.leaf.startswith("['params']")
    assert 1 <= err.replica < 8
    # Nothing is lost: the state the step returned comes with the error.
    assert not jdp.replicas_in_sync(err.state)
    jdp.assert_replicas_in_sync(step.broadcast(err.state))


def test_unsynced_batch_stats_are_named_as_the_cause():
    """A linen-style step that averages gradients but not `batch_stats`."""
    tx = optax.sgd(0.1)
    params = init_mlp(jax.random.key(0))

    def step_fn(state, batch):
        grads = lax.pmean(jax.grad(mlp_loss)(state["params"], batch), "data")
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        stats = {"mean": jnp.mean(batch["x"], axis=0)}  # this replica's examples
        new = {"params": optax.apply_updates(state["params"], updates)}
        return {**new, "opt_state": opt_state, "batch_stats": stats}, {}

    step = jdp.parallelize(step_fn)
    init = {"params": params, "opt_state": tx.init(params)}
    state = step.replicate({**init, "batch_stats": {"mean": jnp.zeros(8)}})
    with pytest.raises(
        jdp.ReplicaDivergenceError,
        match=r"\['batch_stats'\]\['mean'\].*all of them BatchNorm statistics.*"
        r"`jdp.sync_batch_stats`",
    ):
        run(step, state, make_batches(1, 16))


def test_a_per_replica_key_stored_in_the_state_is_named_as_the_cause(backend):
    """The message said the step "most likely does not average its gradients"."""

    def step_fn(state, batch):
        return {"rng": jdp.replica_key(state["rng"]), "w": state["w"]}, {}

    step = jdp.parallelize(step_fn, backend=backend, devices=jax.devices()[:2])
    state = step.replicate({"rng": jax.random.key(0), "w": jnp.ones(3)})
    with pytest.raises(
        jdp.ReplicaDivergenceError, match=r"\['rng'\].*all of them PRNG keys.*split"
    ):
        step(state, step.shard(np.ones(4, np.float32)))


@pytest.mark.parametrize("inner", ["sync_gradients", "zero"])
def test_own_step_with_multi_steps_accumulates_each_replicas_gradients(inner):
    """`optax.MultiSteps(optax.chain(jdp.sync_gradients(), adam))` in a step of
    one's own (as `jdp.sync_gradients` documents it) failed the first check on
    `acc_grads`, which hold each replica's own gradients until the update."""
    adam = optax.adam(1e-2)
    wrapped = (
        optax.chain(jdp.sync_gradients(), adam) if inner != "zero" else jdp.zero(adam)
    )
    tx = optax.MultiSteps(wrapped, every_k_schedule=2)

    def own_step(state, batch):
        grads = jax.grad(mlp_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), {}

    step = jdp.parallelize(own_step, devices=jax.devices()[:4])
    params = init_mlp(jax.random.key(0))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batches = make_batches(4, 32)
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    from helpers import single_device_train

    expected, _ = single_device_train(
        mlp_loss, params, optax.MultiSteps(adam, every_k_schedule=2), batches
    )
    got = step.unreplicate(state).params
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_synchronous_steps_pass_the_check():
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0))
    step = jdp.parallelize(flax_style_step(tx, average=True), check_sync=1)
    state = step.replicate({"params": params, "opt_state": tx.init(params)})
    run(step, state, make_batches(3, 16))
    made = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), check_sync=1)
    run(
        made,
        made.replicate(jdp.TrainState.create(params=params, tx=tx)),
        make_batches(3, 16),
    )


def test_bmuf_local_params_between_syncs_are_not_checked():
    tx = jdp.bmuf(optax.sgd(0.1), sync_period=4)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), check_sync=1
    )
    params = init_mlp(jax.random.key(0))
    state = run(
        step,
        step.replicate(jdp.TrainState.create(params=params, tx=tx)),
        make_batches(3, 16),
    )
    assert not jdp.replicas_in_sync(state.params)  # mid-block: they differ


def bmuf_step(tx, *, corrupt=False):
    """A hand-written step applying `jdp.bmuf` as flax's `apply_gradients` does.

    With `corrupt`, replica 1 shifts BMUF's global model: a broken sync.
    """

    def step_fn(state, batch):
        grads = jax.grad(mlp_loss)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        if corrupt:
            nudge = jnp.where(lax.axis_index("data") == 1, 1.0, 0.0)
            opt_state = opt_state._replace(
                global_params=jax.tree.map(lambda g: g + nudge, opt_state.global_params)
            )
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {}

    return step_fn


def test_own_bmuf_step_checks_only_what_replicas_agree_on():
    """Replicas training locally between syncs are not an error, in a step of
    one's own either; BMUF's global model drifting apart still is."""
    tx = jdp.bmuf(optax.sgd(0.1), sync_period=4)
    params = init_mlp(jax.random.key(0))
    step = jdp.parallelize(bmuf_step(tx), check_sync=1)
    state = step.replicate({"params": params, "opt_state": tx.init(params)})
    state = run(step, state, make_batches(3, 16))
    assert not jdp.replicas_in_sync(state["params"])  # mid-block: they differ

    broken = jdp.parallelize(bmuf_step(tx, corrupt=True), check_sync=1)
    state = broken.replicate({"params": params, "opt_state": tx.init(params)})
    with pytest.raises(jdp.ReplicaDivergenceError) as info:
        run(broken, state, make_batches(1, 16))
    assert info.value.leaf.startswith("['opt_state'].global_params")
    assert info.value.replica == 1


def test_the_check_runs_on_the_first_call_then_every_k():
    tx = optax.sgd(0.1)
    params = init_mlp(jax.random.key(0))

    def drift_at(call_index):
        def step_fn(state, batch):
            nudge = jnp.where(
                (state["calls"] == call_index) & (lax.axis_index("data") == 1), 1.0, 0.0
            )
            w = state["w"] + nudge
            return {"w": w, "calls": state["calls"] + 1}, {}

        return step_fn

    step = jdp.parallelize(drift_at(2), check_sync=5)  # drifts in call 3
    state = step.replicate({"w": jnp.zeros(3), "calls": jnp.int32(0)})
    batch = step.shard(make_batches(1, 8)[0])
    for _ in range(4):  # calls 1-4: checked at call 1 only
        state, _ = step(state, batch)
    with pytest.raises(jdp.ReplicaDivergenceError, match=r"during step call 5"):
        step(state, batch)
    off = jdp.parallelize(drift_at(0), check_sync=None)
    state = off.replicate({"w": jnp.zeros(3), "calls": jnp.int32(0)})
    state, _ = off(state, batch)  # no check
    assert not jdp.replicas_in_sync(state)
    del params, tx


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, r"`check_sync` must be an int >= 1"),
        (2.5, TypeError, r"`check_sync` must be an int >= 1.*2\.5 \(a float\)"),
    ],
)
def test_bad_check_sync(value, error, match):
    with pytest.raises(error, match=match):
        jdp.parallelize(lambda s, b: (s, {}), check_sync=value)


@pytest.mark.parametrize("drift", ["permuted", "compensating ulps"])
def test_drifts_a_plain_bit_sum_would_miss_are_caught(drift):
    """Replica 1's `w` has replica 0's values in another order, or one element an
    ulp up and another an ulp down: both kept every bit sum the same."""
    values = jnp.array([1.0, 2.0, 3.0, 4.0])
    if drift == "permuted":
        other = values[::-1]
    else:
        bits = lax.bitcast_convert_type(values, jnp.uint32)
        other = lax.bitcast_convert_type(
            bits
            + jnp.array([1, 0, 0, 0], jnp.uint32)
            - jnp.array([0, 0, 1, 0], jnp.uint32),
            jnp.float32,
        )

    def step_fn(state, batch):
        w = jnp.where(lax.axis_index("data") == 1, other, state["w"])
        return {"w": w}, {}

    step = jdp.parallelize(step_fn, devices=jax.devices()[:2], check_sync=1)
    state = step.replicate({"w": values})
    batch = step.shard(make_batches(1, 2)[0])
    with pytest.raises(jdp.ReplicaDivergenceError, match=r"\['w'\] differs"):
        step(state, batch)


def test_complex_leaves_are_compared_and_a_drift_of_the_imaginary_part_caught():
    values = jnp.array([1.0 + 2.0j, 3.0 - 4.0j], jnp.complex64)

    def step_fn(state, batch):
        w = jnp.where(lax.axis_index("data") == 1, jnp.conj(state["w"]), state["w"])
        return {"w": w, "same": state["same"]}, {}

    step = jdp.parallelize(step_fn, devices=jax.devices()[:2], check_sync=1)
    state = step.replicate({"w": values, "same": values})
    batch = step.shard(make_batches(1, 2)[0])
    with pytest.raises(jdp.ReplicaDivergenceError, match=r"\['w'\] differs"):
        step(state, batch)
    agreed = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2],
                             check_sync=1)  # fmt: skip
    state, _ = agreed(agreed.replicate({"w": values}), batch)
    np.testing.assert_array_equal(agreed.unreplicate(state)["w"], values)


def test_own_bmuf_step_still_checks_batch_statistics():
    """Between syncs the params may differ; batch statistics must not."""
    tx = jdp.bmuf(optax.sgd(0.1), sync_period=4)
    params = init_mlp(jax.random.key(0))
    inner = bmuf_step(tx)

    def step_fn(state, batch):
        new, metrics = inner({k: state[k] for k in ("params", "opt_state")}, batch)
        stats = state["stats"] + jnp.mean(batch["x"])  # not averaged: drifts
        return {**new, "stats": stats}, metrics

    step = jdp.parallelize(step_fn, check_sync=1)
    init = {"params": params, "opt_state": tx.init(params), "stats": jnp.zeros(())}
    with pytest.raises(jdp.ReplicaDivergenceError, match=r"\['stats'\] differs"):
        run(step, step.replicate(init), make_batches(1, 16))


class _Store(dict):
    """The coordination service's key-value store, in memory (one process's view)."""

    def key_value_set(self, key, value, allow_overwrite=False):
        self[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        import time

        if key not in self:
            time.sleep(timeout_in_ms / 1000)
            raise RuntimeError("DEADLINE_EXCEEDED")  # what JAX's client does
        return self[key]


def _guard_over_two_processes(check_sync, number):
    """A guard as process 0 of two builds it (each with one of the devices)."""
    import numpy as np
    from jax.sharding import Mesh

    from jdp import _divergence

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    guard = _divergence.Guard(check_sync, lambda state: state, mesh)
    guard._processes, guard._number = [0, 1], number
    return guard


def test_check_sync_that_differs_between_processes_is_refused():
    guard = _guard_over_two_processes(5, 3)
    store = _Store({"jdp/check_sync/0,1/3/1": "None"})
    with pytest.raises(
        ValueError,
        match=r"^`jdp\.parallelize\(\.\.\., check_sync=\.\.\.\)`: the processes "
        r"passed different values of `check_sync` to this step: process 0: 5, "
        r"process 1: None\. The check is a collective across the processes that "
        r"runs on some step calls only .* wait for each other forever\. Pass the "
        r"same `check_sync` on every process\. .*this is the 4th step over "
        r"these devices built in each process\.\)$",
    ):
        guard._agree(client=store)
    assert store["jdp/check_sync/0,1/3/0"] == "5"  # published for process 1
    with pytest.raises(ValueError, match=r"process 0: 5, process 1: None"):
        guard.due(2)  # and refused at every later call


def test_check_sync_that_agrees_between_processes_is_compared_once():
    guard = _guard_over_two_processes(5, 0)
    store = _Store({"jdp/check_sync/0,1/0/1": "5"})
    guard._agree(client=store)
    assert store["jdp/check_sync/0,1/0/0"] == "5"
    assert guard._processes is None  # compared: not again
    assert guard.due(1) and not guard.due(2) and guard.due(5)


def test_a_process_that_never_compares_check_sync_is_named(monkeypatch):
    from jdp import _divergence

    monkeypatch.setattr(_divergence, "AGREE_TIMEOUT_S", 0.2)
    guard = _guard_over_two_processes(None, 1)
    with pytest.raises(
        TimeoutError,
        match=r"at its first call of this step, process 0 waited 0\.2 s for "
        r"process 1 to make its first call of the same step \(the 2nd step over "
        r"these devices built in each process\)",
    ):
        guard._agree(client=_Store())


def test_steps_over_several_processes_are_numbered_in_build_order_per_device_list():
    import numpy as np
    from jax.sharding import Mesh

    from jdp import _divergence

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    guard = _divergence.Guard(5, lambda state: state, mesh)
    assert guard._processes is None and guard._number is None  # one process

    def mesh_of(ids):  # a mesh over two processes' devices (seen from process 0)
        devices = [type("Device", (), {"process_index": p, "id": i})() for p, i in ids]
        return type("FakeMesh", (), {"size": 2, "devices": np.array(devices)})()

    fake = mesh_of([(0, 900), (1, 901)])
    first = _divergence.Guard(5, lambda state: state, fake)
    # Another device order counts its own steps: a process that builds its
    # steps over it later (a replacement) numbers them as the others do.
    other = _divergence.Guard(5, lambda state: state, mesh_of([(1, 901), (0, 900)]))
    second = _divergence.Guard(None, lambda state: state, fake)
    assert (first._processes, first._number) == ([0, 1], 0)
    assert (other._processes, other._number) == ([0, 1], 0)
    assert (second._processes, second._number) == ([0, 1], 1)
