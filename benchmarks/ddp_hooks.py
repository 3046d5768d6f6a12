"""jdp's gradient exchanges side by side with PyTorch DDP's comm hooks.

2 processes on 127.0.0.1, each pinned to its own core before JAX is imported (XLA
sizes its CPU thread pool from the affinity mask; torch runs 1 thread), and in the
SAME processes both frameworks: a torch.distributed gloo group and
`jdp.distributed.initialize` (JAX's gloo CPU collectives). The model is the MLP
256-W-W-W-10 of `multihost.py` (SGD with momentum, 8 examples per process, the same
initial weights in both frameworks). Rows, in pairs (torch / jdp):

- local: the model without DDP / `jdp.local()` (no communication): the floor;
- float32: DDP / `jdp.all_reduce()`;
- bf16: DDP with `bf16_compress_hook` / `jdp.all_reduce(wire=jdp.wire.bf16())`;
- fp16 vs int8: DDP with `fp16_compress_hook` /
  `jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)`, and the same DDP row
  against `jdp.all_reduce(wire=jdp.wire.int8())` (no error feedback: what the error
  buffers' reads and writes cost);
- PowerSGD rank 4: DDP with `powerSGD_hook` / `jdp.powersgd(rank=4)`, in two forms
  on the DDP side: one bucket (`bucket_cap_mb` above the model's size), and DDP's
  default buckets with a wrapper that waits for the hook's future before returning;
- transport alone: `torch.distributed.all_reduce` / a `jax.lax.psum` of a flat
  float32 buffer of the model's size (no model, no step): what each framework's
  gloo all-reduce costs by itself.

Two of DDP's hooks need help on gloo, and both helps are used here:

- `bf16_compress_hook` is refused by DDP's registration check
  (`DistributedDataParallel._check_comm_hook`), which goes by the hook's function
  name and by whether torch was built with CUDA/NCCL, not by the backend in use; it
  is registered through a function of another name that calls it (with the default
  Linux wheel, a CUDA build, the check passes anyway, without a GPU).
- `powerSGD_hook` with 2 or more buckets issues its P and Q all-reduces from future
  callbacks while the next bucket's hook issues its own, so the ranks' collective
  order can differ and gloo aborts ("Received data size doesn't match expected
  size"). One bucket, or waiting for the hook's future, avoids the race.
  (`batched_powerSGD_hook` is left out: it fails on any backend here.)

Every row, of either framework, ends its step with the loss averaged over the
processes, as jdp's step does for its metrics (under `jdp.local()` too, where that
scalar is the step's only collective): so the local rows of both frameworks meet the
other process once a step, and "local" means no gradient communication.

The rows are set up once (compiled, `--warmup` steps each), then timed in
`--rounds` rounds, the row order shuffled each round (the same order in both
processes), `--steps` timed steps per row per round; a row's figure is the median of
all its timed steps. "sync ms" is a row's step minus its own framework's local
step; "jdp / DDP" is the ratio of the paired rows; "CPU ms" the process's CPU time
per step (all its threads), which shows whether a row is bound by its core. After
the timed steps, every DDP model's parameters are hashed on each rank and compared
across ranks, so a hook that silently lets the replicas drift apart is caught; the
final loss (mean over ranks) is printed beside each row.

    pip install torch        # not a dependency of jdp; the default wheel
    python benchmarks/ddp_hooks.py [--sizes 1M 8.9M 39M] [--rounds 6] [--steps 6]
    python benchmarks/ddp_hooks.py --quick          # 1M and 8.9M, 3 rounds x 4 steps
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time

from _common import mlp_loss, pin_to_core, raw_psum
from multihost import LR, MOMENTUM, WIDTHS, _data, num_params, torch_mlp, torch_sgd_step

#: One all-reduce of the gradient's bytes, no model: each framework's transport.
RAW = ("torch all_reduce (raw)", "JAX psum (raw)")
#: Row pairs: (label, torch row, jdp row).
PAIRS = [
    ("local (no communication)", "torch local", "jdp local"),
    ("float32", "DDP fp32", "jdp f32"),
    ("bf16", "DDP bf16_compress_hook (renamed wrapper)", "jdp bf16"),
    ("fp16 hook / int8+EF", "DDP fp16_compress_hook", "jdp int8+EF"),
    ("fp16 hook / int8", "DDP fp16_compress_hook", "jdp int8"),
    ("PowerSGD r4", "DDP powerSGD_hook r4, one bucket", "jdp PowerSGD r4"),
    ("PowerSGD r4", "DDP powerSGD_hook r4, waiting wrapper", "jdp PowerSGD r4"),
    ("transport alone", *RAW),
]
TORCH_LOCAL, JDP_LOCAL = "torch local", "jdp local"
INSTALL = (
    "benchmarks/ddp_hooks.py needs PyTorch, which is not a dependency of jdp: "
    "install it with `pip install torch` (the default wheel; a CPU-only build works "
    "too)."
)


def bf16_wrapper(state, bucket):
    """`bf16_compress_hook` under another name: DDP's name-based check lets it by."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def powersgd_waiting(state, bucket):
    """`powerSGD_hook`, waiting for its future: one bucket's collectives at a time."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    fut = psgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def _torch_rows(width: int, rank: int, world: int):
    """name -> (one step, model or None); the models start from the same weights."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    weights, x, y = _data(width, rank)
    xb, yb = torch.from_numpy(x), torch.from_numpy(y)
    model_mb = 4 * num_params(width) / 2**20

    def model():
        return torch_mlp(weights)

    def powersgd_state():
        # Compression from the 3rd step on (within the warm-up), as jdp's from the 1st.
        return psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )

    def ddp(hook=None, state=None, **kw):
        net = DDP(model(), **kw)
        if hook is not None:
            net.register_comm_hook(state, hook)
        return net

    nets = {
        "torch local": model(),
        "DDP fp32": ddp(),
        "DDP bf16_compress_hook (renamed wrapper)": ddp(bf16_wrapper),
        "DDP fp16_compress_hook": ddp(default_hooks.fp16_compress_hook),
        "DDP powerSGD_hook r4, one bucket": ddp(
            psgd.powerSGD_hook, powersgd_state(), bucket_cap_mb=2 * model_mb + 1
        ),
        "DDP powerSGD_hook r4, waiting wrapper": ddp(
            powersgd_waiting, powersgd_state()
        ),
    }
    rows = {}
    for name, net in nets.items():
        step, box = torch_sgd_step(net, xb, yb)

        def one(step=step, box=box):
            # The loss averaged over the processes, as jdp's metrics are: without
            # it the local row alone would run unsynchronised, each process at its
            # own pace, while jdp's local step meets the other process once a step.
            step()
            loss = torch.tensor([box["loss"]])
            dist.all_reduce(loss)
            box["mean loss"] = loss.item() / world

        def final(net=net, box=box, name=name):
            """(mean loss over ranks, params identical on every rank, buckets)."""
            import hashlib

            digest = hashlib.sha256()
            for p in net.parameters():
                digest.update(p.detach().numpy().tobytes())
            digests = [None] * world
            dist.all_gather_object(digests, digest.hexdigest())
            buckets = None
            if name != TORCH_LOCAL:
                data = net._get_ddp_logging_data()
                # After the first step DDP rebuilds its buckets in gradient order.
                sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
                buckets = len(str(sizes).split(",")) if sizes else None
            same = None if name == TORCH_LOCAL else len(set(digests)) == 1
            return box["mean loss"], same, buckets

        rows[name] = (one, final)
    flat = torch.ones(num_params(width))
    rows[RAW[0]] = (lambda: dist.all_reduce(flat), lambda: (None, None, None))
    return rows


