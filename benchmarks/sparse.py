"""Sparse vs dense embedding gradients: bytes communicated per step and step time.

A recommender-style model (an embedding table of R x 64 plus a small MLP) trained
with SGD on 8 simulated CPU devices at a global batch of 1024 (one id per
example, uniform over the table: the worst case for sparsity). The dense path is
`jdp.make_train_step` (the table's gradient is a dense R x 64 array, all-reduced);
the sparse path is `jdp.make_train_step(..., sync=jdp.sparse.rows())` (ids and
row gradients are all-gathered and applied to the touched rows only).

Bytes are read from the compiled HLO (`step.collectives`, sum of every
collective's logical buffer). The physical limit for the table's traffic is
`touched rows / table rows` of the dense traffic: the table rows that changed.

Run: `python benchmarks/sparse.py [--rows 100000 1000000] [--steps 3]`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

_flags = re.sub(
    r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
)
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402

DIM = 64
HIDDEN = 64
BATCH = 1024
LR = 0.1


def init_params(rows: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "embed": (0.01 * rng.standard_normal((rows, DIM), dtype=np.float32)),
        "mlp": {
            "w1": rng.standard_normal((DIM, HIDDEN), dtype=np.float32) / 8,
            "b1": np.zeros(HIDDEN, np.float32),
            "w2": rng.standard_normal((HIDDEN, 1), dtype=np.float32) / 8,
            "b2": np.zeros(1, np.float32),
        },
    }


def loss_fn(params, batch):
    x = jdp.sparse.lookup(params["embed"], batch["ids"])
    h = jnp.tanh(x @ params["mlp"]["w1"] + params["mlp"]["b1"])
    pred = (h @ params["mlp"]["w2"] + params["mlp"]["b2"])[:, 0]
    return jnp.mean((pred - batch["y"]) ** 2)


def make_batches(rows: int, n: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "ids": rng.integers(0, rows, size=BATCH).astype(np.int32),
            "y": rng.standard_normal(BATCH).astype(np.float32),
        }
        for _ in range(n)
    ]


def measure(train_step, tx, params, batches, steps):
    step = jdp.parallelize(train_step)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    placed = [step.shard(b) for b in batches]
    ops = step.collectives(state, placed[0])
    comm = sum(c.bytes for c in ops)
    kinds = sorted({c.kind for c in ops})
    state, metrics = step(state, placed[0])  # compile
    jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, placed[i % len(placed)])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    loss = float(metrics["loss"])
    del state
    return comm, kinds, times, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10**5, 10**6])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices, "
        f"table R x {DIM} f32, global batch {BATCH}, {args.steps} timed steps"
    )
    header = (
        f"{'rows':>9} {'path':<15} {'bytes/step':>12} {'vs dense':>9} "
        f"{'limit':>8} {'vs limit':>9} {'step ms (median, min-max)':>27} "
        f"{'speedup':>8}  collectives"
    )
    print(header)
    print("-" * len(header))
    for rows in args.rows:
        params = init_params(rows)
        batches = make_batches(rows, min(args.steps, 4))
        touched = statistics.mean(len(np.unique(b["ids"])) for b in batches)
        limit = touched / rows
        sparse_tx = jdp.sparse.optimizer(optax.sgd(LR), {"embed": jdp.sparse.sgd(LR)})
        variants = [
            ("dense", jdp.make_train_step(loss_fn, optax.sgd(LR)), optax.sgd(LR)),
            (
                "sparse",
                jdp.make_train_step(loss_fn, sparse_tx, sync=jdp.sparse.rows()),
                sparse_tx,
            ),
            (
                "sparse+combine",
                jdp.make_train_step(
                    loss_fn, sparse_tx, sync=jdp.sparse.rows(combine=True)
                ),
                sparse_tx,
            ),
        ]
        dense_bytes = dense_ms = None
        for name, train_step, tx in variants:
            comm, kinds, times, _ = measure(train_step, tx, params, batches, args.steps)
            ms = [1e3 * t for t in times]
            med = statistics.median(ms)
            if dense_bytes is None:
                dense_bytes, dense_ms = comm, med
            ratio = comm / dense_bytes
            print(
                f"{rows:>9} {name:<15} {comm:>12,} {ratio:>9.4f} {limit:>8.4f} "
                f"{ratio / limit:>9.2f} {med:>10.1f} ({min(ms):.1f}-{max(ms):.1f})"
                f"{'':>6} {dense_ms / med:>7.1f}x  {','.join(kinds)}"
            )
        del params
    print(
        "\nvs dense: bytes / dense bytes. limit: touched rows / table rows (the "
        "fraction of the table that changes). vs limit: (vs dense) / limit; 1.0 "
        "is the physical limit, the excess is the ids and the MLP's all-reduce."
    )


if __name__ == "__main__":
    main()
