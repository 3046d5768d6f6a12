"""Per-leaf sync (`jdp.partition`) and hierarchical local SGD: bytes and quality.

The model: a bag-of-embeddings classifier, an embedding table (50k x 64 by
default) averaged over each example's ids, then a small dense head (64-64-10).

Part 1, bytes, from the compiled program (`step.collectives`) on 8 simulated
CPU devices: full sync (`jdp.all_reduce()`), and `jdp.partition` with the head
all-reduced and the embedding `jdp.local()` with `jdp.bmuf(adam, 16,
outer=jdp.block_momentum(momentum=0.9, nesterov=True))` in an
`optax.multi_transform`. The every-step collectives sit
outside any conditional, the embedding's block sync inside the branch that runs
once per 16 steps, so the mean per step is `every-step + conditional / 16`.
Target: exactly `dense + embedding / 16` (+ the loss metric's 4 bytes).

Part 2, quality: a synthetic task (a fixed random teacher labels bags of ids
drawn from a Zipf-like distribution over the vocabulary), the student trained
with each sync for the same steps and examples on 8 simulated devices, 5 seeds;
the held-out accuracy of the replicas' mean model. Target: the partition within
1% of full sync.

Part 3, hierarchical: the same model on a one-process `(2, 4)` layout (2
"hosts" of 4 devices), `jdp.all_reduce(axis_name="device")` every step with
`jdp.bmuf(adam, sync_period=16, axis_name="host")`: the bytes within hosts and
across hosts per step, told apart by the collectives' replica groups, against
the flat all-reduce's.

    python benchmarks/hierarchical.py [--vocab 50000] [--quality-vocab 5000]
        [--steps 2048] [--seeds 5] [--quick]
"""

from __future__ import annotations

import argparse
import time

from _common import set_devices

H = 16
DIM, HIDDEN, CLASSES, BAG = 64, 64, 10, 8


def params_of(vocab, key):
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k1, (vocab, DIM)) * 0.1,
        "head": {
            "w1": jax.random.normal(k2, (DIM, HIDDEN)) / jnp.sqrt(DIM),
            "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k3, (HIDDEN, CLASSES)) / jnp.sqrt(HIDDEN),
            "b2": jnp.zeros(CLASSES),
        },
    }


LABELS = {"embed": "embed", "head": "dense"}


def logits_of(params, ids):
    import jax

    h = params["embed"][ids].mean(axis=1)
    head = params["head"]
    h = jax.nn.relu(h @ head["w1"] + head["b1"])
    return h @ head["w2"] + head["b2"]


