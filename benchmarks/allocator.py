"""glibc's allocator with and without jdp's thresholds (`jdp._allocator`), one core.

XLA:CPU allocates a step's temporaries at every call. Above glibc's mmap
threshold (32 MiB at most by default) they are fresh pages, faulted in at every
step; jdp's entry points (`python -m jdp.launch`, `jdp.launch.run`, the demo)
raise the mmap and trim thresholds to 1 GiB. Per model size (the MLP
256-W-W-W-10 of `multihost.py`, SGD with momentum, batch 8, one CPU device),
three steps, timed in the same process:

- `hand`: `jax.jit` of grad + `optax` update, written by hand;
- `jdp local`: `jdp.make_train_step(..., sync=jdp.local())`;
- `jdp all_reduce`: `jdp.make_train_step` as shipped (over one replica it
  communicates nothing: the same program as `jdp local`).

Each (size, allocator) runs in a fresh process pinned to one core (XLA sizes its
thread pool from the affinity mask): `default` with `JDP_DEFAULT_MALLOC=1`;
`thresholds` with glibc's `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` at
1 GiB but its arenas as they are (jdp's setting before it also set one arena);
`tuned` calling `jdp._allocator.tune()` first. Rounds run the three in a shuffled
order. The table gives the median over rounds of each run's median step.

    python benchmarks/allocator.py [--rounds 3] [--steps 20] [--sizes 1M 8.9M 39M]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

from _common import set_devices

WIDTHS = {"1M": 640, "8.9M": 2048, "39M": 4352}
ROWS = ("hand", "jdp local", "jdp all_reduce")
ARMS = ("default", "thresholds", "tuned")


def child(width: int, steps: int) -> dict:
    set_devices(1)
    import jax
    import jax.numpy as jnp
    import optax
    from _common import median_ms, mlp_loss

    import jdp

    key = jax.random.key(0)
    sizes = [256, width, width, width, 10]
    params = [
        {"w": jax.random.normal(key, (m, k)) / m**0.5, "b": jnp.zeros(k)}
        for m, k in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    tx = optax.sgd(1e-3, momentum=0.9)
    batch = {"x": jnp.ones((8, 256)), "y": jnp.ones((8, 10))}

    def hand_step(p, o, b):
        g = jax.grad(mlp_loss)(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    hand = jax.jit(hand_step, donate_argnums=(0, 1))

    box = [jax.tree.map(jnp.copy, params), tx.init(params)]  # donated

    def run_hand():
        box[0], box[1] = hand(box[0], box[1], batch)
        jax.block_until_ready(box[0])

    out = {"hand": median_ms(run_hand, steps, 3)}
    for name, sync in (
        ("jdp local", jdp.local()),
        ("jdp all_reduce", jdp.all_reduce()),
    ):
        step = jdp.parallelize(
            jdp.make_train_step(mlp_loss, tx, sync=sync), devices=jax.devices()[:1]
        )
        state = [step.replicate(jdp.TrainState.create(params=params, tx=tx))]
        sharded = step.shard(batch)

        def run(step=step, state=state, sharded=sharded):
            state[0], metrics = step(state[0], sharded)
            jax.block_until_ready(metrics)

        out[name] = median_ms(run, steps, 3)
    return out


def run_child(size: str, arm: str, steps: int, core: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("JDP_DEFAULT_MALLOC", None)
    if arm == "default":
        env["JDP_DEFAULT_MALLOC"] = "1"
    if arm == "thresholds":
        for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
            env[name] = str(1 << 30)
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import os, sys, json; os.sched_setaffinity(0, {{{core}}}); "
        f"sys.path.insert(0, {here!r}); from jdp import _allocator; "
        "tuned = _allocator.tune(); import allocator; "
        f"times = allocator.child({WIDTHS[size]}, {steps}); "
        "print('RESULT', json.dumps([tuned, times]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    tuned, times = json.loads(line.removeprefix("RESULT "))
    if tuned != (arm == "tuned"):
        raise RuntimeError(f"{arm}: _allocator.tune() returned {tuned}")
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", nargs="+", default=list(WIDTHS), choices=WIDTHS)
    parser.add_argument("--quick", action="store_true", help="1 round, 1M and 8.9M")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.sizes, args.steps = 1, ["1M", "8.9M"], 10
    core = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    results: dict = {}
    rng = random.Random(0)
    for _ in range(args.rounds):
        runs = [(s, a) for s in args.sizes for a in ARMS]
        rng.shuffle(runs)
        for size, arm in runs:
            for row, ms in run_child(size, arm, args.steps, core).items():
                results.setdefault((size, row, arm), []).append(ms)
    print(f"one core (core {core}), {args.rounds} rounds x {args.steps} steps")
    print(
        "| size | step | glibc default ms | thresholds only ms | jdp's setting ms "
        "| thresholds / default | jdp's / default |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        for row in ROWS:
            d, h, t = (statistics.median(results[(size, row, a)]) for a in ARMS)
            print(
                f"| {size} | {row} | {d:.1f} | {h:.1f} | {t:.1f} | {h / d:.2f} "
                f"| {t / d:.2f} |"
            )


if __name__ == "__main__":
    main()
