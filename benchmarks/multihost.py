"""Several processes on one machine: jdp over gloo, against 1 process and torch DDP.

Every configuration trains the same MLP (width 512 x depth 4, 1.05 M params, f32)
with SGD on the same global batch (256 examples), in fresh processes started by
`jdp.launch.run`, on 127.0.0.1:

- `1 proc x 2 dev`: one process, 2 simulated CPU devices (`jdp.parallelize`).
- `2 proc x 1 dev, jdp`: two processes joined by `jdp.distributed.initialize`
  (gloo), `jdp.make_train_step` as shipped (bucketed all-reduce, 25 MiB buckets,
  sent as flat buffers across CPU processes). The batch is placed once; the
  `+ step.shard` row places it every step, as a training loop does, which adds
  `shard`'s cross-process batch-size check (one small all-gather).
- `... per-leaf buckets`: `bucket_bytes=1`, one bucket (one array) per gradient
  leaf: the gradient tree as XLA sends it without bucketing.
- `... lax.pmean tree`: the hand-written recipe, `lax.pmean(grads)`.
- `... one flat buffer`: hand-written `ravel_pytree(grads)` + one `pmean`: the
  fastest way to send the gradients through JAX's gloo (PLATFORM.md).
- `torch DDP gloo`: PyTorch DistributedDataParallel, 2 ranks (if torch imports).

All start from the same weights, so the final losses agree across frameworks.
Two-process rows pin each process to one core (as `torch.set_num_threads(1)` does
for DDP) unless `--no-pin`. Each configuration runs `--rounds` times in fresh
processes, interleaved; the table gives the median of the per-run median step
times and their range, then ratios. This is a 2-core machine: two processes (or two
simulated devices) share the cores a single device would use, so these rows measure
what data parallelism costs on one host, not a speed-up.

    python benchmarks/multihost.py [--rounds 3] [--steps 30] [--no-pin] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import mlp_loss

WIDTH, DEPTH, GLOBAL_BATCH = 512, 4, 256
LR = 1e-3


def _pin(pin: bool) -> None:
    if pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        rank = int(os.environ.get("JDP_PROCESS_ID", "0"))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _data(seed: int = 0):
    """The global batch and the initial weights, shared by JAX and torch."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(GLOBAL_BATCH, WIDTH)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, WIDTH)).astype(np.float32)
    weights = [
        (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        for _ in range(DEPTH)
    ]
    return x, y, weights


def jax_step_times(kind: str, steps: int, warmup: int, pin: bool) -> dict:
    """Runs in every process: median step time (ms) of one JAX configuration."""
    _pin(pin)
    import jax
    import numpy as np
    import optax
    from jax import lax
    from jax.flatten_util import ravel_pytree

    import jdp

    loss_fn = mlp_loss

    x, y, weights = _data()
    params = [{"w": w, "b": np.zeros(WIDTH, np.float32)} for w in weights]
    tx = optax.sgd(LR)

    def hand_written(reduce):
        def train_step(state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
            return state.apply_gradients(grads=reduce(grads)), {"loss": loss}

        return train_step

    def flat_pmean(grads):
        flat, unravel = ravel_pytree(grads)
        return unravel(lax.pmean(flat, "data"))

    train_step = {
        "jdp": jdp.make_train_step(loss_fn, tx),
        "jdp+shard": jdp.make_train_step(loss_fn, tx),
        "per-leaf": jdp.make_train_step(loss_fn, tx, bucket_bytes=1),
        "tree": hand_written(lambda g: lax.pmean(g, "data")),
        "flat": hand_written(flat_pmean),
    }[kind]
    step = jdp.parallelize(train_step)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    n, r = jax.process_count(), jax.process_index()
    share = slice(r * GLOBAL_BATCH // n, (r + 1) * GLOBAL_BATCH // n)
    local = {"x": x[share], "y": y[share]}
    batch = step.shard(local)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        if kind == "jdp+shard":  # includes the cross-process batch-size check
            batch = step.shard(local)
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    ops = step.collectives(state, batch)
    return {
        "ms": 1e3 * statistics.median(times),
        "loss": loss,
        "arrays": sum(len(c.shapes) for c in ops if c.kind == "all-reduce"),
    }


def torch_step_times(steps: int, warmup: int, pin: bool) -> dict:
    """Runs in every process: PyTorch DDP (gloo) on the same MLP and batch."""
    _pin(pin)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    rank = int(os.environ["JDP_PROCESS_ID"])
    world = int(os.environ["JDP_NUM_PROCESSES"])
    host, port = os.environ["JDP_COORDINATOR_ADDRESS"].rsplit(":", 1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world
    )
    try:
        torch.manual_seed(0)
        layers = []
        for i in range(DEPTH):
            layers.append(torch.nn.Linear(WIDTH, WIDTH))
            if i < DEPTH - 1:
                layers.append(torch.nn.ReLU())
        x, y, weights = _data()
        with torch.no_grad():
            for layer, w in zip(layers[::2], weights, strict=True):
                layer.weight.copy_(torch.from_numpy(w.T))  # torch computes x @ W.T
                layer.bias.zero_()
        model = DistributedDataParallel(torch.nn.Sequential(*layers))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        share = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        xb, yb = torch.from_numpy(x[share]), torch.from_numpy(y[share])
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = torch.mean((model(xb) - yb) ** 2)
            loss.backward()
            opt.step()
            value = float(loss)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        # Report the global-batch loss, as jdp's averaged metric does.
        total = torch.tensor([value])
        dist.all_reduce(total)
        return {"ms": 1e3 * statistics.median(times), "loss": total.item() / world}
    finally:
        dist.destroy_process_group()


CONFIGS = {
    # name: (function, num_processes, devices per process, initialize, kind, pinned)
    "1 proc x 2 dev (jdp)": ("jax", 1, 2, False, "jdp", False),
    "2 proc x 1 dev, jdp": ("jax", 2, 1, True, "jdp", True),
    "2 proc x 1 dev, jdp + step.shard": ("jax", 2, 1, True, "jdp+shard", True),
    "2 proc x 1 dev, per-leaf buckets": ("jax", 2, 1, True, "per-leaf", True),
    "2 proc x 1 dev, lax.pmean tree": ("jax", 2, 1, True, "tree", True),
    "2 proc x 1 dev, one flat buffer": ("jax", 2, 1, True, "flat", True),
    "torch DDP gloo, 2 ranks x 1 thread": ("torch", 2, None, False, None, True),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 round, 10 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 10

    import jdp.launch

    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    names = [n for n in CONFIGS if have_torch or CONFIGS[n][0] != "torch"]
    runs = {name: [] for name in names}
    extra = {}
    for rnd in range(args.rounds):
        for name in names:
            what, num_processes, devices, initialize, kind, pinned = CONFIGS[name]
            pin = pinned and not args.no_pin
            if what == "jax":
                fn, fn_args = jax_step_times, (kind, args.steps, args.warmup, pin)
            else:
                fn, fn_args = torch_step_times, (args.steps, args.warmup, pin)
            out = jdp.launch.run(
                fn,
                num_processes,
                args=fn_args,
                devices_per_process=devices,
                initialize=initialize,
                timeout_s=600,
                quiet=True,
            )[0]
            runs[name].append(out["ms"])
            extra[name] = out
            print(
                f"  round {rnd + 1}/{args.rounds} {name}: {out['ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )

    med = {n: statistics.median(v) for n, v in runs.items()}
    print(
        f"\nMLP {WIDTH}x{DEPTH} (1.05 M params), global batch {GLOBAL_BATCH}, SGD; "
        f"{args.rounds} fresh runs x {args.steps} steps each; 2-process rows "
        f"{'pinned to 1 core each' if not args.no_pin else 'unpinned'}.\n"
    )
    header = f"{'configuration':38s} {'median ms':>10s} {'range ms':>15s} "
    header += f"{'arrays reduced':>15s} {'final loss':>11s}"
    print(header)
    print("-" * len(header))
    for name in names:
        lo, hi = min(runs[name]), max(runs[name])
        ops = extra[name].get("arrays", "-")
        print(
            f"{name:38s} {med[name]:10.1f} {f'{lo:.1f}-{hi:.1f}':>15s} "
            f"{ops!s:>15s} {extra[name]['loss']:11.6f}"
        )
    print()

    def ratio(a, b, label):
        if a in med and b in med:
            print(f"{label:74s} {med[a] / med[b]:5.2f}x")

    ratio(
        "2 proc x 1 dev, jdp",
        "1 proc x 2 dev (jdp)",
        "2 processes x 1 device / 1 process x 2 devices (jdp)",
    )
    ratio(
        "2 proc x 1 dev, jdp + step.shard",
        "2 proc x 1 dev, jdp",
        "step.shard every step (size check across processes) / batch placed once",
    )
    ratio(
        "2 proc x 1 dev, per-leaf buckets",
        "2 proc x 1 dev, jdp",
        "per-leaf buckets / jdp bucketed (bucket_bytes 1 B vs 25 MiB)",
    )
    ratio(
        "2 proc x 1 dev, lax.pmean tree",
        "2 proc x 1 dev, jdp",
        "lax.pmean gradient tree / jdp bucketed",
    )
    ratio(
        "2 proc x 1 dev, jdp",
        "2 proc x 1 dev, one flat buffer",
        "jdp bucketed / one flat buffer (1.0 = the flat-buffer rate)",
    )
    ratio(
        "2 proc x 1 dev, jdp",
        "torch DDP gloo, 2 ranks x 1 thread",
        "jdp 2 processes / torch DDP 2 ranks",
    )
    if not have_torch:
        print("torch is not installed: the PyTorch DDP row was skipped.")


if __name__ == "__main__":
    main()
