"""Streaming DiLoCo in `jdp.bmuf`: bytes per step, and quality against F = 1.

Part 1, bytes: the MLP 256-2048-2048-2048-10 (8.94M parameters) on simulated CPU
devices, `sync_period=16`, for BMUF (the whole model every 16 steps), and
`fragments=4` with `delay=0` and `delay=4`. The bytes come from the compiled
program (`step.collectives`): the every-step collectives (the loss metric) plus
the conditional ones, each of which sits in a branch that runs once per cycle of
16 steps (the block sync; one fragment sync each; one chunk each), so the mean
per step is `every-step + sum(conditional) / 16` and the peak step
`every-step + max(conditional)`. Targets: mean = |Θ|·4/H within 1%; peak
<= 1.1·|Θ|·4/F with delay 0 and <= 1.1·|Θ|·4/H with delay = H/F.

Part 2, quality: a deterministic synthetic-teacher regression (a fixed random
tanh MLP 32-128-128-8 labels Gaussian inputs, plus noise), a student of the same
shape on 8 simulated devices, inner Adam, DiLoCo's outer Nesterov SGD, the same
`sync_period` and examples for every variant: F = 1 against F = 4 with delay in
{0, 1} and mix in {0, 0.5}. The loss of the global model
(`jdp.bmuf_global_params`) on 4096 held-out examples after the last step.

    python benchmarks/streaming.py [--devices 8] [--steps 512] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import set_devices, tanh_mlp


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=512, help="part 2's steps")
    parser.add_argument(
        "--quick", action="store_true", help="MLP width 512, 128 steps in part 2"
    )
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:
        set_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    devices = jax.devices()[: args.devices]
    n = len(devices)
    H, F = 16, 4

    def init(sizes, seed):
        rng = np.random.default_rng(seed)
        return [
            {
                "w": (rng.normal(size=(m, k)) / np.sqrt(m)).astype(np.float32),
                "b": np.zeros(k, np.float32),
            }
            for m, k in zip(sizes[:-1], sizes[1:], strict=True)
        ]

    def mse(params, batch):
        return jnp.mean((tanh_mlp(params, batch["x"]) - batch["y"]) ** 2)

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
        ("F=4, delay=0", {"fragments": F, "delay": 0}, theta / F, F),
        ("F=4, delay=4", {"fragments": F, "delay": H // F}, theta / H, H),
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

    # -- part 2: quality against F = 1 ------------------------------------------
    steps = 128 if args.quick else args.steps
    steps -= steps % H
    teacher = init((32, 128, 128, 8), 10)
    for layer in teacher:  # a teacher with some curvature
        layer["w"] *= 2.0
        layer["b"] = np.random.default_rng(11).normal(size=layer["b"].shape) * 0.5
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
        ("F=4 delay=0 mix=0", {"fragments": F, "delay": 0, "mix": 0.0}),
        ("F=4 delay=0 mix=0.5", {"fragments": F, "delay": 0, "mix": 0.5}),
        ("F=4 delay=1 mix=0", {"fragments": F, "delay": 1, "mix": 0.0}),
        ("F=4 delay=1 mix=0.5", {"fragments": F, "delay": 1, "mix": 0.5}),
    ]
    print(
        f"Quality: teacher MLP 32-128-128-8 regression, student of the same shape, "
        f"{n} replicas x 32 examples per step, {steps} steps ({steps * per_step} "
        f"examples), H={H}, inner optax.adam(3e-3), outer "
        "optax.sgd(0.7, momentum=0.9, nesterov=True); held-out MSE of the global "
        "model (4096 examples; the label noise alone is 0.0025)\n"
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
            outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
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


if __name__ == "__main__":
    main()
