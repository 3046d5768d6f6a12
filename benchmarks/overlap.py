"""The float32 all-reduce overlapping the backward pass: bucket chain vs combined.

`jdp.all_reduce()` sends the gradients in buckets, last layer first. XLA's
all-reduce combiner merges independent all-reduces of a step into one, which then
waits for every gradient: nothing of it can run during the backward pass. jdp
chains the buckets (each one's input waits for the previous bucket's result,
`jdp._buckets.after`), so that XLA keeps them apart and each may start as soon as
its own gradients exist. This benchmark measures what that changes in 2 processes
x 1 CPU device on 127.0.0.1 (JAX's gloo collectives), with the MLP 256-W-W-W-10 of
`multihost.py` (SGD with momentum, 8 examples per process, the same weights
everywhere), in rows:

- `local`: `jdp.make_train_step(..., sync=jdp.local())`, no communication;
- `chained`: `jdp.make_train_step` as this tree ships it (`jdp.all_reduce()`);
- `combined`: the same step with the chain taken out (`_buckets.after` replaced by
  the identity), in the same processes: what XLA makes of unchained buckets;
- `ref local`, `ref`: the local and `jdp.all_reduce()` steps of an older jdp
  (`--ref`, exported with `git archive REF jdp` into a temporary directory that
  is put first on the processes' `PYTHONPATH` and removed at the end).

Each round launches the processes of this tree and of the ref (alternately first);
in a job every row is compiled and warmed up, then timed in `--inner` passes of
`--steps` steps per row, the row order reversed every pass. A row's figure in a
round is the median of its timed steps; the table gives the median over rounds and
the range. "sync ms" is a row's step minus its own job's local step; "hidden ms"
is the combined (or ref) sync minus the chained sync: communication that no longer
adds to the step. The compiled program's all-reduces are counted for each row,
and the final losses printed (the rows train from the same weights: equal losses
mean equal sums).

    python benchmarks/overlap.py --ref REF [--sizes 8.9M 39M] [--rounds 5]
                                 [--steps 6] [--inner 3] [--pin]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import median_ms, mlp_loss, pin_to_core, raw_psum
from multihost import LR, MOMENTUM, WIDTHS, _data, num_params

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_SIZES = ("8.9M", "39M")
TREE_ROWS = ("local", "chained", "combined")
REF_ROWS = ("local", "ref")


def job(width: int, rows, steps: int, warmup: int, inner: int, pin: bool):
    """Runs in both processes: per row, the median step time and the loss."""
    pin_to_core(pin)  # before JAX is imported: XLA sizes its pool from the mask
    import jax
    import numpy as np
    import optax

    import jdp
    from jdp import _buckets

    jdp.distributed.initialize()
    chain = getattr(_buckets, "after", None)

    @contextlib.contextmanager
    def traced_as(row):
        """While `row` is traced: `combined` without the chain."""
        if row == "combined":
            _buckets.after = lambda arrays, previous, **kw: arrays
        try:
            yield
        finally:
            if chain is not None:
                _buckets.after = chain

    weights, x, y = _data(width, jax.process_index())
    params = [{"w": w, "b": np.zeros(w.shape[1], np.float32)} for w in weights]
    tx = optax.sgd(LR, momentum=MOMENTUM)
    calls, boxes, arrays = {}, {}, {}
    for row in rows:
        sync = jdp.local() if row == "local" else jdp.all_reduce()
        step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx, sync=sync))
        box = {"state": step.replicate(jdp.TrainState.create(params=params, tx=tx))}
        batch = step.shard({"x": x, "y": y})

        def one(step=step, box=box, batch=batch):
            box["state"], metrics = step(box["state"], batch)
            box["loss"] = float(metrics["loss"])  # waits for the step

        with traced_as(row):
            one()  # compiles
            ops = step.collectives(box["state"], batch)
        for _ in range(warmup):
            one()
        arrays[row] = [len(c.shapes) for c in ops if c.kind == "all-reduce"]
        calls[row], boxes[row] = one, box
    times = {row: [] for row in rows}
    order = list(rows)
    for _ in range(inner):
        for row in order:
            times[row].append(median_ms(calls[row], steps, 0))
        order.reverse()
    if "chained" in rows:  # the transport alone
        times["raw"] = [median_ms(raw_psum(num_params(width)), steps, warmup)]
    return {
        "jdp": os.path.dirname(jdp.__file__),
        "ms": {row: statistics.median(v) for row, v in times.items()},
        "loss": {row: boxes[row]["loss"] for row in rows},
        "all_reduces": arrays,
    }


def _launch(width, rows, args, env=None):
    import jdp.launch

    return jdp.launch.run(
        job,
        2,
        args=(width, rows, args.steps, args.warmup, args.inner, args.pin),
        devices_per_process=1,
        initialize=False,
        timeout_s=1800,
        env=env,
        quiet=True,
    )[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="older jdp to compare with (a git ref)")
    parser.add_argument(
        "--sizes", nargs="+", choices=list(WIDTHS), default=list(DEFAULT_SIZES)
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per pass")
    parser.add_argument("--inner", type=int, default=3, help="passes per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--pin", action="store_true", help="pin each process to its own core"
    )
    parser.add_argument("--quick", action="store_true", help="8.9M, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.inner = ["8.9M"], 2, 2

    with tempfile.TemporaryDirectory(prefix="overlap-") as tmp:
        env = None
        if args.ref:
            archive = subprocess.run(
                ["git", "-C", ROOT, "archive", args.ref, "jdp"],
                capture_output=True,
                check=True,
            )
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            env = {"PYTHONPATH": tmp}
        results = _rounds(args, env, tmp)
    _report(args, results)


def _rounds(args, env, ref_dir):
    """`{size: {"tree": [job results], "ref": [...]}}` over the rounds."""
    results = {s: {"tree": [], "ref": []} for s in args.sizes}
    for rnd in range(args.rounds):
        for size in args.sizes:
            width = WIDTHS[size]
            runs = [("tree", TREE_ROWS, None)]
            if env is not None:
                runs.append(("ref", REF_ROWS, env))
            if rnd % 2:
                runs.reverse()
            for which, rows, e in runs:
                start = time.perf_counter()
                rows = rows if rnd % 2 == 0 else rows[::-1]
                res = _launch(width, rows, args, e)
                where = os.path.realpath(res["jdp"])
                want = os.path.join(ref_dir if which == "ref" else ROOT, "jdp")
                if where != os.path.realpath(want):
                    raise RuntimeError(f"{which} job imported jdp from {where}")
                results[size][which].append(res)
                print(
                    f"  round {rnd + 1}/{args.rounds} {size} {which}: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in res["ms"].items())
                    + f" ms ({time.perf_counter() - start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def _report(args, results) -> None:
    pinned = "each process pinned to its own core" if args.pin else "unpinned"
    print(
        f"\n2 processes x 1 CPU device, gloo on 127.0.0.1, {pinned}; MLP 256-W-W-W-10,"
        f" SGD momentum, 8 examples per process; {args.rounds} rounds x "
        f"{args.inner} passes x {args.steps} steps; ref {args.ref or '-'}\n"
    )
    print(
        "| model | row | all-reduces (arrays each) | step ms | range | sync ms "
        "| range | hidden ms | final loss |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        width = WIDTHS[size]
        label = f"{size} ({4 * num_params(width) / 2**20:.0f} MiB)"
        rows = [("tree", r) for r in TREE_ROWS]
        if results[size]["ref"]:
            rows += [("ref", r) for r in REF_ROWS]
        syncs = {}
        for which, row in rows:
            jobs = results[size][which]
            ms = [j["ms"][row] for j in jobs]
            if row != "local":
                syncs[row] = [j["ms"][row] - j["ms"]["local"] for j in jobs]
        chained = syncs["chained"]
        for which, row in rows:
            jobs = results[size][which]
            ms = [j["ms"][row] for j in jobs]
            name = f"ref {row}" if which == "ref" and row == "local" else row
            sync = syncs.get(row)
            hidden = ""
            if row in ("combined", "ref"):
                diffs = [a - b for a, b in zip(sync, chained, strict=True)]
                hidden = f"{statistics.median(diffs):.1f} ({min(diffs):.1f} to "
                hidden += f"{max(diffs):.1f})"
            print(
                f"| {label} | {name} | {jobs[-1]['all_reduces'][row] or '-'} "
                f"| {statistics.median(ms):.1f} | {min(ms):.1f}-{max(ms):.1f} | "
                + (
                    f"{statistics.median(sync):.1f} | {min(sync):.1f}-{max(sync):.1f}"
                    if sync
                    else " | "
                )
                + f" | {hidden} | {jobs[-1]['loss'][row]:.6f} |"
            )
        raw = [j["ms"]["raw"] for j in results[size]["tree"]]
        print(
            f"| {label} | raw psum of the gradient bytes | 1 | "
            f"{statistics.median(raw):.1f} | {min(raw):.1f}-{max(raw):.1f} | | | | |"
        )


if __name__ == "__main__":
    main()
