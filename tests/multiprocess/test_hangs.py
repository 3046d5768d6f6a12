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

from jdp.launch._launcher import free_port

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
