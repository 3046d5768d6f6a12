"""Checkpoint save and restore times for a ~100 MB training state on 8 replicas.

An MLP trained with Adam (params plus two moments: about 100 MB in float32 by
default), replicated on 8 simulated CPU devices. Each round, taken round-robin so
that machine noise hits every row alike, times:

- `jdp` sync save: `CheckpointManager.save` until the step is committed on disk;
- `jdp` async save, blocking part: until `save` returns (the copy to host memory
  and the checksums), and until `wait_until_finished` returns (committed);
- `jdp` restore into a replicated state, and into `jax.ShapeDtypeStruct`s;
- for reference, plain orbax on the same data: saving the one host copy (what
  jdp adds on top of orbax), saving the replicated arrays as they are (every
  replica written: what a checkpoint of the raw state costs), and restoring the
  one copy to host memory.

    python benchmarks/checkpoint.py [--mb 100] [--devices 8] [--rounds 3]

Times are medians over rounds, with the throughput on the logical (one-copy)
size and the ratio to the jdp sync save. Simulated devices share the host's
cores and disk, and a shared machine adds other people's jobs: read the ratios,
not the absolute times.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from _common import set_devices


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="state size in MB")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:
        set_devices(args.devices)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp

    import jdp
    from jdp.checkpoint import CheckpointManager

    devices = jax.devices()[: args.devices]
    # Adam keeps two moments per parameter: params are a third of the state.
    width = int((args.mb * 1e6 / 4 / 3 / 4) ** 0.5)
    sizes = (width,) * 5 + (10,)
    rng = np.random.default_rng(0)
    params = {
        f"layer{i}": {
            "w": rng.normal(size=(m, n)).astype(np.float32) / np.sqrt(m),
            "b": np.zeros(n, np.float32),
        }
        for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    }
    tx = optax.adam(1e-3)

    def loss_fn(p, batch):
        x = batch
        for i in range(len(p)):
            x = x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
            x = jnp.tanh(x) if i < len(p) - 1 else x
        return jnp.mean(x**2)

    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=devices)
    init = jdp.TrainState.create(params=params, tx=tx)
    state = step.replicate(init)
    state, _ = step(state, step.shard(np.ones((len(devices) * 2, width), np.float32)))
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(step.unreplicate(state)))
    like = step.replicate(init)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    host = jax.tree.map(np.array, step.unreplicate(state))

    root = tempfile.mkdtemp(prefix="jdp_ckpt_bench_")
    counter = iter(range(10**6))

    def fresh_dir():
        return os.path.join(root, str(next(counter)))

    def jdp_sync_save():
        with CheckpointManager(fresh_dir()) as manager:
            start = time.perf_counter()
            manager.save(1, state)
            return time.perf_counter() - start

    async_blocking = []

    def jdp_async_save():
        with CheckpointManager(fresh_dir(), async_save=True) as manager:
            start = time.perf_counter()
            manager.save(1, state)
            async_blocking.append(time.perf_counter() - start)
            manager.wait_until_finished()
            return time.perf_counter() - start

    saved_dir = fresh_dir()
    with CheckpointManager(saved_dir) as manager:
        manager.save(1, state)

    def jdp_restore(target):
        def run():
            with CheckpointManager(saved_dir) as manager:
                start = time.perf_counter()
                jax.block_until_ready(manager.restore(target))
                return time.perf_counter() - start

        return run

    def orbax_save(tree):
        def run():
            with ocp.StandardCheckpointer() as checkpointer:
                start = time.perf_counter()
                checkpointer.save(os.path.join(fresh_dir(), "state"), tree)
                checkpointer.wait_until_finished()
                return time.perf_counter() - start

        return run

    orbax_dir = os.path.join(fresh_dir(), "state")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(orbax_dir, host)
        checkpointer.wait_until_finished()

    def orbax_restore():
        with ocp.PyTreeCheckpointer() as checkpointer:
            restore_args = jax.tree.map(
                lambda x: ocp.RestoreArgs(restore_type=np.ndarray), host
            )
            start = time.perf_counter()
            checkpointer.restore(
                orbax_dir, args=ocp.args.PyTreeRestore(host, restore_args=restore_args)
            )
            return time.perf_counter() - start

    rows = {
        "jdp save, sync": jdp_sync_save,
        "jdp save, async (until committed)": jdp_async_save,
        "jdp restore into replicated arrays": jdp_restore(like),
        "jdp restore into ShapeDtypeStructs": jdp_restore(abstract),
        "orbax save, one host copy": orbax_save(host),
        f"orbax save, all {len(devices)} replicas as they are": orbax_save(state),
        "orbax restore, one host copy": orbax_restore,
    }
    keep = {saved_dir, os.path.dirname(orbax_dir)}
    times = {name: [] for name in rows}
    try:
        for _ in range(args.rounds):
            for name, fn in rows.items():
                times[name].append(fn())
                for entry in os.listdir(root):  # keep the disk (and cache) small
                    path = os.path.join(root, entry)
                    if path not in keep:
                        shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(t) for name, t in times.items()}
    medians = {
        **dict(list(medians.items())[:2]),
        "jdp save, async (blocking part)": statistics.median(async_blocking),
        **dict(list(medians.items())[2:]),
    }
    base = medians["jdp save, sync"]
    print(
        f"\nState: {nbytes / 1e6:.1f} MB per copy ({len(jax.tree.leaves(host))} "
        f"leaves), {len(devices)} replicas on {jax.default_backend()}; "
        f"median of {args.rounds} rounds.\n"
    )
    print(f"{'operation':<44} {'seconds':>8} {'MB/s':>8} {'vs jdp sync save':>17}")
    for name, t in medians.items():
        print(f"{name:<44} {t:8.3f} {nbytes / 1e6 / t:8.0f} {t / base:16.2f}x")


if __name__ == "__main__":
    main()
