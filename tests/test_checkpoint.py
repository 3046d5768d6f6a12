import asyncio
import json
import os
import pickle
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_worker import (
    MID_BLOCK,
    MID_BLOCK_SAVE_AT,
    NUM_STEPS,
    SAVE_AT,
    SKIP_CODE,
    flat_leaves,
    make_step,
    save_in_a_job,
    save_into_own_directory,
)
from helpers import init_mlp, make_batches, mlp_loss

import jdp
from jdp.checkpoint import CheckpointCorruptedError, CheckpointManager

WORKER = Path(__file__).with_name("checkpoint_worker.py")
TX = optax.adam(1e-2)


def child_env(num_devices):
    env = dict(os.environ)
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")
    )
    env["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()
    )
    env["JAX_PLATFORMS"] = "cpu"
    return env


def make_parallel(backend="shard_map", num_devices=8, tx=TX):
    return jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx),
        backend=backend,
        devices=jax.devices()[:num_devices],
    )


def init_state(tx=TX, seed=0, sizes=(8, 16, 16, 4)):
    return jdp.TrainState.create(params=init_mlp(jax.random.key(seed), sizes), tx=tx)


def trained_state(step, num_steps=2):
    state = step.replicate(init_state())
    for batch in make_batches(num_steps, 32, seed=1):
        state, _ = step(state, step.shard(batch))
    return state


def abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )


def assert_bitwise_equal(actual, expected):
    """`{path: array}` dicts (or pytrees) hold the same bits, leaf by leaf."""
    if not isinstance(actual, dict) or not isinstance(expected, dict):
        actual, expected = flat_leaves(actual), flat_leaves(expected)
    assert actual.keys() == expected.keys()
    for path in expected:
        a, e = np.asarray(actual[path]), np.asarray(expected[path])
        assert a.dtype == e.dtype and a.shape == e.shape, path
        assert a.tobytes() == e.tobytes(), f"leaf {path} differs"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A directory with step 2 of an 8-replica Adam MLP state, and that state's copy."""
    directory = tmp_path_factory.mktemp("ckpt")
    step = make_parallel()
    state = trained_state(step)
    with CheckpointManager(directory) as manager:
        assert manager.save(2, state, parallel=step)
    return directory, step.unreplicate(state)


# -- save and restore ---------------------------------------------------------------


def test_public_names():
    assert jdp.checkpoint.__all__ == ["CheckpointCorruptedError", "CheckpointManager"]
    assert jdp.checkpoint.CheckpointManager is CheckpointManager
    assert issubclass(CheckpointCorruptedError, ValueError)


def test_restore_gives_every_replica_the_saved_copy(saved, backend):
    directory, copy = saved
    step = make_parallel(backend)
    like = step.replicate(init_state(seed=7))
    with CheckpointManager(directory) as manager:
        assert manager.latest_step() == 2
        restored = manager.restore(like)
    assert restored.tx is like.tx  # static fields come from `like`
    for (path, got), ref, want in zip(
        jax.tree_util.tree_flatten_with_path(restored)[0],
        jax.tree.leaves(like),
        jax.tree.leaves(copy),
        strict=True,
    ):
        assert got.shape == ref.shape and got.dtype == ref.dtype, path
        assert got.sharding.is_equivalent_to(ref.sharding, got.ndim), path
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(shard.data[0], want, err_msg=str(path))
    jdp.assert_replicas_in_sync(restored)
    # Caffe2's FinalizeAfterCheckpoint (`step.broadcast`) has nothing left to do.
    assert_bitwise_equal(step.unreplicate(step.broadcast(restored)), copy)
    step(restored, step.shard(make_batches(1, 32)[0]))  # the layout runs as is


@pytest.mark.parametrize("num_devices", [4, 1], ids=lambda n: f"{n}dev")
@pytest.mark.parametrize("like_kind", ["arrays", "abstract"])
def test_restore_into_another_replica_count_and_backend(saved, num_devices, like_kind):
    directory, copy = saved  # saved from 8 replicas under shard_map
    step = make_parallel("pmap", num_devices)
    like = step.replicate(init_state(seed=3))
    if like_kind == "abstract":
        like = abstract(like)
    with CheckpointManager(directory) as manager:
        restored = manager.restore(like)
    assert restored.params["layer0"]["w"].shape == (num_devices, 8, 16)
    assert_bitwise_equal(step.unreplicate(restored), copy)
    jdp.assert_replicas_in_sync(restored)
    _, metrics = step(restored, step.shard(make_batches(1, 32)[0]))
    assert np.isfinite(metrics["loss"])


def test_metadata_records_the_run(saved):
    directory, copy = saved
    with CheckpointManager(directory) as manager:
        meta = manager.metadata()
    assert meta["step"] == 2 and meta["format"] == "jdp.checkpoint/1"
    assert meta["jdp_version"] == jdp.__version__
    assert meta["num_replicas"] == 8
    assert (meta["backend"], meta["axis_name"]) == ("shard_map", "data")
    assert meta["state_type"].endswith("TrainState")
    want = jax.tree_util.tree_flatten_with_path(copy)[0]
    assert [r["path"] for r in meta["leaves"]] == [
        jax.tree_util.keystr(p) for p, _ in want
    ]
    assert [tuple(r["shape"]) for r in meta["leaves"]] == [x.shape for _, x in want]
    assert meta["leaves"][0] == {
        "path": ".step",
        "shape": [],
        "dtype": "int32",
        "crc32": meta["leaves"][0]["crc32"],
    }


def test_interval_and_max_to_keep(tmp_path):
    step = make_parallel(num_devices=2)
    state = step.replicate(init_state())
    with CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as manager:
        written = [manager.save(s, state) for s in range(7)]
        assert written == [True, False, True, False, True, False, True]
        assert manager.all_steps() == [4, 6]
        assert manager.save(7, state, force=True)
        assert manager.all_steps() == [6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]
    with CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [6, 7] and manager.latest_step() == 7


def test_async_save_survives_donation_of_the_saved_state(tmp_path):
    step = make_parallel(num_devices=4)
    state = trained_state(step, num_steps=1)
    copy = jax.tree.map(np.array, step.unreplicate(state))
    with CheckpointManager(tmp_path, async_save=True) as manager:
        assert manager.save(1, state)
        # The next step donates (deletes) `state`'s buffers while orbax writes.
        state, _ = step(state, step.shard(make_batches(1, 32)[0]))
    with CheckpointManager(tmp_path) as manager:
        restored = manager.restore(step.replicate(init_state()))
    assert_bitwise_equal(step.unreplicate(restored), copy)
    assert int(step.unreplicate(state).step) == int(copy.step) + 1


