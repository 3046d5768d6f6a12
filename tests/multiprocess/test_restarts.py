"""Jobs restarted after a SIGKILL resume from their checkpoints, bit for bit.

A 2-process job runs under `python -m jdp.launch --max-restarts 3`; in its first
two attempts one process (drawn from a seed the test writes) kills itself with
SIGKILL after a step drawn from the same seed. The job must finish on its own,
with the final parameters of a run that never failed, and lose at most one save
interval of steps per failure. With `--min-processes 1`, a slot that always
crashes is dropped and the job finishes with one process.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("restart_worker.py")
STEPS = 40
SAVE_EVERY = 5
LIMIT_S = 240  # each launcher run; a run takes ~20-60 s on 2 busy cores


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def launch(args):
    """`python -m jdp.launch ARGS`: (exit status, stdout, stderr); bounded in time."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jdp.launch", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # forwarded to the job's processes
        try:
            out, err = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"the launcher did not finish in {LIMIT_S} s:\n{out}\n{err}")
    return proc.returncode, out, err


def job_args(tmp_path, name, *more, processes=2):
    return [
        f"--num-processes={processes}",
        "--devices-per-process=1",
        WORKER,
        tmp_path / f"ckpt-{name}",
        tmp_path / f"{name}.npz",
        f"--steps={STEPS}",
        f"--save-every={SAVE_EVERY}",
        *more,
    ]


def attempts_of(out):
    """`[(attempt, processes, {rank: pid}, resumed at)]` from the job's output."""
    found = {}
    pattern = r"^\[(\d)\] attempt (\d) processes (\d) pid (\d+) resumed at step (\d+)$"
    for rank, attempt, n, pid, start in re.findall(pattern, out, re.M):
        entry = found.setdefault(int(attempt), (int(n), {}, int(start)))
        assert entry[0] == int(n) and entry[2] == int(start), out
        entry[1][int(rank)] = int(pid)
    return [(a, *found[a]) for a in sorted(found)]


def assert_all_dead(pids, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)]


def test_sigkilled_processes_resume_bit_for_bit(tmp_path, record_property):
    seed = int(os.environ.get("JDP_TEST_SEED", random.randrange(2**31)))
    (tmp_path / "seed").write_text(str(seed))
    about = f"(seed {seed}; rerun with JDP_TEST_SEED={seed})"

    code, out, err = launch(job_args(tmp_path, "clean"))
    assert code == 0, f"{about}\n{out}\n{err}"

    start = time.monotonic()
    code, out, err = launch(
        [
            "--max-restarts=3",
            *job_args(tmp_path, "killed", f"--kill-plan={tmp_path / 'seed'}"),
        ]
    )
    elapsed = time.monotonic() - start
    assert code == 0, f"{about}\n{out}\n{err}"
    attempts = attempts_of(out)
    assert [(a, n) for a, n, _, _ in attempts] == [(0, 2), (1, 2), (2, 2)], about
    assert_all_dead([pid for _, _, pids, _ in attempts for pid in pids.values()])

    # One process killed itself in each of the first two attempts; the launcher
    # named it, and restarted the job.
    kills = re.findall(r"^\[(\d)\] killing myself after step (\d+)$", out, re.M)
    assert len(kills) == 2, f"{about}\n{out}"
    restarts = re.findall(
        r"^jdp\.launch: process (\d) of 2 \(pid (\d+)\) was killed by SIGKILL.*"
        r"Restarting the job \(restart (\d)/3\) with 2 processes\.$",
        err,
        re.M,
    )
    assert len(restarts) == 2, f"{about}\n{err}"
    lost = []
    for i, ((rank, at), (named, pid, restart)) in enumerate(
        zip(kills, restarts, strict=True)
    ):
        assert named == rank and int(restart) == i + 1, f"{about}\n{err}"
        assert int(pid) == attempts[i][2][int(rank)], about
        resumed = attempts[i + 1][3]
        assert resumed % SAVE_EVERY == 0 and resumed <= int(at), about
        lost.append(int(at) - resumed)
    record_property("lost_steps", lost)
    record_property("seconds_with_two_restarts", round(elapsed, 1))
    print(f"{about}: killed after steps {[int(a) for _, a in kills]}, lost {lost}")
    assert all(0 <= n < SAVE_EVERY for n in lost), (lost, about)
    assert out.count(f"finished step {STEPS} with 2 processes") == 2, out

    clean = np.load(tmp_path / "clean.npz")
    killed = np.load(tmp_path / "killed.npz")
    assert sorted(clean.files) == sorted(killed.files) and clean.files
    for name in clean.files:
        assert clean[name].tobytes() == killed[name].tobytes(), (name, about)


def test_a_slot_that_keeps_failing_is_dropped_down_to_min_processes(tmp_path):
    code, out, err = launch(
        [
            "--max-restarts=3",
            "--min-processes=1",
            *job_args(tmp_path, "elastic", "--bad-slot=12"),
        ]
    )
    assert code == 0, f"{out}\n{err}"
    attempts = attempts_of(out)
    # Process 1 fails after step 12 twice with 2 processes (the checkpoint of
    # step 10 is the latest); then one process resumes from it, with the whole
    # global batch, and completes the steps.
    assert [(a, n, s) for a, n, _, s in attempts] == [(0, 2, 0), (1, 2, 10), (2, 1, 10)]
    assert re.search(
        r"Restarting the job \(restart 2/3\) with 1 process, one fewer: process 1 "
        r"failed first in two attempts in a row \(--min-processes 1\)\.",
        err,
    ), err
    assert f"[0] finished step {STEPS} with 1 processes" in out
    params = np.load(tmp_path / "elastic.npz")
    assert params.files and all(np.isfinite(params[k]).all() for k in params.files)
    assert_all_dead([pid for _, _, pids, _ in attempts for pid in pids.values()])
