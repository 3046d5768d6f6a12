"""A small data-parallel training script, run by the tests under the launcher.

    python -m jdp.launch --num-processes 2 --devices-per-process 2 \
        tests/multiprocess/train_script.py CHECKPOINT_DIR [--steps N] [--die-at STEP]

Each process trains on its share of the global batch and saves a checkpoint every
5 steps. With `--die-at STEP`, process 1 kills itself with SIGKILL after that step
(no clean-up of any kind), which is what the fault test needs.
"""

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jdp  # noqa: E402

jdp.distributed.initialize(timeout_s=60)

import jax  # noqa: E402
import optax  # noqa: E402
from helpers import init_mlp, make_batches, mlp_loss  # noqa: E402

SAVE_EVERY = 5
GLOBAL_BATCH = 32


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--die-at", type=int, default=None)
    args = parser.parse_args()

    r, n = jax.process_index(), jax.process_count()
    print(f"pid {os.getpid()}", flush=True)
    tx = optax.adam(1e-2)
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx))
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    batches = make_batches(SAVE_EVERY * 4, GLOBAL_BATCH)
    with jdp.checkpoint.CheckpointManager(args.checkpoint_dir) as manager:
        for i in range(1, args.steps + 1):
            batch = batches[(i - 1) % len(batches)]
            share = slice(r * len(batch["x"]) // n, (r + 1) * len(batch["x"]) // n)
            local = jax.tree.map(lambda x, share=share: x[share], batch)
            state, metrics = step(state, step.shard(local))
            print(f"step {i} loss {float(metrics['loss']):.6f}", flush=True)
            if i % SAVE_EVERY == 0:
                manager.save(i, state, parallel=step)
            if args.die_at == i and r == 1:
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
