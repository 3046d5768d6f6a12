"""Two processes over gloo: jdp's synchronous step against hand-written JAX and DDP.

A sweep of model sizes, 0.1M to 39M parameters: an MLP 256-W-W-W-10 (ReLU, f32)
trained with SGD momentum on 8 examples per process, in 2 processes x 1 CPU device
on 127.0.0.1 started by `jdp.launch.run` and joined by `jdp.distributed.initialize`
(JAX's gloo collectives). Per size, in the same processes and interleaved:

- `local step, no all-reduce`: `jdp.make_train_step(..., sync=jdp.local())`, what a
  step costs without communication.
- `jdp`: `jdp.make_train_step` as shipped (bucketed all-reduce; across CPU processes
  small leaves are packed into flat buffers and leaves of 8 MiB or more travel
  uncopied; `jdp, every leaf packed` is the same without that rule, an ablation).
  `jdp + step.shard` also places the batch every step, as a training
  loop does (with `shard`'s cross-process batch check, which sends a message only
  when a process's batch shapes change: none in this loop of steady shapes);
  `jdp + batch placed by hand` places it with
  `jax.make_array_from_process_local_data`, unchecked.
- `hand: lax.pmean tree`: the flax recipe, `lax.pmean(grads)` in a `shard_map` step.
- `hand: ravel_pytree + pmean`: one flat buffer made by `jax.flatten_util`.
- `raw psum of the gradient bytes`: one jitted `psum` of a flat f32 buffer of the
  parameter count, nothing else: what JAX's gloo transport costs.

and, in two more processes with torch (if it imports; it is not a dependency of
jdp): PyTorch DDP (gloo, 1 thread per rank as `torchrun` sets), the same model
without DDP, and a raw `torch.distributed.all_reduce` of the gradient bytes.

Each round starts fresh processes for every size; the table gives the median over
rounds of each run's median step time, the range, and the all-reduce bandwidth a
row achieves: gradient bytes / (step time - local step time) for training rows,
bytes / time for raw rows. All variants start from the same weights, so their
losses agree. This is a 2-core machine: both processes share it, and the numbers
are what data parallelism costs on one host, not a speed-up.

    python benchmarks/multihost.py [--rounds 3] [--steps 15] [--sizes 0.1M 1M ...]
                                   [--pin] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import median_ms, mlp_loss, pin_to_core, raw_psum

#: Model sizes: name -> hidden width W of the MLP 256-W-W-W-10.
WIDTHS = {"0.1M": 192, "1M": 640, "2.4M": 1024, "8.9M": 2048, "39M": 4352}
QUICK_SIZES = ("1M", "8.9M")
#: Above this many parameters the `ravel_pytree` row is left out (seconds a step).
RAVEL_MAX_PARAMS = 10_000_000
IN, OUT, PER_PROCESS_BATCH = 256, 10, 8
LR, MOMENTUM = 1e-3, 0.9

JAX_ROWS = {
    "local": "local step, no all-reduce",
    "jdp": "jdp",
    "jdp+place": "jdp + batch placed by hand every step",
    "jdp+shard": "jdp + step.shard every step",
    "packall": "jdp, every leaf packed",
    "tree": "hand: lax.pmean tree",
    "flat": "hand: ravel_pytree + pmean",
    "raw": "raw psum of the gradient bytes",
}
TORCH_ROWS = {
    "ddp": "torch DDP",
    "torch_local": "torch, no DDP",
    "torch_raw": "raw torch all_reduce of the bytes",
}


def sizes_of(width: int) -> list[int]:
    return [IN, width, width, width, OUT]


def num_params(width: int) -> int:
    s = sizes_of(width)
    return sum(a * b + b for a, b in zip(s[:-1], s[1:], strict=True))


def torch_mlp(weights):
    """The same MLP in torch, starting from `weights` (ReLU between layers)."""
    import torch

    layers = []
    for i, w in enumerate(weights):
        layer = torch.nn.Linear(*w.shape)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(w.T))  # x @ W.T
            layer.bias.zero_()
        layers.append(layer)
        if i < len(weights) - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def torch_sgd_step(net, xb, yb):
    """`(one, box)`: `one()` takes an SGD-with-momentum step of `net` on the MSE of
    `(xb, yb)`, as jdp's step does, and leaves the loss in `box["loss"]`."""
    import torch

    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    box = {}

    def one():
        opt.zero_grad(set_to_none=True)
        loss = torch.mean((net(xb) - yb) ** 2)
        loss.backward()
        opt.step()
        box["loss"] = loss.item()

    return one, box


