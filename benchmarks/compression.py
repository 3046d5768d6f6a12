"""Compressed gradient exchanges: bytes, time across processes, and quality.

Three measurements, each printed as a Markdown table (`benchmarks/README.md`):

- `bytes`: the collectives of one train step of the 8.9M-parameter MLP
  (256-2048-2048-2048-10), read from the compiled program (`step.collectives`,
  scales included) on 2 and 8 simulated devices: float32 all-reduce, bf16,
  int8 and fp8 with error feedback, PowerSGD rank 1 and 4. Two columns: the
  logical buffer bytes NCCL's benchmarks quote (`Collective.bytes`), and the
  bytes each device sends with a bandwidth-optimal algorithm (NCCL's "bus
  bytes": an all-reduce sends 2(n-1)/n of its buffer, an all-gather, all-to-all
  or reduce-scatter (n-1)/n), which is what compression saves on a link.
- `time`: 2 processes x 1 CPU device over gloo (127.0.0.1, `jdp.launch.run`),
  each pinned to its own core before JAX starts (XLA sizes its CPU thread pool
  from the affinity mask; torch runs 1 thread), the MLP sweep of
  `multihost.py`: the local step (no communication), jdp's float32 step, bf16,
  int8 + error feedback, PowerSGD rank 4; a breakdown of the int8 step
  (quantise + dequantise alone, the int8 and the bf16 exchanges' collectives
  alone, the whole int8 exchange alone, without and with error feedback, its
  buffers carried from call to call); and, in two more processes if torch
  imports, PyTorch DDP in float32, with `powerSGD_hook` (rank 4) and with
  `bf16_compress_hook`.
- `quality`: 8 simulated devices, deterministic per seed: a synthetic-teacher
  MLP regression and the scikit-learn digits classifier, float32 against every
  compressed variant (and ablations without error feedback / warm start), final
  loss and accuracy over 5 seeds.

    python benchmarks/compression.py bytes
    python benchmarks/compression.py time [--rounds 3] [--steps 15] [--sizes 1M 8.9M]
    python benchmarks/compression.py quality [--seeds 5] [--steps 300]
    python benchmarks/compression.py [all] [--quick]     # all three
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _common import median_ms, mlp_loss, normal_mlp, pin_to_core, set_devices

# The models, data and optimizer of multihost.py's sweep, so the rows compare.
from multihost import (
    IN,
    LR,
    MOMENTUM,
    OUT,
    WIDTHS,
    _data,
    num_params,
    sizes_of,
)


def syncs(jdp, names):
    """The sync pieces compared, by row name."""
    made = {
        "f32": lambda: jdp.all_reduce(),
        "bf16": lambda: jdp.all_reduce(wire=jdp.wire.bf16()),
        "int8+EF": lambda: jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True),
        "int8": lambda: jdp.all_reduce(wire=jdp.wire.int8()),
        "fp8+EF": lambda: jdp.all_reduce(wire=jdp.wire.fp8(), error_feedback=True),
        "PowerSGD r1": lambda: jdp.powersgd(rank=1),
        "PowerSGD r4": lambda: jdp.powersgd(rank=4),
        "PowerSGD r4, no EF": lambda: jdp.powersgd(rank=4, error_feedback=False),
        "PowerSGD r4, no warm start": lambda: jdp.powersgd(rank=4, warm_start=False),
        "local": lambda: jdp.local(),
    }
    return {n: made[n]() for n in names}


# -- bytes ---------------------------------------------------------------------------

BYTES_ROWS = ["f32", "bf16", "int8+EF", "fp8+EF", "PowerSGD r1", "PowerSGD r4"]


def bus_bytes(collectives, num: int) -> float:
    factor = {"all-reduce": 2 * (num - 1) / num, "collective-permute": 1.0}
    return sum(c.bytes * factor.get(c.kind, (num - 1) / num) for c in collectives)


def measure_bytes(width: int = 2048) -> None:
    set_devices(8)
    import jax
    import numpy as np
    import optax

    import jdp

    rng = np.random.default_rng(0)
    s = sizes_of(width)
    params = [
        {"w": rng.normal(size=(a, b)).astype(np.float32), "b": np.zeros(b, np.float32)}
        for a, b in zip(s[:-1], s[1:], strict=True)
    ]
    tx = optax.sgd(LR, momentum=MOMENTUM)
    print(
        f"\n### Bytes per step, compiled program, MLP {'-'.join(map(str, s))} "
        f"({num_params(width) / 1e6:.1f}M parameters)\n"
    )
    print("| devices | sync | collectives (kind dtype) | buffer bytes | ratio "
          "| bytes sent per device | ratio |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|")
    for num in (2, 8):
        devices = jax.devices()[:num]
        batch = {
            "x": np.ones((num * 2, IN), np.float32),
            "y": np.zeros((num * 2, OUT), np.float32),
        }
        base = None
        for name, sync in syncs(jdp, BYTES_ROWS).items():
            step = jdp.parallelize(
                jdp.make_train_step(mlp_loss, tx, sync=sync), devices=devices
            )
            state = step.replicate(
                jdp.TrainState.create(params=params, tx=tx, sync=sync)
            )
            ops = step.collectives(state, step.shard(batch))
            # The loss metric's all-reduce (8 bytes) is not gradient traffic.
            grads = [c for c in ops if not (c.kind == "all-reduce" and c.bytes <= 16)]
            logical = sum(c.bytes for c in grads)
            sent = bus_bytes(grads, num)
            if base is None:
                base = (logical, sent)
            kinds = ", ".join(
                sorted({f"{c.kind} {c.dtype}" for c in grads}, key=str.lower)
            )
            print(
                f"| {num} | {name} | {kinds} | {logical / 1e6:.2f} MB | "
                f"{logical / base[0]:.3f} | {sent / 1e6:.2f} MB | "
                f"{sent / base[1]:.3f} |"
            )
            del state, step


# -- time across processes -----------------------------------------------------------

TIME_ROWS = ["local", "f32", "bf16", "int8+EF", "PowerSGD r4"]


def jax_job(width: int, steps: int, warmup: int):
    """Runs in both processes: median step time of each row, and the breakdown."""
    pin_to_core(True)  # before JAX starts: XLA sizes its pool from the mask
    import jax
    import numpy as np
    import optax

    import jdp

    jdp.distributed.initialize()
    weights, x, y = _data(width, jax.process_index())
    params = [{"w": w, "b": np.zeros(w.shape[1], np.float32)} for w in weights]
    local = {"x": x, "y": y}
    tx = optax.sgd(LR, momentum=MOMENTUM)
    out = {}
    for name, sync in syncs(jdp, TIME_ROWS).items():
        step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx, sync=sync))
        box = {
            "state": step.replicate(
                jdp.TrainState.create(params=params, tx=tx, sync=sync)
            )
        }
        batch = step.shard(local)

        def one(step=step, box=box, batch=batch):
            box["state"], metrics = step(box["state"], batch)
            box["loss"] = float(metrics["loss"])

        out[name] = {"ms": median_ms(one, steps, warmup), "loss": box["loss"]}
        ops = step.collectives(box["state"], batch)
        grads = [c for c in ops if not (c.kind == "all-reduce" and c.bytes <= 16)]
        out[name]["sent"] = bus_bytes(grads, len(jax.devices()))
        del box
    return out


def breakdown_job(width: int, steps: int, warmup: int):
    """Runs in both processes (a job of its own): the int8 exchange in parts."""
    pin_to_core(True)
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdp
    from jdp import _wire

    jdp.distributed.initialize()
    out = {}
    # The int8 step in parts, on a gradient-sized float32 vector.
    n = num_params(width)
    wire = jdp.wire.int8()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    num = len(jax.devices())
    size = -(-n // (num * wire.block_size)) * wire.block_size * num
    vec = jax.device_put(
        np.random.default_rng(2).normal(size=(num * size,)).astype(np.float32),
        NamedSharding(mesh, P("data")),
    )

    def shard(fn):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        )

    def codec(v):  # quantise and dequantise, no communication
        q, s = wire.encode(v)
        return wire.decode(q, s)

    # What the exchanges send, nothing else: int8 values and their scales, one
    # buffer each way; bf16's 2 bytes a value the same way.
    def sent(dtype, nbytes):
        per_device = nbytes // np.dtype(dtype).itemsize // num * num
        host = np.zeros(num * per_device, dtype)
        return jax.device_put(host, NamedSharding(mesh, P("data")))

    def collectives_only(q):
        if num == 2:  # as the exchange of two replicas: one all-gather
            return lax.all_gather(q, "data").sum(axis=0, dtype=q.dtype)
        got = lax.all_to_all(q.reshape(num, -1), "data", 0, 0, tiled=False)
        own = got.sum(axis=0, dtype=q.dtype)
        return lax.all_gather(own, "data").reshape(-1)

    def exchange(v):  # without error feedback
        return _wire.mean(v, wire=wire, axis_name="data")[0]

    def exchange_ef(v, error):  # the error buffers carried from call to call
        return _wire.mean(v, wire=wire, axis_name="data", error=error)

    error = jax.device_put(
        _wire.init_state(np.zeros(num * size, np.float32), wire),
        NamedSharding(mesh, P("data")),
    )
    ef = jax.jit(
        jax.shard_map(exchange_ef, mesh=mesh, in_specs=P("data"), out_specs=P("data")),
        donate_argnums=1,
    )
    box = {"error": error}

    def run_ef(v):
        mean, box["error"] = ef(v, box["error"])
        return mean

    int8_sent = sent(np.int8, int(size * wire.bytes_per_value))
    for name, fn, arg in [
        ("quantise+dequantise", shard(codec), vec),
        ("int8 collectives alone", shard(collectives_only), int8_sent),
        ("bf16 collectives alone", shard(collectives_only), sent(np.uint16, 2 * size)),
        ("int8 exchange alone", shard(exchange), vec),
        ("int8+EF exchange alone", run_ef, vec),
    ]:
        out[name] = {
            "ms": median_ms(
                lambda fn=fn, arg=arg: fn(arg).block_until_ready(), steps, warmup
            )
        }
    return out


#: PyTorch's hooks as registered plainly here, with DDP's default buckets:
#: `powerSGD_hook` aborts with gloo's "Received data size doesn't match expected
#: size" (a race between buckets: the ranks issue P and Q all-reduces in
#: different orders), and a CPU-only torch build refuses `bf16_compress_hook` at
#: registration (the check goes by the hook's name and the build, not by the
#: backend). Both run on gloo as `benchmarks/ddp_hooks.py` registers them (one
#: bucket or a waiting wrapper; a renamed wrapper), which is where jdp is
#: compared with them. `--torch-hooks` tries the plain registrations.
TORCH_VARIANTS = ("local", "ddp")
TORCH_HOOKS = ("powersgd", "bf16")


def torch_job(width: int, steps: int, warmup: int, variants=TORCH_VARIANTS):
    """Runs in both processes: DDP float32, with its PowerSGD and bf16 hooks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    pin_to_core(True)
    torch.set_num_threads(1)
    rank = int(os.environ["JDP_PROCESS_ID"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=int(os.environ["JDP_NUM_PROCESSES"]),
        init_method=f"tcp://127.0.0.1:{os.environ['TORCH_PORT']}",
    )
    weights, x, y = _data(width, rank)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    out = {}

    def model():
        layers = []
        for i, w in enumerate(weights):
            lin = torch.nn.Linear(*w.shape)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w.T.copy()))
                lin.bias.zero_()
            layers.append(lin)
            if i < len(weights) - 1:
                layers.append(torch.nn.ReLU())
        return torch.nn.Sequential(*layers)

    def timed(net):
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)

        def one():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()

        return median_ms(one, steps, warmup)

    if "local" in variants:
        out["torch, no DDP"] = {"ms": timed(model())}
    if "ddp" in variants:
        out["torch DDP"] = {"ms": timed(DistributedDataParallel(model()))}
    if "powersgd" in variants:
        ddp = DistributedDataParallel(model())
        state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        out["torch DDP + powerSGD_hook r4"] = {"ms": timed(ddp)}
    if "bf16" in variants:
        ddp = DistributedDataParallel(model())
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        out["torch DDP + bf16_compress_hook"] = {"ms": timed(ddp)}
    dist.destroy_process_group()
    return out


