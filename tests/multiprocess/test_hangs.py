"""Jobs that would hang (or abort) end promptly, each with a clear message.

Real two-process jobs on `jax.distributed` (gloo on CPU): a process that is alive
but stuck while the other waits for it in a collective, a launcher stopped with
SIGTERM while its processes train (JAX's preemption service takes SIGTERM over),
and a process that waits at shutdown for one that left without shutting down.
"""

import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jdp.launch._setup import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

# Every job here must end within this many seconds.
BOUND_S = 60

# Process STUCK_RANK (argv[1]) stops before its step STUCK_AT (argv[2]): alive,
# but the other process waits for it in that step's collective. -1: none stops.
TRAIN_LOOP = """
import os, sys, time
import jdp
jdp.distributed.initialize(timeout_s=60)
import jax, jax.numpy as jnp, numpy as np, optax
from jdp import _progress

STUCK_RANK, STUCK_AT = int(sys.argv[1]), int(sys.argv[2])


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


tx = optax.sgd(0.1)
step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=tx))
ones = np.ones((2, 1), np.float32)
batch = step.shard({"x": np.ones((2, 4), np.float32), "y": ones})
state, _ = step(state, batch)  # compiled before the loop: a step is fast
print(f"pid {os.getpid()}", flush=True)
for i in range(1, 1_000_000):
    if jax.process_index() == STUCK_RANK and i == STUCK_AT:
        time.sleep(1e6)  # stuck before its step
    _progress.beat()  # what a jdp step does as it starts
    state, metrics = step(state, batch)
    loss = float(metrics["loss"])
    if i <= 3 or i % 100 == 0:
        print(f"step {i} loss {loss:.4f}", flush=True)
"""
STUCK_LINE = (
    textwrap.dedent(TRAIN_LOOP)
    .splitlines()
    .index("        time.sleep(1e6)  # stuck before its step")
    + 1
)

