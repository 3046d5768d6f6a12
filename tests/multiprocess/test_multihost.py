"""2 real processes x 2 CPU devices (gloo, 127.0.0.1) against 1 process x 4 devices.

One job runs every check (starting JAX processes costs seconds each); the tests
below read its parts. The job runs once per test session: under xdist, the first
worker to need it runs it and the others wait for its pickled results.
The 1-process oracles run here, on 4 of this process's 8 simulated devices, on the
same global batches.
"""

import fcntl
import pickle

import jax
import multihost_workers as mw
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    init_mlp,
    make_batches,
    mlp_loss,
    single_device_train,
)

import jdp

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(240),
]

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
ORACLE_DEVICES = NUM_PROCESSES * DEVICES_PER_PROCESS


def oracle_devices():
    return jax.devices()[:ORACLE_DEVICES]


def global_batches():
    return make_batches(mw.NUM_STEPS, mw.GLOBAL_BATCH)


@pytest.fixture(scope="session")
def dirs(shared_dir):
    return {
        "restore": shared_dir / "multihost_saved_by_1x4",
        "save": shared_dir / "multihost_saved_by_2x2",
    }


@pytest.fixture(scope="session")
def job(shared_dir, dirs):
    """The job's results; with xdist, the first worker runs it, the others wait."""
    with open(shared_dir / "multihost.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared_dir / "multihost_results.pkl"
        if not done.exists():
            results = run_job(dirs)
            tmp = done.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(results))
            tmp.rename(done)
        return pickle.loads(done.read_bytes())


def run_job(dirs):
    # A checkpoint written by 1 process x 4 devices, for the job to resume from.
    tx = optax.adam(1e-2)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), devices=oracle_devices())
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    for batch in global_batches()[: mw.CHECKPOINT_STEP]:
        state, _ = step(state, step.shard(batch))
    with jdp.checkpoint.CheckpointManager(dirs["restore"]) as manager:
        manager.save(mw.CHECKPOINT_STEP, state, parallel=step)
    return jdp.launch.run(
        mw.scenario,
        NUM_PROCESSES,
        args=(str(dirs["restore"]), str(dirs["save"])),
        devices_per_process=DEVICES_PER_PROCESS,
        timeout_s=200,
        env={"JDP_SHARD_CHECK_TIMEOUT": "10"},
    )


def part(job, name):
    """Each process's result for one check; a check that raised fails here."""
    out = []
    for p, results in enumerate(job):
        value = results[name]
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"process {p} failed in {name!r}:\n{value['error']}")
        out.append(value)
    return out


@pytest.fixture(scope="session")
def oracle_adam():
    """1 process x 4 devices, 20 steps, from process 0's initial params."""
    step, state, losses = mw.train(
        "shard_map",
        batches=global_batches(),
        params=init_mlp(jax.random.key(0)),
        tx=optax.adam(1e-2),
        devices=oracle_devices(),
    )
    return jax.device_get(step.unreplicate(state).params), losses


def test_job_spans_every_process(job):
    assert [r["process_index"] for r in job] == [0, 1]
    for r in job:
        assert r["is_initialized"]
        assert r["process_count"] == NUM_PROCESSES
        assert r["device_count"] == ORACLE_DEVICES
        assert r["local_device_count"] == DEVICES_PER_PROCESS


