"""Child process for tests/test_checkpoint.py: resume from a checkpoint, or be killed.

Run by the tests with `XLA_FLAGS` (the simulated device count) set in the child's
environment, so a resumed run really is a new process:

    python tests/checkpoint_worker.py resume CASE STEP [BACKEND DIR OUT]...
    python tests/checkpoint_worker.py resume-cases STEP [CASE BACKEND DIR OUT]...
    python tests/checkpoint_worker.py save-large DIR STEP MIB
    python tests/checkpoint_worker.py save-unwritable DIR
    python tests/checkpoint_worker.py hold DIR SEED  (saves step 1, waits for stdin)
    python tests/checkpoint_worker.py save DIR STEP SEED
    python tests/checkpoint_worker.py save-async-and-exit DIR STEP MIB KEEP
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import sys
import tempfile
import time

import jax
import numpy as np
import optax
from helpers import init_mlp, make_batches, mlp_loss

import jdp

#: The exit code of a worker that cannot set up its case here (the test skips).
SKIP_CODE = 77
NUM_STEPS = 10
SAVE_AT = 5
GLOBAL_BATCH = 32


#: Mid-block BMUF cases: 4 replicas, a block of 4 steps, saved after 2 steps.
MID_BLOCK = {
    "bmuf_mid": lambda: jdp.bmuf(optax.sgd(0.1), sync_period=4),
    "diloco_mid": lambda: jdp.bmuf(
        optax.sgd(0.1), sync_period=4, outer=optax.sgd(0.7, momentum=0.9, nesterov=True)
    ),
}
MID_BLOCK_DEVICES = 4
MID_BLOCK_SAVE_AT = 2
MID_BLOCK_STEPS = 6


def make_case(name):
    """Returns `(tx, loss_fn, params, batches, sync)` for a resume test."""
    if name in MID_BLOCK:
        params = init_mlp(jax.random.key(0))
        batches = make_batches(MID_BLOCK_STEPS, GLOBAL_BATCH)
        return MID_BLOCK[name](), mlp_loss, params, batches, jdp.local()
    if name == "bmuf":
        tx = jdp.bmuf(
            optax.sgd(0.01, momentum=0.9),
            sync_period=SAVE_AT,
            outer=jdp.block_momentum(momentum=0.5),
            inner_state_at_sync="average",
        )
        params = init_mlp(jax.random.key(0))
        return tx, mlp_loss, params, make_batches(NUM_STEPS, GLOBAL_BATCH), jdp.local()
    tx = {
        "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
        "adam": lambda: optax.adam(1e-2),
    }[name]()
    params = init_mlp(jax.random.key(0))
    batches = make_batches(NUM_STEPS, GLOBAL_BATCH)
    return tx, mlp_loss, params, batches, jdp.all_reduce()


def make_step(name, backend, num_devices=None):
    tx, loss_fn, params, batches, sync = make_case(name)
    if num_devices is None and name in MID_BLOCK:
        num_devices = MID_BLOCK_DEVICES
    devices = None if num_devices is None else jax.devices()[:num_devices]
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, sync=sync),
        backend=backend,
        devices=devices,
    )
    return step, jdp.TrainState.create(params=params, tx=tx), batches


def flat_leaves(tree):
    """`{path: np.ndarray}` for `np.savez` (no pickle); typed keys as key data."""
    return {
        jax.tree_util.keystr(path): np.asarray(
            jax.random.key_data(x)
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x
        )
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def resume(name, step_number, *jobs):
    """Restores `step_number` and trains to the end, once per (backend, dir, out)."""
    step_number = int(step_number)
    for backend, directory, out in zip(*[iter(jobs)] * 3, strict=True):
        step, init, batches = make_step(name, backend)
        with jdp.checkpoint.CheckpointManager(directory) as manager:
            state = manager.restore(step.replicate(init), step=step_number)
        for batch in batches[step_number:]:
            state, _ = step(state, step.shard(batch))
        np.savez(out, **flat_leaves(step.unreplicate(state)))


def resume_cases(step_number, *jobs):
    """Like `resume`, once per (case, backend, dir, out); saves every replica."""
    step_number = int(step_number)
    for name, backend, directory, out in zip(*[iter(jobs)] * 4, strict=True):
        step, init, batches = make_step(name, backend)
        with jdp.checkpoint.CheckpointManager(directory) as manager:
            state = manager.restore(step.replicate(init), step=step_number)
        for batch in batches[step_number:]:
            state, _ = step(state, step.shard(batch))
        np.savez(out, **flat_leaves(state))  # every replica, not one copy


def small_state(seed):
    """A small replicated state on 2 devices whose values depend on `seed`."""
    step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
    values = np.random.default_rng(int(seed)).random(64, dtype=np.float32)
    return step.replicate({"w": values})


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_dac_override():
    """Makes file permissions apply to this process even as root (Linux).

    Drops `CAP_DAC_OVERRIDE` and `CAP_DAC_READ_SEARCH` with `capset(2)`, then
    checks that a read-only directory really refuses a new file. Exits with
    `SKIP_CODE` where that cannot be arranged.
    """
    if os.geteuid() == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
            data = (_CapData * 2)()
            if libc.capget(ctypes.byref(header), data) != 0:
                raise OSError(ctypes.get_errno(), "capget")
            drop = ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            data[0].effective &= drop
            data[0].permitted &= drop
            if libc.capset(ctypes.byref(header), data) != 0:
                raise OSError(ctypes.get_errno(), "capset")
        except (OSError, AttributeError) as e:
            print(f"cannot drop CAP_DAC_OVERRIDE here: {e}", flush=True)
            sys.exit(SKIP_CODE)
    probe = tempfile.mkdtemp()
    os.chmod(probe, 0o555)
    try:
        open(os.path.join(probe, "f"), "w").close()
    except PermissionError:
        return
    finally:
        os.chmod(probe, 0o755)
    print("a read-only directory does not stop this process here", flush=True)
    sys.exit(SKIP_CODE)


def save_unwritable(directory):
    """Async saves that fail in four ways; the last failure ends the process.

    File permissions must stop this process, even when it runs as root. Into
    `directory`, step 1 is saved; a damaged step 2 cannot be moved aside (a
    read-only directory); step 3 fails in the background (a file size limit: as
    a full disk). A read-only `<directory>-other` cannot be locked. Last, a new
    manager saves step 1 into `<directory>-last`, which then becomes read-only:
    its async save of step 2 fails, and that error is not caught: the process
    must then exit by itself.
    """
    _drop_dac_override()
    state = small_state(0)
    manager = jdp.checkpoint.CheckpointManager(directory, async_save=True)
    manager.save(1, state)
    manager.wait_until_finished()
    shutil.copytree(os.path.join(directory, "1"), os.path.join(directory, "2"))
    shutil.rmtree(os.path.join(directory, "2", "jdp_metadata"))  # a damaged step 2
    os.chmod(directory, 0o555)
    try:
        manager.save(2, state)
    except PermissionError as e:
        print(f"set aside failed: {e}", flush=True)
    os.chmod(directory, 0o755)
    shutil.rmtree(os.path.join(directory, "2"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail writes, do not kill
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, limit[1]))
    try:
        manager.save(3, state)
        print("step 3 is being written", flush=True)
        manager.wait_until_finished()
    except OSError as e:
        print(f"background failed: {e}", flush=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    manager.close()
    other = f"{directory}-other"
    os.makedirs(other, mode=0o555)
    try:
        jdp.checkpoint.CheckpointManager(other).save(1, state)
    except PermissionError as e:
        print(f"lock failed: {e}", flush=True)

    last = f"{directory}-last"
    manager = jdp.checkpoint.CheckpointManager(last, async_save=True)
    manager.save(1, state)
    manager.wait_until_finished()
    os.chmod(last, 0o555)
    print(f"saving step 2 at {time.time()}", flush=True)
    manager.save(2, state)  # raises: the process must then exit by itself
    manager.wait_until_finished()
    print("saved step 2 (unexpected)", flush=True)


def hold(directory, seed):
    """Saves step 1 and keeps the manager (and its lock) open until stdin says go."""
    with jdp.checkpoint.CheckpointManager(directory) as manager:
        manager.save(1, small_state(seed))
        print(f"locked {os.getpid()}", flush=True)
        sys.stdin.readline()
        manager.save(2, small_state(seed))
    print("closed", flush=True)


def save_in_a_job(directory):
    """Run by every process of a `jdp.launch` job: save into `directory`.

    Returns:
      The error message this process got, or None if it saved.
    """
    step = jdp.parallelize(lambda s, b: (s, {}))  # every device of every process
    state = step.replicate({"w": np.zeros(4, np.float32)})
    try:
        with jdp.checkpoint.CheckpointManager(directory) as manager:
            manager.save(5, state)
    except RuntimeError as e:
        return str(e)
    return None


def save_into_own_directory(base):
    """Run by every process of a `jdp.launch` job: each names its own directory.

    Returns:
      The error message this process got, or what `save` returned and whether
      the step is on disk, e.g. `"saved=True on_disk=False"`.
    """
    directory = os.path.join(base, f"process-{jax.process_index()}")
    step = jdp.parallelize(lambda s, b: (s, {}))  # every device of every process
    state = step.replicate({"w": np.zeros(4, np.float32)})
    try:
        with jdp.checkpoint.CheckpointManager(directory) as manager:
            saved = manager.save(5, state)
    except ValueError as e:
        return str(e)
    on_disk = os.path.isdir(os.path.join(directory, "5"))
    return f"saved={saved} on_disk={on_disk}"


_KEPT = []


def save_async_and_exit(directory, step_number, mib, keep):
    """Starts an async save and leaves without `close` or `wait_until_finished`.

    With `keep` "1" the manager stays referenced until the interpreter exits;
    with "0" it is dropped (garbage collected) when this function returns.
    """
    size = int(mib) * 2**20 // 4
    values = np.random.default_rng(int(step_number)).random(size, dtype=np.float32)
    step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
    manager = jdp.checkpoint.CheckpointManager(directory, async_save=True)
    manager.save(int(step_number), step.replicate({"w": values}))
    if keep == "1":
        _KEPT.append(manager)
    print("started", flush=True)


def save(directory, step_number, seed):
    with jdp.checkpoint.CheckpointManager(directory) as manager:
        manager.save(int(step_number), small_state(seed))
    print("saved", flush=True)


def save_large(directory, step_number, mib):
    size = int(mib) * 2**20 // 4
    values = np.random.default_rng(0).random(size, dtype=np.float32)
    step = jdp.parallelize(lambda s, b: (s, {}))
    state = step.replicate({"w": values})
    manager = jdp.checkpoint.CheckpointManager(directory)
    print("saving", flush=True)
    manager.save(int(step_number), state)
    manager.close()
    print("saved", flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {
        "resume": resume,
        "resume-cases": resume_cases,
        "save-large": save_large,
        "save-unwritable": save_unwritable,
        "hold": hold,
        "save": save,
        "save-async-and-exit": save_async_and_exit,
    }[command](*args)
