"""BMUF against synchronous SGD: bytes communicated, step time, convergence.

Part 1, on simulated CPU devices with an MLP of about 10M parameters: the bytes
all-reduced per step, read from the compiled HLO with `step.collectives` (a
collective inside a conditional branch, BMUF's block sync, is counted once per
block, i.e. divided by the sync period), and the time per step, for synchronous
SGD, the same step without the all-reduce (`sync=jdp.local()`, the floor BMUF
can reach) and `jdp.bmuf` with sync periods 1, 4 and 16. Each round times one
block of 16 steps (a whole number of blocks for every period) of every variant,
in a fresh order; ratios are taken within a round, then the median over rounds.

Part 2: test accuracy on scikit-learn's digits after the same number of training
examples, synchronous SGD against BMUF variants, with a small MLP.

    python benchmarks/bmuf.py [--devices 8] [--rounds 5] [--quick] [--steps N]

The simulated devices share the host's CPU cores (and, on a shared machine,
other people's jobs): step times are noisy and say little about real
interconnects, where the all-reduce BMUF avoids costs far more than a memcpy.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time

from _common import set_devices, tanh_mlp

PAGE = resource.getpagesize()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="~1M params, fewer steps")
    parser.add_argument(
        "--steps", type=int, default=None, help="convergence steps (240; 120 quick)"
    )
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:
        set_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    import jdp

    # `make_train_step`'s `sync` for a run that does / does not all-reduce.
    sync = {True: jdp.all_reduce(), False: jdp.local()}
    devices = jax.devices()[: args.devices]
    n = len(devices)

    def init(sizes, key):
        params = []
        for m, k in zip(sizes[:-1], sizes[1:], strict=True):
            key, sub = jax.random.split(key)
            params.append(
                {
                    "w": jax.random.normal(sub, (m, k)) / np.sqrt(m),
                    "b": jnp.zeros(k),
                }
            )
        return params

    apply = tanh_mlp

    def xent(params, batch):
        logits = apply(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]
        ).mean()

    # -- part 1: communication and step time ----------------------------------
    width = 512 if args.quick else 2048
    sizes = (784, width, width, width, 10)
    params = jax.tree.map(np.asarray, init(sizes, jax.random.key(0)))
    num_params = sum(x.size for x in jax.tree.leaves(params))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    global_batch = 4 * n
    host_batch = {
        "x": rng.normal(size=(global_batch, 784)).astype(np.float32),
        "y": rng.integers(0, 10, size=global_batch).astype(np.int32),
    }
    inner = optax.sgd(1e-3, momentum=0.9)
    block = 16  # steps timed together: a whole number of blocks for every k

    # name: (optimizer, all-reduce the gradients?, sync period)
    variants = {
        "sync SGD": (inner, True, None),
        "local step": (inner, False, None),  # no all-reduce: BMUF's floor
    }
    for k in (1, 4, 16):
        variants[f"BMUF k={k}"] = (jdp.bmuf(inner, sync_period=k), False, k)

    runners, comm, copies, layout, step_memory = {}, {}, {}, {}, {}
    for name, (tx, all_reduce, k) in variants.items():
        step = jdp.parallelize(
            jdp.make_train_step(xent, tx, sync=sync[all_reduce]), devices=devices
        )
        state = [step.replicate(jdp.TrainState.create(params=params, tx=tx))]
        batch = step.shard(host_batch)
        ops = step.collectives(state[0], batch)
        lowered = step.collectives(state[0], batch, stage="lowered")
        every = sum(c.bytes for c in ops if not c.in_conditional)
        cond = sum(c.bytes for c in ops if c.in_conditional)
        comm[name] = every + cond / (k or 1)
        layout[name] = (
            [(c.bytes, c.in_conditional) for c in ops],
            [(c.bytes, c.in_conditional) for c in lowered],
        )
        # The training state per replica, in copies of the parameters.
        copies[name] = sum(x.nbytes for x in jax.tree.leaves(state[0])) / (
            n * param_bytes
        )

        def run(step=step, state=state, batch=batch):
            for _ in range(block):
                state[0], metrics = step(state[0], batch)
            return metrics["loss"]

        jax.block_until_ready(run())  # compile (both branches) and warm up
        runners[name] = run
        step_memory[name] = step.memory_analysis(state[0], batch)
    # Rounds of one block per variant, in a fresh order each round; a ratio is
    # taken within a round (variants timed back to back), then the median over
    # rounds: a slow phase of a shared machine hits both sides of a ratio.
    times = {name: [] for name in runners}
    faults = {name: 0 for name in runners}  # minor page faults, whole process
    order = list(runners)
    for _ in range(args.rounds):
        random.Random(len(times["sync SGD"])).shuffle(order)
        for name in order:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            jax.block_until_ready(runners[name]())
            times[name].append((time.perf_counter() - t0) / block)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    temp = {name: step_memory[name].temp_bytes / 2**20 for name in step_memory}

    def ratios(name, base):
        return [a / b for a, b in zip(times[name], times[base], strict=True)]

    def floor_ratios(name, k):
        """BMUF's step against its floor in the same round: the local step plus
        synchronous SGD's all-reduce (sync - local) once every k steps."""
        local, sync = times["local step"], times["sync SGD"]
        floor = [lo + (sy - lo) / k for lo, sy in zip(local, sync, strict=True)]
        return [a / f for a, f in zip(times[name], floor, strict=True)], [
            f / lo for f, lo in zip(floor, local, strict=True)
        ]

    print(
        f"\nBMUF vs synchronous SGD: {n} simulated CPU devices, jax "
        f"{jax.__version__}, MLP {'-'.join(map(str, sizes))} = {num_params / 1e6:.2f}M "
        f"params ({param_bytes / 2**20:.1f} MiB), global batch {global_batch}, "
        f"{args.rounds} interleaved rounds of {block} steps per variant\n"
    )
    header = (
        f"{'variant':<11} {'AR MiB/step':>11} {'vs sync':>8} {'params/k':>8} "
        f"{'state':>5} {'ms/step':>8} {'vs local':>8} {'range':>11} {'vs sync':>8} "
        f"{'floor':>6} {'vs floor':>8} {'temp MiB':>8} {'faults MiB':>10}"
    )
    print(header)
    print("-" * len(header))
    base = "sync SGD"
    for name, (_, _, k) in variants.items():
        target = f"{1 / k:8.4f}" if k else f"{'':>8}"
        local = ratios(name, "local step")
        if k:
            vs_floor, floor = floor_ratios(name, k)
            floor, vs_floor = statistics.median(floor), statistics.median(vs_floor)
            floors = f"{floor:6.3f} {vs_floor:8.3f}"
        else:
            floors = f"{'':>6} {'':>8}"
        print(
            f"{name:<11} {comm[name] / 2**20:11.3f} {comm[name] / comm[base]:8.4f} "
            f"{target} {copies[name]:5.1f} {statistics.median(times[name]) * 1e3:8.1f} "
            f"{statistics.median(local):8.3f} {min(local):5.2f}-{max(local):<5.2f} "
            f"{statistics.median(ratios(name, base)):8.3f} {floors} {temp[name]:8.1f} "
            f"{faults[name] * PAGE / 2**20 / (args.rounds * block):10.1f}"
        )
    print(
        "\nAR MiB/step: all-reduced bytes per step from the compiled HLO, sync-branch "
        "collectives divided by k (they run once per block). params/k: the target "
        "ratio, params bytes / k over the gradient bytes. The extra 4 bytes every "
        "step are the loss metric. state: the training state per replica, in copies "
        "of the parameters (params + momentum; BMUF adds the global model and the "
        "block velocity, nothing more). ms/step: median over rounds of the mean "
        "over a block of "
        f"{block} steps (one sync for k=16). vs local / vs sync: median over rounds "
        "of the ratio to the local step without all-reduce (BMUF's floor) / to "
        "synchronous SGD, timed in the same round; range: lowest and highest round. "
        "floor: what a BMUF step cannot beat, the local step plus synchronous SGD's "
        "all-reduce (sync - local, same round) once every k steps, as a ratio to the "
        "local step; vs floor: BMUF's step over that floor (median over rounds). "
        "temp MiB: XLA's temporary buffer of the compiled step, per device. faults "
        "MiB: memory the process touched fresh (minor page faults x page size) per "
        "step, all devices: XLA:CPU allocates a step's temporary buffer on every "
        "call, and glibc hands a large allocation fresh pages (above 32 MiB "
        "always, and here from about 10 MiB)."
    )
    for name in ("sync SGD", "BMUF k=16"):
        compiled, lowered = layout[name]
        print(f"{name}: (bytes, in_conditional) compiled {compiled}; lowered {lowered}")

    # -- part 2: convergence on digits ----------------------------------------
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    small = jax.tree.map(np.asarray, init((64, 128, 10), jax.random.key(1)))
    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(apply(p, x_test), -1) == y_test))
    batch_size = 64
    num_steps = args.steps or (120 if args.quick else 240)
    checkpoints = (num_steps // 3, 2 * num_steps // 3, num_steps)
    lr = 0.05

    def batches():
        r = np.random.default_rng(1)
        while True:
            order = r.permutation(len(x_train))
            for i in range(0, len(order) - batch_size + 1, batch_size):
                idx = order[i : i + batch_size]
                yield {"x": x_train[idx], "y": y_train[idx]}

    sgd = optax.sgd(lr, momentum=0.9)
    runs = {
        "sync SGD": (sgd, True),
        "BMUF k=4": (jdp.bmuf(sgd, sync_period=4), False),
        "BMUF k=4 reset": (
            jdp.bmuf(sgd, sync_period=4, inner_state_at_sync="reset"),
            False,
        ),
        "BMUF k=16": (jdp.bmuf(sgd, sync_period=16), False),
        "BMUF k=16 NBM": (
            jdp.bmuf(sgd, 16, outer=jdp.block_momentum(nesterov=True)),
            False,
        ),
        "averaging k=16": (
            jdp.bmuf(sgd, 16, outer=jdp.block_momentum(momentum=0.0)),
            False,
        ),
    }
    results = {}
    for name, (tx, all_reduce) in runs.items():
        step = jdp.parallelize(
            jdp.make_train_step(xent, tx, sync=sync[all_reduce]), devices=devices
        )
        state = step.replicate(jdp.TrainState.create(params=small, tx=tx))
        data = batches()
        accs = []
        for s in range(1, num_steps + 1):
            state, _ = step(state, step.shard(next(data)))
            if s in checkpoints:
                if all_reduce:
                    model = step.unreplicate(state).params
                else:
                    model = step.unreplicate(jdp.bmuf_global_params(state))
                accs.append(float(accuracy(model)))
        results[name] = accs

    print(
        f"\nConvergence on digits (1400 train / {len(x_test)} test), MLP 64-128-10, "
        f"{n} replicas, global batch {batch_size}, inner optax.sgd({lr}, "
        "momentum=0.9), default block momentum 1 - 1/N; test accuracy of the "
        "global model after the same number of training examples\n"
    )
    header = f"{'variant':<15}" + "".join(
        f"{f'{c * batch_size} ex':>10}" for c in checkpoints
    )
    header += f"{'vs sync':>9}"
    print(header)
    print("-" * len(header))
    for name, accs in results.items():
        print(
            f"{name:<15}"
            + "".join(f"{a:10.3f}" for a in accs)
            + f"{accs[-1] / results['sync SGD'][-1]:9.3f}"
        )
    print(
        "\n'vs sync': final accuracy / synchronous SGD's. 'reset' zeroes the inner "
        "momentum at every sync; 'NBM' is the paper's Nesterov-like block momentum; "
        "'averaging' is block momentum 0 (plain model averaging)."
    )


if __name__ == "__main__":
    main()
