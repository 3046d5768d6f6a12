"""Scale to 64 devices: compile time and step time of the demo's CNN, 8 to 64 devices.

The demo's CNN (two 3x3 convolutions with BatchNorm and two dense layers, 38k
params; `jdp.demo`), on random images shaped like its 8x8 digits, trained by

- `sync`: synchronous SGD (momentum 0.9), `jdp.make_train_step(loss_fn, tx)`;
- `bmuf`: `jdp.bmuf(optax.sgd(lr), sync_period=K)` (K = 16 unless `--sync-period`)
  with `jdp.make_train_step(..., sync=jdp.local())`,

both through `jdp.parallelize` (shard_map backend unless `--backend pmap`), on 8,
16, 32 and 64 simulated CPU devices in one process, and on 2 processes x 4 and 2
processes x 32 devices (joined by `jdp.distributed.initialize`, gloo). The device
count of a process is fixed when JAX starts, so every configuration runs in fresh
processes started by `jdp.launch.run(..., devices_per_process=N)`; each
configuration runs `--rounds` times, interleaved, and the table gives medians over
rounds.

The per-device batch is fixed (`--per-device 4` examples), so the global batch, and
the total work of a step, grows with the device count: on a 2-core machine the
simulated devices share the same cores, so step time grows about linearly with
devices while examples/s stays flat. Compile time is measured on the step itself:
`trace+lower` is `step.lower(state, batch)` (tracing and lowering to StableHLO) and
`compile` is `.compile()` of that (XLA); the first call reuses that executable, so
`1st call` is one step plus what else the first call costs (the replica-sync check
compiles and runs a small program of its own). Step time is the median of `--steps`
steps after a warm-up (BMUF: of `--blocks` whole blocks of K steps, each divided by
K, so that the block sync counts once per K steps). With 2 processes, every time is
the slower process's. Ratios compare each row with the 8-device row of the same
algorithm and process count (1 x 8 or 2 x 4); `slope` is the least-squares slope of
log(time) against log(devices) over the 1-process rows: 1 means linear growth, above
1 faster than linear.

    python benchmarks/scale64.py [--rounds 2] [--steps 10] [--blocks 2]
                                 [--per-device 4] [--layouts 1x8 ... 2x32]
                                 [--algos sync bmuf] [--sync-period 16]
                                 [--backend shard_map] [--quick]

`--quick`: 8 and 64 devices in 1 process, sync only, 1 round, 5 steps.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

LR = 0.05
MOMENTUM = 0.9  # the demo's (sync); BMUF's block momentum replaces it
#: (processes, devices per process) of every configuration, and of quick mode.
LAYOUTS = [(1, 8), (1, 16), (1, 32), (1, 64), (2, 4), (2, 32)]
QUICK_LAYOUTS = [(1, 8), (1, 64)]


def measure(
    algo: str, per_device: int, timed: int, sync_period: int, backend: str
) -> dict:
    """Runs in every process: compile time and step time of one configuration.

    Times `timed` steps (BMUF: `timed` blocks of `sync_period` steps).
    """
    import jax
    import numpy as np
    import optax

    import jdp
    from jdp.demo import _model

    n, procs, rank = jax.device_count(), jax.process_count(), jax.process_index()
    global_batch = per_device * n
    rng = np.random.default_rng(0)
    x = rng.random((global_batch, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, size=global_batch).astype(np.int32)
    share = slice(rank * global_batch // procs, (rank + 1) * global_batch // procs)
    local = {"x": x[share], "y": y[share]}

    variables = _model.init_variables(0, x)
    if algo == "sync":
        tx = optax.sgd(LR, momentum=MOMENTUM)
        train_step = jdp.make_train_step(_model.loss_fn, tx)
        block = 1
    else:
        tx = jdp.bmuf(optax.sgd(LR), sync_period=sync_period)
        train_step = jdp.make_train_step(_model.loss_fn, tx, sync=jdp.local())
        block = sync_period
    step = jdp.parallelize(train_step, backend=backend)
    state = step.replicate(
        jdp.TrainState.create(
            params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
        )
    )
    batch = step.shard(local)

    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    t1 = time.perf_counter()
    lowered.compile()  # the step's first call reuses this executable
    t2 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    t3 = time.perf_counter()
    # Warm-up: 2 more steps (sync), the rest of the first block (BMUF).
    for _ in range(block - 1 if block > 1 else 2):
        state, metrics = step(state, batch)
    float(metrics["loss"])

    times = []
    for _ in range(timed):
        start = time.perf_counter()
        for _ in range(block):
            state, metrics = step(state, batch)
        loss = float(metrics["loss"])
        times.append((time.perf_counter() - start) / block)
    return {
        "devices": n,
        "processes": procs,
        "global_batch": global_batch,
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "first_s": t3 - t2,
        "step_s": statistics.median(times),
        "loss": loss,
    }


def _layout(text: str) -> tuple[int, int]:
    """`"2x32"` -> `(2, 32)`: processes x devices per process."""
    try:
        procs, devices = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected PxD, e.g. 2x32; got {text!r}"
        ) from None
    if procs < 1 or devices < 1:
        raise argparse.ArgumentTypeError(f"expected positive counts; got {text!r}")
    return procs, devices


def _compile(m: dict) -> float:
    """Seconds from the traced step to its executable: trace+lower + compile."""
    return m["lower_s"] + m["compile_s"]


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(ys) against log(xs)."""
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per run (sync)"
    )
    parser.add_argument(
        "--blocks", type=int, default=2, help="timed blocks of K steps per run (BMUF)"
    )
    parser.add_argument("--per-device", type=int, default=4, help="examples/device")
    parser.add_argument("--sync-period", type=int, default=16, help="BMUF's K")
    parser.add_argument("--backend", default="shard_map", choices=["shard_map", "pmap"])
    parser.add_argument(
        "--algos", nargs="+", default=["sync", "bmuf"], choices=["sync", "bmuf"]
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        type=_layout,
        default=LAYOUTS,
        metavar="PxD",
        help="processes x devices per process (default: "
        + " ".join(f"{p}x{d}" for p, d in LAYOUTS)
        + ")",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8 and 64 devices, 1 process, sync only, 1 round, 5 steps",
    )
    args = parser.parse_args(argv)
    layouts = args.layouts
    if args.quick:
        layouts, args.algos, args.rounds, args.steps = QUICK_LAYOUTS, ["sync"], 1, 5

    import jdp.launch

    configs = [(algo, p, d) for algo in args.algos for p, d in layouts]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    t_start = time.monotonic()
    for rnd in range(args.rounds):
        for config in configs:
            algo, procs, devices = config
            t = time.monotonic()
            outs = jdp.launch.run(
                measure,
                procs,
                args=(
                    algo,
                    args.per_device,
                    args.steps if algo == "sync" else args.blocks,
                    args.sync_period,
                    args.backend,
                ),
                devices_per_process=devices,
                initialize=procs > 1,
                timeout_s=600,
                quiet=True,
            )
            runs[config].append(
                {
                    **outs[0],
                    "lower_s": max(o["lower_s"] for o in outs),
                    "compile_s": max(o["compile_s"] for o in outs),
                    "first_s": max(o["first_s"] for o in outs),
                    "step_s": max(o["step_s"] for o in outs),
                }
            )
            print(
                f"  round {rnd + 1}/{args.rounds} {algo} {procs} x {devices}: "
                f"compile {outs[0]['compile_s']:.2f} s, "
                f"step {1e3 * outs[0]['step_s']:.1f} ms "
                f"({time.monotonic() - t:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    med = {
        c: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for c, rs in runs.items()
    }
    print(
        f"\nDemo CNN (38k params), {args.per_device} examples per device, "
        f"{args.backend}"
        f"{f'; BMUF K={args.sync_period}' if 'bmuf' in args.algos else ''}; "
        f"medians of {args.rounds} "
        f"fresh run(s) x {args.steps} timed steps"
        f"{f' (BMUF: {args.blocks} blocks)' if 'bmuf' in args.algos else ''}; "
        f"{time.monotonic() - t_start:.0f} s in all.\n"
    )
    header = (
        f"{'algo':5s} {'procs x dev':>11s} {'batch':>6s} {'trace+lower s':>13s} "
        f"{'compile s':>9s} {'1st call s':>10s} {'step ms':>8s} {'examples/s':>10s} "
        f"{'devices x':>9s} {'compile x':>9s} {'step x':>7s}"
    )
    print(header)
    print("-" * len(header))
    for algo, procs, devices in configs:
        m = med[(algo, procs, devices)]
        base = med.get((algo, procs, 8 // procs))
        total = procs * devices
        if base:
            ratios = (
                f"{total / base['devices']:9.0f} "
                f"{_compile(m) / _compile(base):9.2f} "
                f"{m['step_s'] / base['step_s']:7.2f}"
            )
        else:
            ratios = f"{'-':>9s} {'-':>9s} {'-':>7s}"
        print(
            f"{algo:5s} {f'{procs} x {devices}':>11s} {m['global_batch']:6.0f} "
            f"{m['lower_s']:13.2f} {m['compile_s']:9.2f} {m['first_s']:10.2f} "
            f"{1e3 * m['step_s']:8.1f} {m['global_batch'] / m['step_s']:10.0f} "
            f"{ratios}"
        )
    print(
        "\n'compile x' is (trace+lower + compile) over the 8-device row's; "
        "'step x' likewise for the step time."
    )

    for algo in args.algos:
        rows = [(d, med[(algo, 1, d)]) for p, d in layouts if p == 1]
        if len(rows) < 2:
            continue
        xs = [d for d, _ in rows]
        s_compile = slope(xs, [_compile(m) for _, m in rows])
        s_xla = slope(xs, [m["compile_s"] for _, m in rows])
        s_step = slope(xs, [m["step_s"] for _, m in rows])
        verdict = "yes" if s_compile > 1 else "no"
        print(
            f"{algo}: log-log slope over {', '.join(map(str, xs))} devices "
            "(1 process): "
            f"trace+lower+compile {s_compile:.2f}, compile alone {s_xla:.2f}, "
            f"step {s_step:.2f}; compile time faster than linear in devices: "
            f"{verdict}."
        )


if __name__ == "__main__":
    main()