def test_restore_never_unpickles(saved, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("restore must not unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    directory, copy = saved
    step = make_parallel(num_devices=2)
    with CheckpointManager(directory) as manager:
        restored = manager.restore(step.replicate(init_state()))
    assert_bitwise_equal(step.unreplicate(restored), copy)


def test_restore_inside_a_running_event_loop(saved):
    """As in a notebook, whose cells run inside an asyncio event loop."""
    directory, copy = saved
    step = make_parallel(num_devices=2)

    async def cell():
        with CheckpointManager(directory) as manager:
            return manager.restore(step.replicate(init_state()))

    restored = asyncio.run(cell())
    assert_bitwise_equal(step.unreplicate(restored), copy)


def test_divergence_after_restore_is_caught_and_broadcast_repairs_it(saved):
    directory, copy = saved
    step = make_parallel(num_devices=4)
    with CheckpointManager(directory) as manager:
        state = manager.restore(step.replicate(init_state()))
    leaf = state.params["layer1"]["w"]
    values = np.array(leaf)
    values[3] += 1e-3  # replica 3 drifts
    broken = jax.make_array_from_callback(
        leaf.shape, leaf.sharding, lambda index: values[index]
    )
    state = state.replace(
        params={**state.params, "layer1": {**state.params["layer1"], "w": broken}}
    )
    with pytest.raises(
        AssertionError, match=r"\.params\['layer1'\]\['w'\]: replica 3 differs"
    ):
        jdp.assert_replicas_in_sync(state)
    repaired = step.broadcast(state)  # FinalizeAfterCheckpoint
    jdp.assert_replicas_in_sync(repaired)
    assert_bitwise_equal(step.unreplicate(repaired), copy)


# -- resume in a new process ----------------------------------------------------------


def train_and_save(case, backend, directory):
    """The uninterrupted run: NUM_STEPS steps, saving every SAVE_AT."""
    step, init, batches = make_step(case, backend)
    state = step.replicate(init)
    with CheckpointManager(directory, save_interval_steps=SAVE_AT) as manager:
        for i, batch in enumerate(batches, start=1):
            state, _ = step(state, step.shard(batch))
            if manager.save(i, state, parallel=step) and case == "bmuf":
                # Saved right after a sync: every replica holds the same bits, so
                # one saved copy resumes BMUF exactly.
                jdp.assert_replicas_in_sync(state)
        assert manager.all_steps() == [SAVE_AT, NUM_STEPS]
    return flat_leaves(step.unreplicate(state))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sgd_momentum", "adam", "bmuf"])
def test_resume_in_a_new_process_is_bit_exact(tmp_path, case):
    """Train 10 steps saving at 5; a new process resumes from 5 and trains 5 more."""
    backends = ["shard_map", "pmap"]
    uninterrupted, jobs = {}, []
    for backend in backends:
        directory = tmp_path / backend
        uninterrupted[backend] = train_and_save(case, backend, directory)
        jobs += [backend, directory, tmp_path / f"{backend}.npz"]
    proc = subprocess.run(
        [sys.executable, WORKER, "resume", case, str(SAVE_AT), *jobs],
        env=child_env(8),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for backend in backends:
        with np.load(tmp_path / f"{backend}.npz", allow_pickle=False) as resumed:
            assert_bitwise_equal(dict(resumed), uninterrupted[backend])


def test_bmuf_state_round_trips(tmp_path):
    step, init, batches = make_step("bmuf", "shard_map")
    state = step.replicate(init)
    for batch in batches[:SAVE_AT]:
        state, _ = step(state, step.shard(batch))
    with CheckpointManager(tmp_path) as manager:
        manager.save(SAVE_AT, state)
        restored = manager.restore(step.replicate(init))
    opt_state = step.unreplicate(restored).opt_state
    assert isinstance(opt_state, jdp.BMUFState)
    assert int(opt_state.count) == SAVE_AT
    assert np.any(np.asarray(opt_state.velocity["layer0"]["w"]) != 0)  # synced
    assert_bitwise_equal(step.unreplicate(restored), step.unreplicate(state))


# -- replicas that differ: BMUF between syncs ----------------------------------------


def everything(state):
    """`{path: array}` of every replica of a replicated state (not one copy)."""
    return flat_leaves(jax.device_get(state))


def run_steps(step, state, batches):
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return state


@pytest.mark.parametrize("case", sorted(MID_BLOCK))
def test_bmuf_mid_block_resume_is_bit_exact(tmp_path, backend, case):
    """Saved 2 steps into a 4-step block: every replica's local work comes back."""
    step, init, batches = make_step(case, backend)
    state = run_steps(step, step.replicate(init), batches[:MID_BLOCK_SAVE_AT])
    assert not jdp.replicas_in_sync(state)  # mid-block: the replicas differ
    with CheckpointManager(tmp_path) as manager:
        manager.save(MID_BLOCK_SAVE_AT, state, parallel=step)
        saved = everything(state)
        straight = everything(run_steps(step, state, batches[MID_BLOCK_SAVE_AT:4]))
        meta = manager.metadata()
        restored = manager.restore(step.replicate(init))
    per_replica = [r["path"] for r in meta["leaves"] if r.get("per_replica")]
    assert ".params['layer0']['w']" in per_replica
    assert not any("global_params" in p or p.endswith(".count") for p in per_replica)
    assert_bitwise_equal(everything(restored), saved)
    resumed = run_steps(step, restored, batches[MID_BLOCK_SAVE_AT:4])
    assert_bitwise_equal(everything(resumed), straight)


@pytest.mark.slow
def test_bmuf_mid_block_resume_in_a_new_process(tmp_path):
    """A new process resumes every replica (both variants; each backend once)."""
    jobs, straight = [], {}
    for case, backend in zip(sorted(MID_BLOCK), ("pmap", "shard_map"), strict=True):
        step, init, batches = make_step(case, backend)
        state = run_steps(step, step.replicate(init), batches[:MID_BLOCK_SAVE_AT])
        with CheckpointManager(tmp_path / case) as manager:
            manager.save(MID_BLOCK_SAVE_AT, state)
        rest = batches[MID_BLOCK_SAVE_AT:]  # across the sync at step 4
        straight[case] = everything(run_steps(step, state, rest))
        jobs += [case, backend, tmp_path / case, tmp_path / f"{case}.npz"]
    proc = subprocess.run(
        [sys.executable, WORKER, "resume-cases", str(MID_BLOCK_SAVE_AT), *jobs],
        env=child_env(8),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, expected in straight.items():
        with np.load(tmp_path / f"{case}.npz", allow_pickle=False) as resumed:
            assert_bitwise_equal(dict(resumed), expected)


def test_bmuf_mid_block_into_another_count_starts_from_the_global_model(tmp_path):
    """Into 2 replicas, or as one copy: a warning, and params = the global model."""
    step, init, batches = make_step("diloco_mid", "shard_map")
    state = run_steps(step, step.replicate(init), batches[:MID_BLOCK_SAVE_AT])
    copy = step.unreplicate(state)
    expected = copy.replace(params=copy.opt_state.global_params)
    assert np.any(
        np.asarray(copy.params["layer0"]["w"])
        != np.asarray(expected.params["layer0"]["w"])
    )  # replica 0's local params differ from the global model
    two = make_step("diloco_mid", "shard_map", num_devices=2)[0]
    where = re.escape(str(tmp_path))
    with CheckpointManager(tmp_path) as manager:
        manager.save(MID_BLOCK_SAVE_AT, state)
        for like, why in (
            (two.replicate(init), "`like` has 2 replicas"),
            (init, "`like` is one copy"),
        ):
            with pytest.warns(
                RuntimeWarning,
                match=rf"(?s)step 2 in {where} was saved between syncs: its 4 "
                rf"replicas held different values in \d+ leaves \(\.params.*{why}, "
                r"so it gets replica 0's copy.*local work since their last sync is "
                r"not carried over.*a new block starts from the global model",
            ):
                restored = manager.restore(like)
            if like is not init:
                jdp.assert_replicas_in_sync(restored)
                restored = two.unreplicate(restored)
            assert_bitwise_equal(restored, expected)
    # A state with no `params` to reset: replica 0's copy, and what to do.
    odd = {"weights": state.params, "opt": state.opt_state}
    with CheckpointManager(tmp_path / "odd") as manager:
        manager.save(MID_BLOCK_SAVE_AT, odd)
        with pytest.warns(
            RuntimeWarning,
            match=r"(?s)was saved between syncs.*holds a `jdp.bmuf` state, but no "
            r"`params` of the same structure to reset: set them to "
            r"`jdp.bmuf_global_params\(state\)` .*before training on",
        ):
            restored = manager.restore({"weights": init.params, "opt": init.opt_state})
    assert_bitwise_equal(flat_leaves(restored["weights"]), flat_leaves(copy.params))


def test_bmuf_under_one_label_starts_from_the_global_model_too(tmp_path):
    """`jdp.bmuf` in one label of an `optax.multi_transform` (the Sync guide's
    `jdp.partition` example): restored into another count, every replica went on
    from replica 0's local params (its start is masked where the other labels
    are), and `jdp.bmuf_global_params` gave `MaskedNode`s there."""
    params = init_mlp(jax.random.key(0), (8, 16, 4))
    labels = {"layer0": "local", "layer1": "dense"}
    tx = optax.multi_transform(
        {"dense": optax.sgd(0.1), "local": jdp.bmuf(optax.sgd(0.5), sync_period=4)},
        labels,
    )
    sync = jdp.partition(labels, {"dense": jdp.all_reduce(), "local": jdp.local()})

    def make(num):
        train_step = jdp.make_train_step(mlp_loss, tx, sync=sync)
        return jdp.parallelize(train_step, devices=jax.devices()[:num])

    four, two = make(4), make(2)
    init = jdp.TrainState.create(params=params, tx=tx)
    state = run_steps(four, four.replicate(init), make_batches(2, 32))  # mid-block
    copy = four.unreplicate(state)
    global_params = jdp.bmuf_global_params(copy)
    assert_bitwise_equal(global_params["layer1"], copy.params["layer1"])  # flat
    assert not np.array_equal(global_params["layer0"]["w"], copy.params["layer0"]["w"])
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state)
        with pytest.warns(RuntimeWarning, match="a new block starts from the global"):
            restored = two.unreplicate(manager.restore(two.replicate(init)))
    assert_bitwise_equal(flat_leaves(restored.params), flat_leaves(global_params))


def test_each_replicas_own_prng_key_round_trips(tmp_path):
    step = make_parallel(num_devices=4)
    like = step.replicate({"key": jax.random.key(0), "w": jnp.zeros(2)})
    keys = jax.random.split(jax.random.key(1), 4)  # one key per replica
    state = {"key": jax.device_put(keys, like["key"].sharding), "w": like["w"]}
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state)
        records = manager.metadata()["leaves"]
        restored = manager.restore(like)
    assert [bool(r.get("per_replica")) for r in records] == [True, False]
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    assert_bitwise_equal(everything(restored), everything(state))
    # Damage is caught in the leaves saved with every replica too.
    bad = _copy_checkpoint(tmp_path, tmp_path.parent / f"{tmp_path.name}-crc")
    meta = json.loads(_metadata_file(bad, step=1).read_text())
    meta["leaves"][0]["per_replica"]["crc32"] ^= 1
    _metadata_file(bad, step=1).write_text(json.dumps(meta))
    truncated = _copy_checkpoint(tmp_path, tmp_path.parent / f"{tmp_path.name}-cut")
    for path in (truncated / "1" / "jdp_replicas").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for directory, detail in (
        (bad, r"leaf \['key'\] \(saved with every replica\) does not match the CRC"),
        (truncated, "reading the leaves saved with every replica failed"),
    ):
        with CheckpointManager(directory) as manager:
            with pytest.raises(ValueError, match=rf"step 1 .* corrupted .*: {detail}"):
                manager.restore(like)


def test_zero_slices_are_not_saved_per_replica(tmp_path):
    """ZeRO's optimizer-state slices differ by design: their layout restores them."""
    tx = jdp.zero(optax.adam(1e-2))
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:4],
    )
    init = init_state(tx=tx)
    state = run_steps(step, step.replicate(init), make_batches(2, 32))
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state)
        assert not any(r.get("per_replica") for r in manager.metadata()["leaves"])
        two = jdp.parallelize(
            jdp.make_train_step(mlp_loss, tx, sync=jdp.local()),
            devices=jax.devices()[:2],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "replicas differed" warning
            restored = manager.restore(two.replicate(init))
    assert_bitwise_equal(two.unreplicate(restored), step.unreplicate(state))


def test_zero_slices_shaped_as_their_parameter_restore(tmp_path):
    """A (4, 16) kernel's Adam slices on 4 replicas are (4, 16) too: restore took
    them for one copy and refused the state as "mixed"."""
    tx = jdp.zero(optax.adam(1e-2))
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:4],
    )
    init = init_state(tx=tx, sizes=(4, 16, 4))
    state = run_steps(step, step.replicate(init), make_batches(2, 32, in_dim=4))
    assert state.opt_state.chunks[0].mu["layer0"]["w"].shape == (4, 16)
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state)
        restored = manager.restore(step.replicate(init))
    assert_bitwise_equal(step.unreplicate(restored), step.unreplicate(state))