# Process 1 leaves without shutting down; process 0 then waits for it at shutdown.
LEAVE_EARLY = """
import os, time
import jax, jdp
jdp.distributed.initialize(timeout_s=3, fail_fast=True)  # its exit hook
if jax.process_index() == 1:
    os._exit(0)  # no shutdown: process 0 waits for it in vain
time.sleep(0.5)
print("process 0 is done", flush=True)
"""


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_dead(pids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_launcher(args):
    return subprocess.Popen(
        [sys.executable, "-m", "jdp.launch", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # the processes exit when their launcher dies
        out, err = proc.communicate()
        pytest.fail(f"the launcher did not finish in {timeout} s:\n{out}\n{err}")


def test_stuck_process_is_named_and_the_job_stopped(tmp_path):
    script = tmp_path / "train_loop.py"
    script.write_text(textwrap.dedent(TRAIN_LOOP))
    start = time.monotonic()
    proc = start_launcher(
        ["--num-processes=2", "--devices-per-process=1", "--stall-timeout=3"]
        + [script, 1, 3]
    )
    out, err = finish(proc, BOUND_S + 30)
    pids = [int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", out, re.M)]
    assert proc.returncode == 124, out + err
    assert "[1] step 2 " in out and "step 3 " not in out, out
    # Process 0 started step 3 and waits in it for process 1.
    assert re.search(
        r"jdp\.launch: process 1 of 2 \(pid \d+\) made no progress for more than "
        r"3 s while the others went on or waited for it: it reported progress \d+ "
        r"times, the others up to \d+ times\. Process 1 was last seen at "
        rf"train_loop\.py:{STUCK_LINE} in <module>: `time\.sleep\(1e6\)  # stuck "
        r"before its step`\. Stopped the job\. .*raise the limit with "
        r"`--stall-timeout SECONDS` \(0 turns the check off\)\.",
        err,
    ), err
    assert time.monotonic() - start < BOUND_S
    assert len(pids) == 2
    assert wait_dead(pids, 5) == []


def _read_lines(stream, lines):
    for line in iter(stream.readline, ""):
        lines.put(line)


def test_sigterm_stops_a_training_job_within_seconds(tmp_path):
    """JAX's preemption service swallows SIGTERM: jdp makes it stop the process."""
    script = tmp_path / "train_loop.py"
    script.write_text(textwrap.dedent(TRAIN_LOOP))
    proc = start_launcher(
        ["--num-processes=2", "--devices-per-process=1", script, -1, 0]
    )
    lines, errors = queue.Queue(), queue.Queue()
    for stream, sink in ((proc.stdout, lines), (proc.stderr, errors)):
        threading.Thread(target=_read_lines, args=(stream, sink), daemon=True).start()
    pids, training = [], set()
    try:
        deadline = time.monotonic() + BOUND_S
        while len(training) < 2 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if m := re.match(r"\[\d\] pid (\d+)$", line.strip()):
                pids.append(int(m.group(1)))
            if m := re.match(r"\[(\d)\] step 3 ", line):
                training.add(m.group(1))
        assert training == {"0", "1"}, "the processes did not start training"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        left = wait_dead(pids, max(5 - (time.monotonic() - start), 0))
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait(timeout=10)
        kill_all(pids)
    assert len(pids) == 2
    assert left == [] and proc.returncode == 128 + signal.SIGTERM
    assert elapsed < 5, f"the job took {elapsed:.1f} s to stop"
    err = "".join(errors.get() for _ in range(errors.qsize()))
    assert "jdp.launch: stopped by SIGTERM." in err, err


def test_waiting_at_shutdown_for_a_process_that_left_ends_with_a_message(tmp_path):
    """Without jdp's exit hook (`fail_fast`), JAX's failed shutdown barrier aborts."""
    script = tmp_path / "leave_early.py"
    script.write_text(textwrap.dedent(LEAVE_EARLY))
    port = free_port()
    procs = []
    start = time.monotonic()
    try:
        for rank in range(2):
            env = dict(
                os.environ,
                JDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JDP_NUM_PROCESSES="2",
                JDP_PROCESS_ID=str(rank),
                JAX_NUM_CPU_DEVICES="1",
            )
            env.pop("JDP_FAIL_FAST", None)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        out, err = procs[0].communicate(timeout=BOUND_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert "process 0 is done" in out
    assert procs[0].returncode == 1, err
    assert re.search(
        r"jdp\.distributed: process 0 of 2 waited 3 s at shutdown for process 1, "
        r"which did not arrive\. .*Look for an error in the output of process 1; if "
        r"the processes finish at different times, raise `timeout_s` of "
        r"`jdp\.distributed\.initialize` \(now 3 s\)\. Exiting with status 1\.",
        err,
    ), err
    assert "Check failure stack trace" not in err
    assert time.monotonic() - start < BOUND_S


# Process r makes STEPS[r] steps (argv[1], comma-separated); with argv[2] == "exit",
# a process leaves with `os._exit(0)` (no shutdown) when its steps are done,
# else it waits at shutdown for the others (jdp's exit hook); LINGER_S (argv[3])
# seconds of work of process 0's own after its steps (an evaluation, a checkpoint).
UNEVEN_STEPS = """
import os, sys, time
import jdp
jdp.distributed.initialize(timeout_s=60)
import jax, jax.numpy as jnp, numpy as np, optax

STEPS = [int(s) for s in sys.argv[1].split(",")]
HOW, LINGER_S = sys.argv[2], float(sys.argv[3])


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


tx = optax.sgd(0.1)
step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=tx))
ones = np.ones((2, 1), np.float32)
batch = step.shard({"x": np.ones((2, 4), np.float32), "y": ones})
print(f"pid {os.getpid()}", flush=True)
for i in range(1, STEPS[jax.process_index()] + 1):
    state, metrics = step(state, batch)
    print(f"step {i} loss {float(metrics['loss']):.4f}", flush=True)
if jax.process_index() == 0:
    time.sleep(LINGER_S)
print("done", flush=True)
if HOW == "exit":
    os._exit(0)
"""

# The advice that ends both messages about a process that finished early.
SAME_STEPS = (
    r"Every process must make the same number of step calls \(calls of a "
    r"`jdp\.parallelize` step, and of `step\.shard` across processes\); a data "
    r"set that ends at different steps on different processes .* is the usual "
    r"cause: give every process the same number of batches"
)


def run_uneven(tmp_path, steps, how, linger_s=0, stall_timeout_s=3):
    script = tmp_path / "uneven.py"
    script.write_text(textwrap.dedent(UNEVEN_STEPS))
    start = time.monotonic()
    proc = start_launcher(
        [
            "--num-processes=2",
            "--devices-per-process=1",
            f"--stall-timeout={stall_timeout_s}",
            script,
            steps,
            how,
            linger_s,
        ]
    )
    out, err = finish(proc, BOUND_S + 30)
    pids = [int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", out, re.M)]
    assert len(pids) == 2, out + err
    assert wait_dead(pids, 5) == []
    return proc.returncode, out, err, time.monotonic() - start


def test_processes_waiting_for_one_that_finished_are_stopped_with_the_cause(
    tmp_path,
):
    code, out, err, elapsed = run_uneven(tmp_path, "6,3", "wait")
    assert code == 124, out + err
    assert "[1] done" in out and "[0] step 4 " not in out, out
    # Each process's `step.shard` call counts too: 1 + 3 for process 1.
    assert re.search(
        r"jdp\.launch: process 1 of 2 \(pid \d+\) finished its program \(it waits "
        r"at shutdown for the others\) after 4 step calls while process 0 \(pid "
        r"\d+\) is still running \(at step call 5\) and has stopped making "
        r"progress \(none for 3 s\): it waits in a step that process 1 will never "
        rf"join\. {SAME_STEPS}.* Process 0 was last seen at uneven\.py:\d+ in "
        r"<module>: `state, metrics = step\(state, batch\)`.*\. Stopped the job\.",
        err,
    ), err
    assert "--stall-timeout" not in err  # not a limit to raise
    assert elapsed < BOUND_S


def test_a_process_that_exits_early_is_named_as_the_cause(tmp_path):
    code, out, err, elapsed = run_uneven(tmp_path, "6,3", "exit")
    # Process 0 fails at once in the step's collective (its peer has left).
    # The launcher names process 1's step count when it has read one before
    # process 1 ended (its reports are polled, so under load it may not have),
    # and may see process 1 end after process 0 (its threads are late).
    assert code == 1, out + err
    assert "[1] done" in out, out
    assert re.search(
        r"jdp\.launch: process 1 of 2 \(pid \d+\) finished \(exit 0\)( after at "
        r"least \d step calls)? while process 0 was still running; (\S+ s later|as "
        r"it left) process 0 exited with status 1, most likely in a step that "
        rf"process 1 never joined \(a collective whose peer has left fails\)\. "
        rf"{SAME_STEPS}",
        err,
    ), err
    assert elapsed < BOUND_S


def test_processes_that_finish_a_little_apart_end_the_job_normally(tmp_path):
    # Process 1 waits at shutdown while process 0 works 2 s more.
    code, out, err, _ = run_uneven(
        tmp_path, "3,3", "wait", linger_s=2, stall_timeout_s=4
    )
    assert code == 0, out + err
    assert "[0] done" in out and "[1] done" in out


# `check_sync` of each process (argv[1], comma-separated: an int or None).
CHECK_SYNC = """
import os, sys
import jdp
jdp.distributed.initialize(timeout_s=60)
import jax, jax.numpy as jnp, numpy as np, optax

K = [None if s == "None" else int(s) for s in sys.argv[1].split(",")]


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


tx = optax.sgd(0.1)
step = jdp.parallelize(
    jdp.make_train_step(loss_fn, tx), check_sync=K[jax.process_index()]
)
state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=tx))
ones = np.ones((2, 1), np.float32)
batch = step.shard({"x": np.ones((2, 4), np.float32), "y": ones})
print(f"pid {os.getpid()}", flush=True)
for i in range(1, 8):
    state, metrics = step(state, batch)
    print(f"step {i} loss {float(metrics['loss']):.4f}", flush=True)
"""


def test_check_sync_that_differs_between_processes_fails_at_once(tmp_path):
    """Else one process runs the check while the other runs its next step."""
    script = tmp_path / "check_sync.py"
    script.write_text(textwrap.dedent(CHECK_SYNC))
    start = time.monotonic()
    proc = start_launcher(
        ["--num-processes=2", "--devices-per-process=1", "--stall-timeout=10"]
        + [script, "2,3"]
    )
    out, err = finish(proc, BOUND_S + 30)
    pids = [int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", out, re.M)]
    assert proc.returncode == 1, out + err
    failed = re.search(
        r"^jdp\.launch: process (\d) of 2 \(pid \d+\) exited with "
        r"status 1",
        err,
        re.M,
    )
    assert failed, err
    # The process that failed first says why, at its first step call.
    assert re.search(
        rf"^\[{failed.group(1)}\] ValueError: `jdp\.parallelize\(\.\.\., "
        r"check_sync=\.\.\.\)`: the processes passed different values of "
        r"`check_sync` to this step: process 0: 2, process 1: 3\. The check is a "
        r"collective across the processes .* Pass the same `check_sync` on every "
        r"process\.",
        err,
        re.M,
    ), err
    assert "step 2 " not in out, out
    assert time.monotonic() - start < BOUND_S
    assert len(pids) == 2
    assert wait_dead(pids, 5) == []
