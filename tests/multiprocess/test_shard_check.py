"""`step.shard`'s cross-process check in real 2-process jobs (gloo, 127.0.0.1).

The check runs on the calling thread and sends nothing while a process's batch
keeps its shapes: a disagreement is raised by the process whose batch changed,
at once if the others' batches changed too, else once its wait for them ran out
(`JDP_SHARD_CHECK_TIMEOUT`, short here); a process whose batch did not change
goes on into its step, and a job whose process raises ends. Processes that pass
different `pad_to` are told which, and short jobs exit cleanly.
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
# How long a process whose batch changed waits for the others, in these jobs.
WAIT_S = 5
SIZES = r"local batches of different sizes.*process 0: 8, process 1: 6 examples"
EARLIER = (
    r"`step.shard`: at an earlier call \(call \d+ of `step.shard` on this process\), "
)
WAITED = (
    r"^`step.shard`: at call {call} of `step.shard` the batch of this process "
    r"\(process 1\) changed to {mine}, while process 0 passes {theirs} \(since its "
    r"call {since}\), and passed no other batch in the \d+ s this process waited: "
)


@pytest.fixture(scope="module")
def job():
    start = time.monotonic()
    results = jdp.launch.run(
        workers.scenario,
        2,
        devices_per_process=2,
        timeout_s=BOUND_S,
        quiet=True,
        env={"JDP_SHARD_CHECK_TIMEOUT": str(WAIT_S)},
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


def test_a_disagreement_is_raised_by_the_process_whose_batch_changed(job):
    r0, r1 = part(job, "one_changed")
    # Process 1's batch changed: it waited for process 0 to confirm, in vain,
    # and raised, naming both processes and both batches.
    waited = WAITED.format(
        call=3,
        mine="6 examples, pad=False, pad_to=None, layout checksum [0-9a-f]{8}",
        theirs="8 examples, pad=False, pad_to=None, layout checksum [0-9a-f]{8}",
        since=0,
    )
    assert re.search(waited + "the processes passed " + SIZES, r1["changed"])
    assert "JDP_SHARD_CHECK_TIMEOUT" in r1["changed"]
    assert WAIT_S <= r1["changed_s"] < WAIT_S + 30
    assert r1["waits"] == 1 and r1["next"] is None
    # Process 0's did not change: it sent nothing and went on into its step.
    assert r0["changed"] is None and r0["waits"] == 0
    # It learns of the disagreement only if it asks (`late`), and then raises it.
    assert r0["late"] == 3
    assert re.search("^" + EARLIER + "the processes passed " + SIZES, r0["next"])
    # Then both agree again, and the step runs on every replica.
    assert r0["after"] == r1["after"] == 4  # 4 examples a replica


def test_shard_starts_no_thread(job):
    for r in part(job, "one_changed"):
        assert r["new_threads"] == []


def test_different_pad_to_is_refused_naming_each_process_and_value(job):
    for r in part(job, "pad_to"):
        # Both changed their pad_to at the same call: both raise at once.
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
    # In a steady loop, process 1 changes its pad_to: it raises once its wait
    # for process 0 ran out ...
    waited = WAITED.format(
        call=r"\d+",
        mine=r"pad=True, pad_to=32, layout checksum [0-9a-f]{8}",
        theirs=r"pad=True, pad_to=16, layout checksum [0-9a-f]{8}",
        since=r"\d+",
    )
    assert re.search(
        waited + r"the processes called `step.shard` with different `pad_to` "
        r"\(process 0: pad_to=16, process 1: pad_to=32\)",
        r1["changed"],
    )
    assert r1["next"] is None
    # ... and process 0, whose pad_to did not change, goes on.
    assert r0["changed"] is None and r0["next"] is None


#: A job's set-up: a small linear model on every process.
JOB_SETUP = """
import os
import jdp
jdp.distributed.initialize(timeout_s=60)
import jax, jax.numpy as jnp, numpy as np, optax
print(f"pid {os.getpid()}", flush=True)


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


tx = optax.sgd(0.1)
step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=tx))
"""

SHORT_JOB = (
    JOB_SETUP
    + """
for _ in range(5):
    batch = {"x": np.ones((2, 4), np.float32), "y": np.ones((2, 1), np.float32)}
    state, metrics = step(state, step.shard(batch))
print("loss", float(metrics["loss"]), flush=True)
"""
)


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


DISAGREEING_JOB = (
    JOB_SETUP
    + """
for i in range(5):
    # Process 1's last batch is short; process 0's is not.
    n = 2 if i < 3 or jax.process_index() == 0 else 1
    batch = {"x": np.ones((n, 4), np.float32), "y": np.ones((n, 1), np.float32)}
    state, metrics = step(state, step.shard(batch))
    print("step", i, float(metrics["loss"]), flush=True)
"""
)


def _run_job(script, env=None):
    """Runs `script` in 2 processes; (exit status, output, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jdp.launch", "--num-processes=2"]
        + ["--devices-per-process=1", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        _kill(int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", out, re.M))
        pytest.fail(f"the job did not finish in {BOUND_S} s:\n{out}\n{err}")
    return proc.returncode, out + err, time.monotonic() - start


def test_a_job_whose_batches_disagree_ends_with_the_error(tmp_path):
    """Process 1's batch shrinks, process 0's does not: process 0 goes on into
    its step and blocks there; process 1 waits for it, raises, and the launcher
    stops the job."""
    script = tmp_path / "disagreeing_job.py"
    script.write_text(textwrap.dedent(DISAGREEING_JOB))
    code, output, seconds = _run_job(script, {"JDP_SHARD_CHECK_TIMEOUT": str(WAIT_S)})
    assert code != 0, output
    assert seconds < BOUND_S
    # The error names both processes and both batches.
    assert re.search(
        r"ValueError: `step.shard`: at call 3 of `step.shard` the batch of this "
        r"process \(process 1\) changed to 1 examples, .*while process 0 passes 2 "
        r"examples, .*the processes passed local batches of different sizes.*"
        r"got process 0: 2, process 1: 1 examples",
        output,
    ), output
    # Process 0 reached its fourth step, whose collective never ran.
    assert len(re.findall(r"^\[\d\] step 2 ", output, re.M)) == 2
    assert not re.search(r"^\[\d\] step 3 ", output, re.M)


def test_short_jobs_exit_with_status_0(tmp_path):
    """A job that ends right after its steps used to abort (SIGABRT) now and then:
    `shard`'s background thread woke while the interpreter shut down (there is
    none now: `test_shard_starts_no_thread`); two runs, each a chance to catch it."""
    script = tmp_path / "short_job.py"
    script.write_text(textwrap.dedent(SHORT_JOB))
    for attempt in range(2):
        code, output, seconds = _run_job(script)
        assert code == 0, f"run {attempt}:\n{output}"
        assert "SIGABRT" not in output and "terminate called" not in output
        assert len(re.findall(r"^\[\d\] loss ", output, re.M)) == 2
        assert seconds < BOUND_S
