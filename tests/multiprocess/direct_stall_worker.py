"""A training loop started directly (as `srun` would), with jdp's stall check on.

Usage: python direct_stall_worker.py STALL_TIMEOUT_S STUCK_RANK STUCK_AT STEPS

The job's configuration comes from the environment (simulated SLURM variables and
`$JDP_COORDINATOR_ADDRESS`). Process STUCK_RANK stops before its step STUCK_AT,
alive, in `sleep_forever` (-1: none stops); the loop ends after STEPS steps (one
count for every process, or one per process: "3,4").
"""

import logging
import os
import sys
import time

import jdp

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
logging.getLogger("jax").setLevel(logging.WARNING)

STALL_TIMEOUT_S, STUCK_RANK, STUCK_AT, STEPS = sys.argv[1:5]
jdp.distributed.initialize(timeout_s=60, stall_timeout_s=float(STALL_TIMEOUT_S))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jdp import _progress  # noqa: E402


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def sleep_forever():
    time.sleep(1e6)  # a deadlocked data loader


tx = optax.sgd(0.1)
step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
state = step.replicate(jdp.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=tx))
batch = step.shard({"x": np.ones((2, 4), np.float32), "y": np.ones((2, 1), np.float32)})
print(f"pid {os.getpid()} processes {jax.process_count()}", flush=True)
steps = [int(n) for n in STEPS.split(",")]
for i in range(1, steps[jax.process_index() % len(steps)] + 1):
    if jax.process_index() == int(STUCK_RANK) and i == int(STUCK_AT):
        print(f"stuck after step call {_progress.count()} at {time.time()}", flush=True)
        sleep_forever()
    state, metrics = step(state, batch)
    print(f"step {i} loss {float(metrics['loss']):.4f}", flush=True)
print("done", flush=True)
