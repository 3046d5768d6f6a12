"""A training script that resumes after a restart, run by test_restarts.py.

    python -m jdp.launch --num-processes 2 --max-restarts 3 \
        tests/multiprocess/restart_worker.py CKPT OUT [--steps N] [--save-every K]
        [--kill-plan SEED_FILE] [--bad-slot STEP]

The job trains a small MLP on a fixed data set, epoch by epoch in an order drawn
from the epoch number, with noise drawn from a JAX key that is split every step:
the data position (epoch, batch) and the key are saved with every checkpoint
(`extra=`) and restored with it, so a restarted job sees the same batches and
the same noise. Each process takes its share of a fixed global batch, so the
share grows when fewer processes run. Process 0 writes the final parameters to
OUT (`.npz`).

`--kill-plan SEED_FILE`: in attempts 0 and 1 (`JDP_RESTART_COUNT`), one process,
drawn from the seed in the file, kills itself with SIGKILL after a step drawn
from it too. `--bad-slot STEP`: process 1 kills itself after step STEP whenever
two processes run (a slot that keeps failing).
"""

import argparse
import os
import random
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jdp  # noqa: E402

jdp.distributed.initialize(timeout_s=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import init_mlp, mlp_loss  # noqa: E402

GLOBAL_BATCH = 16
DATA_SIZE = 96  # 6 batches per epoch


def data_set():
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(DATA_SIZE, 8)).astype(np.float32)
    y = rng.normal(size=(DATA_SIZE, 4)).astype(np.float32)
    return x, y


def batch_at(x, y, epoch, index):
    """The global batch `index` of `epoch`: the same on every process and attempt."""
    order = np.random.default_rng(epoch).permutation(DATA_SIZE)
    rows = order[index * GLOBAL_BATCH : (index + 1) * GLOBAL_BATCH]
    return x[rows], y[rows]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--kill-plan", default=None)
    parser.add_argument("--bad-slot", type=int, default=None)
    args = parser.parse_args()

    rank, n = jax.process_index(), jax.process_count()
    attempt = int(os.environ.get("JDP_RESTART_COUNT", "0"))

    tx = optax.adam(1e-2)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx))
    like = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    x, y = data_set()
    per_epoch = DATA_SIZE // GLOBAL_BATCH
    share = GLOBAL_BATCH // n  # the global batch stays; each share grows if n drops

    with jdp.checkpoint.CheckpointManager(
        args.checkpoint_dir, save_interval_steps=args.save_every
    ) as manager:
        # The resume idiom: the state and the data position of the latest
        # checkpoint, or the initial ones when there is none yet.
        state, extra = manager.restore(like, default=like, with_extra=True)
        epoch, index = extra.get("epoch", 0), extra.get("batch", 0)
        key = extra.get("key", jax.random.key(42))
        start = int(step.unreplicate(state).step)
        print(
            f"attempt {attempt} processes {n} pid {os.getpid()} resumed at step "
            f"{start}",
            flush=True,
        )

        kill_at = None
        if args.kill_plan is not None and attempt < 2:
            with open(args.kill_plan) as f:
                seed = int(f.read())
            rng = random.Random(f"{seed}-{attempt}")
            victim = rng.randrange(n)
            when = rng.randint(start + 1, args.steps - 1)
            kill_at = when if victim == rank else None
        if args.bad_slot is not None and n == 2 and rank == 1:
            kill_at = args.bad_slot

        for i in range(start + 1, args.steps + 1):
            bx, by = batch_at(x, y, epoch, index)
            key, sub = jax.random.split(key)
            noise = np.asarray(jax.random.normal(sub, bx.shape)) * 0.1
            mine = slice(rank * share, (rank + 1) * share)
            batch = {"x": bx[mine] + noise[mine], "y": by[mine]}
            state, _ = step(state, step.shard(batch))
            index += 1
            if index == per_epoch:
                epoch, index = epoch + 1, 0
            manager.save(i, state, extra={"epoch": epoch, "batch": index, "key": key})
            if kill_at == i:
                print(f"killing myself after step {i}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    params = step.unreplicate(state).params
    if rank == 0:
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        np.savez(args.out, **{jax.tree_util.keystr(p): np.asarray(v) for p, v in flat})
    print(f"finished step {args.steps} with {n} processes", flush=True)


if __name__ == "__main__":
    main()
