"""`python -m jdp.launch --live`: a dead process is started again alone.

Three real processes train with `jdp.distributed.live`; process 2 kills itself
once. The launcher starts it again with the same process id while the others
train on, and it rejoins them. Then process 0 kills itself once: the launcher
restarts the whole job and says why. Every process ends with the same parameters.
"""

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_trees_close

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

WORKER = Path(__file__).with_name("live_launch_worker.py")


def test_a_dead_process_rejoins_and_process_0_falls_back_to_a_restart(tmp_path):
    steps = 30
    proc = subprocess.run(
        [sys.executable, "-m", "jdp.launch", "--num-processes", "3",
         "--devices-per-process", "1", "--live", "--max-restarts", "2",
         "--timeout", "180", str(WORKER), str(tmp_path), str(steps)],
        capture_output=True,
        text=True,
        timeout=220,
    )  # fmt: skip
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    assert "process 2 was killed by SIGKILL" in proc.stderr, output
    assert "started it again alone (restart 1/2)" in proc.stderr, output
    # It joined the others where they were, before process 0's kill at step 15.
    assert 5 <= int((tmp_path / "joined-2").read_text()) < 15
    assert "process 0 of 3" in proc.stderr and "was killed by SIGKILL" in output
    assert "Process 0 hosts JAX's coordination service, so live recovery" in (
        proc.stderr
    ), output
    assert "Restarting the job (restart 2/2) with 3 processes." in proc.stderr, output
    # The whole job ran again from the start (no checkpoint): every process
    # started at step 0 and ends with the same parameters.
    results = {p: pickle.loads((tmp_path / f"{p}.pkl").read_bytes()) for p in range(3)}
    assert [results[p]["first"] for p in range(3)] == [0, 0, 0]
    for p in (1, 2):
        assert_trees_close(results[0]["params"], results[p]["params"], rtol=0, atol=0)


def test_live_needs_restarts():
    proc = subprocess.run(
        [sys.executable, "-m", "jdp.launch", "--num-processes", "2", "--live",
         "script.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "argument --live: it starts failed processes again" in proc.stderr