def loss_fn(params, batch):
    import optax

    logits = logits_of(params, batch["ids"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def variants(lr=1e-2):
    import optax

    import jdp

    adam = optax.adam(lr)
    full = (adam, jdp.all_reduce())
    tx = optax.multi_transform(
        {
            "dense": adam,
            "embed": jdp.bmuf(
                adam, H, outer=jdp.block_momentum(momentum=0.9, nesterov=True)
            ),
        },
        LABELS,
    )
    sync = jdp.partition(LABELS, {"dense": jdp.all_reduce(), "embed": jdp.local()})
    return {"full sync": full, "partition (embed bmuf 16)": (tx, sync)}


def step_bytes(step, state, batch):
    """(every-step bytes, conditional bytes) of the compiled step."""
    ops = step.collectives(state, batch)
    every = sum(c.bytes for c in ops if not c.in_conditional)
    cond = sum(c.bytes for c in ops if c.in_conditional)
    return every, cond, ops


def part_bytes(vocab, devices):
    import jax
    import jax.numpy as jnp

    import jdp

    params = params_of(vocab, jax.random.key(0))
    embed = params["embed"].size * 4
    dense = sum(x.size * 4 for x in jax.tree.leaves(params["head"]))
    batch = {
        "ids": jnp.zeros((8 * devices, BAG), jnp.int32),
        "y": jnp.zeros(8 * devices, jnp.int32),
    }
    print(f"\n## Part 1: bytes per step, {devices} devices, vocab {vocab}")
    rows, metric = [], None
    for name, (tx, sync) in variants().items():
        step = jdp.parallelize(
            jdp.make_train_step(loss_fn, tx, sync=sync),
            devices=jax.devices()[:devices],
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        every, cond, _ = step_bytes(step, state, step.shard(batch))
        if metric is None:  # full sync: the gradients and the metrics, every step
            metric = every - dense - embed
            expected = every
        else:
            expected = dense + metric + embed / H
        rows.append((name, every, cond, every + cond / H, expected))
    print(f"embedding {embed} B, dense head {dense} B, metrics {metric} B\n")
    print(
        "| sync | every step (B) | sync branch (B) | mean per step (B) | expected (B) |"
    )
    print("|---|---|---|---|---|")
    for name, every, cond, mean, expected in rows:
        print(f"| {name} | {every} | {cond} | {mean:.1f} | {expected:.1f} |")
        assert mean == expected, (name, mean, expected)


def part_quality(vocab, devices, steps, seeds):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jdp

    def task(seed):
        rng = np.random.default_rng(1000 + seed)
        # Zipf-like ids: a few frequent ids, a long tail.
        p = 1.0 / np.arange(1, vocab + 1) ** 1.1
        p /= p.sum()
        teacher_embed = rng.normal(size=(vocab, 16)).astype(np.float32)
        teacher_w = rng.normal(size=(16, CLASSES)).astype(np.float32)

        def draw(n):
            ids = rng.choice(vocab, size=(n, BAG), p=p).astype(np.int32)
            y = np.argmax(teacher_embed[ids].mean(axis=1) @ teacher_w, axis=1)
            return {"ids": ids, "y": y.astype(np.int32)}

        return draw

    print(f"\n## Part 2: quality, {devices} devices, vocab {vocab}, {steps} steps")
    print(f"held-out accuracy of the replicas' mean model, {seeds} seeds\n")
    per_batch = 16 * devices
    results = {name: [] for name in variants()}
    for seed in range(seeds):
        draw = task(seed)
        batches = [draw(per_batch) for _ in range(steps)]
        test = draw(4096)
        params = params_of(vocab, jax.random.key(seed))
        for name, (tx, sync) in variants().items():
            step = jdp.parallelize(
                jdp.make_train_step(loss_fn, tx, sync=sync),
                devices=jax.devices()[:devices],
            )
            state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
            for batch in batches:
                state, _ = step(state, step.shard(batch))
            mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), state.params)
            pred = np.argmax(logits_of(mean, test["ids"]), axis=1)
            results[name].append(float(np.mean(pred == test["y"])))
    print("| sync | " + " | ".join(f"seed {s}" for s in range(seeds)) + " | mean |")
    print("|---|" + "---|" * (seeds + 1))
    for name, accs in results.items():
        cells = " | ".join(f"{a:.4f}" for a in accs)
        print(f"| {name} | {cells} | {np.mean(accs):.4f} |")
    full, part = (np.mean(v) for v in results.values())
    print(f"\npartition / full sync: {part / full:.4f} (target: within 1%)")


def part_hierarchical(vocab):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    params = params_of(vocab, jax.random.key(0))
    total = sum(x.size * 4 for x in jax.tree.leaves(params))
    adam = optax.adam(1e-2)
    hosts = np.array(jax.devices()[:8]).reshape(2, 4)
    batch = {"ids": jnp.zeros((64, BAG), jnp.int32), "y": jnp.zeros(64, jnp.int32)}
    print(f"\n## Part 3: hierarchical on a (2, 4) layout, vocab {vocab}")
    print(f"parameters {total} B; bytes per step (mean over a block of {H})\n")
    print(
        "| schedule | within hosts (B/step) | across hosts (B/step) | all 8 (B/step) |"
    )
    print("|---|---|---|---|")
    rows = {
        "flat all-reduce (8 devices)": (
            adam,
            jdp.all_reduce(),
            jax.devices()[:8],
            "data",
        ),
        "host mesh all-reduce": (adam, jdp.all_reduce(), hosts, ("host", "device")),
        "hierarchical (device every step, host bmuf 16)": (
            jdp.bmuf(adam, sync_period=H, axis_name="host"),
            jdp.all_reduce(axis_name="device"),
            hosts,
            ("host", "device"),
        ),
    }
    for name, (tx, sync, devices, axis) in rows.items():
        step = jdp.parallelize(
            jdp.make_train_step(loss_fn, tx, sync=sync), devices=devices, axis_name=axis
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        _, _, ops = step_bytes(step, state, step.shard(batch))
        where = {"within": 0.0, "across": 0.0, "all": 0.0}
        for c in ops:
            size = len(c.replica_groups[0])
            key = {4: "within", 2: "across", 8: "all"}[size]
            where[key] += c.bytes / (H if c.in_conditional else 1)
        print(
            f"| {name} | {where['within']:.0f} | {where['across']:.0f} | "
            f"{where['all']:.0f} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--quality-vocab", type=int, default=5_000)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2048)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer steps and seeds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds = 64, 2
    if args.steps % H:
        parser.error(
            f"--steps must be a multiple of {H} (the models are compared synced)"
        )
    set_devices(max(args.devices, 8))
    start = time.perf_counter()
    part_bytes(args.vocab, args.devices)
    part_hierarchical(args.vocab)
    part_quality(args.quality_vocab, args.devices, args.steps, args.seeds)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
