"""The 8-bit codec of `jdp.all_reduce(wire=...)` on one CPU core, against a copy.

Per size (a float32 vector of N values: 1M, 8.9M and 39M, the gradient sizes of
`multihost.py`'s MLPs), in one process pinned to one core (`os.sched_setaffinity`
before JAX is imported: XLA sizes its thread pool from the affinity mask), with
the allocator thresholds of jdp's entry points (`jdp._allocator.tune()`):

- `copy`: `jnp.copy` of the vector, one read and one write of N float32s: the
  floor every row is compared with;
- `encode`: `wire.encode(x)`: the block scales and the payload;
- `decode`: `wire.decode(q, scales)`: back to float32;
- `encode+EF`: the sending side of an exchange among 2 replicas with error
  feedback, as `jdp.all_reduce(wire=..., error_feedback=True)` runs it on the
  leaves of `multihost.py`'s MLP of that size (`_wire._quantise` and `_pack`):
  each leaf plus last step's error, scales, payload, new error, and the buffer
  the all-to-all sends; the error buffers are donated and carried from call to
  call, as in a train step;
- `average+EF`: the receiving side, as the owner of one of the 2 chunks runs it
  (`_wire._unpack`, `_average`, `_pack`): its chunk from both replicas decoded
  from that buffer, their mean plus its error, encoded again with its new error
  (donated and carried), packed for the all-gather.

Between the two sides run the all-to-all and all-gather of the payloads, and
after them one more `decode` per leaf; `compression.py time` times the whole
exchange across processes.

Each round runs every row `--reps` times, rows interleaved, in a fresh process;
the table gives the median over rounds of each round's median wall time and the
range of those medians, the median CPU time per call (`time.process_time`: less
disturbed by other load than the wall time), GB/s (N float32s, 4N bytes, over the
median wall time) and the ratio to the copy's time. `--ref DIR` times the jdp at
DIR as well (a git worktree of another commit, imported through PYTHONPATH), its
processes alternating with this tree's in a shuffled order.

    python benchmarks/codec.py [--sizes 1M 8.9M 39M] [--rounds 5] [--reps 7]
                               [--wire int8 fp8] [--ref DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

from multihost import WIDTHS, num_params, sizes_of

SIZES = {k: num_params(WIDTHS[k]) for k in ("1M", "8.9M", "39M")}
ROWS = ("copy", "encode", "decode", "encode+EF", "average+EF")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(sizes: list[str], wires: list[str], reps: int, warmup: int) -> dict:
    """Runs in a pinned process: `{"size wire row": [wall s, cpu s] medians}`."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jdp
    from jdp import _wire

    out = {}
    for size in sizes:
        n = SIZES[size]
        rng = np.random.default_rng(0)
        host = rng.normal(size=(2, n)).astype(np.float32)
        host *= np.linspace(0.01, 10, n, dtype=np.float32)  # uneven magnitudes
        x = jax.device_put(host[0], jax.devices()[0])
        leaves, at = [], 0
        for k in leaf_sizes(size):
            leaves.append(jax.device_put(host[0, at : at + k], jax.devices()[0]))
            at += k
        for name in wires:
            wire = {"int8": jdp.wire.int8(), "fp8": jdp.wire.fp8()}[name]
            p = -(-n // wire.block_size) * wire.block_size
            xp = jnp.pad(x, (0, p - n))  # `encode` takes whole blocks
            q, s = jax.jit(wire.encode)(xp)
            sizes = [int(v.size) for v in leaves]
            padded = [-(-k // wire.block_size) * wire.block_size for k in sizes]
            box = {"error": tuple(jnp.zeros(k, jnp.float32) for k in padded)}

            def send(vs, errors, wire=wire, sizes=sizes, padded=padded):
                state = _wire.WireState(errors, errors[0])
                workers, payload, scale = _wire._quantise(
                    vs, sizes, padded, wire, state, 2
                )
                return tuple(workers), _wire._pack(payload.reshape(2, -1), scale, 2)

            send = jax.jit(send, donate_argnums=1)
            _, rows = send(leaves, tuple(jnp.zeros(k, jnp.float32) for k in padded))
            # A row: the chunk, then its scales' bytes (4 a block).
            chunk = rows.shape[1] * wire.block_size // (wire.block_size + 4)

            def average(rows, server, wire=wire, chunk=chunk):
                got, got_scale = _wire._unpack(rows, wire, chunk)
                own_q, own_scale, server = _wire._average(got, got_scale, wire, server)
                return _wire._pack(own_q[None], own_scale, 1), server

            average = jax.jit(average, donate_argnums=1)
            box["server"] = jnp.zeros(sum(padded), jnp.float32)
            copy, enc, dec = (
                jax.jit(jnp.copy),
                jax.jit(wire.encode),
                jax.jit(wire.decode),
            )

            def run_send(box=box, send=send, leaves=leaves):
                box["error"], rows = send(leaves, box["error"])
                return rows

            def run_average(box=box, f=average, rows=rows):
                out, box["server"] = f(rows, box["server"])
                return out

            calls = {
                "copy": lambda copy=copy, x=x: copy(x),
                "encode": lambda enc=enc, xp=xp: enc(xp),
                "decode": lambda dec=dec, q=q, s=s: dec(q, s),
                "encode+EF": run_send,
                "average+EF": run_average,
            }
            times = {row: [] for row in calls}
            for i in range(warmup + reps):
                for row, call in calls.items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    jax.block_until_ready(call())
                    if i >= warmup:
                        times[row].append(
                            (time.perf_counter() - wall, time.process_time() - cpu)
                        )
            for row, got in times.items():
                out[f"{size} {name} {row}"] = [
                    statistics.median(t[0] for t in got),
                    statistics.median(t[1] for t in got),
                ]
            del box, calls
    return out


def leaf_sizes(size: str) -> list[int]:
    """The sizes of the leaves (weights, biases) of `multihost.py`'s MLP."""
    s = sizes_of(WIDTHS[size])
    return [k for a, b in zip(s[:-1], s[1:], strict=True) for k in (a * b, b)]


def run_child(tree: str, args, core: int) -> dict:
    """One round in a fresh process, importing jdp from `tree`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree, HERE])
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    code = (
        f"import os, sys, json; os.sched_setaffinity(0, {{{core}}}); "
        "from jdp import _allocator; _allocator.tune(); import jdp, codec; "
        f"assert os.path.dirname(os.path.dirname(jdp.__file__)) == {tree!r}; "
        f"out = codec.child({args.sizes!r}, {args.wire!r}, {args.reps}, "
        f"{args.warmup}); print('RESULT', json.dumps(out))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        cwd="/",
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def summary(samples: list[float]) -> tuple[float, float, float]:
    ms = [1e3 * s for s in samples]
    return statistics.median(ms), min(ms), max(ms)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--wire", nargs="+", default=["int8"], choices=["int8", "fp8"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--ref", default=None, help="a tree of another jdp version to time as well"
    )
    parser.add_argument("--quick", action="store_true", help="1 round, 1M and 8.9M")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.sizes, args.reps = 1, ["1M", "8.9M"], 3
    core = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    trees = {"this": ROOT}
    if args.ref:
        trees = {"ref": os.path.abspath(args.ref), "this": ROOT}
    results: dict = {}
    rng = random.Random(0)
    for r in range(args.rounds):
        order = list(trees)
        rng.shuffle(order)
        for version in order:
            for key, (wall, cpu) in run_child(trees[version], args, core).items():
                results.setdefault((version, key), []).append((wall, cpu))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(
        f"\n### Codec on one core (core {core}), {args.rounds} rounds x "
        f"{args.reps} calls, median (range) over rounds\n"
    )
    cols = list(trees)
    head = ["size", "wire", "row"]
    for stat in ("ms (range)", "CPU ms", "GB/s", "/ copy"):
        head += [f"{v} {stat}" if args.ref else stat for v in cols]
    if args.ref:
        head.append("this / ref")
    print("| " + " | ".join(head) + " |")
    print("|---|---|---|" + "---:|" * (len(head) - 3))
    for size in args.sizes:
        for name in args.wire:
            for row in ROWS:
                wall, cpu, speed, ratio = {}, {}, {}, {}
                for v in cols:
                    got = results[(v, f"{size} {name} {row}")]
                    copy = results[(v, f"{size} {name} copy")]
                    med, lo, hi = summary([g[0] for g in got])
                    wall[v] = med
                    cells = f"{med:.2f} ({lo:.2f}-{hi:.2f})"
                    cpu[v] = f"{summary([g[1] for g in got])[0]:.2f}"
                    speed[v] = f"{4 * SIZES[size] / med / 1e6:.2f}"
                    ratio[v] = f"{med / summary([g[0] for g in copy])[0]:.2f}"
                    wall[v, "cell"] = cells
                line = [size, name, row]
                line += [wall[v, "cell"] for v in cols] + [cpu[v] for v in cols]
                line += [speed[v] for v in cols] + [ratio[v] for v in cols]
                if args.ref:
                    line.append(f"{wall['this'] / wall['ref']:.2f}")
                print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
