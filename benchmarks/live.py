"""What a lost process costs under `jdp.distributed.live`: recovery time and throughput.

N processes (one CPU device each, gloo on 127.0.0.1) train the goodput MLP of
`benchmarks/goodput.py` (Adam, 0.6 M parameters) through `jdp.distributed.live`
on the same global batches. After `--kill-after` seconds of training the driver
SIGKILLs the last process (never process 0, which hosts the coordination
service); the survivors go on. Reported, from process 0's step times:

- the median step time before and after the kill (N and N - 1 replicas);
- the recovery time: from the kill to the survivors' next completed step (the
  wait for the failure to surface, at most the collective timeout or the
  heartbeat, then a new mesh, its compilation and the step run again);
- the throughput kept at a failure every 60 s and every 30 s, modelled from the
  measured recovery: 1 - recovery / interval (the step time with one replica
  fewer is shown beside it: on an oversubscribed CPU it falls, on GPUs the
  survivors' larger share of the global batch makes it rise).

With `--rejoin` the driver starts the killed process again at once (as
`python -m jdp.launch --live` does): also reported is the time from its start to
its first step with the others, and the throughput kept then counts all the time
from the kill to that step that was not spent on steps at the old rate.

With `--kill-every 60 30` nothing is modelled: the job runs `--steps` steps
failure-free, then again with a random non-zero process SIGKILLed every 60 s of
training (and started again at once), then every 30 s; "kept" is the failure-free
run's training time over each run's.

    python benchmarks/live.py [--processes 4] [--kill-after 20] [--steps 5000]
        [--collective-timeout 10] [--heartbeat 5] [--cache] [--rejoin]
        [--kill-every 60 30 [--seed 0]] [--batch 48]

Processes are pinned one per core when the machine has enough cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH, DEPTH = 384, 4


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def worker(args) -> None:
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=1 "
        f"--xla_cpu_collective_timeout_seconds={args.collective_timeout}"
    )
    import jax

    jax.config.update("jax_enable_recoverability", True)
    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import jdp

    jdp.distributed.initialize(
        f"127.0.0.1:{args.port}",
        args.processes,
        args.rank,
        heartbeat_timeout_s=args.heartbeat,
        fail_fast=False,
    )
    import numpy as np
    import optax

    sys.path.insert(0, HERE)
    from _common import mlp_loss, square_mlp

    tx = optax.adam(1e-3)
    step = jdp.distributed.live(jdp.make_train_step(mlp_loss, tx))
    state = step.replicate(
        jdp.TrainState.create(params=square_mlp(WIDTH, DEPTH, jax.random.key(0)), tx=tx)
    )
    emit(ev="ready", t=time.time(), rank=args.rank, position=step.position)
    joined = step.position > 0  # a replacement: it reports its first step
    while step.position < args.steps:
        i = step.position
        x = np.random.default_rng(i).normal(size=(args.batch, WIDTH))
        x = x.astype(np.float32)
        state, metrics = step(state, {"x": x, "y": np.tanh(x)})
        loss = float(metrics["loss"])
        if args.rank == 0 or joined:
            emit(ev="step", i=i, t=time.time(), n=step.num_replicas, loss=loss)
            joined = False
    emit(ev="done", t=time.time(), rank=args.rank)
    sys.stdout.flush()
    os._exit(0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(args, port: int, cores: list[int], rank: int) -> list[str]:
    """The command line of process `rank`, pinned to a core of its own if any."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(rank)]
    cmd += ["--port", str(port), "--processes", str(args.processes)]
    cmd += ["--steps", str(args.steps), "--heartbeat", str(args.heartbeat)]
    cmd += ["--collective-timeout", str(args.collective_timeout)]
    cmd += ["--batch", str(args.batch)]
    if args.cache:
        cmd += ["--cache", args.cache]
    if len(cores) >= args.processes:
        cmd = ["taskset", "-c", str(cores[rank])] + cmd
    return cmd


def run(args) -> dict:
    port = free_port()
    cores = os.sched_getaffinity(0)
    procs = []
    log = tempfile.TemporaryFile("w+")  # the workers' stderr, shown on a failure

    def start(rank):
        cmd = worker_command(args, port, sorted(cores), rank)
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        )

    for rank in range(args.processes):
        start(rank)
    events, victim = [], procs[-1]
    killed_at = started_at = None
    replacement: list[dict] = []
    try:
        first_step = None
        for line in procs[0].stdout:
            if not line.startswith("{"):
                continue
            ev = json.loads(line)
            events.append(ev)
            if ev["ev"] == "step" and first_step is None:
                first_step = ev["t"]
            if (
                killed_at is None
                and first_step is not None
                and time.time() - first_step >= args.kill_after
            ):
                victim.send_signal(signal.SIGKILL)
                killed_at = time.time()
                if args.rejoin:
                    victim.wait()
                    started_at = time.time()
                    start(args.processes - 1)
                    threading.Thread(
                        target=lambda: replacement.extend(
                            json.loads(x) for x in procs[-1].stdout if x[0] == "{"
                        ),
                        daemon=True,
                    ).start()
            if ev["ev"] == "done":
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if not any(e["ev"] == "done" for e in events):
        log.seek(0)
        raise SystemExit("process 0 did not finish:\n" + log.read()[-4000:])
    return {
        "events": events,
        "killed_at": killed_at,
        "started_at": started_at,
        "replacement": replacement,
    }