def measure_time(
    sizes, rounds: int, steps: int, warmup: int, torch_hooks: tuple = ()
) -> None:
    import socket

    import jdp.launch

    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    results: dict[str, dict[str, list[float]]] = {}
    sent_by: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for size in sizes:
            width = WIDTHS[size]
            rows = results.setdefault(size, {})
            # Each job pins its process to its own core, then starts JAX.
            got = jdp.launch.run(
                jax_job, 2, args=(width, steps, warmup), devices_per_process=1,
                initialize=False, quiet=True, timeout_s=1200,
            )  # fmt: skip
            got[0].update(
                jdp.launch.run(
                    breakdown_job, 2, args=(width, steps, warmup),
                    devices_per_process=1, initialize=False, quiet=True,
                    timeout_s=1200,
                )[0]
            )  # fmt: skip
            for name, value in got[0].items():
                rows.setdefault(name, []).append(value["ms"])
                if "sent" in value:
                    sent_by.setdefault(size, {}).setdefault(name, []).append(
                        value["sent"]
                    )
            if have_torch:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                got = jdp.launch.run(
                    torch_job, 2, initialize=False,
                    args=(width, steps, warmup, TORCH_VARIANTS + torch_hooks),
                    quiet=True, timeout_s=1200, env={"TORCH_PORT": str(port)},
                )  # fmt: skip
                for name, value in got[0].items():
                    if "error" in value:
                        rows.setdefault(name, []).append(float("nan"))
                        rows[name + " error"] = value["error"]
                    else:
                        rows.setdefault(name, []).append(value["ms"])
            print(f"round {r + 1}/{rounds} {size} done", file=sys.stderr)
    print("\n### Step time, 2 processes x 1 CPU device (gloo), median of rounds\n")
    print("| model | row | ms/step | / jdp f32 | / local step | / torch DDP |")
    print("|---|---|---:|---:|---:|---:|")
    for size, rows in results.items():
        med = {
            k: statistics.median(v) for k, v in rows.items() if not k.endswith("error")
        }
        for name, ms in med.items():
            ddp = med.get("torch DDP")
            print(
                f"| {size} | {name} | {ms:.2f} | {ms / med['f32']:.2f} | "
                f"{ms / med['local']:.2f} | "
                f"{'' if ddp is None else f'{ms / ddp:.2f}'} |"
            )
        for k, v in rows.items():
            if k.endswith("error"):
                print(f"| {size} | {k} | {v} | | | |")
    print_model(results, sent_by)


