"""BMUF and DiLoCo across processes: step time against the all-reduce they avoid.

Two processes x one CPU device each, joined over gloo by `jdp.launch.run`
(127.0.0.1), train a parameter-heavy MLP (784-2048-2048-2048-10, 10.0 M params,
f32) on scikit-learn's digits (each 8x8 image upsampled 3x and padded to 28x28),
8 examples per process per step, inner optimizer Adam with a cosine decay of its
learning rate to 0 over the run (DiLoCo's inner optimizer is AdamW; ending every
run at the end of its schedule compares the methods at rest rather than wherever
a noisy constant-rate run happens to stop):

- `sync`: `jdp.make_train_step(loss, tx)`, the gradients all-reduced every step.
- `local step`: `grad_sync="none"` without BMUF: no communication at all, the
  floor for any method that trains locally.
- `BMUF k=4`, `BMUF k=16`: `jdp.bmuf(tx, sync_period=k)` (classical block
  momentum, the default `1 - 1/N`): one all-reduce of the parameters per block.
- `DiLoCo k=16`: `jdp.bmuf(tx, sync_period=16, outer=optax.sgd(0.7, momentum=0.9,
  nesterov=True))`.

Every configuration runs in fresh processes, `--rounds` times, interleaved. A run
trains `--steps` steps (a whole number of 16-step blocks; the first block, which
compiles, is not timed) and reports the mean step time of each later block, its
median, the test accuracy of the (global) model after those steps (the same
examples in the same order for every configuration), and the time of one raw
all-reduce of the parameter bytes (a jitted `shard_map` `psum` of one flat f32
buffer), measured in the same processes. The floor of a method that syncs every k
steps is `local step + all-reduce / k`. Each process is pinned to one core
(`--no-pin` to leave them free).

    python benchmarks/bmuf_multihost.py [--rounds 3] [--steps 256] [--no-pin] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import median_ms, raw_psum, tanh_mlp

SIZES = (784, 2048, 2048, 2048, 10)
PER_PROCESS = 8  # examples per process per step
BLOCK = 16  # steps per timed block: a whole number of blocks for k = 1, 4, 16
LR = 3e-4  # Adam's peak learning rate, decayed to 0 over the run


def _pin(pin: bool) -> None:
    if pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        rank = int(os.environ.get("JDP_PROCESS_ID", "0"))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


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


def worker(kind: str, k: int | None, steps: int, pin: bool) -> dict:
    """Runs in every process: trains one configuration, times its blocks."""
    _pin(pin)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    x_train, y_train, x_test, y_test = _digits()
    params = _init(jax.random.key(0))
    num_params = sum(p.size for p in jax.tree.leaves(params))
    inner = optax.adam(optax.cosine_decay_schedule(LR, steps))
    if kind == "bmuf":
        tx = jdp.bmuf(inner, sync_period=k)
    elif kind == "diloco":
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        tx = jdp.bmuf(inner, sync_period=k, outer=outer)
    else:
        tx = inner
    grad_sync = "all_reduce" if kind == "sync" else "none"
    step = jdp.parallelize(jdp.make_train_step(_loss, tx, grad_sync=grad_sync))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))

    # The same global batches in the same order for every configuration; each
    # process takes its share. Placed before the clock starts.
    n, r = jax.process_count(), jax.process_index()
    rng = np.random.default_rng(1)
    global_batch = PER_PROCESS * n
    order = np.concatenate(
        [rng.permutation(len(x_train)) for _ in range(steps * global_batch // 1400 + 1)]
    )
    batches = []
    for s in range(steps):
        idx = order[s * global_batch : (s + 1) * global_batch]
        idx = idx[r * PER_PROCESS : (r + 1) * PER_PROCESS]
        batches.append(step.shard({"x": x_train[idx], "y": y_train[idx]}))

    block_ms = []
    for b in range(steps // BLOCK):
        start = time.perf_counter()
        for s in range(b * BLOCK, (b + 1) * BLOCK):
            state, metrics = step(state, batches[s])
        loss = float(metrics["loss"])  # waits for the block's last step
        if b:  # the first block compiles
            block_ms.append(1e3 * (time.perf_counter() - start) / BLOCK)

    if kind in ("bmuf", "diloco"):
        model = step.unreplicate(jdp.bmuf_global_params(state))
    else:
        model = step.unreplicate(state.params)
    logits = jax.jit(tanh_mlp)(model, x_test)
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    if kind == "local":
        accuracy = float("nan")  # replicas never merge: no one model to test
    return {
        "ms": statistics.median(block_ms),
        "loss": loss,
        "accuracy": accuracy,
        "allreduce_ms": median_ms(raw_psum(num_params), steps=8, warmup=2),
        "params": num_params,
    }


CONFIGS = {
    # name: (kind, sync period)
    "sync SGD": ("sync", None),
    "local step": ("local", None),
    "BMUF k=4": ("bmuf", 4),
    "BMUF k=16": ("bmuf", 16),
    "DiLoCo k=16": ("diloco", 16),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 round, 64 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 64
    if args.steps % BLOCK or args.steps < 2 * BLOCK:
        parser.error(f"--steps must be a multiple of {BLOCK}, at least {2 * BLOCK}")

    import jdp.launch

    ms = {name: [] for name in CONFIGS}
    allreduce, results = [], {}
    for rnd in range(args.rounds):
        for name, (kind, k) in CONFIGS.items():
            out = jdp.launch.run(
                worker,
                2,
                args=(kind, k, args.steps, not args.no_pin),
                devices_per_process=1,
                timeout_s=900,
                quiet=True,
            )[0]
            ms[name].append(out["ms"])
            allreduce.append(out["allreduce_ms"])
            results[name] = out
            print(
                f"  round {rnd + 1}/{args.rounds} {name}: {out['ms']:.1f} ms/step, "
                f"all-reduce {out['allreduce_ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )

    med = {name: statistics.median(v) for name, v in ms.items()}
    ar = statistics.median(allreduce)
    num_params = results["sync SGD"]["params"]
    examples = args.steps * 2 * PER_PROCESS
    print(
        f"\nBMUF / DiLoCo across 2 processes x 1 CPU device (gloo), jax "
        f"{jax_version()}, MLP {'-'.join(map(str, SIZES))} = {num_params / 1e6:.2f}M "
        f"params ({4 * num_params / 2**20:.1f} MiB), {PER_PROCESS} examples per "
        f"process per step, Adam({LR}, cosine decay to 0 over the run); "
        f"{args.rounds} fresh runs x "
        f"{args.steps} steps; processes "
        f"{'unpinned' if args.no_pin else 'pinned to 1 core each'}.\n"
        f"One all-reduce of the parameter bytes: {ar:.1f} ms (median of "
        f"{len(allreduce)} runs).\n"
    )
    header = (
        f"{'configuration':<13} {'ms/step':>8} {'range':>13} {'vs sync':>8} "
        f"{'floor ms':>8} {'vs floor':>8} {f'acc @{examples} ex':>15}"
    )
    print(header)
    print("-" * len(header))
    for name, (_, k) in CONFIGS.items():
        lo, hi = min(ms[name]), max(ms[name])
        acc = results[name]["accuracy"]
        floor = vs_floor = "-"
        if k:
            floor_ms = med["local step"] + ar / k
            floor, vs_floor = f"{floor_ms:.1f}", f"{med[name] / floor_ms:.3f}"
        print(
            f"{name:<13} {med[name]:8.1f} {f'{lo:.1f}-{hi:.1f}':>13} "
            f"{med[name] / med['sync SGD']:8.3f} {floor:>8} {vs_floor:>8} "
            f"{'-' if acc != acc else f'{100 * acc:.1f}%':>15}"
        )
    print(
        "\nms/step: median over runs of the median over 16-step blocks (the first "
        "block, which compiles, untimed) of the mean step time. floor: local step + "
        "one parameter all-reduce / k. acc: test accuracy (397 digits) of the model "
        "(BMUF / DiLoCo: the global model) after the same examples, from the last "
        "run; the local step's replicas never merge, so it has no single model."
    )


def jax_version() -> str:
    import jax

    return jax.__version__


if __name__ == "__main__":
    main()
