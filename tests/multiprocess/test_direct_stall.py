"""The stall check of a job started without the launcher (`srun`, Kubernetes).

Two real processes on 127.0.0.1, started directly with `subprocess` and simulated
SLURM variables (as `srun --ntasks=2` would set them); `jdp.distributed.initialize`
gets `stall_timeout_s`, and the processes watch each other through JAX's
coordination service.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jdp.launch._setup import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

WORKER = os.path.join(os.path.dirname(__file__), "direct_stall_worker.py")
# Start-up (imports, joining, the first compilation) must fit in this.
BOUND_S = 90
# How long after the timeout every process must have exited.
FEW_S = 8
SLEEP_LINE = (
    open(WORKER)
    .read()
    .splitlines()
    .index("    time.sleep(1e6)  # a deadlocked data loader")
    + 1
)


def slurm_env(rank, port, **more):
    env = dict(os.environ)
    for name in list(env):
        if name.startswith(("JDP_", "SLURM_", "OMPI_", "PMI_")):
            del env[name]
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")
    )
    env.update(
        XLA_FLAGS=flags,
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES="1",
        PYTHONUNBUFFERED="1",
        # What `srun --ntasks=2 --ntasks-per-node=2` sets (one node).
        SLURM_JOB_ID="4242",
        SLURM_STEP_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        # The coordinator on loopback (SLURM's would be the first node, any port).
        JDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
    )
    env.update(more)
    return env


def run_job(tmp_path, args, **env):
    """Runs the two processes; (returncodes, exit times, stdouts, stderrs)."""
    port = free_port()
    procs, files = [], []
    try:
        for rank in range(2):
            out = open(tmp_path / f"out{rank}", "w+")
            err = open(tmp_path / f"err{rank}", "w+")
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, *map(str, args)],
                    env=slurm_env(rank, port, **env),
                    stdout=out,
                    stderr=err,
                    text=True,
                )
            )
        ended = [None, None]
        deadline = time.monotonic() + BOUND_S
        while None in ended and time.monotonic() < deadline:
            for rank, proc in enumerate(procs):
                if ended[rank] is None and proc.poll() is not None:
                    ended[rank] = time.time()
            time.sleep(0.05)
        codes = [proc.poll() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    texts = []
    for out, err in files:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    return codes, ended, [t[0] for t in texts], [t[1] for t in texts]


def test_a_stuck_rank_stops_the_job_and_is_named_with_its_stack(tmp_path):
    timeout_s = 3
    codes, ended, outs, errs = run_job(tmp_path, [timeout_s, 1, 4, 100_000])
    report = f"codes {codes}\n--- 0\n{outs[0]}{errs[0]}\n--- 1\n{outs[1]}{errs[1]}"
    assert None not in ended, "a process did not exit:\n" + report
    assert codes == [124, 124], report
    assert "processes 2" in outs[0] and "processes 2" in outs[1], report
    stuck = re.search(r"stuck after step call (\d+) at ([\d.]+)", outs[1])
    assert stuck, report
    last, since = int(stuck.group(1)), float(stuck.group(2))
    for rank in range(2):
        assert ended[rank] - since < timeout_s + FEW_S, report
    named = (
        rf"jdp\.distributed: process 1 of 2 \([^)]*pid \d+\) stopped making "
        rf"progress first: none for more than {timeout_s} s \(its last step call "
        rf"was number {last}\), while the others reached step call {last + 1}"
    )
    frame = rf'File "[^"]*direct_stall_worker\.py", line {SLEEP_LINE} in sleep_forever'
    for rank in range(2):
        assert re.search(named, errs[rank]), report
        # Process 1 dumped its own stack; process 0 got it through the
        # coordination service.
        # The main thread's stack first (not the stall check's own thread).
        stack = (
            r"The Python stack of process 1 \(faulthandler, every thread\):\n"
            r" +Thread 0x[0-9a-f]+ \(most recent call first\):\n"
            rf" +{frame}"
        )
        assert re.search(stack, errs[rank]), report
        assert f"Stopping process {rank} of 2 with status 124." in errs[rank], report


def test_a_job_that_finishes_with_the_stall_check_on_exits_cleanly(tmp_path):
    codes, ended, outs, errs = run_job(tmp_path, [2, -1, 0, 5])
    report = f"codes {codes}\n--- 0\n{outs[0]}{errs[0]}\n--- 1\n{outs[1]}{errs[1]}"
    assert codes == [0, 0], report
    for rank in range(2):
        assert "done" in outs[rank], report
        assert "stopped making progress" not in errs[rank], report
        # The device plan of a SLURM task sharing its node (no GPU here).
        assert re.search(
            rf"jdp\.distributed: local_device_ids=\[{rank}\] \(SLURM: task {rank} "
            r"of 2 on its node \(\$SLURM_LOCALID=\d, \$SLURM_NTASKS_PER_NODE=2\)",
            errs[rank],
        ), report


def test_processes_waiting_for_a_finished_one_are_stopped(tmp_path):
    """Process 0 finishes after 3 steps (at jdp's exit hook, in the shutdown
    barrier); process 1 waits in its step 4 for it in vain."""
    timeout_s = 3
    codes, ended, outs, errs = run_job(
        tmp_path, [timeout_s, -1, 0, "3,4"], JDP_FAIL_FAST="1"
    )
    report = f"codes {codes}\n--- 0\n{outs[0]}{errs[0]}\n--- 1\n{outs[1]}{errs[1]}"
    assert None not in ended, "a process did not exit:\n" + report
    assert codes == [124, 124], report
    assert "done" in outs[0] and "done" not in outs[1], report
    for rank in range(2):
        assert re.search(
            r"jdp\.distributed: process 0 of 2 \([^)]*\) finished its program after "
            r"\d+ step calls while process 1 is still running \(at step call \d+\) "
            rf"and made no progress for {timeout_s} s: it waits in a step that "
            r"process 0 will never join\. Every process must make the same number",
            errs[rank],
        ), report