def _jdp_rows(width: int):
    """name -> (one step, final): jdp's steps, all from the same weights."""
    import jax
    import numpy as np
    import optax

    import jdp

    weights, x, y = _data(width, jax.process_index())
    params = [{"w": w, "b": np.zeros(w.shape[1], np.float32)} for w in weights]
    tx = optax.sgd(LR, momentum=MOMENTUM)
    pieces = {
        "jdp local": jdp.local(),
        "jdp f32": jdp.all_reduce(),
        "jdp bf16": jdp.all_reduce(wire=jdp.wire.bf16()),
        "jdp int8+EF": jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True),
        "jdp int8": jdp.all_reduce(wire=jdp.wire.int8()),
        "jdp PowerSGD r4": jdp.powersgd(rank=4),
    }
    rows = {}
    for name, piece in pieces.items():
        step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx, sync=piece))
        box = {
            "state": step.replicate(
                jdp.TrainState.create(params=params, tx=tx, sync=piece)
            )
        }
        batch = step.shard({"x": x, "y": y})

        def one(step=step, box=box, batch=batch):
            box["state"], metrics = step(box["state"], batch)
            box["loss"] = float(metrics["loss"])  # waits for the step

        def final(box=box, name=name):
            # jdp's loss metric is the mean over replicas (under `jdp.local()`
            # too: the step's one collective then).
            return box["loss"], None, None

        rows[name] = (one, final)
    rows[RAW[1]] = (raw_psum(num_params(width)), lambda: (None, None, None))
    return rows


