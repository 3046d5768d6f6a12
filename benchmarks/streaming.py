"""Streaming DiLoCo in `jdp.bmuf`: bytes per step, and quality against F = 1.

Part 1, bytes: the MLP 256-2048-2048-2048-10 (8.94M parameters) on simulated CPU
devices, `sync_period=16`, for BMUF (the whole model every 16 steps), and
`streaming=jdp.Streaming(fragments=4, delay=d)` with `d=0` and `d=4`. The bytes
come from the compiled program (`step.collectives`): the every-step collectives
(the loss metric) plus the conditional ones, each of which sits in a branch that
runs once per cycle of 16 steps (the block sync; one fragment sync each; one
chunk each), so the mean per step is `every-step + sum(conditional) / 16` and
the peak step `every-step + max(conditional)`. Targets: mean = |Θ|·4/H within 1%; peak
<= 1.1·|Θ|·4/F with delay 0 and <= 1.1·|Θ|·4/H with delay = H/F.

Part 2, quality: a deterministic synthetic-teacher regression (a fixed random
tanh MLP 32-128-128-8 labels Gaussian inputs, plus noise), a student of the same
shape on 8 simulated devices, inner Adam, DiLoCo's outer Nesterov SGD, the same
`sync_period` and examples for every variant: F = 1 against F = 4 with delay in
{0, 1} and mix in {0, 0.5}. The loss of the global model
(`jdp.bmuf_global_params`) on 4096 held-out examples after the last step.

Part 3 (`--time-rig`), step times across processes: 2 processes x 1 CPU device
joined over gloo by `jdp.launch.run` (127.0.0.1), each pinned to one core, train
the part-1 MLP (8 examples per process per step, inner SGD) with the local step
(no communication, the floor), the synchronous step (`jdp.all_reduce()`), BMUF,
DiLoCo (outer Nesterov SGD), F=4 with delay 0, 1 and 4 (H=16), Streaming
DiLoCo (F=4, delay 1, outer Nesterov SGD), one cycle of 16 steps each in turn,
in a shuffled order, every step timed on its own (waiting for its loss).
Reported: p50, p99 and the largest step time over the timed cycles (the first
cycle, which compiles, is not timed), and the mean.

    python benchmarks/streaming.py [--devices 8] [--steps 2048] [--quick]
        [--time-rig] [--rig-cycles 20] [--rig-only]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _common import normal_mlp as init
from _common import pin_to_core, set_devices, tanh_mlp

H, F = 16, 4
RIG_SIZES = (256, 2048, 2048, 2048, 10)
RIG_CONFIGS = {
    "local step": None,
    "synchronous": "all_reduce",
    "BMUF (F=1)": {},
    "DiLoCo (F=1)": {"outer": "nesterov"},
    # `jdp.Streaming(fragments, delay)`, built once jdp is imported.
    "F=4 delay=0": {"streaming": (F, 0)},
    "F=4 delay=1": {"streaming": (F, 1)},
    "F=4 delay=4": {"streaming": (F, H // F)},
    "DiLoCo F=4 d=1": {"streaming": (F, 1), "outer": "nesterov"},  # Streaming
}


def rig_worker(cycles: int, seed: int) -> dict:
    """Runs in each of the 2 processes: every configuration, a cycle at a time."""
    pin_to_core(True)
    import random

    import jax
    import numpy as np
    import optax

    import jdp

    params = init(RIG_SIZES, seed)
    inner = optax.sgd(0.01)
    run = {}
    for name, kw in RIG_CONFIGS.items():
        sync = jdp.all_reduce() if kw == "all_reduce" else jdp.local()
        if isinstance(kw, dict) and kw.get("outer") == "nesterov":  # DiLoCo's
            kw = {**kw, "outer": optax.sgd(0.7, momentum=0.9, nesterov=True)}
        if isinstance(kw, dict) and "streaming" in kw:
            kw = {**kw, "streaming": jdp.Streaming(*kw["streaming"])}
        tx = inner if not isinstance(kw, dict) else jdp.bmuf(inner, sync_period=H, **kw)
        step = jdp.parallelize(jdp.make_train_step(mse, tx, sync=sync))
        run[name] = [step, step.replicate(jdp.TrainState.create(params=params, tx=tx))]
    r = jax.process_index()
    data = np.random.default_rng(seed + 1 + r)
    batches = [
        run["local step"][0].shard(
            {
                "x": data.normal(size=(8, RIG_SIZES[0])).astype(np.float32),
                "y": data.normal(size=(8, RIG_SIZES[-1])).astype(np.float32),
            }
        )
        for _ in range(H)
    ]
    times = {name: [] for name in RIG_CONFIGS}
    shuffle = random.Random(seed).shuffle
    for c in range(cycles + 1):
        names = list(RIG_CONFIGS)
        shuffle(names)
        for name in names:
            step, state = run[name]
            for batch in batches:
                start = time.perf_counter()
                state, metrics = step(state, batch)
                float(metrics["loss"])
                if c:  # the first cycle compiles
                    times[name].append(1e3 * (time.perf_counter() - start))
            run[name][1] = state
    return {"times": times}


def mse(params, batch):
    import jax.numpy as jnp

    return jnp.mean((tanh_mlp(params, batch["x"]) - batch["y"]) ** 2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2048, help="part 2's steps")
    parser.add_argument(
        "--quick", action="store_true", help="MLP width 512, 128 steps in part 2"
    )
    parser.add_argument(
        "--time-rig", action="store_true", help="part 3: 2 processes over gloo"
    )
    parser.add_argument("--rig-cycles", type=int, default=20)
    parser.add_argument(
        "--rig-only", action="store_true", help="part 3 alone (implies --time-rig)"
    )
    parser.add_argument("--quality-only", action="store_true", help="part 2 alone")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="part 2")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="part 2")
    args = parser.parse_args(argv)
    if args.rig_only:
        time_rig(args.rig_cycles)
        return
    if "jax" not in sys.modules:
        set_devices(args.devices)

    import jax

    devices = jax.devices()[: args.devices]

    if not args.quality_only:
        bytes_per_step(args, devices)
    quality(args, devices)
    if args.time_rig:
        time_rig(args.rig_cycles)


def bytes_per_step(args, devices) -> None:
    """Part 1: the bytes of every step of a cycle, from the compiled program."""
    import jax
    import numpy as np
    import optax

    import jdp

    n = len(devices)
    # -- part 1: bytes from the compiled program --------------------------------
    width = 512 if args.quick else 2048
    sizes = (256, width, width, width, 10)
    params = init(sizes, 0)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    theta = 4 * num_params
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(2 * n, sizes[0])).astype(np.float32),
        "y": rng.normal(size=(2 * n, sizes[-1])).astype(np.float32),
    }
    variants = [
        ("BMUF (F=1)", {}, theta / 1, 1),
        ("F=4, delay=0", {"streaming": jdp.Streaming(F, delay=0)}, theta / F, F),
        ("F=4, delay=4", {"streaming": jdp.Streaming(F, delay=H // F)}, theta / H, H),
    ]
    print(
        f"Bytes per step from the compiled program: {n} simulated CPU devices, "
        f"jax {jax.__version__}, MLP {'-'.join(map(str, sizes))} = "
        f"{num_params / 1e6:.2f}M params (|Θ|·4 = {theta / 2**20:.2f} MiB), "
        f"sync_period H={H}\n"
    )
    head = (
        f"{'variant':<14} {'branches':>8} {'mean MiB':>9} {'mean/(|Θ|·4/H)':>15} "
        f"{'peak MiB':>9} {'peak bound MiB':>15} {'peak/bound':>10}"
    )
    print(head)
    print("-" * len(head))
    for name, kw, bound, want_branches in variants:
        tx = jdp.bmuf(optax.sgd(0.01), sync_period=H, **kw)
        step = jdp.parallelize(
            jdp.make_train_step(mse, tx, sync=jdp.local()), devices=devices
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        ops = step.collectives(state, step.shard(batch))
        every = sum(c.bytes for c in ops if not c.in_conditional)
        branch = [c.bytes for c in ops if c.in_conditional]
        mean = every + sum(branch) / H
        peak = every + max(branch)
        print(
            f"{name:<14} {len(branch):>5}/{want_branches:<2} {mean / 2**20:>9.4f} "
            f"{mean / (theta / H):>15.4f} {peak / 2**20:>9.4f} "
            f"{1.1 * bound / 2**20:>15.4f} {peak / (1.1 * bound):>10.4f}"
        )
        del state, step
    print(
        "\nbranches: conditional all-reduces in the compiled step / the number the "
        "schedule runs once per cycle of H steps (1 block sync; F fragment syncs; "
        "F·delay chunks). mean: bytes per step over a cycle, every-step "
        "collectives (the 8-byte loss metric) plus the conditional ones / H; "
        "mean/(|Θ|·4/H): target 1 ± 1%. peak: the step with the largest "
        "all-reduce; peak bound: 1.1·|Θ|·4 / (1, F, H): 1.1x one fragment "
        "with delay 0, 1.1x one H-th of the model with delay = H/F.\n"
    )


def quality(args, devices) -> None:
    """Part 2: the held-out loss of the global model against F = 1."""
    import jax
    import numpy as np
    import optax

    import jdp

    n = len(devices)
    # -- part 2: quality against F = 1 ------------------------------------------
    steps = 128 if args.quick else args.steps
    steps -= steps % H
    teacher = init((32, 128, 128, 8), 10)
    for i, layer in enumerate(teacher):  # some curvature: larger weights, biases
        layer["w"] = 2.0 * layer["w"]
        layer["b"] = 0.5 * np.random.default_rng(11 + i).normal(size=layer["b"].shape)
        layer["b"] = layer["b"].astype(np.float32)
    teach = jax.jit(lambda x: tanh_mlp(teacher, x))

    def data(seed, size):
        r = np.random.default_rng(seed)
        x = r.normal(size=(size, 32)).astype(np.float32)
        y = np.asarray(teach(x)) + 0.05 * r.normal(size=(size, 8)).astype(np.float32)
        return {"x": x, "y": y.astype(np.float32)}

    per_step = 32 * n
    batches = [data(1000 + i, per_step) for i in range(steps)]
    held_out = data(7, 4096)
    student0 = init((32, 128, 128, 8), 20)
    quality = [
        ("F=1", {}),
        ("F=4 delay=0 mix=0", {"streaming": jdp.Streaming(F, delay=0, mix=0.0)}),
        ("F=4 delay=0 mix=0.5", {"streaming": jdp.Streaming(F, delay=0, mix=0.5)}),
        ("F=4 delay=1 mix=0", {"streaming": jdp.Streaming(F, delay=1, mix=0.0)}),
        ("F=4 delay=1 mix=0.5", {"streaming": jdp.Streaming(F, delay=1, mix=0.5)}),
    ]
    print(
        f"Quality: teacher MLP 32-128-128-8 regression, student of the same shape, "
        f"{n} replicas x 32 examples per step, {steps} steps ({steps * per_step} "
        f"examples), H={H}, inner optax.adam(3e-3), outer "
        f"optax.sgd({args.outer_lr:g}"
        + (
            f", momentum={args.outer_momentum:g}, nesterov=True)"
            if args.outer_momentum
            else ")"
        )
        + "; held-out MSE of the global model (4096 examples; the label noise "
        "alone is 0.0025)\n"
    )
    print(f"initial model's MSE: {float(mse(student0, held_out)):.5f}\n")
    head = f"{'variant':<22} {'MSE':>9} {'vs F=1':>8} {'s':>6}"
    print(head)
    print("-" * len(head))
    base = None
    for name, kw in quality:
        tx = jdp.bmuf(
            optax.adam(3e-3),
            sync_period=H,
            outer=optax.sgd(
                args.outer_lr, momentum=args.outer_momentum or None, nesterov=True
            ),
            **kw,
        )
        step = jdp.parallelize(
            jdp.make_train_step(mse, tx, sync=jdp.local()), devices=devices
        )
        state = step.replicate(jdp.TrainState.create(params=student0, tx=tx))
        start = time.perf_counter()
        for b in batches:
            state, _ = step(state, step.shard(b))
        g = step.unreplicate(jdp.bmuf_global_params(state))
        loss = float(mse(g, held_out))
        base = loss if base is None else base
        print(
            f"{name:<22} {loss:>9.5f} {loss / base:>8.4f} "
            f"{time.perf_counter() - start:>6.1f}"
        )
    print(
        "\nvs F=1: the held-out MSE over F=1's (same H, same examples, same initial "
        "model and batches). s: seconds for the run, compile included."
    )


def time_rig(cycles: int) -> None:
    """Part 3: per-step times across 2 processes (gloo), p50 / p99 / max."""
    import numpy as np

    import jdp.launch

    out = jdp.launch.run(
        rig_worker,
        2,
        args=(cycles, 0),
        devices_per_process=1,
        timeout_s=1800,
        quiet=True,
    )
    times = {name: [] for name in RIG_CONFIGS}
    for proc in out:  # a step's time is the slower process's
        for name, ms in proc["times"].items():
            times[name].append(ms)
    print(
        f"\nStep times across 2 processes x 1 CPU device (gloo, 127.0.0.1, one core "
        f"each), MLP {'-'.join(map(str, RIG_SIZES))}, 8 examples per process per "
        f"step, inner optax.sgd, H={H}; {cycles} timed cycles of {H} steps per "
        "variant, interleaved\n"
    )
    head = (
        f"{'variant':<14} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8} "
        f"{'mean/local':>10} {'mean/floor':>10} {'p99/local':>9}"
    )
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    print(
        "glibc malloc: "
        + (
            f"MALLOC_MMAP_THRESHOLD_={threshold} (buffers up to it come from the heap)"
            if threshold
            else "default (a buffer over 32 MiB is fresh mmap'ed pages on every step)"
        )
        + "\n"
    )
    print(head)
    print("-" * len(head))
    steps = {name: np.max(np.asarray(p), axis=0) for name, p in times.items()}
    local = float(np.mean(steps["local step"]))
    # The floor of a variant that moves the model once per H steps: the local
    # step plus an H-th of the synchronous step's all-reduce.
    floor = local + (float(np.mean(steps["synchronous"])) - local) / H
    for name, ms in steps.items():
        mean = float(np.mean(ms))
        ratio = mean / floor if isinstance(RIG_CONFIGS[name], dict) else float("nan")
        print(
            f"{name:<14} {np.percentile(ms, 50):>8.1f} {np.percentile(ms, 99):>8.1f} "
            f"{ms.max():>8.1f} {mean:>8.1f} {mean / local:>10.3f} {ratio:>10.3f} "
            f"{np.percentile(ms, 99) / local:>9.2f}"
        )
    print(
        f"\nfloor: the local step's mean plus 1/{H} of the synchronous step's "
        f"extra time (one all-reduce of the model per {H} steps): {floor:.1f} ms. "
        "p99/local: the p99 over the local step's mean."
    )
    print(
        "\nEach step's time is the larger of the two processes'. XLA:CPU is not "
        "expected to overlap a collective with the step's compute, so what "
        "streaming can change here is the spread of the step times and the peak "
        "step, not the mean."
    )


if __name__ == "__main__":
    main()