def run_repeated(args, interval: float | None) -> dict:
    """One job to `--steps`; with `interval`, a random non-zero process is
    SIGKILLed every `interval` s of training and started again at once (as
    `python -m jdp.launch --live --max-restarts K` does). Returns process 0's
    training wall time (first step to last) and the kills."""
    port = free_port()
    cores = sorted(os.sched_getaffinity(0))
    rng = random.Random(args.seed)
    procs: dict[int, subprocess.Popen] = {}
    log = tempfile.TemporaryFile("w+")

    def start(rank):
        cmd = worker_command(args, port, cores, rank)
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        procs[rank] = subprocess.Popen(cmd, stdout=out, stderr=log, text=True)

    for rank in range(args.processes):
        start(rank)
    first = last_kill = done = None
    kills = 0
    try:
        for line in procs[0].stdout:
            if not line.startswith("{"):
                continue
            ev = json.loads(line)
            if ev["ev"] == "step" and first is None:
                first = last_kill = ev["t"]
            if ev["ev"] == "done":
                done = ev["t"]
                break
            if interval and first is not None and time.time() - last_kill >= interval:
                victim = rng.randrange(1, args.processes)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                start(victim)
                last_kill, kills = time.time(), kills + 1
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    if done is None:
        log.seek(0)
        raise SystemExit("process 0 did not finish:\n" + log.read()[-4000:])
    return {"interval_s": interval, "kills": kills, "wall_s": done - first}


def goodput(args) -> None:
    """Failure-free, then one kill every 60 s and every 30 s: the throughput kept."""
    free = run_repeated(args, None)
    rows = [free] + [run_repeated(args, i) for i in args.kill_every]
    print("| kill every | kills | training s | steps/s | kept |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        every = f"{r['interval_s']:.0f} s" if r["interval_s"] else "never"
        kept = free["wall_s"] / r["wall_s"]
        print(
            f"| {every} | {r['kills']} | {r['wall_s']:.1f} | "
            f"{args.steps / r['wall_s']:.1f} | {100 * kept:.0f}% |"
        )
    print(json.dumps(rows))


def summarize(args, out: dict) -> dict:
    steps = [e for e in out["events"] if e["ev"] == "step"]
    kill = out["killed_at"]
    if kill is None:
        raise SystemExit("the run ended before the kill: raise --steps")
    before = [b["t"] - a["t"] for a, b in zip(steps[:-1], steps[1:], strict=True)]
    before = [d for d, s in zip(before, steps[1:], strict=True) if s["t"] < kill]
    after_steps = [s for s in steps if s["t"] > kill]
    after = [
        b["t"] - a["t"] for a, b in zip(after_steps[:-1], after_steps[1:], strict=True)
    ]
    step_n, step_n1 = statistics.median(before[5:]), statistics.median(after[5:])
    recovery = after_steps[0]["t"] - kill
    # One recovery per interval, the step rate otherwise unchanged (how the step
    # time changes with one replica fewer is reported on its own).
    lost = recovery
    rejoin = {}
    if out["started_at"] is not None:
        first = [e for e in out["replacement"] if e["ev"] == "step"]
        if not first:
            raise SystemExit("the replacement never stepped: raise --steps")
        back = first[0]["t"]  # the replacement's first step with the others
        # From the kill to then, the time not spent on steps at the old rate.
        done = sum(1 for s in steps if kill < s["t"] <= back)
        lost = (back - kill) - done * step_n
        rejoin = {
            "rejoin_s": back - out["started_at"],
            "joined_at_step": first[0]["i"],
            "replicas_at_end": steps[-1]["n"],
        }
    kept = {interval: max(0.0, 1 - lost / interval) for interval in (60, 30)}
    return {
        **rejoin,
        "processes": args.processes,
        "step_ms_before": 1e3 * step_n,
        "step_ms_after": 1e3 * step_n1,
        "recovery_s": recovery,
        "replicas_after": after_steps[0]["n"],
        "kept_60s": kept[60],
        "kept_30s": kept[30],
        "steps": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int, default=None, dest="rank")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--kill-after", type=float, default=20.0)
    parser.add_argument("--collective-timeout", type=int, default=10)
    parser.add_argument("--heartbeat", type=int, default=5)
    parser.add_argument("--cache", nargs="?", const="", default=None)
    parser.add_argument("--rejoin", action="store_true")
    parser.add_argument("--kill-every", type=float, nargs="+", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch",
        type=int,
        default=48,
        help="the global batch: every replica count that may remain must divide it "
        "(48: 4, 3, 2 or 1 processes; 168: 8, 7 or 6)",
    )
    args = parser.parse_args()
    if args.rank is not None:
        worker(args)
        return
    if args.cache == "":
        args.cache = tempfile.mkdtemp(prefix="jdp-live-cache-")
    if args.kill_every:
        goodput(args)
        return
    result = summarize(args, run(args))
    rejoin = "rejoin_s" in result
    print(
        "| processes | step ms (N / N-1) | recovery s |"
        + (" rejoin s (at step) |" if rejoin else "")
        + " kept at 1 kill/60 s | kept at 1 kill/30 s |"
    )
    print("|---:|---:|---:|" + ("---:|" if rejoin else "") + "---:|---:|")
    print(
        f"| {result['processes']} | {result['step_ms_before']:.1f} / "
        f"{result['step_ms_after']:.1f} | {result['recovery_s']:.1f} | "
        + (
            f"{result['rejoin_s']:.1f} ({result['joined_at_step']}) | "
            if rejoin
            else ""
        )
        + f"{100 * result['kept_60s']:.0f}% | {100 * result['kept_30s']:.0f}% |"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