def job(width: int, rounds: int, steps: int, warmup: int, seed: int):
    """Runs in both processes: every row's step times, both frameworks."""
    pin_to_core(True)  # before JAX is imported: XLA sizes its pool from the mask
    import torch
    import torch.distributed as dist

    import jdp

    torch.set_num_threads(1)
    rank = int(os.environ["JDP_PROCESS_ID"])
    world = int(os.environ["JDP_NUM_PROCESSES"])
    jdp.distributed.initialize()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['TORCH_PORT']}",
        rank=rank,
        world_size=world,
    )
    try:
        rows = _torch_rows(width, rank, world)
        rows.update(_jdp_rows(width))
        for one, _ in rows.values():
            for _ in range(warmup):
                one()
        times = {name: [] for name in rows}
        cpu = {name: [] for name in rows}
        order = list(rows)
        for r in range(rounds):
            random.Random(seed * 1000 + r).shuffle(order)  # same order on each rank
            for name in order:
                one = rows[name][0]
                for _ in range(steps):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    one()
                    cpu[name].append(time.process_time() - start_cpu)
                    times[name].append(time.perf_counter() - start)
        out = {}
        for name, (_, final) in rows.items():
            loss, same, buckets = final()
            out[name] = {
                "ms": 1e3 * statistics.median(times[name]),
                "cpu ms": 1e3 * statistics.median(cpu[name]),
                "loss": loss,
                "same": same,
                "buckets": buckets,
                "cores": sorted(os.sched_getaffinity(0)),
            }
        out["versions"] = {"torch": torch.__version__, "jax": _jax_version()}
        return out
    finally:
        dist.destroy_process_group()


def _jax_version() -> str:
    import jax

    return jax.__version__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(results: dict, args) -> None:
    print(
        f"\n2 processes x 1 CPU device, each pinned to its own core, gloo on "
        f"127.0.0.1, torch and jdp in the same processes; MLP 256-W-W-W-10, SGD "
        f"momentum, 8 examples per process; median of {args.rounds} shuffled rounds "
        f"x {args.steps} steps per row (after {args.warmup} warm-up steps).\n"
    )
    print(
        "| model | pair | DDP row | DDP step ms | DDP sync ms | DDP CPU ms | jdp row "
        "| jdp step ms | jdp sync ms | jdp CPU ms | jdp / DDP step | jdp / DDP sync |"
    )
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for size, res in results.items():
        tl, jl = res[TORCH_LOCAL]["ms"], res[JDP_LOCAL]["ms"]
        for label, t, j in PAIRS:
            tm, jm = res[t]["ms"], res[j]["ms"]
            ts, js = tm - tl, jm - jl
            no_sync = t in (TORCH_LOCAL, RAW[0])
            sync_ratio = "" if no_sync or ts <= 0 else f"{js / ts:.2f}"
            tsync = "" if no_sync else f"{ts:.1f}"
            jsync = "" if no_sync else f"{js:.1f}"
            tcpu, jcpu = res[t]["cpu ms"], res[j]["cpu ms"]
            print(
                f"| {size} | {label} | {t} | {tm:.1f} | {tsync} | {tcpu:.1f} | {j} "
                f"| {jm:.1f} | {jsync} | {jcpu:.1f} | {jm / tm:.2f} | {sync_ratio} |"
            )
    print(
        "\nCPU ms: the process's CPU time per step (every thread of it, on its one "
        "core),\nmedian; a row whose CPU time is near its step time is bound by its "
        "core, not by\nwaiting for the other process.\n"
    )
    print("\nChecks after the timed steps (final loss: mean over the 2 ranks):\n")
    print("| model | row | final loss | params identical on both ranks | buckets |")
    print("|---|---|---:|---|---:|")
    for size, res in results.items():
        for name, r in res.items():
            if name == "versions" or name in RAW:
                continue
            same = {None: "", True: "yes", False: "**NO**"}[r["same"]]
            buckets = "" if r["buckets"] is None else r["buckets"]
            print(f"| {size} | {name} | {r['loss']:.6f} | {same} | {buckets} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", nargs="+", choices=list(WIDTHS), default=["1M", "8.9M", "39M"]
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="of the rounds' orders")
    parser.add_argument(
        "--quick", action="store_true", help="1M and 8.9M, 3 rounds x 4 steps"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.steps = ["1M", "8.9M"], 3, 4
    try:
        import torch  # noqa: F401
    except ImportError:  # `make bench` without torch: say so, and skip
        print(f"skipped: {INSTALL}")
        return
    if len(os.sched_getaffinity(0)) < 2:
        print("fewer than 2 cores: both processes share one", file=sys.stderr)

    import jdp.launch

    results = {}
    for size in args.sizes:
        start = time.perf_counter()
        got = jdp.launch.run(
            job,
            2,
            args=(WIDTHS[size], args.rounds, args.steps, args.warmup, args.seed),
            devices_per_process=1,
            initialize=False,  # `job` pins its core first, then initializes
            env={"TORCH_PORT": str(_free_port())},
            timeout_s=1800,
            quiet=True,
        )
        cores = [g[TORCH_LOCAL]["cores"] for g in got]
        versions = got[0].pop("versions")
        got[1].pop("versions")
        results[size] = got[0]
        print(
            f"{size} ({num_params(WIDTHS[size]):,} params) done in "
            f"{time.perf_counter() - start:.0f} s; cores {cores}; {versions}",
            file=sys.stderr,
            flush=True,
        )
    print_table(results, args)


if __name__ == "__main__":
    main()