# -- a save killed midway -------------------------------------------------------------


def _bytes_under(paths):
    total = 0
    for path in paths:
        for root, _, files in os.walk(path):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:
                    pass
    return total


@pytest.mark.slow
def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    step = make_parallel(num_devices=2)
    small = step.replicate({"w": jnp.arange(1000.0)})
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, small)
    proc = subprocess.Popen(
        [sys.executable, WORKER, "save-large", tmp_path, "2", "128"],
        env=child_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            partial = [p for p in tmp_path.iterdir() if p.name.startswith("2.")]
            if partial and _bytes_under(partial) > 2**20:  # data is being written
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
        names = sorted(p.name for p in tmp_path.iterdir())
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (
        f"the save was not killed:\n{err[-2000:]}"
    )
    assert "2" not in names and any(n.startswith("2.") for n in names), names

    with CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [1]
        assert manager.latest_step() == 1
        restored = manager.restore(step.replicate({"w": jnp.zeros(1000)}))
        np.testing.assert_array_equal(
            step.unreplicate(restored)["w"], np.arange(1000.0)
        )
        # The partial step is ignored, not in the way: it can be saved again, and
        # the lock the killed process left behind is reclaimed.
        with pytest.warns(
            RuntimeWarning,
            match=rf"reclaimed the stale lock .* left by process {proc.pid} on host "
            r".*: process \d+ is no longer running",
        ):
            assert manager.save(2, small)
        assert manager.latest_step() == 2
        restored = manager.restore(step.replicate({"w": jnp.zeros(1000)}))
    np.testing.assert_array_equal(step.unreplicate(restored)["w"], np.arange(1000.0))


@pytest.mark.parametrize("reference", ["kept", "dropped"])
def test_async_save_is_finished_when_the_process_exits_without_close(
    tmp_path, reference
):
    """A script that ends right after an async `save` still commits the step.

    The manager stays referenced until exit, or is garbage collected first.
    """
    keep = "1" if reference == "kept" else "0"
    proc = subprocess.run(
        [sys.executable, WORKER, "save-async-and-exit", tmp_path, "3", "32", keep],
        env=child_env(2),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "started", proc.stderr[
        -3000:
    ]
    assert not (tmp_path / ".jdp-checkpoint.lock").exists()  # released at exit
    expected = np.random.default_rng(3).random(32 * 2**20 // 4, dtype=np.float32)
    with CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [3]
        got = manager.restore({"w": np.zeros_like(expected)})
    np.testing.assert_array_equal(got["w"], expected)


# -- a save that fails ----------------------------------------------------------------


def test_failed_async_save_raises_and_the_process_exits(tmp_path):
    """An async save into a directory it cannot write: an error, then exit."""
    directory = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, WORKER, "save-unwritable", directory],
        env=child_env(2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
        ended = time.time()
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the process did not exit after the failed save:\n{err[-3000:]}")
    finally:
        for path in (directory, tmp_path / "ckpt-last"):
            if path.exists():
                os.chmod(path, 0o755)
    if proc.returncode == SKIP_CODE:
        pytest.skip(out.strip())
    where = re.escape(str(directory))
    # A damaged step 2 that cannot be moved aside: named, with the fix.
    assert re.search(
        rf"set aside failed: `CheckpointManager.save`: step 2 in {where} is "
        r"incomplete or damaged \(its metadata could not be read .*\), and moving "
        rf"it aside to {where}/2\.damaged-1 failed \(PermissionError: .*\)\. "
        rf"Nothing was saved\.\nFix: move or delete {where}/2 yourself",
        out,
    ), out
    # A write that fails in the background: raised by `wait_until_finished`.
    assert "step 3 is being written" in out, out
    assert re.search(
        rf"background failed: `CheckpointManager.save`: the background write of "
        rf"step 3 to {where} failed \(.*\)\. Step 3 was not committed; the steps "
        r"saved before it are intact \(\[1\]\)",
        out,
    ), out
    # A read-only directory that a manager cannot even lock.
    assert re.search(
        r"lock failed: `CheckpointManager.save`: cannot create the lock file "
        rf"{where}-other/\.jdp-checkpoint\.lock in the checkpoint directory "
        rf"{where}-other \(PermissionError: .*\)\. Nothing was saved\.\nFix: make "
        rf"{where}-other writable",
        out,
    ), out
    # The uncaught error ends the process promptly.
    started = re.search(r"saving step 2 at ([\d.]+)", out)
    assert started and "unexpected" not in out, out
    assert proc.returncode == 1, err[-3000:]
    assert ended - float(started.group(1)) < 30, "the process took long to exit"
    assert re.search(
        rf"PermissionError: `CheckpointManager.save`: writing step 2 to {where}-last "
        r"failed \(PermissionError: .*\)\. Step 2 was not committed; the steps "
        r"saved before it are intact \(\[1\]\)\.\nFix: check that .* is writable",
        err,
    ), err[-3000:]
    for path in (directory, tmp_path / "ckpt-last"):
        with CheckpointManager(path) as manager:
            assert manager.all_steps() == [1]


def test_unwritable_directory_names_the_directory_and_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    state = make_parallel(num_devices=2).replicate({"w": jnp.ones(3)})
    for async_save in (False, True):
        with CheckpointManager(blocker / "ckpt", async_save=async_save) as manager:
            with pytest.raises(
                NotADirectoryError,
                match=rf"`CheckpointManager\.save`: the checkpoint directory "
                rf"{re.escape(str(blocker / 'ckpt'))} cannot be created: "
                rf"{re.escape(str(blocker))}, above it, is a file, not a directory",
            ):
                manager.save(4, state)


# -- one writer per directory ---------------------------------------------------------


def _lock_owner_pattern(directory, pid):
    """The start of the error for a directory locked by process `pid` of this host."""
    return (
        rf"{re.escape(str(directory))} is locked by another checkpoint manager: "
        rf"process {pid} on host '{re.escape(socket.gethostname())}'"
    )


def test_two_managers_in_one_process_never_overwrite_each_other(tmp_path):
    step = make_parallel(num_devices=2)
    first = step.replicate({"w": jnp.arange(4.0)})
    second = step.replicate({"w": -jnp.arange(4.0)})
    tmp_path.mkdir(exist_ok=True)
    a = CheckpointManager(tmp_path)
    b = CheckpointManager(tmp_path)  # opened before `a` saved anything
    a.save(1, first)
    with pytest.raises(
        RuntimeError,
        match="(?s)"
        + _lock_owner_pattern(tmp_path, os.getpid())
        + r" .*\(this process\) "
        r"holds .*\.jdp-checkpoint\.lock.*Fix: give this run its own directory, or "
        r"`close\(\)` the other manager",
    ):
        b.save(1, second)
    a.save(2, first)
    a.close()
    # The lock is free now, but step 1 and 2 exist: `b` looks again before writing.
    with pytest.raises(ValueError, match="step 2 already has a checkpoint"):
        b.save(2, second)
    with pytest.raises(ValueError, match="step 1 already has a checkpoint"):
        b.save(1, second)
    with pytest.raises(ValueError, match=r"step 0 is older than the latest .*\(2\)"):
        b.save(0, second)
    assert b.save(3, second)
    b.close()
    with CheckpointManager(tmp_path) as reader:
        assert reader.all_steps() == [1, 2, 3]
        like = step.replicate({"w": jnp.zeros(4)})
        for number, want in ((1, first), (2, first), (3, second)):
            got = reader.restore(like, step=number)
            assert_bitwise_equal(step.unreplicate(got), step.unreplicate(want))
    assert not (tmp_path / ".jdp-checkpoint.lock").exists()  # released by close


def _read_line(proc, timeout):
    """The child's next stdout line, or a failure after `timeout` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        pytest.fail(f"no output from the child in {timeout} s: {proc.stderr.read()}")
    return proc.stdout.readline()


def test_two_processes_at_once_one_gets_the_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, WORKER, "hold", tmp_path, "1"],
        env=child_env(2),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _read_line(holder, 120).strip() == f"locked {holder.pid}"
        other = subprocess.run(
            [sys.executable, WORKER, "save", tmp_path, "5", "2"],
            env=child_env(2),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert other.returncode == 1, other.stderr[-3000:]
        assert re.search(
            "RuntimeError: `CheckpointManager.save`: "
            + _lock_owner_pattern(tmp_path, holder.pid),
            other.stderr,
        ), other.stderr[-3000:]
        holder.stdin.write("go\n")
        holder.stdin.flush()
        out, err = holder.communicate(timeout=120)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate(timeout=30)
    assert holder.returncode == 0 and out.strip() == "closed", err[-3000:]
    step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
    with CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [1, 2]  # the holder's steps, nothing else
        got = step.unreplicate(manager.restore({"w": np.zeros(64, np.float32)}))
    expected = np.random.default_rng(1).random(64, dtype=np.float32)
    np.testing.assert_array_equal(got["w"], expected)


@pytest.mark.multiprocess
def test_every_process_of_a_job_raises_when_the_directory_is_locked(tmp_path):
    step = make_parallel(num_devices=2)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, step.replicate({"w": jnp.ones(4)}))  # holds the lock
        errors = jdp.launch.run(
            save_in_a_job,
            2,
            args=(str(tmp_path),),
            devices_per_process=1,
            timeout_s=120,
            quiet=True,
        )
        assert manager.all_steps() == [1]
    assert re.search(_lock_owner_pattern(tmp_path, os.getpid()), errors[0])
    assert errors[1] == (
        f"`CheckpointManager.save`: process 0 could not lock {tmp_path} (see its "
        "error); nothing was saved."
    )


@pytest.mark.multiprocess
def test_processes_of_a_job_saving_into_different_directories_raise(tmp_path):
    """Process 1's `save` returned True while only process 0 wrote anything."""
    results = jdp.launch.run(
        save_into_own_directory,
        2,
        args=(str(tmp_path),),
        devices_per_process=1,
        timeout_s=120,
        quiet=True,
    )
    assert results[0] == results[1], results  # every process raises the same
    assert results[0] == (
        "`CheckpointManager.save`: the processes of this job save into different "
        f"directories:\n  process 0: {tmp_path}/process-0\n  process 1: "
        f"{tmp_path}/process-1\nEvery process of a job must pass the same "
        "directory: process 0 writes the checkpoint into its own directory and the "
        "other processes only synchronise with it, so the steps would be saved "
        "into one directory only and a restore from the others would find "
        "nothing. Nothing was saved.\nFix: pass the same path on every process "
        "(e.g. `CheckpointManager(base_dir)`, not a path that holds the process "
        "index; an absolute path if the processes run in different working "
        "directories)."
    )
    assert list(tmp_path.iterdir()) == []  # nothing was created


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_a_stale_lock_is_reclaimed_and_a_foreign_one_is_named(tmp_path):
    step = make_parallel(num_devices=2)
    state = step.replicate({"w": jnp.ones(3)})
    lock = tmp_path / ".jdp-checkpoint.lock"
    host = socket.gethostname()
    dead, me, parent = _dead_pid(), os.getpid(), os.getppid()
    for number, (record, owner, why) in enumerate(
        (
            ({"pid": dead, "token": "t"}, f"process {dead}", "is no longer running"),
            ({"pid": me, "token": "t"}, f"process {me}", "its manager in this process"),
            (  # alive, but not the process that took the lock
                {"pid": parent, "start_time": 1},
                f"process {parent}",
                r"is no longer running \(its id now belongs to a process started "
                r"later\)",
            ),
            ({}, "process None", "the lock file names no process"),
            (None, "an unknown process", "the lock file is unreadable"),
        ),
        start=1,
    ):
        text = '{"pid": 12' if record is None else json.dumps({**record, "host": host})
        lock.write_text(text)
        with CheckpointManager(tmp_path, max_to_keep=None) as manager:
            with pytest.warns(
                RuntimeWarning,
                match=rf"reclaimed the stale lock {re.escape(str(lock))} left by "
                rf"{owner}.*: .*{why}",
            ):
                assert manager.save(number, state)
            held = json.loads(lock.read_text())
            assert held["pid"] == os.getpid() and held["host"] == host
        assert not lock.exists()
    # A lock from another machine cannot be checked from here: named, with the fix.
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "t"}))
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(
            RuntimeError,
            match=rf"(?s){re.escape(str(tmp_path))} is locked by another checkpoint "
            rf"manager: process 1 on host 'elsewhere'.*delete {re.escape(str(lock))} "
            "and save again",
        ):
            manager.save(6, state)
        assert manager.all_steps() == [1, 2, 3, 4, 5]
    assert lock.exists()  # not ours to remove