#: Links for the alpha-beta model: name -> bytes per second per host.
MODEL_LINKS = {"1 GbE": 0.125e9, "10 GbE": 1.25e9, "100 GbE": 12.5e9}


def print_model(results, sent_by) -> None:
    """Where compression pays: an alpha-beta model fed with this run's numbers.

    Per step, with n = 2 processes and P parameters, a bandwidth-optimal exchange
    sends 2 (n-1)/n * B bytes per device for an all-reduce of B bytes, and
    (n-1)/n * B for an all-to-all or an all-gather. Each row's step is its
    compute (the local step plus what the row adds: quantising, low-rank
    products, copies; measured here as the row's step time minus the local step
    minus its bytes at the loopback's measured bandwidth) plus its bytes over
    the link. Latency terms are equal for float32 and int8 (two messages each
    way per step on a ring of 2) and are left out.
    """
    print("\n### Where compression pays: alpha-beta model from the measured steps\n")
    print(
        "| model | row | extra compute ms | bytes sent / device | break-even link "
        "| step / f32 step at " + " | at ".join(MODEL_LINKS) + " |"
    )
    print("|---|---|---:|---:|---:|" + "---:|" * len(MODEL_LINKS))
    for size, rows in results.items():
        med = {k: statistics.median(v) for k, v in rows.items() if k in TIME_ROWS}
        sent = {  # bytes each device sends per step, from the compiled programs
            k: statistics.median(v) for k, v in sent_by.get(size, {}).items()
        }
        local = med["local"]
        beta_loop = sent["f32"] / max(med["f32"] - local, 1e-9) * 1e3  # bytes/s
        for name in ("f32", "bf16", "int8+EF", "PowerSGD r4"):
            if name not in med or name not in sent:
                continue
            comm_loop = 1e3 * sent[name] / beta_loop
            extra = max(med[name] - local - comm_loop, 0.0)
            saved = sent["f32"] - sent[name]
            even = "" if name == "f32" or extra == 0 else saved / (extra / 1e3)
            ratios = []
            for beta in MODEL_LINKS.values():
                f32 = local + 1e3 * sent["f32"] / beta
                mine = local + extra + 1e3 * sent[name] / beta
                ratios.append(f"{mine / f32:.2f}")
            print(
                f"| {size} | {name} | {extra:.1f} | {sent[name] / 1e6:.2f} MB | "
                f"{'' if even == '' else f'{even / 1e9:.2f} GB/s'} | "
                + " | ".join(ratios)
                + " |"
            )
    print(
        "\nbreak-even link: the bandwidth per host below which the row's step is "
        "faster than float32's (the bytes it saves take longer to send than its "
        "extra compute). The loopback's own bandwidth, measured from the float32 "
        "row, is the `f32` row's bytes / (f32 step - local step)."
    )


