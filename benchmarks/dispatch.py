"""What a jdp step costs the host per call, as the state's leaf count grows.

A step that does almost no work (every state leaf + 1, the sum of the batch) is
timed call by call (dispatch, then waiting for the metric), jdp against the same
step written by hand: `jax.jit` of `jax.shard_map` over the replica axis (or
`jax.pmap`), with the state donated. What is left is the host's share of a call:
flattening the state, jdp's checks and donation. States:

- a dict of N small leaves (N = 10, 100, 600: about the params, BatchNorm
  statistics and momentum of a ResNet-50);
- flax NNX modules with 300 leaves (a 50-layer MLP and its `nnx.Optimizer`, Adam),
  passed to the step directly (NNX modules are pytrees) and as `nnx.split` state;
- the same modules against flax's own recipe for data parallelism instead of a
  hand-written `shard_map`: `nnx.jit` of the step on modules placed `P()` (every
  device a copy) and the batch `P('data')`, updating the modules in place;
- the same modules in an evaluation loop: a forward-only step (the sum of every
  leaf and of the batch) called on the same state again and again.

Each round times every variant `--calls` times, in a fresh order; ratios are taken
within a round, then the median over rounds.

    python benchmarks/dispatch.py [--devices 8] [--rounds 7] [--calls 30] [--quick]
                                  [--gc-freeze] [--dict-leaves 10 100 600]

`--gc-freeze` calls `gc.freeze()` once everything is built, as a training script
can after setting up its model: Python's cyclic garbage collector then no longer
rescans the long-lived objects (jax's, flax's, the modules' metadata) every few
dozen calls, which NNX states, rebuilt as new Python objects at every call,
otherwise make it do.

On a GPU the host dispatches ahead of the device, and this cost hides behind any
step that takes longer; on simulated CPU devices jdp keeps one step in flight (see
`jdp.parallelize`), so it adds to the step time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import sys
import time

from _common import set_devices


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once set up (see the module docstring)",
    )
    parser.add_argument(
        "--dict-leaves",
        type=int,
        nargs="+",
        default=[10, 100, 600],
        help="the dict states' leaf counts (the largest also runs on pmap)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.calls = 3, 10
    if "jax" not in sys.modules:
        set_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdp

    devices = jax.devices()[: args.devices]
    axis = "data"

    def bump(state):
        return jax.tree.map(lambda x: x + 1, state)

    def jdp_step(state, batch):
        return bump(state), {"x": jnp.sum(batch)}

    def total(state):
        return sum(jnp.sum(x) for x in jax.tree.leaves(state))

    def evaluation(step):
        """A forward-only step (an evaluation loop), jdp's and by hand."""
        jdp_eval = jdp.parallelize(
            lambda s, b: {"x": total(s) + jnp.sum(b)}, devices=devices
        )

        def block(s, b):
            s = jax.tree.map(lambda x: x.reshape(x.shape[1:]), s)
            return jax.lax.psum(total(s) + jnp.sum(b), axis)

        raw = jax.jit(
            jax.shard_map(
                block, mesh=step.mesh, in_specs=(P(axis), P(axis)), out_specs=P()
            )
        )
        return (
            lambda s, b: (s, jdp_eval(s, b)["x"]),
            lambda s, b: (s, raw(s, b)),
        )

    def hand_written(step, backend):
        """The same step without jdp, on the mesh of `step`."""
        if backend == "pmap":
            return jax.pmap(
                lambda s, b: (bump(s), jax.lax.psum(jnp.sum(b), axis)),
                axis_name=axis,
                devices=devices,
                donate_argnums=0,
            )

        def block(s, b):
            s = jax.tree.map(lambda x: x.reshape(x.shape[1:]), s)
            s = jax.tree.map(lambda x: x.reshape((1,) + x.shape), bump(s))
            return s, jax.lax.psum(jnp.sum(b), axis)

        mapped = jax.shard_map(
            block,
            mesh=step.mesh,
            in_specs=(P(axis), P(axis)),
            out_specs=(P(axis), P()),
        )
        return jax.jit(mapped, donate_argnums=0)

    class MLP(nnx.Module):
        def __init__(self, depth, rngs):
            self.layers = nnx.List(
                [nnx.Linear(16, 16, rngs=rngs) for _ in range(depth)]
            )

    model = MLP(50, nnx.Rngs(0))
    modules = (model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    _, split = nnx.split(modules)

    def nnx_jit(step):
        """flax's recipe: `nnx.jit`, modules replicated `P()`, updated in place."""

        @functools.partial(nnx.jit, donate_argnums=0)
        def bump_modules(modules, batch):
            nnx.update(modules, bump(nnx.state(modules)))
            return jnp.sum(batch)

        def call(modules, batch):
            return modules, bump_modules(modules, batch)

        return call

    def place_nnx_jit(modules, step):
        modules = nnx.clone(modules)
        replicated = NamedSharding(step.mesh, P())
        # From host copies: placing device arrays may reuse their buffers, which
        # the donating `nnx.jit` would then delete under the original modules.
        host = jax.tree.map(np.asarray, nnx.state(modules))
        nnx.update(modules, jax.device_put(host, replicated))
        return modules

    def dict_state(n):
        return {f"w{i:03d}": np.ones(16, np.float32) for i in range(n)}

    # name: (logical state, backend)
    configs = {
        f"dict, {n} leaves": (dict_state(n), "shard_map") for n in args.dict_leaves
    }
    most = max(args.dict_leaves)
    configs |= {
        f"dict, {most} leaves, pmap": (dict_state(most), "pmap"),
        "NNX modules, 300 leaves": (modules, "shard_map"),
        "NNX split state, 300": (split, "shard_map"),
        "NNX modules vs nnx.jit": (modules, "nnx.jit"),
        "NNX modules, evaluation": (modules, "eval"),
    }
    batch = np.ones((8 * len(devices), 16), np.float32)
    runners = {}
    for name, (init, backend) in configs.items():
        kind = backend
        if kind in ("nnx.jit", "eval"):
            backend = "shard_map"
        step = jdp.parallelize(jdp_step, devices=devices, backend=backend)
        placed = step.shard(batch)
        states = {"jdp": step.replicate(init)}
        if kind == "nnx.jit":
            raw, own = nnx_jit(step), place_nnx_jit(init, step)
        else:
            raw, own = hand_written(step, backend), step.replicate(init)
        states["hand-written"] = own
        calls = {"jdp": step, "hand-written": raw}
        if kind == "eval":
            calls["jdp"], calls["hand-written"] = evaluation(step)

        def run(kind, states=states, calls=calls, placed=placed):
            fn = calls[kind]
            t0 = time.perf_counter()
            for _ in range(args.calls):
                states[kind], x = fn(states[kind], placed)
                jax.block_until_ready(x)
            return (time.perf_counter() - t0) / args.calls

        for kind in calls:  # compile, warm up
            run(kind)
        runners[name] = (run, len(jax.tree.leaves(states["jdp"])))

    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    order = [(name, kind) for name in runners for kind in ("jdp", "hand-written")]
    times = {key: [] for key in order}
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        for name, kind in order:
            times[name, kind].append(runners[name][0](kind))

    print(
        f"\nHost cost per call: {len(devices)} simulated CPU devices, jax "
        f"{jax.__version__}; a step that adds 1 to every state leaf; {args.rounds} "
        f"interleaved rounds of {args.calls} calls per variant"
        f"{'; gc.freeze() after set-up' if args.gc_freeze else ''}\n"
    )
    header = (
        f"{'state':<26} {'leaves':>6} {'hand ms':>8} {'jdp ms':>7} {'ratio':>6} "
        f"{'range':>11} {'jdp - hand':>10} {'us/leaf':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, (_, leaves) in runners.items():
        jdp_t, hand_t = times[name, "jdp"], times[name, "hand-written"]
        ratios = [a / b for a, b in zip(jdp_t, hand_t, strict=True)]
        extra = statistics.median(a - b for a, b in zip(jdp_t, hand_t, strict=True))
        print(
            f"{name:<26} {leaves:6d} {1e3 * statistics.median(hand_t):8.2f} "
            f"{1e3 * statistics.median(jdp_t):7.2f} {statistics.median(ratios):6.2f} "
            f"{min(ratios):5.2f}-{max(ratios):<5.2f} {1e3 * extra:8.2f}ms "
            f"{1e6 * extra / leaves:7.2f}"
        )
    print(
        "\nhand ms / jdp ms: median time per call; ratio: median over rounds of jdp / "
        "hand-written in the same round (range: lowest and highest round); jdp - "
        "hand: the median difference per call, and per state leaf. A call passes "
        "back the state the previous call returned, as a training loop does. 'vs "
        "nnx.jit': the hand column is flax's recipe, `nnx.jit` on modules placed "
        "P() (it traverses the module graph on the host at every call)."
    )


if __name__ == "__main__":
    main()
