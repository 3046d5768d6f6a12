"""The copies XLA makes in each compiled training step, per configuration.

A donated step updates its state in place; where XLA cannot prove that an update
comes after every read of the old value, it copies the buffer first, every step,
and nothing fails: only the step gets slower (a copy of every weight and
gradient costs a sizeable share of a CPU step). This compiles, without running,
the step of an MLP 256-512-512-10 (two weights of 512 KiB and 1 MiB) on 8
simulated CPU devices for each sync piece and optimizer, and lists every `copy` of
64 KiB or more in the compiled program by where it runs: in the step itself (every
step), in a `lax.cond` branch taken when nothing is due (every step but the
syncs), or in the branch of a sync (once per sync).

Expected on the default `shard_map` backend: none every step. A block sync that
writes one new value into two buffers (the global model and the params of
`jdp.bmuf`, a leaf a fragment holds whole) copies it, which costs what a second
write would. `backend="pmap"` copies every updated leaf every step, as `jax.pmap`
does for a hand-written step (the performance guide says why).

    python benchmarks/copies.py [--backends shard_map pmap] [--quick]
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from _common import set_devices

#: The model's layer sizes; its weights are 512 KiB and 1 MiB.
SIZES = (256, 512, 512, 10)
#: The smallest copy listed (the size under which jdp's views skip a leaf too).
MIN_BYTES = 1 << 16


def configurations(jdp, optax):
    """name -> (sync piece, optimizer, `make_train_step` options, loss kind[,
    number of devices: all 8 if absent])."""
    sgd, adam = optax.sgd(0.01, momentum=0.9), optax.adam(1e-3)
    diloco = optax.sgd(0.7, momentum=0.9, nesterov=True)
    dense, embed = {"w": "dense", "b": "dense"}, {"w": "embed", "b": "embed"}
    labels = [dense, embed, dense]  # the middle layer trains locally, with BMUF
    return {
        "all_reduce, sgd": (jdp.all_reduce(), sgd, {}, "mlp"),
        "all_reduce, adam": (jdp.all_reduce(), adam, {}, "mlp"),
        "all_reduce, adam, skip_nonfinite": (
            jdp.all_reduce(), adam, {"skip_nonfinite": True}, "mlp"
        ),
        "all_reduce, adam, 2 microbatches": (
            jdp.all_reduce(), adam, {"microbatches": 2}, "mlp"
        ),
        "bf16": (jdp.all_reduce(wire=jdp.wire.bf16()), sgd, {}, "mlp"),
        "int8 + error feedback": (
            jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True), sgd, {}, "mlp"
        ),
        "drop bad replicas": (
            jdp.all_reduce(on_bad_replica="drop"), adam, {"skip_nonfinite": True},
            "mlp",
        ),
        "powersgd rank 4": (jdp.powersgd(rank=4), sgd, {}, "mlp"),
        "local, adam": (jdp.local(), adam, {}, "mlp"),
        "local, adam, skip_nonfinite": (
            jdp.local(), adam, {"skip_nonfinite": True}, "mlp"
        ),
        "sync_gradients in the optimizer": (
            jdp.local(), optax.chain(jdp.sync_gradients(jdp.all_reduce()), adam), {},
            "mlp",
        ),
        "zero(adam)": (jdp.local(), jdp.zero(adam), {}, "mlp"),
        "bmuf": (jdp.local(), jdp.bmuf(sgd, 8), {}, "mlp"),
        "bmuf, nesterov block momentum": (
            jdp.local(), jdp.bmuf(sgd, 8, outer=jdp.block_momentum(nesterov=True)), {},
            "mlp",
        ),
        "DiLoCo (adam inside)": (
            jdp.local(), jdp.bmuf(adam, 8, outer=diloco), {}, "mlp"
        ),
        "Streaming DiLoCo, F=4, delay 1": (
            jdp.local(),
            jdp.bmuf(adam, 8, streaming=jdp.Streaming(4, delay=1), outer=diloco),
            {}, "mlp",
        ),
        "Streaming, F=4, delay 2, nesterov": (
            jdp.local(),
            jdp.bmuf(
                sgd, 8, streaming=jdp.Streaming(4, delay=2),
                outer=jdp.block_momentum(nesterov=True),
            ),
            {}, "mlp",
        ),
        "partition: all_reduce + bmuf": (
            jdp.partition(labels, {"dense": jdp.all_reduce(), "embed": jdp.local()}),
            optax.multi_transform({"dense": adam, "embed": jdp.bmuf(adam, 8)}, labels),
            {}, "mlp",
        ),
        "sparse.rows + adam": (
            jdp.sparse.rows(),
            jdp.sparse.optimizer(adam, {"embed": jdp.sparse.adagrad(0.1)}),
            {}, "sparse",
        ),
        "two devices: int8 + error feedback": (
            jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True), sgd, {}, "mlp", 2
        ),
        "one device: all_reduce, adam": (jdp.all_reduce(), adam, {}, "mlp", 1),
        "one device: int8 + error feedback, adam": (
            jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True),
            adam, {}, "mlp", 1,
        ),
        "one device: powersgd rank 4": (jdp.powersgd(rank=4), adam, {}, "mlp", 1),
    }  # fmt: skip


def model(kind: str):
    """`(loss_fn, params, batch)` of the MLP, or of a table + MLP for the rows."""
    import jax.numpy as jnp
    import numpy as np

    import jdp

    rng = np.random.default_rng(0)

    def dense(a, b):
        return {
            "w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "b": np.zeros(b, np.float32),
        }

    layers = [dense(a, b) for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)]

    def mlp(layers, h):
        for i, layer in enumerate(layers):
            h = h @ layer["w"] + layer["b"]
            h = jnp.tanh(h) if i < len(layers) - 1 else h
        return h

    y = rng.normal(size=(64, SIZES[-1])).astype(np.float32)
    if kind == "mlp":
        x = rng.normal(size=(64, SIZES[0])).astype(np.float32)
        return (
            lambda p, b: jnp.mean((mlp(p, b["x"]) - b["y"]) ** 2),
            layers,
            {"x": x, "y": y},
        )
    table = (0.01 * rng.normal(size=(20_000, SIZES[0]))).astype(np.float32)

    def loss(p, b):
        x = jdp.sparse.lookup(p["embed"], b["ids"])
        return jnp.mean((mlp(p["mlp"], x) - b["y"]) ** 2)

    ids = rng.integers(0, 20_000, 64)
    return loss, {"embed": table, "mlp": layers}, {"ids": ids, "y": y}


def where_copies(hlo_text: str) -> dict[str, list[str]]:
    """Copies of `MIN_BYTES` or more, by where they run: `step`, `untaken`, `sync`.

    Computations are followed from the entry (loop bodies, calls, branches), each
    taking its caller's role, but for the branches of a `jdp.bmuf` conditional
    (named `bmuf_...`): `untaken` (nothing due) and `sync`. Another conditional's
    branches (`skip_nonfinite`'s, a warmup's) keep their caller's role, a rarely
    taken one included: a copy there is counted, not hidden.
    """
    from jdp import _hlo

    comps, entry = _hlo._parse_computations(hlo_text)
    role, todo = {entry: "step"}, [entry]
    while todo:
        caller = todo.pop()
        for line in comps[caller]:
            m = re.search(r"branch_computations=\{%([^,}]+), %([^,}]+)\}", line)
            if m and "/bmuf_" in line:
                callees = {m[1]: "untaken", m[2]: "sync"}
            else:
                calls = r"(?:body|condition|calls|to_apply)=%([\w.-]+)"
                names = m.groups() if m else re.findall(calls, line)
                callees = dict.fromkeys(names, role[caller])
            for name, r in callees.items():
                if name in comps and name not in role:
                    role[name] = r
                    todo.append(name)
    found: dict[str, list[str]] = {"step": [], "untaken": [], "sync": []}
    for name, lines in comps.items():
        for line in lines:
            m = re.search(r"= (\w+)\[([\d,]+)\]\{[^}]*\} copy\(", line)
            if not m:
                continue
            nbytes = int(re.sub(r"\D", "", m[1]) or 8) // 8  # f32 -> 4, pred -> 1
            for d in m[2].split(","):
                nbytes *= int(d)
            if nbytes >= MIN_BYTES and name in role:
                found[role[name]].append(f"{m[1]}[{m[2]}]")
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backends", nargs="+", default=["shard_map", "pmap"],
        choices=["shard_map", "pmap"],
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="shard_map alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.backends = ["shard_map"]
    if "jax" not in sys.modules:
        set_devices(8)
    import jax
    import optax

    import jdp

    start = time.perf_counter()
    print(
        f"\nCopies of {MIN_BYTES // 1024} KiB or more in the compiled step: MLP "
        f"{'-'.join(map(str, SIZES))}, 8 simulated CPU devices, jax {jax.__version__}"
        "\n\n| configuration | backend | every step | untaken branches | sync "
        "branches |\n|---|---|---|---|---|"
    )

    def cell(copies):
        if not copies:
            return "none"
        counts: dict[str, int] = {}
        for c in copies:
            counts[c] = counts.get(c, 0) + 1
        return ", ".join(f"{n} x {c}" for c, n in counts.items())

    for backend in args.backends:
        for name, (sync, tx, options, kind, *n) in configurations(jdp, optax).items():
            loss, params, batch = model(kind)
            step = jdp.parallelize(
                jdp.make_train_step(loss, tx, sync=sync, **options),
                backend=backend, devices=jax.devices()[: n[0] if n else None],
            )  # fmt: skip
            state = step.replicate(
                jdp.TrainState.create(params=params, tx=tx, sync=sync)
            )
            text = step.lower(state, step.shard(batch)).compile().as_text()
            found = where_copies(text)
            print(
                f"| {name} | {backend} | {cell(found['step'])} | "
                f"{cell(found['untaken'])} | {cell(found['sync'])} |",
                flush=True,
            )
    print(f"\n{time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
