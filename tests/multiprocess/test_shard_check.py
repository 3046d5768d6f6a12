"""`step.shard`'s cross-process check in real 2-process jobs (gloo, 127.0.0.1).

The check runs on the calling thread: a disagreement is raised by the process
whose batch changed at once and by the others at their next call, processes that
pass different `pad_to` are told which, and short jobs exit cleanly.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import shard_check_workers as workers

import jdp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

# Every job here must end within this many seconds.
BOUND_S = 120
SIZES = r"local batches of different sizes.*process 0: 8, process 1: 6 examples"
EARLIER = (
    r"`step.shard`: at an earlier call \(call \d+ of `step.shard` on this process\), "
)


@pytest.fixture(scope="module")
def job():
    start = time.monotonic()
    results = jdp.launch.run(
        workers.scenario, 2, devices_per_process=2, timeout_s=BOUND_S, quiet=True
    )
    assert time.monotonic() - start < BOUND_S
    return results


def part(job, name):
    """Each process's result for one check; a check that raised fails here."""
    out = []
    for p, results in enumerate(job):
        if "error" in results[name]:
            pytest.fail(f"process {p} failed in {name!r}:\n{results[name]['error']}")
        out.append(results[name])
    return out


def test_a_disagreement_is_raised_on_every_process(job):
    r0, r1 = part(job, "everywhere")
    # Process 1's batch changed: it compared and raised at once.
    assert re.search(r"^`step.shard`: the processes passed " + SIZES, r1["changed"])
    assert r1["next"] is None
    # Process 0's did not change: its next call raises what process 1 found.
    assert r0["changed"] is None
    assert re.search("^" + EARLIER + "the processes passed " + SIZES, r0["next"])
    # Then both agree again, and the step runs on every replica.
    assert r0["after"] == r1["after"] == 4  # 4 examples a replica


def test_shard_starts_no_thread(job):
    for r in part(job, "everywhere"):
        assert r["new_threads"] == []


def test_different_pad_to_is_refused_naming_each_process_and_value(job):
    for r in part(job, "pad_to"):
        assert re.search(
            r"^`step.shard`: the processes called `step.shard` with different "
            r"`pad_to` \(process 0: pad_to=16, process 1: pad_to=32\); every process "
            r"must pass the same `pad_to`",
            r["first"],
        )
        assert re.search(
            r"different `pad_to` \(process 0: pad_to=16, process 1: pad_to=None\)",
            r["none"],
        )
        assert r["count"] == pytest.approx(10)  # 5 + 5 real examples, padded to 16
    r0, r1 = part(job, "pad_to")
    # In a steady loop, process 1 changes its pad_to: it raises at once ...
    assert "process 0: pad_to=16, process 1: pad_to=32" in r1["changed"]
    assert r1["next"] is None
    # ... and process 0 at its next call.
    assert r0["changed"] is None
    assert re.search(
        "^" + EARLIER + r"the processes called `step.shard` with different `pad_to` "
        r"\(process 0: pad_to=16, process 1: pad_to=32\)",
        r0["next"],
    )


SHORT_JOB = """
import os
import jdp
jdp.distributed.initialize(timeout_s=60)
import jax.numpy as jnp, numpy as np, optax
print(f"pid {os.getpid()}", flush=True)


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


tx = optax.sgd(0.1)
step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=tx))
for _ in range(5):
    batch = {"x": np.ones((2, 4), np.float32), "y": np.ones((2, 1), np.float32)}
    state, metrics = step(state, step.shard(batch))
print("loss", float(metrics["loss"]), flush=True)
"""


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_short_jobs_exit_with_status_0(tmp_path):
    """A job that ends right after its steps used to abort (SIGABRT) now and then:
    `shard`'s background thread woke while the interpreter shut down."""
    script = tmp_path / "short_job.py"
    script.write_text(textwrap.dedent(SHORT_JOB))
    for attempt in range(4):
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "jdp.launch", "--num-processes=2"]
            + ["--devices-per-process=1", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            _kill(int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", out, re.M))
            pytest.fail(f"run {attempt} did not finish in {BOUND_S} s:\n{out}\n{err}")
        assert proc.returncode == 0, f"run {attempt}:\n{out}\n{err}"
        assert "SIGABRT" not in err and "terminate called" not in out + err
        assert len(re.findall(r"^\[\d\] loss ", out, re.M)) == 2
        assert time.monotonic() - start < BOUND_S
