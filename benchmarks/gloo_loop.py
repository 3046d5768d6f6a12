"""gloo's TCP loop thread at its default priority or at SCHED_IDLE: JAX's `psum`.

JAX's CPU collectives between processes run on gloo, whose TCP transport reads the
sockets on a thread of its own. jaxlib 0.10's gloo spins on that thread while a
peer's data waits for a receive not yet posted, on the core that the thread running
the program (which posts it) was just woken on. `jdp.distributed.initialize()` runs
the loop thread at Linux's `SCHED_IDLE` on a process bound to one core
(`JDP_GLOO_LOOP_IDLE=1` on any process, `0` never): this benchmark measures both
settings, through that variable, in three layouts of 2 processes on 127.0.0.1:

- pinned: each process bound to its own core before JAX is imported;
- unpinned: both free to run on every core;
- unpinned, busy: the same beside one busy loop per core (another user's work).

Rows: a `jax.lax.psum` of N float32s per process (`_common.raw_psum`), the median of
`--reps` calls after 3 warm-up calls, the two settings in alternate jobs, `--rounds`
rounds; the table gives the median over rounds. "idle threads" counts the threads
of each process at SCHED_IDLE (1 expected with `JDP_GLOO_LOOP_IDLE=1`, 0 with 0).

    python benchmarks/gloo_loop.py [--sizes 1024 9e6] [--rounds 3] [--reps 30]
    python benchmarks/gloo_loop.py --quick      # 1 round of 10 calls
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from _common import pin_to_core, raw_psum

LAYOUTS = ("pinned", "unpinned", "unpinned, busy")


def job(sizes: list[int], reps: int, pin: bool) -> dict:
    """Runs in both processes: the median ms of a psum of each size."""
    pin_to_core(pin)  # before JAX is imported: XLA sizes its pool from the mask
    import jdp

    jdp.distributed.initialize()
    out = {}
    for n in sizes:
        call = raw_psum(n)  # starts JAX's CPU backend (and gloo's loop) first time
        for _ in range(3):
            call()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[n] = 1e3 * statistics.median(times)
    tasks = os.listdir("/proc/self/task")
    idle = sum(os.sched_getscheduler(int(t)) == os.SCHED_IDLE for t in tasks)
    return {"ms": out, "idle": idle}


def _busy_loops(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1024, 9e6])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30, help="timed calls per job")
    parser.add_argument("--quick", action="store_true", help="1 round of 10 calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.reps = 1, 10
    sizes = [int(n) for n in args.sizes]
    if not hasattr(os, "SCHED_IDLE"):
        print("skipped: SCHED_IDLE is Linux's")
        return
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        print("fewer than 2 cores: the pinned layout shares one", file=sys.stderr)

    import jdp.launch

    got = {(lay, s): [] for lay in LAYOUTS for s in ("0", "1")}
    idle = {}
    for r in range(args.rounds):
        for layout in LAYOUTS:
            busy = _busy_loops(cores) if layout.endswith("busy") else []
            try:
                for setting in ("0", "1") if r % 2 == 0 else ("1", "0"):
                    res = jdp.launch.run(
                        job,
                        2,
                        args=(sizes, args.reps, layout == "pinned"),
                        devices_per_process=1,
                        initialize=False,  # `job` pins its core first
                        env={"JDP_GLOO_LOOP_IDLE": setting},
                        timeout_s=600,
                        quiet=True,
                    )
                    got[layout, setting].append(res[0]["ms"])
                    idle[setting] = sorted({x["idle"] for x in res})
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    print(
        f"\n2 processes, gloo on 127.0.0.1, {cores} cores; median over {args.rounds} "
        f"round(s) of each job's median of {args.reps} calls; idle threads per "
        f"process: {idle.get('0')} with JDP_GLOO_LOOP_IDLE=0, {idle.get('1')} with 1.\n"
    )
    print("| layout | psum of | loop at default ms | loop at SCHED_IDLE ms | ratio |")
    print("|---|---|---:|---:|---:|")
    for layout in LAYOUTS:
        for n in sizes:
            a = statistics.median(x[n] for x in got[layout, "0"])
            b = statistics.median(x[n] for x in got[layout, "1"])
            print(f"| {layout} | {n:,} floats | {a:.2f} | {b:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
