import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_worker import NUM_STEPS, SAVE_AT, flat_leaves, make_step
from helpers import init_mlp, make_batches, mlp_loss

import jdp
from jdp.checkpoint import CheckpointManager

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
    assert jdp.checkpoint.__all__ == ["CheckpointManager"]
    assert jdp.checkpoint.CheckpointManager is CheckpointManager


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
        # The partial step is ignored, not in the way: it can be saved again.
        assert manager.save(2, small)
        assert manager.latest_step() == 2
        restored = manager.restore(step.replicate({"w": jnp.zeros(1000)}))
    np.testing.assert_array_equal(step.unreplicate(restored)["w"], np.arange(1000.0))


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


def test_unreplicated_like_gets_a_hint(saved, tmp_path):
    step = make_parallel(num_devices=2)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, step.replicate({"w": jnp.ones((3, 4))}))
        with pytest.raises(
            ValueError,
            match=r"(?s)\['w'\]: the checkpoint has shape \(3, 4\).*`like` looks like "
            "one unreplicated copy",
        ):
            manager.restore({"w": jnp.ones((3, 4))})
    directory, copy = saved
    with CheckpointManager(directory) as manager:
        with pytest.raises(TypeError, match=r"leaf \.step of `like` has shape \(\)"):
            manager.restore(copy)
        sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), copy)
        with pytest.raises(TypeError, match=r"\.step of `like` is a ShapeDtypeStruct"):
            manager.restore(sds)


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
    with CheckpointManager(directory) as manager:
        with pytest.raises(
            ValueError, match=r"leaf \.params\['layer0'\]\['w'\] does not match the CRC"
        ):
            manager.restore(like)


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
        with pytest.raises(TypeError, match="must be an integer step number"):
            manager.save(1.5, state)
        with pytest.raises(ValueError, match="`step` must be a non-negative integer"):
            manager.save(-1, state)
        assert manager.all_steps() == []
        assert manager.save(step.unreplicate(state).step + 4, state)  # a 0-d array
        assert manager.all_steps() == [4]


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