def _data(width: int, rank: int):
    """Initial weights (the same everywhere) and this process's batch."""
    import numpy as np

    rng = np.random.default_rng(0)
    s = sizes_of(width)
    weights = [
        (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        for a, b in zip(s[:-1], s[1:], strict=True)
    ]
    rng = np.random.default_rng(1 + rank)
    x = rng.normal(size=(PER_PROCESS_BATCH, IN)).astype(np.float32)
    y = rng.normal(size=(PER_PROCESS_BATCH, OUT)).astype(np.float32)
    return weights, x, y


def jax_job(width: int, kinds: list[str], steps: int, warmup: int, pin: bool):
    """Runs in both processes: the median step time of each JAX variant."""
    pin_to_core(pin)
    import jax
    import numpy as np
    import optax
    from jax import lax
    from jax.flatten_util import ravel_pytree

    import jdp
    from jdp import _collectives

    alone_bytes = _collectives.ALONE_BYTES

    loss_fn = mlp_loss

    def hand_written(reduce):
        def train_step(state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
            return state.apply_gradients(grads=reduce(grads)), {"loss": loss}

        return train_step

    def flat_pmean(grads):
        flat, unravel = ravel_pytree(grads)
        return unravel(lax.pmean(flat, "data"))

    weights, x, y = _data(width, jax.process_index())
    params = [{"w": w, "b": np.zeros(w.shape[1], np.float32)} for w in weights]
    local = {"x": x, "y": y}
    tx = optax.sgd(LR, momentum=MOMENTUM)
    out = {}
    for kind in kinds:
        if kind == "raw":
            ms = median_ms(raw_psum(num_params(width)), steps, warmup)
            out[kind] = {"ms": ms}
            continue
        train_step = {
            "local": lambda: jdp.make_train_step(loss_fn, tx, sync=jdp.local()),
            "jdp": lambda: jdp.make_train_step(loss_fn, tx),
            "jdp+shard": lambda: jdp.make_train_step(loss_fn, tx),
            "jdp+place": lambda: jdp.make_train_step(loss_fn, tx),
            "packall": lambda: jdp.make_train_step(loss_fn, tx),
            "tree": lambda: hand_written(lambda g: lax.pmean(g, "data")),
            "flat": lambda: hand_written(flat_pmean),
        }[kind]()
        # The ablation row: no leaf travels uncopied (jdp packs leaves < 8 MiB).
        _collectives.ALONE_BYTES = None if kind == "packall" else alone_bytes
        step = jdp.parallelize(train_step)
        box = {"state": step.replicate(jdp.TrainState.create(params=params, tx=tx))}
        batch = step.shard(local)

        def place(step=step):  # what a hand-written loop does: no check
            return {
                k: jax.make_array_from_process_local_data(step.sharding, v)
                for k, v in local.items()
            }

        def one(step=step, box=box, batch=batch, kind=kind, place=place):
            if kind == "jdp+shard":
                b = step.shard(local)
            elif kind == "jdp+place":
                b = place()
            else:
                b = batch
            box["state"], metrics = step(box["state"], b)
            box["loss"] = float(metrics["loss"])  # waits for the step

        ms = median_ms(one, steps, warmup)
        out[kind] = {"ms": ms, "loss": box["loss"]}
        if kind == "jdp+shard":  # placing alone, without a step: what the check adds
            out["place_us"] = {
                "shard": _median_us(lambda step=step: step.shard(local)),
                "hand": _median_us(place),
            }
        if kind == "jdp":
            ops = step.collectives(box["state"], batch)
            out[kind]["arrays"] = sum(
                len(c.shapes) for c in ops if c.kind == "all-reduce"
            )
        del box
    return out


def _median_us(fn, calls: int = 200, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of `calls` calls of `fn`, in us."""

    def calls_of_fn():
        for _ in range(calls):
            fn()

    return 1e3 * median_ms(calls_of_fn, repeats, warmup=1) / calls


def torch_job(width: int, steps: int, warmup: int, pin: bool):
    """Runs in both processes: DDP, the model without DDP, a raw all_reduce."""
    pin_to_core(pin)
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
        weights, x, y = _data(width, rank)
        xb, yb = torch.from_numpy(x), torch.from_numpy(y)

        def model():
            return torch_mlp(weights)

        out = {}
        for kind in ("ddp", "torch_local"):
            net = model()
            if kind == "ddp":
                net = DistributedDataParallel(net)
            one, box = torch_sgd_step(net, xb, yb)
            out[kind] = {"ms": median_ms(one, steps, warmup)}
            if kind == "ddp":  # the global-batch loss, as jdp's averaged metric
                total = torch.tensor([box["loss"]])
                dist.all_reduce(total)
                out[kind]["loss"] = total.item() / world
        buf = torch.ones(num_params(width))
        out["torch_raw"] = {
            "ms": median_ms(lambda: dist.all_reduce(buf), steps, warmup)
        }
        return out
    finally:
        dist.destroy_process_group()


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_round(width: int, args) -> dict:
    """The torch rows of one round; {} if torch's job fails twice."""
    import jdp.launch

    for attempt in range(2):
        try:
            return jdp.launch.run(
                torch_job,
                2,
                args=(width, args.steps, args.warmup, args.pin),
                initialize=False,
                timeout_s=900,
                quiet=True,
            )[0]
        except RuntimeError as e:  # seen: gloo aborting at exit, now and then
            print(f"  torch job failed (attempt {attempt + 1}): {e}", file=sys.stderr)
    return {}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--sizes", nargs="+", choices=list(WIDTHS), default=list(WIDTHS)
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin each process to one core (fair for compute, but gloo's I/O "
        "thread then shares that core)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"1 round, sizes {' '.join(QUICK_SIZES)}"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.sizes = 1, 8, list(QUICK_SIZES)

    import jdp.launch

    torch_ok = _have_torch()
    kinds = list(JAX_ROWS)
    runs = {s: {} for s in args.sizes}  # size -> row -> [ms per round]
    last = {s: {} for s in args.sizes}
    place_us = {s: {} for s in args.sizes}  # size -> "shard"/"hand" -> [us]
    for rnd in range(args.rounds):
        order = kinds if rnd % 2 == 0 else kinds[::-1]  # against drift
        for size in args.sizes:
            width = WIDTHS[size]
            big = num_params(width) > RAVEL_MAX_PARAMS
            these = [k for k in order if not (big and k == "flat")]
            start = time.perf_counter()
            res = jdp.launch.run(
                jax_job,
                2,
                args=(width, these, args.steps, args.warmup, args.pin),
                devices_per_process=1,
                timeout_s=900,
                quiet=True,
            )[0]
            if torch_ok:
                res.update(_torch_round(width, args))
            for name, us in res.pop("place_us", {}).items():
                place_us[size].setdefault(name, []).append(us)
            for row, r in res.items():
                runs[size].setdefault(row, []).append(r["ms"])
                last[size][row] = r
            print(
                f"  round {rnd + 1}/{args.rounds} {size}: "
                + ", ".join(f"{k} {r['ms']:.1f}" for k, r in res.items())
                + f" ms ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    rows = dict(JAX_ROWS, **(TORCH_ROWS if torch_ok else {}))
    med = {
        s: {row: statistics.median(v) for row, v in runs[s].items()} for s in args.sizes
    }
    pinned = "pinned to 1 core each" if args.pin else "unpinned"
    print(
        f"\n2 processes x 1 CPU device, gloo on 127.0.0.1, {pinned}; MLP "
        f"{IN}-W-W-W-{OUT}, SGD momentum, {PER_PROCESS_BATCH} examples per process; "
        f"median of {args.rounds} round(s) x {args.steps} steps.\n"
    )
    for size in args.sizes:
        width = WIDTHS[size]
        nbytes = 4 * num_params(width)
        print(
            f"{size}: W={width}, {num_params(width):,} params, "
            f"{nbytes / 2**20:.1f} MiB of gradients"
        )
        header = f"  {'row':36s} {'ms/step':>9s} {'range':>13s} {'GB/s':>6s} "
        header += f"{'x jdp':>6s} {'final loss':>11s}"
        print(header)
        for row, label in rows.items():
            if row not in med[size]:
                continue
            ms, v = med[size][row], runs[size][row]
            local = med[size]["torch_local" if row == "ddp" else "local"]
            if row in ("raw", "torch_raw"):
                gbps = nbytes / ms / 1e6
            elif row in ("local", "torch_local") or ms <= local:
                gbps = None
            else:
                gbps = nbytes / (ms - local) / 1e6
            loss = last[size][row].get("loss")
            print(
                f"  {label:36s} {ms:9.1f} {f'{min(v):.1f}-{max(v):.1f}':>13s} "
                f"{'-' if gbps is None else f'{gbps:.2f}':>6s} "
                f"{ms / med[size]['jdp']:6.2f} "
                f"{'-' if loss is None else f'{loss:.6f}':>11s}"
            )
        arrays = last[size]["jdp"].get("arrays")
        print(f"  (jdp sends its gradients as {arrays} arrays)")
        if "flat" not in med[size]:
            print(f"  (ravel_pytree row left out above {RAVEL_MAX_PARAMS:,} params)")
        print()

    print(
        "Summary: ratios of medians (lower is better for jdp); shard/hand placed: "
        "median and range of the per-round ratios (the two rows run back to back)"
    )
    header = f"{'size':>6s} {'jdp/best hand':>14s} {'jdp/DDP':>8s} "
    header += f"{'jdp/(local+raw psum)':>21s} {'shard/hand placed':>17s} {'range':>11s}"
    print(header)
    for size in args.sizes:
        m = med[size]
        best = min(m["tree"], m.get("flat", m["tree"]))
        ddp = f"{m['jdp'] / m['ddp']:.2f}" if "ddp" in m else "-"
        floor = m["local"] + m["raw"]
        shard = [
            a / b
            for a, b in zip(
                runs[size]["jdp+shard"], runs[size]["jdp+place"], strict=True
            )
        ]
        print(
            f"{size:>6s} {m['jdp'] / best:14.2f} {ddp:>8s} "
            f"{m['jdp'] / floor:21.2f} {statistics.median(shard):17.3f} "
            f"{f'{min(shard):.2f}-{max(shard):.2f}':>11s}"
        )
    print(
        "\nPlacing the batch alone (no step), 200 calls x 5 in each process, median "
        "over rounds: what `step.shard` (its checks, and the cross-process "
        "comparison, which a loop of steady shapes does not wait for) adds to a "
        "placement by hand, against the jdp step"
    )
    header = f"{'size':>6s} {'shard us':>9s} {'by hand us':>11s} "
    print(header + f"{'extra / jdp step':>17s}")
    for size in args.sizes:
        us = {k: statistics.median(v) for k, v in place_us[size].items()}
        extra = (us["shard"] - us["hand"]) / (1e3 * med[size]["jdp"])
        print(f"{size:>6s} {us['shard']:9.0f} {us['hand']:11.0f} {100 * extra:16.1f}%")
    if not torch_ok:
        print("torch is not installed: the PyTorch rows were skipped.")


if __name__ == "__main__":
    main()