# -- bad input ------------------------------------------------------------------------


def test_no_checkpoint_names_the_directory(tmp_path):
    missing = tmp_path / "nowhere"
    like = make_parallel(num_devices=2).replicate(init_state())
    with CheckpointManager(missing) as manager:
        assert manager.all_steps() == [] and manager.latest_step() is None
        with pytest.raises(
            FileNotFoundError,
            match=f"no checkpoint in {re.escape(str(missing))} .the directory does not",
        ):
            manager.restore(like)
    assert not missing.exists()  # reading never creates the directory
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(
            FileNotFoundError, match=f"no checkpoint in {re.escape(str(tmp_path))}\\."
        ):
            manager.restore(like)


def test_missing_step(saved):
    directory, _ = saved
    like = make_parallel(num_devices=2).replicate(init_state())
    with CheckpointManager(directory) as manager:
        with pytest.raises(
            FileNotFoundError,
            match=r"no complete checkpoint for step 7 .*the complete steps are \[2\]",
        ):
            manager.restore(like, step=7)
        with pytest.raises(ValueError, match="`step` must be a non-negative integer"):
            manager.restore(like, step=-1)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda: init_state(sizes=(8, 32, 16, 4)),
            r"\.params\['layer0'\]\['b'\]: the checkpoint has shape \(16,\) float32, "
            r"`like` has shape \(32,\) float32",
        ),
        (
            lambda: init_state(tx=optax.sgd(0.1, momentum=0.9)),
            r"\.opt_state\[0\]\.count: in the checkpoint with shape \(\) int32, not in",
        ),
        (
            lambda: jax.tree.map(
                lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                init_state(),
            ),
            r"\.params\['layer0'\]\['b'\]: the checkpoint has shape \(16,\) float32, "
            r"`like` has shape \(16,\) bfloat16",
        ),
    ],
    ids=["shape", "other_optimizer", "dtype"],
)
def test_mismatch_names_the_leaf_and_both_shapes(saved, change, message):
    directory, _ = saved
    state = change()
    like = make_parallel(num_devices=2, tx=state.tx).replicate(state)
    with CheckpointManager(directory) as manager:
        with pytest.raises(ValueError, match=f"does not match `like`.*:\n  {message}"):
            manager.restore(like)