def test_replicate_gives_process_0_params_everywhere(job):
    results = part(job, "replicate")
    own0, own1 = results[0]["own"], results[1]["own"]
    assert not np.allclose(own0["layer0"]["w"], own1["layer0"]["w"])
    for r in results:
        for i in range(DEVICES_PER_PROCESS):
            local = jax.tree.map(lambda x, i=i: x[i], r["local_replicas"])
            assert_trees_close(local, own0, rtol=0, atol=0)
        assert_trees_close(r["unreplicated"], own0, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_two_processes_match_one_process(job, oracle_adam, backend):
    expected, expected_losses = oracle_adam
    for r in part(job, f"train_{backend}"):
        assert r["num_replicas"] == ORACLE_DEVICES
        assert r["in_sync"]
        assert_trees_close(r["params"], expected, rtol=1e-5)
        np.testing.assert_allclose(r["losses"], expected_losses, rtol=1e-5)


def test_host_mesh_matches_flat_mesh(job, oracle_adam):
    expected, expected_losses = oracle_adam
    for r in part(job, "train_host_mesh"):
        assert r["mesh"] == {"host": NUM_PROCESSES, "device": DEVICES_PER_PROCESS}
        assert r["in_sync"]
        assert_trees_close(r["params"], expected, rtol=1e-5)
        np.testing.assert_allclose(r["losses"], expected_losses, rtol=1e-5)
        # Within each host first (devices 0,1 | 2,3), then across (0,2 | 1,3).
        kinds = [(k, tuple(map(tuple, g))) for k, g in r["collectives"]]
        within, across = ((0, 1), (2, 3)), ((0, 2), (1, 3))
        assert ("reduce-scatter", within) in kinds
        assert ("all-reduce", across) in kinds
        assert ("all-gather", within) in kinds
        first = kinds.index(("reduce-scatter", within))
        assert kinds.index(("all-reduce", across)) > first


def test_int8_exchange_across_processes_matches_one_process(job):
    # The same exchange on 2 processes x 2 devices as on 1 process x 4.
    step, state, losses = mw.wire_train(
        batches=global_batches(),
        params=init_mlp(jax.random.key(0)),
        devices=oracle_devices(),
    )
    expected = jax.device_get(step.unreplicate(state).params)
    for r in part(job, "wire"):
        assert r["in_sync"] and r["errors_differ"]
        assert_trees_close(r["params"], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
        assert {k for k, dtype, _ in r["collectives"] if dtype == "s8"} == {
            "all-to-all",
            "all-gather",
        }


def test_int8_exchange_on_a_host_mesh_compresses_across_hosts_only(job, oracle_adam):
    _, fp32_losses = oracle_adam
    for r in part(job, "wire_host_mesh"):
        assert r["in_sync"]
        # int8 with error feedback trains as float32 does, to within a few %.
        np.testing.assert_allclose(r["losses"][-5:], fp32_losses[-5:], rtol=0.05)
        across = ((0, 2), (1, 3))
        narrow = [(k, g) for k, dtype, g in r["collectives"] if dtype == "s8"]
        assert narrow and all(tuple(map(tuple, g)) == across for _, g in narrow)
        # Two hosts: one all-gather of each host's quantised vector.
        assert [k for k, _ in narrow] == ["all-gather"]
        within = ((0, 1), (2, 3))
        assert any(tuple(map(tuple, g)) == within for _, _, g in r["collectives"])


def test_prefetch_metrics_and_replica_keys_across_processes(job):
    for r in part(job, "features"):
        for backend in ("shard_map", "pmap"):
            got = r[backend]
            # Every example once, in global batch order, with an exact count.
            assert got["ids"] == [list(range(8 * k, 8 * k + 8)) for k in range(3)]
            assert got["count"] == [8, 8, 8]
            assert got["draws"] == NUM_PROCESSES * DEVICES_PER_PROCESS


def test_microbatches_across_processes_match_one_device(job):
    batches = make_batches(3, mw.GLOBAL_BATCH)
    tx = optax.adam(1e-2)
    expected, _ = single_device_train(
        mlp_loss, init_mlp(jax.random.key(0)), tx, batches
    )
    for r in part(job, "features"):
        assert_trees_close(r["microbatch_params"], expected, rtol=2e-5)


def test_optax_multisteps_across_processes_match_one_device(job):
    batches = make_batches(4, mw.GLOBAL_BATCH)
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    expected, _ = single_device_train(
        mlp_loss, init_mlp(jax.random.key(0)), tx, batches
    )
    for r in part(job, "features"):
        assert r["multisteps_in_sync"]
        assert_trees_close(r["multisteps_params"], expected, rtol=2e-5)


def test_loss_scaling_skips_on_every_process_when_one_overflows(job):
    for r in part(job, "features"):
        assert r["scaled"] == {
            "skipped": 1,
            "metric": 1.0,
            "unchanged": True,
            "in_sync": True,
        }


def test_shard_rejects_different_local_batch_sizes(job):
    for r in part(job, "shard"):
        with pytest.raises(ValueError, match=r"process 0: 8, process 1: 6 examples"):
            raise ValueError(r["sizes"])
        assert "pad=True" in r["sizes"]


def test_shard_waits_for_the_check_only_when_a_batch_changes(job):
    sizes = r"local batches of different sizes.*process 0: 8, process 1: 6 examples"
    r0, r1 = part(job, "shard")
    assert r0["waits_in_a_steady_loop"] == 0 and r1["waits_in_a_steady_loop"] == 0
    # Process 1's batch changed: it waited for the check and raised at once.
    assert r1["changed"] is not None and r1["next"] is None
    now = r"`step.shard`: the processes passed "
    with pytest.raises(ValueError, match=now + sizes):
        raise ValueError(r1["changed"])
    # Process 0's did not: it went on, and its background check found it.
    assert r0["changed"] is None
    late = r"`step.shard`: at an earlier call \(call \d+ of `step.shard` on this "
    late += r"process\), the processes passed "
    with pytest.raises(ValueError, match=late + sizes):
        raise ValueError(r0["next"])


def test_shard_rejects_different_layouts(job):
    for r in part(job, "shard"):
        with pytest.raises(ValueError, match=r"different structure, trailing shapes"):
            raise ValueError(r["layout"])


def test_shard_pad_pads_every_process_to_the_largest_batch(job):
    expected_total = np.arange(8).sum() + (np.arange(5) + 100).sum()
    for r in part(job, "shard"):
        assert r["pad_global_shape"] == (2 * 8,)
        assert r["pad_count"] == pytest.approx(13)
        assert r["pad_total"] == pytest.approx(expected_total)
        assert r["pad_to_global_shape"] == (16,)
        assert r["pad_to_count"] == pytest.approx(13)
        assert r["pad_to_waits"] == 0


def test_shard_rejects_padding_on_some_processes_only(job):
    """Process 1 stops padding: its batch changed, so it compares and raises;
    process 0's batch did not change (it pads as before), so it sends nothing."""
    r0, r1 = part(job, "shard")
    with pytest.raises(
        ValueError, match=r"different `pad` \(process 0: pad=True, process 1: pad"
    ):
        raise ValueError(r1["pad_mismatch"])
    assert r0["pad_mismatch"] is None


def test_replicas_in_sync_compares_replicas_of_every_process(job):
    for r in part(job, "in_sync"):
        assert r["before"] and not r["after"]
        # Replica 3 (on process 1) differs most from replica 0 (on process 0).
        with pytest.raises(AssertionError, match=r"replica 3 differs from replica 0"):
            raise AssertionError(r["msg"])
        # `check_sync` sees every process's replicas too, the same on each process.
        assert r["guard"] == ["<root>", 1] or r["guard"] == ("<root>", 1)


def test_step_broadcast_spans_every_process(job):
    for r in part(job, "in_sync"):
        assert r["after_broadcast"]
        # Replica 0 (on process 0) added its index 0 to zeros: zeros everywhere.
        np.testing.assert_array_equal(r["broadcast_values"], np.zeros((2, 3)))


def test_hierarchical_across_processes_matches_a_one_process_2d_layout(job):
    # 2 processes x 2 devices against 1 process x 4 devices laid out (2, 2).
    batches = make_batches(10, mw.GLOBAL_BATCH)
    params = init_mlp(jax.random.key(0))
    hosts = np.array(oracle_devices()).reshape(NUM_PROCESSES, DEVICES_PER_PROCESS)
    _, state, losses = mw.hierarchical_train(
        batches=batches, params=params, devices=hosts
    )
    replicas = mw.local_replicas(state.params)
    _, mixed = mw.partition_train(
        batches=batches, params=params, devices=oracle_devices()
    )
    mixed = mw.local_replicas(mixed.params)
    # 10 steps with sync_period=4: the hosts differ (mid-block).
    assert not np.array_equal(replicas["layer0"]["w"][0], replicas["layer0"]["w"][2])
    for p, r in enumerate(part(job, "hierarchical")):
        assert r["mesh"] == {"host": NUM_PROCESSES, "device": DEVICES_PER_PROCESS}
        mine = slice(p * DEVICES_PER_PROCESS, (p + 1) * DEVICES_PER_PROCESS)
        ours = jax.tree.map(lambda x, s=mine: x[s], replicas)
        assert_trees_close(r["replicas"], ours, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
        ours = jax.tree.map(lambda x, s=mine: x[s], mixed)
        assert_trees_close(r["partition"], ours, rtol=1e-5, atol=1e-6)
        # Labels that differ between processes fail at the first step, naming
        # the first leaf whose label differs, on every process.
        assert r["labels_differ"] is not None
        assert (
            "leaf ['layer0']['b'] is labelled 'embed' on process 0, 'dense'"
            in (r["labels_differ"])
        )


def test_bmuf_across_processes_matches_one_process(job):
    step, state = mw.bmuf_train(
        batches=make_batches(10, mw.GLOBAL_BATCH),
        params=init_mlp(jax.random.key(0)),
        devices=oracle_devices(),
    )
    replicas = mw.local_replicas(state.params)
    expected_global = jax.device_get(
        step.unreplicate(jdp.bmuf_global_params(state.opt_state))
    )
    # 10 steps with sync_period=4: replicas differ (mid-block), so compare each.
    assert not jdp.replicas_in_sync(state)
    for p, r in enumerate(part(job, "bmuf")):
        mine = slice(p * DEVICES_PER_PROCESS, (p + 1) * DEVICES_PER_PROCESS)
        assert_trees_close(
            r["local_replicas"],
            jax.tree.map(lambda x, mine=mine: x[mine], replicas),
            rtol=1e-5,
        )
        assert_trees_close(r["global"], expected_global, rtol=1e-5)


def test_nnx_modules_across_processes_match_one_device(job):
    """The README's NNX recipe (modules passed directly) on 2 processes, against
    the tutorial's `nnx.jit` step on one device and the whole global batch."""
    from flax import nnx

    model, optimizer = mw.nnx_modules(seed=0)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(mw.nnx_mse)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [
        float(train_step(model, optimizer, b)) for b in make_batches(5, mw.GLOBAL_BATCH)
    ]
    expected = jax.device_get(jax.tree.leaves(model))
    for r in part(job, "nnx"):
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
        assert_trees_close(r["params"], expected, rtol=1e-5, atol=1e-6)


def test_checkpoint_from_1x4_resumes_on_2x2(job, oracle_adam):
    expected, _ = oracle_adam
    for r in part(job, "checkpoint"):
        assert r["restored_step"] == mw.CHECKPOINT_STEP
        assert_trees_close(r["resumed_params"], expected, rtol=1e-5)


def test_checkpoint_from_2x2_resumes_on_1x4(job, dirs, oracle_adam):
    expected, _ = oracle_adam
    saved = part(job, "checkpoint")[0]["saved_params"]
    tx = optax.adam(1e-2)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), devices=oracle_devices())
    like = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(1)), tx=tx)
    )
    with jdp.checkpoint.CheckpointManager(dirs["save"]) as manager:
        assert manager.latest_step() == mw.CHECKPOINT_STEP
        state = manager.restore(like)
    assert int(step.unreplicate(state).step) == mw.CHECKPOINT_STEP
    assert_trees_close(step.unreplicate(state).params, saved, rtol=0, atol=0)
    for batch in global_batches()[mw.CHECKPOINT_STEP :]:
        state, _ = step(state, step.shard(batch))
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)


def test_initialize_is_idempotent_and_rejects_another_job(job):
    for message in part(job, "initialize_again"):
        with pytest.raises(
            RuntimeError, match=r"already called .* num_processes=5 \(now 2\)"
        ):
            raise RuntimeError(message)
