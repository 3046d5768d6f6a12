"""`jdp.distributed.live`: a process SIGKILLed mid-run, the others train on.

Three real processes (one CPU device each, gloo on 127.0.0.1); process 2 kills
itself at step 5. Two jobs, each run once per test session (under xdist the
first worker to need one runs it and the others wait for its pickled results):
in the first the survivors re-form over two replicas without a restart or a
checkpoint and finish with the same state; in the second process 2 is started
again, rejoins, and every configuration (synchronous, `jdp.partition`, BMUF,
Streaming DiLoCo, int8 with error feedback, ZeRO) trains side by side through
the kill and the rejoin (starting processes and waiting for the dead one's
collectives to time out cost seconds); the tests read its parts.
"""

import fcntl
import itertools
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batches, mlp_loss

from jdp.launch._setup import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

WORKER = Path(__file__).with_name("live_worker.py")
NUM, DIE_PROCESS, DIE_AT, STEPS, GLOBAL_BATCH = 3, 2, 5, 12, 12
REJOIN_STEPS, BOOT_S = 60, 3.0
CONFIGS = "all_reduce,partition,bmuf,streaming,int8_ef,zero"


def run_job(tmp_path, configs, *, timeout=150, replace=False, num=NUM,
            die_process=DIE_PROCESS, env=None):  # fmt: skip
    """Starts the processes; returns each survivor's results and the outputs.

    `configs`: the models the job trains side by side, comma-separated.

    With `replace`, process `die_process` is started again once it has died and
    the others completed a step without it, as a replacement (its output is the
    last of the outputs).
    """
    port = free_port()
    args = [str(num), str(port), str(tmp_path), str(die_process), str(DIE_AT), configs]
    slow = [str(REJOIN_STEPS), "0.2"] if replace else []
    boot = [str(BOOT_S)] if replace else []

    def start(p, replacement="0"):
        return subprocess.Popen(
            [sys.executable, str(WORKER), str(p), *args]
            + (slow + [replacement] + boot if slow else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )

    procs = [start(p) for p in range(num)]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        if replace:
            procs[die_process].wait(timeout=timeout)
            # Started once the survivors completed a step without it, so that
            # the job trains on fewer replicas for a while however fast it is.
            shrunk = tmp_path / "shrunk"
            while not shrunk.exists() and time.monotonic() < deadline:
                if procs[0].poll() is not None:
                    break
                time.sleep(0.05)
            procs.append(start(die_process, "1"))
        for proc in procs:
            left = max(1.0, deadline - time.monotonic())
            outputs.append(proc.communicate(timeout=left)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        tails = [proc.communicate()[0][-2000:] for proc in procs]
        pytest.fail(f"the live job did not finish in {timeout} s:\n" + "\n".join(tails))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for p in range(num):
        path = tmp_path / f"{p}.pkl"
        if path.exists():
            results[p] = pickle.loads(path.read_bytes())
    return results, outputs


def run_once(shared_dir, name, *args, **kwargs):
    """`run_job(*args, **kwargs)`, run by the first worker to ask; pickled."""
    with open(shared_dir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared_dir / f"{name}_results.pkl"
        if not done.exists():
            job = run_job(Path(tempfile.mkdtemp(dir=shared_dir)), *args, **kwargs)
            tmp = done.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(job))
            tmp.rename(done)
        return pickle.loads(done.read_bytes())


@pytest.fixture(scope="session")
def killed_job(shared_dir):
    """A kill and no replacement: the survivors' results and the outputs."""
    return run_once(shared_dir, "live_killed", "all_reduce,partition")


@pytest.fixture(scope="session")
def rejoined_job(shared_dir):
    """Every configuration through a kill and a rejoin; results and outputs."""
    return run_once(shared_dir, "live_rejoined", CONFIGS, replace=True)


def died_at(replicas, num):
    """The first step without the killed process. It kills itself a few
    milliseconds into step DIE_AT; when the step's collectives were done by then,
    the others complete that step with it and miss it from the next one."""
    died = next(i for i, n in enumerate(replicas) if n < num)
    assert died in (DIE_AT, DIE_AT + 1), replicas
    return died


def check_survivors(results, outputs):
    assert set(results) == {0, 1}, "\n".join(o[-3000:] for o in outputs)
    assert "Devices failed" in outputs[0], outputs[0][-3000:]
    for r in results.values():
        # Three replicas until the kill, then two; one re-formed mesh.
        died = died_at(r["replicas"], 3)
        assert r["replicas"] == [3] * died + [2] * (STEPS - died)
        assert r["changes"] == 1
        for losses in r["losses"].values():
            assert np.isfinite(losses).all()
    # The survivors hold the same bits.
    for config in results[0]["params"]:
        mine, other = (results[p]["params"][config] for p in (0, 1))
        assert_trees_close(mine, other, rtol=0, atol=0)


def check_rejoined(results, outputs):
    """Returns the first step without the killed process, and the step the
    replacement joined at."""
    assert set(results) == {0, 1, 2}, "\n".join(o[-3000:] for o in outputs)
    assert "Devices failed" in outputs[0], outputs[0][-3000:]
    joined = results[2]["first"]  # the step the replacement started at
    died = died_at(results[0]["replicas"], 3)
    assert died < joined < REJOIN_STEPS
    for p in (0, 1):  # 3 replicas, 2 until the replacement joined, 3 again
        gap = joined - died
        assert results[p]["replicas"] == [3] * died + [2] * gap + [3] * (
            REJOIN_STEPS - joined
        )
    assert results[2]["replicas"] == [3] * (REJOIN_STEPS - joined)
    for r in results.values():
        for losses in r["losses"].values():
            assert np.isfinite(losses).all()
    return died, joined


def one_device(steps):
    """The params after `steps` global batches on one device (SGD, momentum)."""
    tx = optax.sgd(0.1, momentum=0.9)
    params = init_mlp(jax.random.key(0))
    opt_state = tx.init(params)
    for batch in make_batches(steps, GLOBAL_BATCH):
        grads = jax.grad(mlp_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_synchronous_training_survives_a_kill_with_its_global_batch(killed_job):
    results, outputs = killed_job
    check_survivors(results, outputs)
    # The same global batches, split over 3 then 2 replicas: the optimizer saw
    # the mean over the same examples, as one device does.
    expected = one_device(STEPS)
    # `jdp.partition` too: its survivors trace the step on the new devices and
    # compare their labels among themselves, not with the dead process.
    for config in ("all_reduce", "partition"):
        assert_trees_close(results[0]["params"][config], expected, rtol=1e-5, atol=1e-6)


def reference(config, steps=STEPS, joined=None, died=DIE_AT):
    """The same membership schedule in one process, without a kill: 3 replicas,
    then from step `died` replicas 0 and 1 (the survivors) go on with their own
    state. With
    `joined`, from that step on a third replica holds what process 0's replica
    sent it, in the mesh order the job used then (process 0, 2, 1). Returns
    each replica's params, in that order."""
    import jdp

    if config == "bmuf":
        tx, sync = jdp.bmuf(optax.sgd(0.1), 3), jdp.local()
    elif config == "streaming":
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        streaming = jdp.Streaming(fragments=2, delay=1)
        tx = jdp.bmuf(optax.sgd(0.1), 4, outer=outer, streaming=streaming)
        sync = jdp.local()
    elif config == "zero":
        # Momentum, not Adam: Adam's update of an element whose gradient is
        # about zero takes its sign, which the order of a sum can flip.
        tx, sync = jdp.zero(optax.sgd(0.1, momentum=0.9)), jdp.local()
    else:
        tx = optax.sgd(0.1)
        sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    train_step = jdp.make_train_step(mlp_loss, tx, sync=sync)
    batches = make_batches(steps, GLOBAL_BATCH)
    three = jdp.parallelize(train_step, devices=jax.devices()[:3])
    state = three.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx, sync=sync)
    )
    for batch in batches[:died]:
        state, _ = three(state, three.shard(batch))
    two = jdp.parallelize(train_step, devices=jax.devices()[:2])
    if config == "zero":  # the dead replica's slices restart at zero momentum
        state = two.replicate(zero_without(three.unreplicate(state), replica=2))
    else:
        state = jax.tree.map(
            lambda x: jax.device_put(np.asarray(x)[:2], two.sharding), state
        )
    for batch in batches[died:joined]:
        state, _ = two(state, two.shard(batch))
    if joined is not None and config == "zero":  # sliced anew over 3, none lost
        state = three.replicate(two.unreplicate(state))
    elif joined is not None:  # process 0's replica sent to the replacement
        state = jax.tree.map(
            lambda x: jax.device_put(np.asarray(x)[[0, 0, 1]], three.sharding), state
        )
    for batch in batches[joined:] if joined is not None else []:
        state, _ = three(state, three.shard(batch))
    kept = (0, 1, 2) if joined is not None else (0, 1)
    return [jax.tree.map(lambda x, r=r: np.asarray(x)[r], state.params) for r in kept]


def zero_without(state, replica):
    """A whole `jdp.zero` TrainState of 3 replicas with `replica`'s slices reset."""
    zs = state.opt_state
    leaves, treedef = jax.tree.flatten(zs.chunks)
    out = []
    for x, shape, fill in zip(leaves, zs.shapes, zs.fills, strict=True):
        x = np.array(x)
        if shape is not None:
            flat, rows = x.reshape(-1), -(-x.size // 3)
            flat[replica * rows : (replica + 1) * rows] = fill
        out.append(x)
    return state.replace(opt_state=zs.replace(chunks=treedef.unflatten(out)))


def test_a_replacement_rejoins_and_every_replica_ends_identical(rejoined_job):
    """Process 2 is started again after its kill: it joins the survivors at a
    step boundary, receives their whole state and trains on with them."""
    results, outputs = rejoined_job
    check_rejoined(results, outputs)
    # Every replica holds the same bits (of the synchronous models), and the
    # optimizer saw every global batch once, as on one device.
    synchronous = ("all_reduce", "partition", "int8_ef", "zero")
    for p, config in itertools.product((1, 2), synchronous):
        mine, first = results[p]["params"][config], results[0]["params"][config]
        assert_trees_close(mine, first, rtol=0, atol=0)
    expected = one_device(REJOIN_STEPS)
    for config in ("all_reduce", "partition"):
        assert_trees_close(results[0]["params"][config], expected, rtol=1e-5, atol=1e-6)


def test_the_survivors_train_on_while_a_replacement_starts_up(rejoined_job):
    """A replacement is connected to the job BOOT_S seconds before it calls
    `step.replicate` (a real one loads its data and builds its model then): the
    others do not wait for it, they train on and take it in once it is ready."""
    results, outputs = rejoined_job
    check_rejoined(results, outputs)
    connected, ready = results[2]["boot"]
    assert ready - connected >= BOOT_S
    for p in (0, 1):
        during = [t for t in results[p]["times"] if connected < t < ready]
        assert len(during) >= 3, (p, connected, ready, results[p]["times"])


@pytest.mark.parametrize("config", ["bmuf", "streaming", "int8_ef", "zero"])
def test_per_replica_state_survives_a_kill_and_a_rejoin(rejoined_job, config):
    """BMUF's and Streaming DiLoCo's local models, the error-feedback buffers and
    ZeRO's optimizer-state slices stay each replica's own; the dead replica
    leaves the block average and the all-reduce, and its ZeRO slices restart
    from the optimizer's initial value; the replacement gets process 0's. The
    result is the run given the same membership schedule without a kill."""
    results, outputs = rejoined_job
    died, joined = check_rejoined(results, outputs)
    expected = reference(config, REJOIN_STEPS, joined, died)
    # gloo and the in-process collectives may sum in another order; with int8
    # that can move a value by one quantization level, which error feedback
    # carries into the next step.
    tolerance = dict(atol=2e-3) if config == "int8_ef" else dict(rtol=1e-5, atol=1e-6)
    for p, r in ((0, 0), (2, 1), (1, 2)):  # mesh order then: processes 0, 2, 1
        assert_trees_close(results[p]["params"][config], expected[r], **tolerance)


def test_a_collective_that_times_out_among_live_processes_is_survived(tmp_path):
    """Process 1 pauses for longer than the collective timeout before step 5 (alive,
    as in a long GC pause): the others' all-reduce times out, which leaves that
    mesh's connections broken. Every process re-forms on a new device order and
    runs the step again; the job ends as one device would have trained."""
    env = {"LIVE_COLLECTIVE_TIMEOUT": "2", "LIVE_STALL": "1:5:4"}
    results, outputs = run_job(tmp_path, "all_reduce", die_process=-1, env=env)
    assert set(results) == {0, 1, 2}, "\n".join(o[-3000:] for o in outputs)
    assert "the step failed on every live process" in outputs[0], outputs[0][-3000:]
    for p in range(3):
        assert results[p]["replicas"] == [3] * STEPS
        assert results[p]["changes"] >= 1  # re-formed over the same three devices
        assert_trees_close(
            results[p]["params"]["all_reduce"], results[0]["params"]["all_reduce"],
            rtol=0, atol=0,
        )  # fmt: skip
    assert_trees_close(
        results[0]["params"]["all_reduce"], one_device(STEPS), rtol=1e-5, atol=1e-6
    )


def test_a_replacement_rejoins_a_job_of_four_processes(tmp_path):
    """Four processes; the last of the mesh order dies mid-step and is replaced.

    In the CPU collectives' ring process 0 sends to the last process: when that
    one dies, process 0 leaves its collective at once while process 1 goes on
    sending, through every all-reduce of the step, all under one tag. The step
    reduces its metrics after the gradients, so that nothing it then receives
    is larger than the buffer it left posted (which would abort it, and with it
    the coordination service)."""
    steps, num = REJOIN_STEPS, 4
    results, outputs = run_job(
        tmp_path, "all_reduce", replace=True, num=num, die_process=num - 1
    )
    assert set(results) == set(range(num)), "\n".join(o[-3000:] for o in outputs)
    joined = results[num - 1]["first"]
    died = died_at(results[0]["replicas"], num)
    assert died < joined < steps
    for p in range(num - 1):
        gap = joined - died
        expected = [num] * died + [num - 1] * gap + [num] * (steps - joined)
        assert results[p]["replicas"] == expected
    assert results[num - 1]["replicas"] == [num] * (steps - joined)
    first = results[0]["params"]["all_reduce"]
    for p in range(1, num):
        assert_trees_close(results[p]["params"]["all_reduce"], first, rtol=0, atol=0)
    assert_trees_close(first, one_device(steps), rtol=1e-5, atol=1e-6)