@pytest.mark.parametrize(
    "like_tree, message",
    [
        (
            {"a": 2, "b": 3, "c": 4},
            r"\['c'\]: not in the checkpoint; `like` has shape \(4,\)",
        ),
        ({"a": 2}, r"\['b'\]: in the checkpoint with shape \(3,\) float32, not in"),
        ({"a": 2, "z": 3}, r"\['b'\]: in the checkpoint .*\n  \['z'\]: not in the"),
    ],
    ids=["extra_leaf", "missing_leaf", "renamed_leaf"],
)
def test_structure_mismatch_names_the_first_leaf(tmp_path, like_tree, message):
    step = make_parallel(num_devices=2)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, step.replicate({"a": jnp.ones(2), "b": jnp.ones(3)}))
        like = step.replicate({k: jnp.ones(n) for k, n in like_tree.items()})
        with pytest.raises(ValueError, match=f"does not match `like`.*:\n  {message}"):
            manager.restore(like)


def test_restore_one_copy_for_analysis(saved, tmp_path):
    """A `like` without replica axis (the saved shapes) gets one copy back."""
    directory, copy = saved
    init = init_state(seed=5)
    with CheckpointManager(directory) as manager:
        one = manager.restore(init)  # a plain `jdp.TrainState.create(...)`
        assert one.tx is init.tx
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(one))
        assert_bitwise_equal(one, copy)
        # Its `jax.ShapeDtypeStruct`s without shardings: NumPy arrays.
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init)
        host = manager.restore(shapes)
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
        assert_bitwise_equal(host, copy)
        # Arrays on one device: placed on that device.
        device = jax.devices()[3]
        placed = manager.restore(jax.device_put(init, device))
        assert {x.devices().pop() for x in jax.tree.leaves(placed)} == {device}
        assert_bitwise_equal(placed, copy)
    with CheckpointManager(tmp_path) as manager:
        step = make_parallel(num_devices=2)
        manager.save(1, step.replicate({"w": jnp.ones((3, 4)), "n": jnp.arange(2)}))
        got = manager.restore(
            {"w": np.zeros((3, 4), np.float32), "n": np.zeros(2, int)}
        )
        # (NumPy's int64 is JAX's int32 without x64, as `step.replicate` makes it.)
        np.testing.assert_array_equal(got["w"], np.ones((3, 4)))
        np.testing.assert_array_equal(got["n"], [0, 1])
        with pytest.raises(
            ValueError, match=r"\['n'\]: the checkpoint has shape \(2,\) int32, `like` "
        ):
            manager.restore({"w": np.zeros((3, 4), np.float32), "n": np.zeros(2)})


def test_ambiguous_or_wrong_one_copy_like_is_refused(saved):
    directory, copy = saved
    with CheckpointManager(directory) as manager:
        # One-copy leaves next to replicated ones: neither reading is right.
        mixed = copy.replace(params=make_parallel(num_devices=2).replicate(copy.params))
        with pytest.raises(
            ValueError,
            match=r"(?s)`like` mixes one-copy leaves \(shaped as saved in step 2, "
            r"e\.g\. \.step \(\), .*\) and leaves with a replica axis \(e\.g\. "
            r"\.params\['layer0'\]\['b'\] \(2, 16\), .*Fix: pass one copy",
        ):
            manager.restore(mixed)
        # One copy of another model: the leaf, both shapes, and how it was read.
        other = init_state(sizes=(8, 32, 16, 4))
        with pytest.raises(
            ValueError,
            match=r"(?s)\.params\['layer0'\]\['b'\]: the checkpoint has shape \(16,\) "
            r"float32, `like` has shape \(32,\).*`like` is read as one copy",
        ):
            manager.restore(other)
        # Arrays on one device are one copy: a leading axis is no replica axis
        # (each leaf came back as copies of the saved one).
        stacked = jax.tree.map(lambda x: jnp.stack([x] * 2), copy)
        with pytest.raises(
            ValueError,
            match=r"(?s)\.step: the checkpoint has shape \(\) int32, `like` has "
            r"shape \(2,\).*`like` is read as one copy",
        ):
            manager.restore(stacked)
        # A replica axis without a sharding cannot be placed.
        sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), copy)
        with pytest.raises(TypeError, match=r"\.step of `like` is a ShapeDtypeStruct"):
            manager.restore(sds)


def test_resume_or_start_in_one_line(tmp_path):
    """`restore(like, default=like)`: `like` itself when there is no checkpoint."""
    step = make_parallel(num_devices=2)
    like = step.replicate(init_state())
    with CheckpointManager(tmp_path / "new") as manager:
        assert manager.restore(like, default=like) is like
        trained = trained_state(step, num_steps=1)
        manager.save(1, trained)
        resumed = manager.restore(like, default=like)
        assert_bitwise_equal(step.unreplicate(resumed), step.unreplicate(trained))
        with pytest.raises(
            FileNotFoundError, match="no complete checkpoint for step 5"
        ):
            manager.restore(like, step=5, default=like)  # `default` is for step=None


