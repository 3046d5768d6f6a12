"""`python -m jdp.demo`, run as users run it: in a subprocess, checked from outside."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Small and quick: 4 simulated devices, a few dozen steps.
QUICK = ["--devices", "4", "--steps", "24", "--eval-every", "8", "--no-progress"]


def run_demo(*args, timeout=180):
    proc = subprocess.run(
        [sys.executable, "-m", "jdp.demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc


def read_metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def table_row(stdout, algo):
    rows = [line for line in stdout.splitlines() if line.startswith(f"| {algo} ")]
    assert len(rows) == 1, stdout
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


@pytest.mark.slow
def test_default_sync_run_reaches_95_percent(tmp_path):
    """The default run (`make demo`): accuracy target, table, metrics.json, plot."""
    out = tmp_path / "out"
    proc = run_demo("--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    m = read_metrics(out)
    assert m["config"]["algo"] == "sync"
    assert m["num_devices"] == 8 and m["platform"] == "cpu"
    assert m["steps"] == 300 and not m["interrupted"]
    assert m["test_accuracy"] >= 0.95
    assert m["history"]["step"] == list(range(1, 301))
    assert np.mean(m["history"]["loss"][-10:]) < np.mean(m["history"]["loss"][:10]) / 10
    assert m["examples_per_second"] > 0
    # Every step all-reduces the gradients (and BatchNorm statistics, the loss):
    # at least the parameter bytes, sent 2 (N-1)/N times with a ring.
    comm = m["communication"]
    assert [c["kind"] for c in comm["collectives"]] == ["all-reduce"]
    assert comm["collectives"][0]["bytes"] >= 4 * 38_378  # f32 params of the CNN
    assert comm["bytes_per_step"] == pytest.approx(
        2 * 7 / 8 * comm["collectives"][0]["bytes"]
    )
    assert comm["reduction_vs_sync"] == pytest.approx(1.0)
    row = table_row(proc.stdout, "sync")
    assert row[2:4] == ["8 cpu", "300"]
    assert row[5] == f"{100 * m['test_accuracy']:.1f}%"
    with open(out / "loss_accuracy.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC


@pytest.mark.slow
def test_bmuf_communicates_sync_period_times_less(tmp_path):
    out = tmp_path / "out"
    proc = run_demo("--algo", "bmuf", "--sync-period", "8", "--out", str(out), *QUICK)
    assert proc.returncode == 0, proc.stderr
    m = read_metrics(out)
    comm = m["communication"]
    at_sync = [c for c in comm["collectives"] if c["in_conditional"]]
    every = [c for c in comm["collectives"] if not c["in_conditional"]]
    # The parameter all-reduce sits in the block sync's branch: once per 8 steps.
    assert [c["kind"] for c in at_sync] == ["all-reduce"]
    assert at_sync[0]["bytes"] >= 4 * 38_378 and at_sync[0]["runs_every"] == 8
    # Left every step: BatchNorm statistics and the loss, a few hundred bytes.
    assert sum(c["bytes"] for c in every) < 1024
    assert 7.5 < comm["reduction_vs_sync"] <= 8.0
    assert table_row(proc.stdout, "bmuf")[8] == f"{comm['reduction_vs_sync']:.1f}x less"
    assert "every 8 steps (block sync)" in proc.stdout
    assert m["history"]["loss"][-1] < m["history"]["loss"][0]


def _one_line_usage_error(stderr, message):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert re.match(r"python -m jdp\.demo: error: " + message, lines[0]), lines[0]
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algo", "adam"], r"argument --algo: invalid choice: 'adam'"),
        (["--batch-size", "12"], r"--batch-size 12 is not divisible by the 8 devices"),
    ],
    ids=["argparse", "after-jax-start"],
)
def test_bad_arguments_one_line_exit_2(tmp_path, args, message):
    proc = run_demo(*args, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    _one_line_usage_error(proc.stderr, message)
    assert "Traceback" not in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algo", "adam"], r"argument --algo: invalid choice: 'adam'"),
        (["--devices", "3"], r"--batch-size 128 is not divisible by --devices 3"),
        (["--out", "{file}/sub"], r"--out '.*/sub' is not a writable directory"),
        (["--resume"], r"--resume needs --checkpoint-dir"),
        (["--steps", "0"], r"--steps must be a positive integer, got 0"),
        (["--block-momentum", "1"], r"--block-momentum must be in \[0, 1\), got 1"),
    ],
    ids=["algo", "devices", "out", "resume", "steps", "block-momentum"],
)
def test_bad_arguments_are_caught_before_training(tmp_path, capsys, args, message):
    """Checked before JAX starts, so in this process (the exit is argparse's)."""
    from jdp.demo._cli import main

    (tmp_path / "file").write_text("not a directory")
    args = [a.format(file=tmp_path / "file") for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    _one_line_usage_error(capsys.readouterr().err, message)


class _Progress:
    """Reads the progress bar from a pipe; tells the last step number shown."""

    def __init__(self, pipe):
        self.text = ""
        self._pipe = pipe
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for chunk in iter(lambda: os.read(self._pipe.fileno(), 4096), b""):
            self.text += chunk.decode(errors="replace")

    def step(self):
        done = re.findall(r"\| *(\d+)/\d+ \[", self.text)
        return int(done[-1]) if done else 0


def _interrupt_after(args, *, min_step, stdout_path, timeout=120):
    """Starts the demo, sends SIGINT once it shows `min_step`; returns its exit code."""
    with open(stdout_path, "w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jdp.demo", *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
        )
        try:
            progress = _Progress(proc.stderr)
            deadline = time.monotonic() + timeout
            while progress.step() < min_step:
                assert proc.poll() is None, progress.text
                assert time.monotonic() < deadline, progress.text
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code, progress


@pytest.mark.slow
def test_ctrl_c_saves_checkpoint_and_resume_continues_exactly(tmp_path):
    # BMUF is the harder case: its replicas agree only at the end of a block.
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    common = ["--algo", "bmuf", "--devices", "2", "--sync-period", "4",
              "--checkpoint-dir", ckpt, "--eval-every", "1000"]  # fmt: skip
    # 1. Ctrl-C in the middle of a long run: stops at the end of a block, saves a
    #    checkpoint, exit code 130.
    stdout_path = tmp_path / "stdout.txt"
    code, progress = _interrupt_after(
        [*common, "--steps", "100000", "--out", out],
        min_step=10,
        stdout_path=stdout_path,
    )
    assert code == 130, progress.text
    assert "Traceback" not in progress.text
    stopped = read_metrics(out)
    assert stopped["interrupted"]
    stop = stopped["steps"]
    assert stop >= 10 and stop % 4 == 0
    assert f"Stopped at step {stop} of 100000 (checkpoint saved in" in (
        stdout_path.read_text()
    )
    assert str(stop) in os.listdir(os.path.join(ckpt, "state"))
    # 2. --resume continues from that step to --steps.
    proc = run_demo(*common, "--steps", str(stop + 8), "--resume", "--out", out,
                    "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    resumed = read_metrics(out)
    assert resumed["start_step"] == stop and resumed["steps"] == stop + 8
    assert resumed["history"]["step"] == list(range(1, stop + 9))  # history kept
    # 3. Nothing lost: the same steps run without interruption give the same losses.
    fresh_out = str(tmp_path / "fresh")
    proc = run_demo("--algo", "bmuf", "--devices", "2", "--sync-period", "4",
                    "--eval-every", "1000", "--steps", str(stop + 8),
                    "--out", fresh_out, "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    fresh = read_metrics(fresh_out)
    np.testing.assert_allclose(
        resumed["history"]["loss"], fresh["history"]["loss"], rtol=1e-5, atol=1e-7
    )
    assert resumed["test_accuracy"] == pytest.approx(fresh["test_accuracy"])
    # 4. A checkpoint of another algorithm is refused, with a one-line error.
    proc = run_demo(*common[2:], "--algo", "sync", "--resume", "--out", out)
    assert proc.returncode == 2
    assert re.fullmatch(
        r"python -m jdp\.demo: error: --resume: the checkpoint in '.*' was made with "
        r"--algo bmuf, not sync; use the same value or another --checkpoint-dir\.\n",
        proc.stderr,
    )
    # 5. A new run never writes into a directory that holds checkpoints.
    proc = run_demo(*common, "--out", out)
    assert proc.returncode == 2
    _one_line_usage_error(
        proc.stderr, r"--checkpoint-dir '.*' already holds checkpoints \(latest: step"
    )


@pytest.mark.slow
def test_zero_runs_and_sends_what_sync_sends(tmp_path):
    """ZeRO: gradients reduce-scattered, params all-gathered (its numbers equal
    sync's: tests/test_zero.py); together they send what one all-reduce sends."""
    out = tmp_path / "out"
    proc = run_demo("--algo", "zero", "--out", str(out), *QUICK)
    assert proc.returncode == 0, proc.stderr
    m = read_metrics(out)
    kinds = {c["kind"] for c in m["communication"]["collectives"]}
    assert {"reduce-scatter", "all-gather"} <= kinds
    assert m["communication"]["reduction_vs_sync"] == pytest.approx(1.0, rel=0.01)
    assert m["history"]["loss"][-1] < m["history"]["loss"][0]
    assert table_row(proc.stdout, "zero")[8] == "1x"
