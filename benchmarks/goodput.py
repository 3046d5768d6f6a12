"""Goodput of a 2-process job under `--max-restarts` with a SIGKILL every I seconds.

A 2-process data-parallel job (an Adam MLP of 0.6 M parameters, a 7 MB state,
one CPU device per process) runs N steps under `python -m jdp.launch --max-restarts`,
with an async checkpoint every k steps that also holds the data position
(`save(..., extra=...)`); each attempt resumes from the latest one. The driver
(this script) kills a random process of the job by PID with SIGKILL once the
job has trained for I seconds since its last (re)start (its first step done),
again and again until the job ends. It reports:

- goodput: the wall time of a failure-free run of the same N steps (same k)
  over the wall time of the run with failures, i.e. the fraction of failure-free
  throughput kept; and, less exposed to a machine load that drifts between runs,
  the same modelled from the run's own measurements: I / (I + restart latency +
  steps lost x median step time);
- the restart latency per failure, split into detection (the kill to the
  launcher's restart line), process start (to `jdp.distributed.initialize()`
  done in every process), restore (model built and checkpoint read), compile
  (the first step), and the steps lost per failure (the last step done before
  the kill minus the step resumed from);
- what a persistent compilation cache saves (`--cache`: the same runs with
  `jax_compilation_cache_dir` set and `jax_persistent_cache_min_compile_time_secs=0`);
- the save cost per step of async (and, for contrast, sync) checkpoints every
  10, 50 and 200 steps: the step loop's time per step over a run without
  checkpoints (compile and start-up excluded).

    python benchmarks/goodput.py [--quick] [--steps N] [--intervals 30 60 120]
        [--save-every 10 50 200] [--seed 0]

`--quick` runs one short configuration of each kind (a few minutes). Times are
wall-clock on a shared machine: a busy one lengthens process start most.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH, DEPTH, BATCH = 384, 4, 64

# -- the training job (each process runs this with --worker) ----------------------


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def worker(args) -> None:
    t0 = time.time()
    import jdp

    jdp.distributed.initialize(timeout_s=120)
    import jax

    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import numpy as np
    import optax

    sys.path.insert(0, HERE)
    from _common import mlp_loss, square_mlp

    rank, n = jax.process_index(), jax.process_count()
    attempt = int(os.environ.get("JDP_RESTART_COUNT", "0"))
    emit(ev="start", t=time.time(), t0=t0, rank=rank, pid=os.getpid(), attempt=attempt)
    tx = optax.adam(1e-3)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx))
    like = step.replicate(
        jdp.TrainState.create(params=square_mlp(WIDTH, DEPTH, jax.random.key(0)), tx=tx)
    )
    every = args.every or 10**9
    manager = jdp.checkpoint.CheckpointManager(
        args.ckpt, max_to_keep=2, save_interval_steps=every, async_save=not args.sync
    )
    state, extra = manager.restore(like, default=like, with_extra=True)
    start = extra.get("step", 0)
    emit(ev="restored", t=time.time(), rank=rank, step=start, attempt=attempt)
    share = BATCH // n
    loop_start = None
    for i in range(start + 1, args.steps + 1):
        rng = np.random.default_rng(i)  # the data at position i
        x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
        mine = slice(rank * share, (rank + 1) * share)
        batch = {"x": x[mine], "y": np.tanh(x[mine])}
        state, metrics = step(state, step.shard(batch))
        loss = float(metrics["loss"])
        manager.save(i, state, extra={"step": i})
        now = time.time()
        if i == start + 1:
            emit(ev="compiled", t=now, rank=rank, attempt=attempt)
            loop_start = now
        if rank == 0:
            emit(ev="step", i=i, t=now, loss=loss)
    loop_end = time.time()
    manager.close()
    timed = args.steps - start - 1
    emit(
        ev="done",
        t=time.time(),
        rank=rank,
        attempt=attempt,
        loop_s=loop_end - loop_start if loop_start else 0.0,
        timed_steps=timed,
    )


# -- the driver -----------------------------------------------------------------

LINE = re.compile(r"^\[(\d+)\] (\{.*\})$")
RESTART = re.compile(r"Restarting the job \(restart (\d+)/")


class Run:
    """One launcher run, with its events, and a thread killing a rank every I s."""

    def __init__(self, steps, every, interval, cache, seed, sync=False, restarts=50):
        self.ckpt = tempfile.mkdtemp(prefix="jdp-goodput-")
        cmd = [
            sys.executable,
            "-m",
            "jdp.launch",
            "--num-processes=2",
            "--devices-per-process=1",
            f"--max-restarts={restarts}",
            os.path.abspath(__file__),
            "--worker",
            f"--ckpt={self.ckpt}",
            f"--steps={steps}",
            f"--every={every or 0}",
        ]
        if cache:
            cmd.append(f"--cache={cache}")
        if sync:
            cmd.append("--sync")
        self.interval = interval
        self.rng = random.Random(seed)
        self.events: list[dict] = []
        self.restart_lines: list[float] = []
        self.kills: list[dict] = []
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.last_step = 0
        self.last_t = None
        self.step_dts: list[float] = []  # seconds between consecutive steps
        self.t_start = time.time()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.threads = [
            threading.Thread(target=self._read_out, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        if interval:
            self.threads.append(threading.Thread(target=self._killer, daemon=True))
        for t in self.threads:
            t.start()

    def _read_out(self):
        for line in iter(self.proc.stdout.readline, ""):
            m = LINE.match(line.strip())
            if not m:
                continue
            ev = json.loads(m.group(2))
            with self.cond:
                if ev["ev"] == "step":
                    if ev["i"] == self.last_step + 1 and self.last_t is not None:
                        self.step_dts.append(ev["t"] - self.last_t)
                    self.last_step, self.last_t = ev["i"], ev["t"]
                else:
                    self.events.append(ev)
                self.cond.notify_all()

    def _read_err(self):
        for line in iter(self.proc.stderr.readline, ""):
            if RESTART.search(line):
                with self.cond:
                    self.restart_lines.append(time.time())
                    self.cond.notify_all()
            elif "Traceback" in line or "Error" in line:
                sys.stderr.write("  job: " + line)

    def _killer(self):
        attempt = 0
        while self.proc.poll() is None:
            with self.cond:
                # Wait for this attempt's first step on every process.
                while self.proc.poll() is None and (
                    self._count("compiled", attempt) < 2
                ):
                    self.cond.wait(0.2)
                if self.proc.poll() is not None:
                    return
                trained_from = max(
                    e["t"]
                    for e in self.events
                    if e["ev"] == "compiled" and e["attempt"] == attempt
                )
                pids = {
                    e["rank"]: e["pid"]
                    for e in self.events
                    if e["ev"] == "start" and e["attempt"] == attempt
                }
            wait = trained_from + self.interval - time.time()
            deadline = time.time() + max(wait, 0)
            while time.time() < deadline and self.proc.poll() is None:
                time.sleep(0.05)
            if self.proc.poll() is not None:
                return
            with self.cond:
                if self._count("done", attempt):
                    return  # finishing: no kill
                rank = self.rng.randrange(2)
                try:
                    os.kill(pids[rank], signal.SIGKILL)
                except ProcessLookupError:
                    return
                self.kills.append(
                    {"t": time.time(), "rank": rank, "step": self.last_step}
                )
            attempt += 1

    def _count(self, kind, attempt):
        return sum(
            1 for e in self.events if e["ev"] == kind and e["attempt"] == attempt
        )

    def wait(self, timeout):
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
            raise
        self.wall = time.time() - self.t_start
        for t in self.threads[:2]:
            t.join(timeout=5)
        shutil.rmtree(self.ckpt, ignore_errors=True)
        if code != 0:
            raise RuntimeError(f"the job failed with exit status {code}")
        return self

    def failures(self):
        """Per kill: detection, start, restore, compile (s), steps lost."""
        out = []
        for i, kill in enumerate(self.kills):
            a = i + 1
            seen = [t for t in self.restart_lines if t >= kill["t"]]
            ev = [e for e in self.events if e.get("attempt") == a]
            starts = [e["t"] for e in ev if e["ev"] == "start"]
            restored = [e for e in ev if e["ev"] == "restored"]
            compiled = [e["t"] for e in ev if e["ev"] == "compiled"]
            if not (seen and len(starts) == 2 and restored and len(compiled) == 2):
                continue
            r_t = max(e["t"] for e in restored)
            out.append(
                {
                    "detect": seen[0] - kill["t"],
                    "start": max(starts) - seen[0],
                    "restore": r_t - max(starts),
                    "compile": max(compiled) - r_t,
                    "total": max(compiled) - kill["t"],
                    "lost": kill["step"] - restored[0]["step"],
                }
            )
        return out


def med(values):
    return statistics.median(values) if values else float("nan")


def goodput_table(args, cache_dir):
    configs = [
        (i, k, c) for i in args.intervals for k in args.save_every for c in args.caches
    ]
    if args.config:
        configs = [
            (float(i), int(k), int(c))
            for i, k, c in (text.split(":") for text in args.config)
        ]
    rows = []
    baselines = {}
    for every in sorted({k for _, k, _ in configs}):
        base = Run(args.steps, every, None, None, args.seed).wait(args.timeout)
        baselines[every] = base.wall
        print(f"failure-free, k={every}: {base.wall:.1f} s", flush=True)
    for interval, every, cache in configs:
        if cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
            os.makedirs(cache_dir)
        run = Run(
            args.steps, every, interval, cache_dir if cache else None, args.seed
        ).wait(args.timeout)
        f = run.failures()
        row = {
            "interval": interval,
            "every": every,
            "cache": cache,
            "wall": run.wall,
            "base": baselines[every],
            "goodput": baselines[every] / run.wall,
            "failures": len(run.kills),
            "per_failure": (run.wall - baselines[every]) / max(len(run.kills), 1),
            "step_s": med(run.step_dts),
            **{
                k: med([x[k] for x in f])
                for k in ("detect", "start", "restore", "compile", "total", "lost")
            },
        }
        # Per failure cycle: I s of training, then the restart and the lost steps
        # (measured in this run, so less exposed to load that drifts between runs).
        row["modelled"] = interval / (
            interval + row["total"] + row["lost"] * row["step_s"]
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(
        "| kill every | ckpt every | cache | failures | wall (s) | failure-free (s) "
        "| goodput | modelled | wall lost / failure | detect | start | restore "
        "| compile "
        "| restart total | steps lost |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['interval']:g} s | {r['every']} | {'on' if r['cache'] else 'off'} "
            f"| {r['failures']} | {r['wall']:.0f} | {r['base']:.0f} "
            f"| **{r['goodput']:.0%}** | {r['modelled']:.0%} | {r['per_failure']:.1f} "
            f"| {r['detect']:.2f} | {r['start']:.1f} "
            f"| {r['restore']:.2f} | {r['compile']:.2f} | {r['total']:.1f} "
            f"| {r['lost']:.0f} |"
        )
    print(
        "(latencies in seconds: medians over the failures of a run; goodput: "
        "failure-free wall time / wall time; modelled: I / (I + restart total + "
        "steps lost x the run's median step time))"
    )


def save_cost_table(args):
    steps = args.save_steps
    rows = []
    for mode, every in [("none", None)] + [
        (m, k) for k in (10, 50, 200) for m in ("async", "sync")
    ]:
        run = Run(steps, every, None, None, args.seed, sync=mode == "sync").wait(
            args.timeout
        )
        done = [e for e in run.events if e["ev"] == "done"]
        per = max(e["loop_s"] / e["timed_steps"] for e in done)
        rows.append((mode, every, per))
        print(f"{mode} every {every}: {1e3 * per:.2f} ms/step", flush=True)
    base = rows[0][2]
    print()
    print("| checkpoint | every | ms / step | save cost / step (ms) | vs none |")
    print("|---|---|---|---|---|")
    for mode, every, per in rows:
        print(
            f"| {mode} | {every or '-'} | {1e3 * per:.2f} | "
            f"{1e3 * (per - base):+.2f} | {per / base:.3f} |"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sync", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="one short run of each kind")
    p.add_argument("--steps", type=int, default=None, help="steps per job")
    p.add_argument("--intervals", type=float, nargs="+", default=None)
    p.add_argument("--save-every", type=int, nargs="+", default=None)
    p.add_argument("--caches", type=int, nargs="+", default=None, help="0 and/or 1")
    p.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="I:K:C",
        help="instead of the sweep: kill every I s, checkpoint every K steps, "
        "compilation cache C (0 or 1); repeatable",
    )
    p.add_argument("--save-steps", type=int, default=None)
    p.add_argument("--skip-save-cost", action="store_true")
    p.add_argument("--skip-goodput", action="store_true")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    quick = args.quick
    args.steps = args.steps or (1500 if quick else 6000)
    args.intervals = args.intervals or ([20] if quick else [30, 60, 120])
    args.save_every = args.save_every or ([50] if quick else [10, 50, 200])
    args.caches = args.caches or ([0, 1] if quick else [0, 1])
    args.save_steps = args.save_steps or (300 if quick else 1000)
    cache_dir = tempfile.mkdtemp(prefix="jdp-goodput-cache-")
    try:
        if not args.skip_save_cost:
            save_cost_table(args)
        if not args.skip_goodput:
            goodput_table(args, cache_dir)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
