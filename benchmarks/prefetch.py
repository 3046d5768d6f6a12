"""Input prefetch: does `step.prefetch` hide the time it takes to load a batch?

A loop that reads each step's loss (as a loop that logs does) cannot load the next
batch while the step runs, unless something loads it in the background. This
benchmark makes loading a batch cost about as much as a step (a sleep, as waiting
for disk or network does, plus building the arrays) and times, interleaved:

- `shard`: `for b in loader: state, m = step(state, step.shard(b)); float(m["loss"])`
- `prefetch`: the same loop over `step.prefetch(loader, size=2)`
- `no loading`: the step alone on a placed batch (the floor)

    python benchmarks/prefetch.py [--devices 8] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import mlp_loss, set_devices, square_mlp


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:
        set_devices(args.devices)

    import jax
    import numpy as np
    import optax

    import jdp

    width, depth, batch_size = 512, 4, 256
    steps, rounds = (6, 3) if args.quick else (12, 7)
    params = square_mlp(width, depth, jax.random.key(0))
    tx = optax.sgd(1e-3, momentum=0.9)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx), devices=jax.devices()[: args.devices]
    )
    rng = np.random.default_rng(0)

    def make_batch():
        return {
            "x": rng.normal(size=(batch_size, width)).astype(np.float32),
            "y": rng.normal(size=(batch_size, width)).astype(np.float32),
        }

    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    placed = step.shard(make_batch())
    for _ in range(3):  # compile, warm up
        state, m = step(state, placed)
        float(m["loss"])
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, placed)
        float(m["loss"])
    step_s = (time.perf_counter() - t0) / steps

    def loader(n):
        for _ in range(n):
            time.sleep(step_s)  # waiting for storage, as much as a step takes
            yield make_batch()

    def run(kind):
        nonlocal state
        t0 = time.perf_counter()
        if kind == "no loading":
            batches = (placed for _ in range(steps))
        elif kind == "shard":
            batches = (step.shard(b) for b in loader(steps))
        else:
            batches = step.prefetch(loader(steps), size=2)
        for b in batches:
            state, m = step(state, b)
            float(m["loss"])  # a loop that logs reads every step's loss
        return (time.perf_counter() - t0) / steps

    kinds = ["no loading", "shard", "prefetch"]
    times = {k: [] for k in kinds}
    for r in range(rounds):
        for k in kinds[r % 3 :] + kinds[: r % 3]:
            times[k].append(run(k))
    base = statistics.median(times["no loading"])
    print(
        f"\nstep.prefetch: {args.devices} simulated CPU devices, MLP {width} x "
        f"{depth}, batch {batch_size}, loading a batch takes {1e3 * step_s:.1f} ms "
        f"(one step); {rounds} interleaved rounds of {steps} steps\n"
    )
    print(f"{'loop':<12} {'ms/step':>8} {'vs no loading':>14}")
    print("-" * 36)
    for k in kinds:
        ms = 1e3 * statistics.median(times[k])
        print(f"{k:<12} {ms:8.1f} {ms / (1e3 * base):14.2f}")
    print(
        "\nWithout prefetch a step waits for its batch to load (about 2x); with "
        "prefetch the\nwaiting overlaps the previous steps; what remains is building "
        "and placing the arrays,\nwhich shares the host's cores with the step."
    )


if __name__ == "__main__":
    main()