def test_a_file_as_the_directory_raises_even_with_a_default(tmp_path):
    """A typo naming a file must not start training from scratch."""
    like = make_parallel(num_devices=2).replicate(init_state())
    config = tmp_path / "config.json"
    config.write_text("{}")
    where = re.escape(str(config))
    for path, what in (
        (config, rf"{where} is a file, not a directory"),
        (config / "ckpt", rf"{where}/ckpt cannot be created: {where}, above it, is a"),
    ):
        with CheckpointManager(path) as manager:
            for call in ("restore", "save"):
                with pytest.raises(
                    NotADirectoryError,
                    match=rf"`CheckpointManager\.{call}`: the checkpoint directory "
                    rf"{what}.*\. Expected a directory holding one subdirectory per "
                    rf"saved step.*\nFix: check the path for a typo, or move {where}",
                ):
                    if call == "restore":
                        manager.restore(like, default=like)
                    else:
                        manager.save(1, like)
    assert config.read_text() == "{}"
    # A directory that does not exist yet still gives the default.
    with CheckpointManager(tmp_path / "new") as manager:
        assert manager.restore(like, default=like) is like


def test_dangling_and_looping_symlinks_are_named(tmp_path):
    like = make_parallel(num_devices=2).replicate(init_state())
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "scratch")
    loop_a, loop_b = tmp_path / "a", tmp_path / "b"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    cases = (
        (
            dangling,
            dangling,
            rf"is a symbolic link to {re.escape(str(tmp_path / 'scratch'))}, "
            rf"which does not exist.*\nFix: create "
            rf"{re.escape(str(tmp_path / 'scratch'))}",
        ),
        (
            loop_a,
            loop_a,
            rf"is a symbolic link to {re.escape(str(loop_b))} that loops .*\n"
            rf"Fix: point {re.escape(str(loop_a))} at a real directory",
        ),
        (
            loop_a / "ckpt",
            loop_a,
            r"cannot be created: .*, above it, is a symbolic link to .* that loops",
        ),
    )
    for path, link, what in cases:
        with CheckpointManager(path) as manager:
            for call in ("save", "restore"):
                with pytest.raises(OSError) as info:
                    if call == "restore":
                        manager.restore(like, default=like)
                    else:
                        manager.save(1, like)
                assert not isinstance(info.value, FileExistsError | FileNotFoundError)
                message = str(info.value)
                assert message.startswith(
                    f"`CheckpointManager.{call}`: the checkpoint directory {path} "
                ), message
                assert str(link) in message
                assert re.search(what, message, re.S), message
    # Once the link's target exists, the link is a directory like any other.
    (tmp_path / "scratch").mkdir()
    with CheckpointManager(dangling) as manager:
        assert manager.restore(like, default=like) is like
        assert manager.save(1, like)
    assert (tmp_path / "scratch" / "1").is_dir()


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


# When tensorstore fails a read, orbax's pending callbacks may reach its already
# closed event loop: harmless "Event loop is closed" noise from orbax's threads.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["zeroed", "truncated"])
def test_damaged_files_raise_instead_of_returning_garbage(saved, tmp_path, damage):
    """Damage each file of a checkpoint in turn: an error, or the exact values."""
    source, copy = saved
    step = make_parallel(num_devices=2)
    like = step.replicate(init_state())
    files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file())
    raised = []
    for i, name in enumerate(files):
        directory = _copy_checkpoint(source, tmp_path / str(i))
        target = directory / name
        data = target.read_bytes()
        middle = len(data) // 2
        if damage == "zeroed":
            data = data[: max(middle - 32, 0)] + bytes(64) + data[middle + 32 :]
        else:
            data = data[:middle]
        target.write_bytes(data)
        with CheckpointManager(directory) as manager:
            try:
                restored = manager.restore(like)
            except (ValueError, FileNotFoundError) as e:
                assert re.search("corrupted or truncated|incomplete or damaged", str(e))
                raised.append(str(name))
                continue
        # Not every file is read back (orbax keeps per-process leftovers next to
        # the merged index); whatever restores must be exactly what was saved.
        assert_bitwise_equal(step.unreplicate(restored), copy)
    assert any(n.startswith("2/state/") for n in raised), raised
    assert any(n.startswith("2/jdp_metadata/") for n in raised), raised


def _metadata_file(directory, step=2):
    return directory / str(step) / "jdp_metadata" / "metadata"


def test_checksum_catches_data_that_still_decodes(saved, tmp_path):
    directory = _copy_checkpoint(saved[0], tmp_path / "copy")
    meta = json.loads(_metadata_file(directory).read_text())
    (record,) = [r for r in meta["leaves"] if r["path"] == ".params['layer0']['w']"]
    record["crc32"] ^= 1  # as if one bit of the array had flipped on disk
    _metadata_file(directory).write_text(json.dumps(meta))
    like = make_parallel(num_devices=2).replicate(init_state())
    where = re.escape(str(directory))
    with CheckpointManager(directory) as manager:
        with pytest.raises(
            CheckpointCorruptedError,
            match=rf"the checkpoint of step 2 in {where} is corrupted or truncated: "
            r"leaf \.params\['layer0'\]\['w'\] does not match the CRC-32 recorded "
            r"when it was saved\. Restore an older step .* or save again: the next "
            rf"`save` of step 2 or an earlier step moves the damaged files aside to "
            rf"{where}/2\.damaged-<n> \(nothing is deleted\)",
        ) as info:
            manager.restore(like)
    error = info.value
    assert isinstance(error, ValueError)  # what `restore` raised before 0.3
    assert (error.directory, error.step) == (str(directory), 2)
    assert error.detail == (
        "leaf .params['layer0']['w'] does not match the CRC-32 recorded when it "
        "was saved."
    )
    copy = pickle.loads(pickle.dumps(error))  # e.g. from a `jdp.launch` process
    assert (str(copy), copy.step, copy.detail) == (str(error), 2, error.detail)
    # A manager that never restored it finds the damage before refusing a save.
    with CheckpointManager(directory) as manager:
        with pytest.warns(
            RuntimeWarning,
            match=r"step 2 .* was incomplete or damaged \(1 of its arrays do not match "
            r"the CRC-32 recorded at save\); moved it to .*2\.damaged-1",
        ):
            assert manager.save(2, make_parallel(num_devices=2).replicate(init_state()))


def test_damaged_metadata_hides_the_step_and_says_so(saved, tmp_path):
    directory = _copy_checkpoint(saved[0], tmp_path / "copy")
    _metadata_file(directory).write_text('{"format": "jdp.checkpoint/1", "leaves": [')
    like = make_parallel(num_devices=2).replicate(init_state())
    with CheckpointManager(directory) as manager:
        assert manager.all_steps() == [] and manager.latest_step() is None
        with pytest.raises(
            FileNotFoundError,
            match=r"Step\(s\) \[2\] exist but are incomplete or damaged",
        ):
            manager.restore(like)


