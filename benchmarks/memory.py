"""Per-device memory and step time of donation, remat and ZeRO, side by side.

An MLP (about 50M parameters by default) trained with Adam on 8 simulated CPU
devices. For each configuration the table gives XLA's memory analysis of the
compiled step per device (`step.memory_analysis`), the optimizer-state bytes one
device really holds (read from the arrays' addressable shards), and the median
step time (the fastest of several steps, taken round-robin across configurations)
relative to the plain step (donation on, no remat, full optimizer state on every
replica).

    python benchmarks/memory.py                 # ~50M parameters
    python benchmarks/memory.py --params 12e6   # lighter

On simulated CPU devices all replicas share the host's cores and memory, so step
times measure the extra work, not a network; collectives are memory copies.
"""

from __future__ import annotations

import argparse
import os
import re
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

MiB = 2**20


def mlp_sizes(num_params: float, depth: int, io: int) -> tuple[int, ...]:
    """Layer widths giving about `num_params` weights with `depth` hidden layers."""
    # depth - 1 square hidden matrices plus two io x hidden ones.
    a, b = depth - 1, 2 * io
    hidden = int((-b + (b * b + 4 * a * num_params) ** 0.5) / (2 * a))
    return (io,) + (hidden,) * depth + (io,)


def init_mlp(key, sizes):
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, sub = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": jax.random.normal(sub, (m, n), jnp.float32) / np.sqrt(m),
            "b": jnp.zeros(n, jnp.float32),
        }
    return params


def loss_fn(params, batch):
    x = batch["x"]
    n = len(params)
    for i in range(n):
        x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        if i < n - 1:
            x = jnp.tanh(x)
    return jnp.mean((x - batch["y"]) ** 2)


def device_bytes(tree) -> int:
    """Bytes of `tree` held by the first device (from addressable shards)."""
    device = jax.devices()[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


#: Rematerialisation is `jax.checkpoint` around the loss, with or without a policy.
REMAT_FULL = jax.checkpoint(loss_fn)
REMAT_DOTS = jax.checkpoint(loss_fn, policy=jax.checkpoint_policies.dots_saveable)

#: ZeRO: the benchmark's optimizer wrapped, fed each replica's own gradients.
ZERO = {"wrap_tx": jdp.zero, "sync": jdp.local()}

#: Per configuration: `make_train_step`'s options, plus the loss (`loss_fn` unless
#: given), `wrap_tx` applied to the benchmark's optimizer (for the step and its
#: state alike) and `parallelize`'s `donate_state` (True unless given).
CONFIGS = {
    "plain": {},
    "no donation": {"donate_state": False},
    "remat full": {"loss_fn": REMAT_FULL},
    "remat dots_saveable": {"loss_fn": REMAT_DOTS},
    "ZeRO": ZERO,
    "ZeRO + remat full": {**ZERO, "loss_fn": REMAT_FULL},
    "ZeRO, no donation": {**ZERO, "donate_state": False},
    "microbatches 2": {"microbatches": 2},
    "microbatches 8": {"microbatches": 8},
}


class Config:
    """One configuration: its step, memory figures and step times."""

    def __init__(self, name, options, params, tx, batch_np):
        options = dict(options)
        donate = options.pop("donate_state", True)
        loss = options.pop("loss_fn", loss_fn)
        tx = options.pop("wrap_tx", lambda tx: tx)(tx)
        self.name = name
        self.step = jdp.parallelize(
            jdp.make_train_step(loss, tx, **options), donate_state=donate
        )
        self.params, self.tx = params, tx
        self.batch = self.step.shard(batch_np)
        state = self.fresh_state()
        self.mem = self.step.memory_analysis(state, self.batch)
        self.opt = device_bytes(state.opt_state)
        self.times = []
        self.loss = None

    def fresh_state(self):
        return self.step.replicate(
            jdp.TrainState.create(params=self.params, tx=self.tx)
        )

    def time_steps(self, steps):
        """Runs one warm-up and `steps` timed steps on a fresh state, then frees it."""
        state, metrics = self.step(self.fresh_state(), self.batch)
        jax.block_until_ready((state, metrics))
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = self.step(state, self.batch)
            jax.block_until_ready((state, metrics))
            self.times.append(time.perf_counter() - start)
        self.loss = float(metrics["loss"])
        del state


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--io", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="config names")
    args = parser.parse_args()

    sizes = mlp_sizes(args.params, args.depth, args.io)
    params = init_mlp(jax.random.key(0), sizes)
    count = sum(x.size for x in jax.tree.leaves(params))
    tx = optax.adam(1e-4)
    rng = np.random.default_rng(0)
    batch_np = {
        "x": rng.normal(size=(args.batch, args.io)).astype(np.float32),
        "y": rng.normal(size=(args.batch, args.io)).astype(np.float32),
    }
    print(
        f"MLP {sizes}: {count / 1e6:.1f}M parameters ({4 * count / MiB:.0f} MiB "
        f"f32), Adam, {jax.device_count()} simulated CPU devices, global batch "
        f"{args.batch}, fastest of {args.rounds} x {args.steps} steps; jax "
        f"{jax.__version__}."
    )
    rows = [
        Config(name, options, params, tx, batch_np)
        for name, options in CONFIGS.items()
        if not args.only or name in args.only
    ]
    # Round-robin, so that a busy moment on a shared machine hits every config.
    for _ in range(args.rounds):
        for r in rows:
            r.time_steps(args.steps)
    for r in rows:
        r.time = min(r.times)
        print(f"  {r.name}: fastest {r.time:.3f} s/step, loss {r.loss:.6f}")

    base = next((r for r in rows if r.name == "plain"), rows[0])
    base_peak = base.mem.peak_bytes
    header = (
        "| config | opt state / device | arguments | outputs | aliased | temp | "
        "peak estimate | XLA peak | step time |"
    )
    print()
    print(header)
    print("|---" * 9 + "|")
    for r in rows:
        m = r.mem
        xla_peak = f"{m.xla_peak_bytes / MiB:.0f}" if m.xla_peak_bytes else "-"
        print(
            f"| {r.name} | {r.opt / MiB:.1f} (1/{base.opt / r.opt:.1f}) | "
            f"{m.argument_bytes / MiB:.0f} | {m.output_bytes / MiB:.0f} | "
            f"{m.alias_bytes / MiB:.0f} | {m.temp_bytes / MiB:.0f} | "
            f"{m.peak_bytes / MiB:.0f} ({m.peak_bytes / base_peak:.2f}x) | "
            f"{xla_peak} | {r.time / base.time:.2f}x |"
        )
    print(
        "\nMemory columns are MiB per device from XLA's analysis of the compiled step "
        "(peak estimate = arguments + outputs - aliased + temp; XLA's own peak on "
        "CPU leaves out temporaries). Step time is relative to `plain` "
        f"({base.time:.2f} s/step)."
    )


if __name__ == "__main__":
    main()
