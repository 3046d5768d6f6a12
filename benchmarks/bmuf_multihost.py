"""BMUF and DiLoCo across processes: step time against the all-reduce they avoid.

Two processes x one CPU device each, joined over gloo by `jdp.launch.run`
(127.0.0.1), train a parameter-heavy MLP (784-2048-2048-2048-10, 10.0 M params,
f32) on scikit-learn's digits (each 8x8 image upsampled 3x and padded to 28x28),
8 examples per process per step, inner optimizer Adam with a cosine decay of its
learning rate to 0 over the run (DiLoCo's inner optimizer is AdamW; ending every
run at the end of its schedule compares the methods at rest rather than wherever
a noisy constant-rate run happens to stop):

- `sync`: `jdp.make_train_step(loss, tx)`, the gradients all-reduced every step.
- `local step`: `sync=jdp.local()` without BMUF: no communication at all, the
  floor for any method that trains locally.
- `BMUF k=4`, `BMUF k=16`: `jdp.bmuf(tx, sync_period=k)` (classical block
  momentum, the default `1 - 1/N`): one all-reduce of the parameters per block.
- `DiLoCo k=16`: `jdp.bmuf(tx, sync_period=16, outer=optax.sgd(0.7, momentum=0.9,
  nesterov=True))`.
- `BMUF k=16 bm=.25`, `DiLoCo k=16 m=.5`: the same with a smaller block momentum
  (0.25 instead of `1 - 1/N` = 0.5) / outer momentum (0.5 instead of 0.9): over a
  short run (16 blocks at the default 256 steps) with an adaptive inner optimizer,
  the default momenta cost accuracy (see the README's BMUF section).

Each round starts 2 fresh processes that train every configuration from the same
initial model on the same batches, interleaved: block by block (16 steps), each
configuration takes its next block, in a shuffled order. Timing the methods side by
side in the same processes matters here: the same step varies by up to 1.5x between
fresh processes on this machine, far more than the differences being measured. The
first block, which compiles, is not timed. Reported: the mean step time of each
block, its ratio to the synchronous step and to the floor of the same block, the
test accuracy of the (global) model after all the steps (each round has its own
initial model and batch order: the accuracy is averaged over rounds, a single
run's being noisy at this size), and the time of one raw
all-reduce of the parameter bytes (a jitted `shard_map` `psum` of one flat f32
buffer), measured in the same processes. The floor of a method that syncs every k
steps is `local step + all-reduce / k`. Each process is pinned to one core
(`--no-pin` to leave them free).

    python benchmarks/bmuf_multihost.py [--rounds 3] [--steps 256] [--lr 3e-4]
        [--no-pin] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from _common import median_ms, pin_to_core, raw_psum, tanh_mlp

SIZES = (784, 2048, 2048, 2048, 10)
PER_PROCESS = 8  # examples per process per step
BLOCK = 16  # steps per timed block: a whole number of blocks for k = 1, 4, 16
LR = 3e-4  # Adam's peak learning rate, decayed to 0 over the run


def _digits():
    """Digits upsampled to 28x28 (784 inputs), shuffled, split 1400 / 397."""
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = np.kron(x.reshape(-1, 8, 8) / 16.0, np.ones((3, 3)))  # 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))  # 28x28
    x = images.reshape(len(x), -1).astype(np.float32)
    y = y.astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _init(key):
    import jax
    import numpy as np

    params = []
    for m, k in zip(SIZES[:-1], SIZES[1:], strict=True):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (m, k)) / np.sqrt(m)
        params.append({"w": np.asarray(w), "b": np.zeros(k, np.float32)})
    return params


def _loss(params, batch):
    import optax

    logits = tanh_mlp(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


CONFIGS = {
    # name: (kind, sync period, block momentum (BMUF) / outer momentum (DiLoCo))
    "sync SGD": ("sync", None, None),
    "local step": ("local", None, None),
    "BMUF k=4": ("bmuf", 4, None),
    "BMUF k=16": ("bmuf", 16, None),
    "BMUF k=16 bm=.25": ("bmuf", 16, 0.25),
    "DiLoCo k=16": ("diloco", 16, 0.9),
    "DiLoCo k=16 m=.5": ("diloco", 16, 0.5),
}


def worker(steps: int, pin: bool, seed: int, lr: float = LR) -> dict:
    """Runs in every process: trains every configuration, interleaved by block."""
    pin_to_core(pin)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    x_train, y_train, x_test, y_test = _digits()
    params = _init(jax.random.key(seed))
    num_params = sum(p.size for p in jax.tree.leaves(params))
    inner = optax.adam(optax.cosine_decay_schedule(lr, steps))
    run = {}
    for name, (kind, k, momentum) in CONFIGS.items():
        if kind == "bmuf":
            outer = jdp.block_momentum(momentum=momentum)
            tx = jdp.bmuf(inner, sync_period=k, outer=outer)
        elif kind == "diloco":
            outer = optax.sgd(0.7, momentum=momentum, nesterov=True)
            tx = jdp.bmuf(inner, sync_period=k, outer=outer)
        else:
            tx = inner
        sync = jdp.all_reduce() if kind == "sync" else jdp.local()
        step = jdp.parallelize(jdp.make_train_step(_loss, tx, sync=sync))
        run[name] = [step, step.replicate(jdp.TrainState.create(params=params, tx=tx))]

    # The same global batches in the same order for every configuration; each
    # process takes its share. Placed before the clock starts.
    n, r = jax.process_count(), jax.process_index()
    rng = np.random.default_rng(seed + 1)
    global_batch = PER_PROCESS * n
    order = np.concatenate(
        [rng.permutation(len(x_train)) for _ in range(steps * global_batch // 1400 + 1)]
    )
    batches = []
    for s in range(steps):
        idx = order[s * global_batch : (s + 1) * global_batch]
        idx = idx[r * PER_PROCESS : (r + 1) * PER_PROCESS]
        batches.append(run["sync SGD"][0].shard({"x": x_train[idx], "y": y_train[idx]}))

    # Block by block, each configuration takes its next block of steps, in a fresh
    # order every block, so that a slow spell of the machine hits all of them.
    block_ms = {name: [] for name in CONFIGS}
    shuffle = random.Random(seed).shuffle
    for b in range(steps // BLOCK):
        names = list(CONFIGS)
        shuffle(names)
        for name in names:
            step, state = run[name]
            start = time.perf_counter()
            for s in range(b * BLOCK, (b + 1) * BLOCK):
                state, metrics = step(state, batches[s])
            float(metrics["loss"])  # waits for the block's last step
            if b:  # the first block compiles
                block_ms[name].append(1e3 * (time.perf_counter() - start) / BLOCK)
            run[name][1] = state

    accuracy, test_loss = {}, {}
    for name, (kind, _, _) in CONFIGS.items():
        step, state = run[name]
        if kind == "local":
            # The replicas never merge: no one model.
            accuracy[name] = test_loss[name] = float("nan")
            continue
        if kind in ("bmuf", "diloco"):
            model = step.unreplicate(jdp.bmuf_global_params(state))
        else:
            model = step.unreplicate(state.params)
        logits = jax.jit(tanh_mlp)(model, x_test)
        accuracy[name] = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
        test_loss[name] = float(
            optax.softmax_cross_entropy_with_integer_labels(logits, y_test).mean()
        )
    return {
        "block_ms": block_ms,
        "accuracy": accuracy,
        "test_loss": test_loss,
        "allreduce_ms": median_ms(raw_psum(num_params), steps=8, warmup=2),
        "params": num_params,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--lr", type=float, default=LR, help="Adam's peak rate")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 round, 64 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 64
    if args.steps % BLOCK or args.steps < 2 * BLOCK:
        parser.error(f"--steps must be a multiple of {BLOCK}, at least {2 * BLOCK}")

    import jdp.launch

    rounds = []  # per round: {"block_ms": {name: [ms per block]}, ...}
    for rnd in range(args.rounds):
        out = jdp.launch.run(
            worker,
            2,
            args=(args.steps, not args.no_pin, rnd, args.lr),
            devices_per_process=1,
            timeout_s=1800,
            quiet=True,
        )[0]
        rounds.append(out)
        print(
            f"  round {rnd + 1}/{args.rounds}: "
            + ", ".join(
                f"{name} {statistics.median(v):.1f}"
                for name, v in out["block_ms"].items()
            )
            + f" ms/step; all-reduce {out['allreduce_ms']:.1f} ms",
            file=sys.stderr,
            flush=True,
        )

    def ratios(name, baseline):
        """Per round, the median over blocks of `name`'s time / `baseline(block)`."""
        per_round = []
        for out in rounds:
            ms = out["block_ms"]
            per_round.append(
                statistics.median(m / baseline(out, i) for i, m in enumerate(ms[name]))
            )
        return statistics.median(per_round), min(per_round), max(per_round)

    def sync_ms(out, i):
        return out["block_ms"]["sync SGD"][i]

    med = {
        name: statistics.median(
            statistics.median(out["block_ms"][name]) for out in rounds
        )
        for name in CONFIGS
    }
    ar = statistics.median(out["allreduce_ms"] for out in rounds)
    num_params = rounds[0]["params"]
    examples = args.steps * 2 * PER_PROCESS
    print(
        f"\nBMUF / DiLoCo across 2 processes x 1 CPU device (gloo), jax "
        f"{jax_version()}, MLP {'-'.join(map(str, SIZES))} = {num_params / 1e6:.2f}M "
        f"params ({4 * num_params / 2**20:.1f} MiB), {PER_PROCESS} examples per "
        f"process per step, Adam({args.lr}, cosine decay to 0 over the run); "
        f"{args.rounds} rounds of fresh processes, each training every "
        f"configuration for {args.steps} steps, interleaved by blocks of {BLOCK} "
        f"steps in a shuffled order; processes "
        f"{'unpinned' if args.no_pin else 'pinned to 1 core each'}.\n"
        f"One all-reduce of the parameter bytes: {ar:.1f} ms (median over rounds).\n"
    )
    header = (
        f"{'configuration':<16} {'ms/step':>8} {'vs sync':>8} {'range':>11} "
        f"{'floor ms':>8} {'vs floor':>8} {'range':>11} "
        f"{'acc':>7} {'range':>9} {'loss':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, (_, k, _) in CONFIGS.items():
        accs = [out["accuracy"][name] for out in rounds]
        acc = statistics.mean(accs)
        loss = statistics.mean(out["test_loss"][name] for out in rounds)
        vs_sync, lo, hi = ratios(name, sync_ms)
        floor = vs_floor = floor_range = "-"
        if k:

            def floor_ms(out, i, k=k):
                return out["block_ms"]["local step"][i] + out["allreduce_ms"] / k

            ratio, f_lo, f_hi = ratios(name, floor_ms)
            floors = [
                floor_ms(out, i)
                for out in rounds
                for i in range(len(out["block_ms"][name]))
            ]
            floor = f"{statistics.median(floors):.1f}"
            vs_floor, floor_range = f"{ratio:.3f}", f"{f_lo:.2f}-{f_hi:.2f}"
        print(
            f"{name:<16} {med[name]:8.1f} {vs_sync:8.3f} {f'{lo:.2f}-{hi:.2f}':>11} "
            f"{floor:>8} {vs_floor:>8} {floor_range:>11}"
            + (
                f" {'-':>7} {'-':>9} {'-':>6}"
                if acc != acc
                else f" {100 * acc:6.1f}% {100 * min(accs):4.1f}-{100 * max(accs):4.1f}"
                f" {loss:6.3f}"
            )
        )
    print(
        "\nms/step: median over rounds of the median over blocks (the first block, "
        "which compiles, untimed) of the mean step time. vs sync, vs floor: median "
        "over rounds of the median over blocks of the ratio to the synchronous "
        "step / to the floor, timed in the same processes and block (range: lowest "
        "and highest round). floor: local step + one parameter all-reduce / k. acc: "
        f"test accuracy (397 digits) of the model (BMUF / DiLoCo: the global model) "
        f"after the same {examples} examples, mean over rounds (range: lowest and "
        "highest); each round starts from its own initial model and batch order, "
        "the same for every configuration; one test example is 0.25 points. loss: "
        "the test cross-entropy, mean over rounds (finer-grained than the "
        "accuracy). The local step's replicas never merge, so it has no single "
        "model."
    )


def jax_version() -> str:
    import jax

    return jax.__version__


if __name__ == "__main__":
    main()