def _damage_arrays(step_dir):
    """Zeroes every data file of a step's arrays (as a bad disk block would)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.parent.name == "d"]
    assert files
    for path in files:
        path.write_bytes(bytes(path.stat().st_size))


def _save_steps_1_and_2(tmp_path):
    """Saves states 1 and 2 of three; the step, a `like` and the three states."""
    step = make_parallel(num_devices=2)
    like = step.replicate({"w": jnp.zeros(4)})
    states = [step.replicate({"w": jnp.arange(4.0) * k}) for k in (1, 2, 3)]
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, states[0])
        manager.save(2, states[1])
    return step, like, states


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("restore_first", [True, False], ids=["restored", "fresh"])
def test_damaged_newest_step_warns_and_its_number_can_be_saved_again(
    tmp_path, restore_first
):
    step, like, states = _save_steps_1_and_2(tmp_path)
    _damage_arrays(tmp_path / "2")
    where = re.escape(str(tmp_path))
    with CheckpointManager(tmp_path) as manager:
        if restore_first:
            with pytest.warns(
                RuntimeWarning,
                match=rf"step 2 in {where} is damaged \(reading its arrays failed "
                r".*\); restoring step 1, the newest complete step before it, "
                r"instead\. The next `save` of step 2 or an earlier step moves the "
                rf"damaged step aside to {where}/2\.damaged-<n> \(nothing is deleted\)",
            ):
                got = manager.restore(like)
            assert_bitwise_equal(step.unreplicate(got), step.unreplicate(states[0]))
            assert manager.latest_step() == 1
        with pytest.warns(
            RuntimeWarning,
            match=rf"step 2 in {where} was incomplete or damaged \(.*\); moved it to "
            rf"{where}/2\.damaged-1 so that step 2 can be saved again\. Nothing was "
            r"deleted",
        ):
            assert manager.save(2, states[2])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = manager.restore(like)
    assert_bitwise_equal(step.unreplicate(got), step.unreplicate(states[2]))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "1",
        "2",
        "2.damaged-1",
    ]
    assert (tmp_path / "2.damaged-1" / "jdp_metadata" / "metadata").exists()


@pytest.mark.parametrize(
    "missing, reason",
    [
        ("jdp_metadata", r"its metadata could not be read .*"),
        ("state", r"its `state` item is missing"),
    ],
)
def test_uncommitted_newest_step_warns_and_its_number_can_be_saved_again(
    tmp_path, missing, reason
):
    """A step directory a killed save left without its commit marker, partly written."""
    step, like, states = _save_steps_1_and_2(tmp_path)
    shutil.rmtree(tmp_path / "2" / missing)
    for marker in (tmp_path / "2").rglob("commit_success.txt"):
        marker.unlink()
    where = re.escape(str(tmp_path))
    with CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [1]
        with pytest.warns(
            RuntimeWarning,
            match=rf"step 2 in {where} is incomplete or damaged \({reason}\); "
            r"restoring step 1, the newest complete step, instead",
        ):
            got = manager.restore(like)
    assert_bitwise_equal(step.unreplicate(got), step.unreplicate(states[0]))
    with CheckpointManager(tmp_path) as manager:  # a new manager, as after a restart
        with pytest.warns(RuntimeWarning, match=rf"moved it to {where}/2\.damaged-1"):
            assert manager.save(2, states[2])
        got = manager.restore(like)
    assert_bitwise_equal(step.unreplicate(got), step.unreplicate(states[2]))


def test_only_damaged_steps_and_a_default(tmp_path):
    step = make_parallel(num_devices=2)
    like = step.replicate({"w": jnp.zeros(4)})
    with CheckpointManager(tmp_path) as manager:
        manager.save(3, step.replicate({"w": jnp.ones(4)}))
    shutil.rmtree(tmp_path / "3" / "jdp_metadata")
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(
            FileNotFoundError,
            match=r"Step\(s\) \[3\] exist but are incomplete or damaged .* the next "
            r"`save` of one of these step numbers or an earlier one moves them aside",
        ):
            manager.restore(like)
        with pytest.warns(
            RuntimeWarning,
            match=r"holds no complete checkpoint, only incomplete or damaged step\(s\) "
            r"\[3\]; returning `default`",
        ):
            assert manager.restore(like, default=like) is like


def test_bad_input_never_loses_a_saved_checkpoint(saved, tmp_path):
    directory = _copy_checkpoint(saved[0], tmp_path / "copy")
    step = make_parallel(num_devices=2)
    with CheckpointManager(directory) as manager:
        with pytest.raises(ValueError, match="does not match `like`"):
            manager.restore(step.replicate(init_state(sizes=(8, 32, 16, 4))))
        with pytest.raises(ValueError, match="not a replicated state"):
            manager.save(2, {"w": np.ones(3)})
        with pytest.raises(ValueError, match="step 2 already has a checkpoint"):
            manager.save(2, step.replicate(init_state()))
        assert manager.all_steps() == [2]
        restored = manager.restore(step.replicate(init_state()))
    assert sorted(p.name for p in directory.iterdir()) == ["2"]
    assert_bitwise_equal(step.unreplicate(restored), saved[1])


def test_save_never_overwrites(tmp_path):
    step = make_parallel(num_devices=2)
    first = step.replicate(init_state(seed=0))
    second = step.replicate(init_state(seed=1))
    with CheckpointManager(tmp_path) as manager:
        manager.save(3, first)
        for force in (False, True):
            with pytest.raises(ValueError, match="step 3 already has a checkpoint"):
                manager.save(3, second, force=force)
        with pytest.raises(
            ValueError, match=r"step 1 is older than the latest .*\(3\)"
        ):
            manager.save(1, second)
        restored = manager.restore(step.replicate(init_state(seed=2)))
        assert manager.all_steps() == [3]
    assert_bitwise_equal(step.unreplicate(restored), step.unreplicate(first))


def test_save_rejects_what_it_cannot_restore(tmp_path):
    step = make_parallel(num_devices=2)
    state = step.replicate(init_state())
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(ValueError, match=r"\['w'\]: a ndarray of shape \(3,\)"):
            manager.save(1, {"w": np.ones(3)})
        with pytest.raises(ValueError, match=r"\['n'\]: a 0-d jax.Array"):
            manager.save(1, {"n": jnp.ones(())})
        with pytest.raises(ValueError, match="was not replicated by this step"):
            manager.save(1, state, parallel=make_parallel(num_devices=4))
        with pytest.raises(
            ValueError, match=r"\['a'\]\['b'\] and \['a\.b'\] would both be written"
        ):  # it saved both under one name: the step read back as damaged
            manager.save(
                1, step.replicate({"a.b": jnp.ones(2), "a": {"b": jnp.ones(3)}})
            )
        with pytest.raises(TypeError, match="must be an integer step number"):
            manager.save(1.5, state)
        with pytest.raises(ValueError, match="`step` must be a non-negative integer"):
            manager.save(-1, state)
        assert manager.all_steps() == []
        assert manager.save(step.unreplicate(state).step + 4, state)  # a 0-d array
        assert manager.all_steps() == [4]


def test_save_refuses_an_unreplicated_or_donated_state(tmp_path):
    """An unreplicated state failed inside the copy ("cannot reshape array"); a
    state an earlier step donated crashed the process (or raised JAX's "Array has
    been deleted")."""
    step = make_parallel(num_devices=2)
    state = step.replicate(init_state())
    batch = step.shard(make_batches(1, 32, seed=1)[0])
    with CheckpointManager(tmp_path) as manager:
        manager.save(0, state)
        unreplicated = r"not a replicated state(.|\n)*\['w'\]: shape \(8, 16\)"
        with pytest.raises(ValueError, match=unreplicated):
            manager.save(1, step.unreplicate(state).params)
        step(state, batch)  # donates `state`
        for parallel in (None, step):
            with pytest.raises(ValueError, match=r"was donated(.|\n)*\.params\["):
                manager.save(1, state, parallel=parallel)
        assert manager.all_steps() == [0]


@pytest.mark.parametrize(
    "dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.int4], ids=lambda d: d.__name__
)
def test_narrow_and_empty_leaves_round_trip(tmp_path, dtype):
    """A bfloat16, float8 or int4 leaf stopped `save` ("cannot include dtype 'E'
    in a buffer"), a zero-size one too ("cannot cast view with zeros in shape")."""
    step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
    one = {
        "narrow": jnp.arange(-4, 4).astype(dtype),
        "empty": jnp.zeros((0, 3), dtype),
        "w": jnp.arange(3.0),
    }
    with CheckpointManager(tmp_path) as manager:
        manager.save(0, step.replicate(one))
        back = manager.restore(step.replicate(jax.tree.map(jnp.zeros_like, one)))
        assert_bitwise_equal(step.unreplicate(back), one)
        assert_bitwise_equal(manager.restore(jax.tree.map(jnp.zeros_like, one)), one)
        # Its arrays check out as intact: step 0 is not taken for a damaged one.
        with pytest.raises(ValueError, match="step 0 already has a checkpoint"):
            manager.save(0, step.replicate(one))


def test_prng_keys_resume_bit_for_bit(tmp_path, backend):
    """Typed PRNG keys in the state are saved as key data and rebuilt on restore."""

    def step_fn(state, batch):
        key, sub = jax.random.split(state["key"])
        noise = jax.random.normal(sub, state["w"].shape)
        return {"key": key, "w": state["w"] + noise + batch.mean()}, {}

    def parallel(n):
        return jdp.parallelize(step_fn, backend=backend, devices=jax.devices()[:n])

    def run(step, state, num_steps):
        for _ in range(num_steps):
            state, _ = step(state, step.shard(np.ones(8, np.float32)))
        return state

    init = {"key": jax.random.key(42), "w": np.zeros(5, np.float32)}
    eight = parallel(8)
    straight = eight.unreplicate(run(eight, eight.replicate(init), 4))
    state = run(eight, eight.replicate(init), 2)
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state)
        meta = manager.metadata(2)
        four = parallel(4)
        resumed = run(four, manager.restore(four.replicate(init)), 2)
        assert [r.get("key_impl") for r in meta["leaves"]] == ["threefry2x32", None]
        assert resumed["key"].dtype == init["key"].dtype
        jdp.assert_replicas_in_sync(resumed)
        resumed = four.unreplicate(resumed)
        assert_bitwise_equal(
            jax.random.key_data(resumed["key"]), jax.random.key_data(straight["key"])
        )
        assert_bitwise_equal(resumed["w"], straight["w"])
        # Raw uint32 key data where the checkpoint has keys: named, not guessed.
        raw = dict(init, key=np.zeros(2, np.uint32))
        with pytest.raises(
            ValueError,
            match=r"\['key'\]: the checkpoint has shape \(2,\) uint32 "
            r"\(threefry2x32 key data\), `like` has shape \(2,\) uint32",
        ):
            manager.restore(four.replicate(raw))
        other = dict(init, key=jax.random.key(0, impl="rbg"))
        with pytest.raises(ValueError, match=r"\['key'\].*`like` has shape \(4,\)"):
            manager.restore(four.replicate(other))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_to_keep": 0}, "`max_to_keep` must be a positive integer or None"),
        ({"save_interval_steps": 0}, "`save_interval_steps` must be a positive"),
        ({"save_interval_steps": True}, "`save_interval_steps` must be a positive"),
    ],
)
def test_constructor_arguments_are_checked(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointManager(tmp_path, **kwargs)


# -- extras: the data position and RNG saved with the state -----------------------


def test_extra_is_saved_with_the_step_and_restored_with_it(tmp_path):
    step = make_parallel(num_devices=2)
    state = trained_state(step, num_steps=1)
    key = jax.random.split(jax.random.key(7))[1]
    perm = np.random.default_rng(3).permutation(10).astype(np.int32)
    extra = {
        "epoch": 3,
        "batch": 17,
        "lr": 0.125,
        "name": "run-a",
        "done": None,
        "key": key,
        "perm": perm,
        "scalar": np.float32(2.5),
        "jax": jnp.arange(4.0),
        "nested": {"pos": (1, 2), "flags": [True, False]},
    }
    with CheckpointManager(tmp_path, async_save=True) as manager:
        assert manager.save(1, state, extra=extra)
        state, _ = step(state, step.shard(make_batches(1, 32)[0]))
        assert manager.save(2, state, extra={"epoch": 4})
        assert manager.save(3, state)  # no extra
    like = step.replicate(init_state())
    with CheckpointManager(tmp_path) as manager:
        restored, got = manager.restore(like, step=1, with_extra=True)
        assert int(step.unreplicate(restored).step) == 1
        assert got.keys() == extra.keys()
        for k in ("epoch", "batch", "lr", "name", "done"):
            assert got[k] == extra[k] and type(got[k]) is type(extra[k]), k
        assert got["nested"] == {"pos": [1, 2], "flags": [True, False]}
        assert jnp.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
        assert_bitwise_equal(jax.random.key_data(got["key"]), jax.random.key_data(key))
        assert got["perm"].dtype == np.int32
        np.testing.assert_array_equal(got["perm"], perm)
        assert got["scalar"].shape == () and got["scalar"].dtype == np.float32
        np.testing.assert_array_equal(got["jax"], np.arange(4.0, dtype=np.float32))
        _, newest = manager.restore(like, step=2, with_extra=True)
        assert newest == {"epoch": 4}
        latest, none = manager.restore(like, with_extra=True)
        assert none == {} and int(step.unreplicate(latest).step) == 2
        # One copy too (evaluation): the same extras.
        _, again = manager.restore(init_state(), step=1, with_extra=True)
        assert again["batch"] == 17
        # Without `with_extra`, `restore` returns the state alone, as before.
        assert not isinstance(manager.restore(like, step=1), tuple)


def test_restore_with_extra_and_default_starts_a_run(tmp_path):
    step = make_parallel(num_devices=2)
    like = step.replicate(init_state())
    with CheckpointManager(tmp_path / "new") as manager:
        state, extra = manager.restore(like, default=like, with_extra=True)
    assert state is like and extra == {}


def test_extra_of_a_fallback_step_is_that_steps_extra(tmp_path):
    step = make_parallel(num_devices=2)
    state = step.replicate(init_state())
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state, extra={"batch": 1})
        manager.save(2, state, extra={"batch": 2})
    # Damage step 2's arrays: restore falls back to step 1, with step 1's extras.
    for f in (tmp_path / "2" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and "METADATA" not in f.name:
            f.write_bytes(b"\0" * f.stat().st_size)
    with CheckpointManager(tmp_path) as manager:
        with pytest.warns(RuntimeWarning, match="step 2 .* is damaged"):
            restored, extra = manager.restore(state, with_extra=True)
    assert extra == {"batch": 1}


@pytest.mark.parametrize(
    "extra, where",
    [
        ({"loader": object()}, r"extra\['loader'\] is a builtins\.object"),
        ({"data": {"it": iter([])}}, r"extra\['data'\]\['it'\] is a builtins\."),
        ({"pos": [1, {2: 3}]}, r"extra\['pos'\]\[1\]\[2\] has a key of type int"),
        ({"a": np.array([object()])}, r"extra\['a'\] is a NumPy array of Python"),
        ({"__jdp_array__": 1}, r"extra\['__jdp_array__'\] uses a key reserved"),
        ([1, 2], r"`extra` must be a dict with string keys, got a list"),
    ],
    ids=["object", "nested-iterator", "int-key", "object-array", "tag", "list"],
)
def test_extra_that_cannot_be_saved_names_the_key(tmp_path, extra, where):
    step = make_parallel(num_devices=2)
    state = step.replicate(init_state())
    with CheckpointManager(tmp_path, save_interval_steps=10) as manager:
        with pytest.raises(TypeError, match=where):
            manager.save(10, state, extra=extra)
        # Also checked at a step that is not saved: the error comes at once.
        with pytest.raises(TypeError, match=where):
            manager.save(3, state, extra=extra)
        assert manager.all_steps() == []


def test_damaged_extra_is_reported_as_damage(tmp_path):
    step = make_parallel(num_devices=2)
    state = step.replicate(init_state())
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state, extra={"perm": np.arange(3)})
    path = tmp_path / "1" / "jdp_metadata" / "metadata"  # orbax's JSON item
    record = json.loads(path.read_text())
    record["extra"]["perm"]["__jdp_array__"]["data"] = "not base64!"
    path.write_text(json.dumps(record))
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(CheckpointCorruptedError, match="its extras could not be"):
            manager.restore(state, step=1, with_extra=True)
