"""Trains 0.3's configurations on an older jdp and on this tree; compares bit for bit.

A release check, not a timing: every configuration a 0.3 user could write (plain
all-reduce, a narrow reduce dtype, each wire format with error feedback,
PowerSGD, ZeRO, BMUF, DiLoCo, Streaming DiLoCo, hierarchical local SGD,
`jdp.partition`, microbatches, a `jdp.weighted` loss, loss scaling, skipping a
non-finite step, dropping a bad replica, `jdp.sync_gradients` in an
`optax.chain`) is written once per API, the ref's spelling beside this tree's
(`V3` is true for an API that still has `jdp.powersgd_transform`; `jdp.bmuf`'s
block momentum and streaming options follow `jdp.block_momentum` and
`jdp.Streaming` where they exist), trained for a
few steps on 4 replicas of 8 simulated CPU devices from fixed seeds, and every
leaf of the final state (params, optimizer state, the piece's state, counters,
per replica) is compared bit for bit.

The ref's `jdp/` is exported with `git archive REF jdp` into a temporary
directory; this script then runs itself as a worker twice, once with
`PYTHONPATH` on that directory and once on the repository root, and each worker
saves its final states to `.npz` files. One table row per configuration and
backend: `identical`, `differs: max abs diff, first differing leaf`, or
`error: ...` (a configuration that fails in one version). The exit status is 1
if a row differs or fails, unless it is listed in `EXPECTED` with the reason.

    python benchmarks/compare_versions.py --ref 061b990
    python benchmarks/compare_versions.py --ref v0.4.0 --only plain zero_adam --steps 2
    python benchmarks/compare_versions.py --ref 061b990 --processes 2

`--ref` defaults to the newest tag, if there is one. `--processes 2` runs each
worker as a 2-process job (`python -m jdp.launch`), 2 devices a process, and
compares the configurations that support several processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

STEPS = 8
REPLICAS = 4
PER_REPLICA = 8  # examples of a replica's slice of each batch
SIZES = (16, 32, 32, 8)  # the MLP after the embedding's mean
VOCAB = 64
POISON_STEP = 2  # the step whose batch holds a NaN in the poisoned rows
BACKENDS = ("pmap", "shard_map")

#: (configuration, backend, processes; None for any) -> why the two versions
#: may differ. Such a row is reported, with the reason, but does not fail the run.
EXPECTED: dict[tuple[str, str | None, int | None], str] = {
    ("loss_scaling", None, None): (
        "0.4 runs the optimizer inside the skip's lax.cond (0.3: unconditionally, then "
        "jnp.where), so XLA:CPU no longer fuses the mean's x0.25 into the momentum "
        "update and contracts 0.9*trace+g into an FMA: <= 1 ulp a step; now the same "
        "bits as skip_nonfinite=True without a scaler"
    ),
    ("zero_adam", None, None): (
        "0.4's jdp.zero is an optimizer: it all-gathers the updates and the step adds "
        "them to the params, as for every optimizer; 0.3 added them to the slice "
        "inside the optimizer's fusion before gathering the params, where XLA:CPU may "
        "contract Adam's last multiply and the add into an FMA: <= 1 ulp a step"
    ),
    ("loss_scaling", None, 2): (
        "the optimizer in lax.cond, as with one process, and the synced gradients "
        "as well (loss_scaling_sgd)"
    ),
    ("loss_scaling_sgd", None, 2): (
        "0.3's scaler averaged with flax's lax.pmean, one collective per leaf; 0.4 "
        "syncs through the piece, one flattened bucket across processes, whose gloo "
        "sum rounds differently: now the same bits as plain all_reduce"
    ),
}


# The configurations: one function each, `V3` the ref's spelling beside this
# tree's. A function returns what differs from the defaults of `setup()`.


def setup(**changes) -> dict:
    """A configuration: defaults overridden by `changes`."""
    import optax

    out = dict(
        tx=optax.sgd(0.1, momentum=0.9),
        sync=None,  # the piece (None: the default `jdp.all_reduce()`)
        train={},  # more options of `make_train_step`
        state={},  # more options of `TrainState.create`
        loss="mse",
        poison=(),  # replicas whose slice holds a NaN at POISON_STEP
        mesh="flat",  # or "2x2": ("host", "device"), shard_map only
        multiprocess=BACKENDS,  # the backends it runs on across processes
    )
    out.update(changes)
    return out


def plain(jdp, V3):
    return setup(sync=jdp.all_reduce())


def reduce_bf16(jdp, V3):
    import jax.numpy as jnp

    return setup(sync=jdp.all_reduce(reduce_dtype=jnp.bfloat16))


def wire_bf16(jdp, V3):
    return setup(sync=jdp.all_reduce(wire=jdp.wire.bf16()))


def wire_int8_ef(jdp, V3):
    return setup(sync=jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True))


def wire_fp8_ef(jdp, V3):
    return setup(sync=jdp.all_reduce(wire=jdp.wire.fp8(), error_feedback=True))


def powersgd(jdp, V3):
    return setup(sync=jdp.powersgd(rank=2))


def zero_adam(jdp, V3):
    import optax

    # Across processes under pmap, both 0.3 and 0.4 fail in the step's layout
    # check: the state laid out for 4 replicas, the step counting 2.
    if V3:
        return setup(sync=jdp.zero(), tx=optax.adam(1e-2), multiprocess=("shard_map",))
    return setup(
        sync=jdp.local(), tx=jdp.zero(optax.adam(1e-2)), multiprocess=("shard_map",)
    )


def block_momentum(jdp, momentum: float) -> dict:
    """`jdp.bmuf`'s block momentum: a keyword of its own, or `outer=` where
    `jdp.block_momentum` exists (the same filter, BMUF's own formula)."""
    if hasattr(jdp, "block_momentum"):
        return dict(outer=jdp.block_momentum(momentum=momentum))
    return dict(block_momentum=momentum)


def bmuf(jdp, V3):
    import optax

    tx = jdp.bmuf(optax.sgd(0.1), sync_period=2, **block_momentum(jdp, 0.5))
    return setup(sync=jdp.local(), tx=tx)


def diloco(jdp, V3):
    import optax

    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    tx = jdp.bmuf(optax.adamw(1e-2), sync_period=2, outer=outer)
    return setup(sync=jdp.local(), tx=tx)


def streaming_diloco(jdp, V3):
    import optax

    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    schedule = dict(fragments=2, delay=1, mix=0.5)
    if hasattr(jdp, "Streaming"):  # keywords of `jdp.bmuf` until then
        schedule = dict(streaming=jdp.Streaming(**schedule))
    tx = jdp.bmuf(optax.adamw(1e-2), sync_period=4, outer=outer, **schedule)
    return setup(sync=jdp.local(), tx=tx)


def hierarchical(jdp, V3):
    import optax

    tx = jdp.bmuf(
        optax.sgd(0.1), sync_period=2, axis_name="host", **block_momentum(jdp, 0.5)
    )
    return setup(sync=jdp.all_reduce(axis_name="device"), tx=tx, mesh="2x2")


def partition(jdp, V3):
    import optax

    labels = {"embed": "embed", "mlp": "dense"}
    tx = optax.multi_transform(
        {"dense": optax.adam(1e-2), "embed": jdp.bmuf(optax.adam(1e-2), sync_period=2)},
        labels,
    )
    sync = jdp.partition(labels, {"dense": jdp.all_reduce(), "embed": jdp.local()})
    return setup(sync=sync, tx=tx)


def microbatches(jdp, V3):
    return setup(sync=jdp.all_reduce(), train=dict(microbatches=2))


def weighted(jdp, V3):
    return setup(sync=jdp.all_reduce(), loss="weighted")


def loss_scaling(jdp, V3):
    from flax.training.dynamic_scale import DynamicScale

    return setup(sync=jdp.all_reduce(), state=dict(dynamic_scale=DynamicScale()))


def loss_scaling_sgd(jdp, V3):
    # The control of `loss_scaling`: SGD without momentum, whose update has a
    # single product, so that only the synced gradients can differ (EXPECTED).
    import optax
    from flax.training.dynamic_scale import DynamicScale

    return setup(
        sync=jdp.all_reduce(),
        tx=optax.sgd(0.1),
        state=dict(dynamic_scale=DynamicScale()),
    )


def skip_nonfinite(jdp, V3):
    skip = (
        dict(sync=jdp.all_reduce(skip_nonfinite=True))
        if V3
        else dict(sync=jdp.all_reduce(), train=dict(skip_nonfinite=True))
    )
    return setup(poison=(1,), **skip)


def drop_bad_replica(jdp, V3):
    drop = (
        dict(sync=jdp.all_reduce(on_bad_replica="drop"))
        if V3
        else dict(
            sync=jdp.all_reduce(on_bad_replica="drop"), train=dict(skip_nonfinite=True)
        )
    )
    return setup(poison=(1,), **drop)


def drop_all_bad(jdp, V3):
    # No replica left at POISON_STEP: 0.3 skipped by itself, 0.4 needs the
    # step's `skip_nonfinite`.
    drop = (
        dict(sync=jdp.all_reduce(on_bad_replica="drop"))
        if V3
        else dict(
            sync=jdp.all_reduce(on_bad_replica="drop"), train=dict(skip_nonfinite=True)
        )
    )
    return setup(poison=tuple(range(REPLICAS)), **drop)


def sync_gradients_int8(jdp, V3):
    import optax

    wire = dict(wire=jdp.wire.int8(), error_feedback=True)
    sync = (
        jdp.sync_gradients(**wire) if V3 else jdp.sync_gradients(jdp.all_reduce(**wire))
    )
    return setup(sync=jdp.local(), tx=optax.chain(sync, optax.sgd(0.1, momentum=0.9)))


def powersgd_transform(jdp, V3):
    import optax

    sync = (
        jdp.powersgd_transform(rank=2)
        if V3
        else jdp.sync_gradients(jdp.powersgd(rank=2))
    )
    return setup(sync=jdp.local(), tx=optax.chain(sync, optax.sgd(0.1, momentum=0.9)))


CONFIGS = {
    f.__name__: f
    for f in (
        plain,
        reduce_bf16,
        wire_bf16,
        wire_int8_ef,
        wire_fp8_ef,
        powersgd,
        zero_adam,
        bmuf,
        diloco,
        streaming_diloco,
        hierarchical,
        partition,
        microbatches,
        weighted,
        loss_scaling,
        loss_scaling_sgd,
        skip_nonfinite,
        drop_bad_replica,
        drop_all_bad,
        sync_gradients_int8,
        powersgd_transform,
    )
}


# The worker: trains the configurations with whichever jdp is on sys.path.


def batches(replicas: int) -> list[dict]:
    """STEPS global batches (NumPy), the same in every version and process."""
    rng = np.random.default_rng(1)
    n = replicas * PER_REPLICA
    out = []
    for _ in range(STEPS):
        out.append(
            {
                "ids": rng.integers(0, VOCAB, (n, 4)).astype(np.int32),
                "x": rng.normal(size=(n, SIZES[0])).astype(np.float32),
                "y": rng.normal(size=(n, SIZES[-1])).astype(np.float32),
                "mask": (
                    rng.random(n)
                    < np.repeat(np.linspace(0.2, 0.9, replicas), PER_REPLICA)
                ).astype(np.float32),
            }
        )
    return out


def initial_params() -> dict:
    from _common import normal_mlp

    rng = np.random.default_rng(0)
    embed = rng.normal(size=(VOCAB, SIZES[0])).astype(np.float32) / 4
    return {"embed": embed, "mlp": normal_mlp(SIZES, seed=0)}


def losses(jdp):
    import jax.numpy as jnp

    def forward(params, batch):
        h = params["embed"][batch["ids"]].mean(axis=1) + batch["x"]
        for i, layer in enumerate(params["mlp"]):
            h = h @ layer["w"] + layer["b"]
            if i < len(params["mlp"]) - 1:
                h = jnp.tanh(h)
        return h

    def mse(params, batch):
        return jnp.mean((forward(params, batch) - batch["y"]) ** 2)

    def weighted(params, batch):
        err = jnp.sum((forward(params, batch) - batch["y"]) ** 2, axis=-1)
        return jdp.weighted(jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"]))

    return {"mse": mse, "weighted": weighted}


def train(name: str, backend: str, jdp, V3: bool, steps: int) -> dict[str, np.ndarray]:
    """Trains configuration `name`; returns every leaf of the final state."""
    import jax
    import jax.numpy as jnp

    cfg = CONFIGS[name](jdp, V3)
    devices = jax.devices()
    per_process = REPLICAS // jax.process_count()
    local = [d for d in devices if d.process_index == jax.process_index()]
    if jax.process_count() > 1:
        flat = [
            d
            for p in range(jax.process_count())
            for d in [e for e in devices if e.process_index == p][:per_process]
        ]
    else:
        flat = local[:REPLICAS]
    options = dict(backend=backend)
    if cfg["mesh"] == "2x2":
        options.update(devices=[flat[:2], flat[2:]], axis_name=("host", "device"))
    else:
        options.update(devices=flat)
    train_options = dict(cfg["train"])
    if cfg["sync"] is not None:
        train_options["sync"] = cfg["sync"]
    step = jdp.parallelize(
        jdp.make_train_step(losses(jdp)[cfg["loss"]], cfg["tx"], **train_options),
        **options,
    )
    params = jax.tree.map(jnp.asarray, initial_params())
    state = jdp.TrainState.create(
        params=params, tx=cfg["tx"], sync=cfg["sync"], **cfg["state"]
    )
    state = step.replicate(state)
    mine = slice(
        jax.process_index() * per_process * PER_REPLICA,
        (jax.process_index() + 1) * per_process * PER_REPLICA,
    )
    for i, batch in enumerate(batches(REPLICAS)[:steps]):
        for r in cfg["poison"] if i == POISON_STEP else ():
            batch["x"][r * PER_REPLICA : (r + 1) * PER_REPLICA] = np.nan
        batch = jax.tree.map(lambda a: a[mine], batch)  # this process's replicas
        state, _ = step(state, step.shard(batch))
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            from jax.experimental import multihost_utils

            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        leaves[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return leaves


def worker(args) -> None:
    from _common import set_devices

    if "JDP_PROCESS_ID" not in os.environ:
        set_devices(8)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import warnings

    import jax

    import jdp

    if int(os.environ.get("JDP_NUM_PROCESSES", "1")) > 1:
        jdp.distributed.initialize()  # before anything asks JAX for devices
    V3 = hasattr(jdp, "powersgd_transform")
    rank = jax.process_index()
    status = {
        "version": jdp.__version__,
        "file": os.path.dirname(jdp.__file__),
        "processes": jax.process_count(),
        "rows": {},
    }
    label = f"{jdp.__version__} ({'0.3' if V3 else '0.4'} API)"
    for name in args.only:
        for backend in args.backends:
            key = f"{name}-{backend}"
            row = status["rows"][key] = {"warnings": []}
            start = time.perf_counter()
            try:
                cfg = CONFIGS[name](jdp, V3)
                if cfg["mesh"] == "2x2" and backend != "shard_map":
                    row["skip"] = "shard_map only"
                    continue
                if jax.process_count() > 1 and backend not in cfg["multiprocess"]:
                    row["skip"] = f"one process only under {backend}"
                    continue
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    leaves = train(name, backend, jdp, V3, args.steps)
                row["warnings"] = sorted({str(w.message)[:200] for w in caught})
                if rank == 0:
                    np.savez(os.path.join(args.out, key + ".npz"), **leaves)
                row["leaves"] = list(leaves)
            except Exception as e:  # noqa: BLE001 - reported in the table
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            row["seconds"] = round(time.perf_counter() - start, 1)
            if rank == 0:
                result = "error" if "error" in row else "ok"
                print(
                    f"  {label} {key}: {result} ({row['seconds']} s)",
                    file=sys.stderr,
                    flush=True,
                )
    if rank == 0:
        with open(os.path.join(args.out, "status.json"), "w") as f:
            json.dump(status, f, indent=1)


# The parent: exports the ref, runs the workers, compares.


def newest_tag() -> str | None:
    out = subprocess.run(
        ["git", "-C", ROOT, "describe", "--tags", "--abbrev=0"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or None


def run_worker(jdp_root: str, out: str, args) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [jdp_root, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    worker_args = [
        os.path.abspath(__file__),
        "--worker",
        "--out",
        out,
        "--only",
        *args.only,
        "--backends",
        *args.backends,
        "--steps",
        str(args.steps),
    ]
    if args.processes > 1:
        devices = REPLICAS // args.processes
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        command = [
            sys.executable,
            "-m",
            "jdp.launch",
            "--num-processes",
            str(args.processes),
            "--devices-per-process",
            str(devices),
            "--timeout",
            str(args.timeout),
            *worker_args,
        ]
    else:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        command = [sys.executable, *worker_args]
    log = open(os.path.join(out, "worker.log"), "w")
    # cwd: anywhere but the repository root, so that only PYTHONPATH finds jdp
    return subprocess.Popen(
        command, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT
    )


def compare(
    ref: str, new: str, key: str, ref_status: dict, new_status: dict
) -> tuple[str, bool]:
    """`(result, differs)` of one configuration and backend."""
    rows = [ref_status["rows"].get(key), new_status["rows"].get(key)]
    if rows[0] is None or rows[1] is None:
        return "error: the worker did not reach it (see worker.log)", True
    if "skip" in rows[0] or "skip" in rows[1]:
        return "skipped: " + (rows[0].get("skip") or rows[1].get("skip")), False
    errors = [
        f"{who}: {row['error']}"
        for who, row in zip(("ref", "tree"), rows, strict=True)
        if "error" in row
    ]
    if errors:
        return "error: " + "; ".join(errors), True
    a = np.load(os.path.join(ref, key + ".npz"))
    b = np.load(os.path.join(new, key + ".npz"))
    only_a = [k for k in rows[0]["leaves"] if k not in b.files]
    only_b = [k for k in rows[1]["leaves"] if k not in a.files]
    if only_a or only_b:
        return (
            f"differs: leaves only in ref {only_a[:3]}, only in tree {only_b[:3]}",
            True,
        )
    worst, first, count = 0.0, None, 0
    for k in rows[0]["leaves"]:
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            return (
                f"differs: {k} is {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}",
                True,
            )
        if np.array_equal(
            np.ascontiguousarray(x).view(np.uint8),
            np.ascontiguousarray(y).view(np.uint8),
        ):
            continue
        count += 1
        first = first or k
        diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
        worst = max(worst, float(np.nanmax(diff)) if diff.size else 0.0)
    if first is None:
        return f"identical ({len(rows[0]['leaves'])} leaves)", False
    return (
        f"differs: max abs diff {worst:.3g}, {count}/{len(rows[0]['leaves'])} leaves, "
        f"first {first}",
        True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--ref", default=None, help="the older version (default: newest tag)"
    )
    parser.add_argument(
        "--only", nargs="+", default=list(CONFIGS), choices=list(CONFIGS)
    )
    parser.add_argument(
        "--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS
    )
    parser.add_argument("--steps", type=int, default=STEPS, help=f"1 to {STEPS}")
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2))
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        choices=(1, 2),
        help="run the two workers at once (2) or one after the other",
    )
    parser.add_argument("--timeout", type=int, default=1800, help="per worker, seconds")
    parser.add_argument(
        "--keep", default=None, help="keep the workers' files in this directory"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    ref = args.ref or newest_tag()
    if ref is None:
        parser.error("the repository has no tag: give --ref (e.g. --ref 061b990)")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compare_versions-") as tmp:
        base = args.keep or tmp
        src, out_ref, out_new = (os.path.join(base, d) for d in ("src", "ref", "tree"))
        for d in (src, out_ref, out_new):
            os.makedirs(d, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", ROOT, "archive", ref, "jdp"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, check=True)
        print(
            f"ref {ref} -> {src}; tree {ROOT}; {args.processes} process(es)",
            file=sys.stderr,
            flush=True,
        )
        pairs = [(src, out_ref), (ROOT, out_new)]
        codes = []
        if args.jobs == 2:
            procs = [run_worker(r, o, args) for r, o in pairs]
            codes = [p.wait(timeout=args.timeout + 60) for p in procs]
        else:
            for r, o in pairs:
                codes.append(run_worker(r, o, args).wait(timeout=args.timeout + 60))
        statuses = []
        for (_, o), code in zip(pairs, codes, strict=True):
            path = os.path.join(o, "status.json")
            if code != 0 or not os.path.exists(path):
                with open(os.path.join(o, "worker.log")) as f:
                    tail = f.read()[-3000:]
                sys.exit(f"worker in {o} exited with {code}:\n{tail}")
            with open(path) as f:
                statuses.append(json.load(f))
        for who, s in zip(("ref", "tree"), statuses, strict=True):
            print(
                f"{who}: jdp {s['version']} from {s['file']}, "
                f"{s['processes']} process(es)"
            )
        failed = False
        print("\n| configuration | backend | result |\n|---|---|---|")
        for name in args.only:
            for backend in args.backends:
                key = f"{name}-{backend}"
                result, differs = compare(out_ref, out_new, key, *statuses)
                why = next(
                    (
                        EXPECTED[k]
                        for k in (
                            (name, b, p)
                            for b in (backend, None)
                            for p in (args.processes, None)
                        )
                        if k in EXPECTED
                    ),
                    None,
                )
                if why and result.startswith("differs"):
                    result += f" (expected: {why})"
                failed |= differs and not (why and result.startswith("differs"))
                print(f"| {name} | {backend} | {result} |", flush=True)
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