# -- quality -------------------------------------------------------------------------

QUALITY_ROWS = [
    "f32",
    "bf16",
    "int8+EF",
    "int8",
    "fp8+EF",
    "PowerSGD r1",
    "PowerSGD r4",
    "PowerSGD r4, no EF",
    "PowerSGD r4, no warm start",
]


def _teacher_task(seed: int):
    """A random teacher MLP 32-64-1 labels Gaussian inputs; a wider student fits it."""
    import numpy as np

    rng = np.random.default_rng(1000 + seed)
    w1 = rng.normal(size=(32, 64)) / np.sqrt(32)
    w2 = rng.normal(size=(64, 1)) / 8.0

    def label(x):
        return (np.tanh(x @ w1) @ w2).astype(np.float32)

    x = rng.normal(size=(4096, 32)).astype(np.float32)
    xt = rng.normal(size=(1024, 32)).astype(np.float32)
    return (x, label(x)), (xt, label(xt)), [32, 256, 256, 1]


def _digits_task(seed: int):
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1280], y[:1280]), (x[1280:], y[1280:]), [64, 256, 256, 10]


def measure_quality(seeds: int, steps: int) -> None:
    set_devices(8)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    def forward(params, x):
        for i, layer in enumerate(params):
            x = x @ layer["w"] + layer["b"]
            if i < len(params) - 1:
                x = jnp.tanh(x)
        return x

    def mse(params, batch):
        return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)

    def xent(params, batch):
        logits = forward(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]
        ).mean()

    tasks = {
        "teacher MLP (test MSE)": (_teacher_task, mse, optax.adam(1e-3), 256),
        "digits (test loss, accuracy %)": (_digits_task, xent, optax.adam(1e-3), 128),
    }
    print(f"\n### Quality, 8 simulated devices, {steps} steps, {seeds} seeds\n")
    print("| task | sync | final test loss (mean ± sd) | / f32 | accuracy % |")
    print("|---|---|---:|---:|---:|")
    for task, (make, loss_fn, tx, batch_size) in tasks.items():
        base = None
        for name, sync in syncs(jdp, QUALITY_ROWS).items():
            step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=sync))
            losses, accs = [], []
            for seed in range(seeds):
                (x, y), (xt, yt), sizes = make(seed)
                state = step.replicate(
                    jdp.TrainState.create(
                        params=normal_mlp(sizes, seed), tx=tx, sync=sync
                    )
                )
                order = np.random.default_rng(seed).integers(
                    0, len(x), size=(steps, batch_size)
                )
                for idx in order:
                    state, _ = step(state, step.shard({"x": x[idx], "y": y[idx]}))
                params = jax.device_get(step.unreplicate(state).params)
                losses.append(float(loss_fn(params, {"x": xt, "y": yt})))
                if "digits" in task:
                    pred = np.argmax(np.asarray(forward(params, xt)), axis=1)
                    accs.append(100.0 * float(np.mean(pred == yt)))
            mean, sd = statistics.mean(losses), statistics.stdev(losses)
            if base is None:
                base = mean
            acc = (
                f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}"
                if accs
                else ""
            )
            print(
                f"| {task} | {name} | {mean:.5f} ± {sd:.5f} | {mean / base:.4f} "
                f"| {acc} |"
            )
            del step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what", nargs="?", default="all", choices=["bytes", "time", "quality", "all"]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=None, choices=list(WIDTHS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--torch-hooks",
        action="store_true",
        help="also time DDP's powerSGD and bf16 hooks registered plainly (see "
        "benchmarks/ddp_hooks.py for the registrations that run on gloo)",
    )
    args = parser.parse_args()
    if args.what in ("bytes", "all"):
        measure_bytes()
    if args.what in ("quality", "all"):
        steps = args.steps or (100 if args.quick else 300)
        measure_quality(2 if args.quick else args.seeds, steps)
    if args.what in ("time", "all"):
        sizes = args.sizes or (["1M", "8.9M"] if args.quick else list(WIDTHS))
        measure_time(
            sizes,
            1 if args.quick else args.rounds,
            args.steps or (5 if args.quick else 15),
            args.warmup,
            TORCH_HOOKS if args.torch_hooks else (),
        )


if __name__ == "__main__":
    main()
