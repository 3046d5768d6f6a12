"""Child process for tests/test_checkpoint.py: resume from a checkpoint, or be killed.

Run by the tests with `XLA_FLAGS` (the simulated device count) set in the child's
environment, so a resumed run really is a new process:

    python tests/checkpoint_worker.py resume CASE STEP [BACKEND DIR OUT]...
    python tests/checkpoint_worker.py save-large DIR STEP MIB
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax
from helpers import init_mlp, make_batches, mlp_loss

import jdp

NUM_STEPS = 10
SAVE_AT = 5
GLOBAL_BATCH = 32


def make_case(name):
    """Returns `(tx, loss_fn, params, batches, grad_sync)` for a resume test."""
    if name == "bmuf":
        tx = jdp.bmuf(
            optax.sgd(0.01, momentum=0.9),
            sync_period=SAVE_AT,
            block_momentum=0.5,
            inner_state_at_sync="average",
        )
        params = init_mlp(jax.random.key(0))
        return tx, mlp_loss, params, make_batches(NUM_STEPS, GLOBAL_BATCH), "none"
    tx = {
        "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
        "adam": lambda: optax.adam(1e-2),
    }[name]()
    params = init_mlp(jax.random.key(0))
    return tx, mlp_loss, params, make_batches(NUM_STEPS, GLOBAL_BATCH), "all_reduce"


def make_step(name, backend):
    tx, loss_fn, params, batches, grad_sync = make_case(name)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, grad_sync=grad_sync), backend=backend
    )
    return step, jdp.TrainState.create(params=params, tx=tx), batches


def flat_leaves(tree):
    """`{path: np.ndarray}` for `np.savez` (no pickle)."""
    return {
        jax.tree_util.keystr(path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def resume(name, step_number, *jobs):
    """Restores `step_number` and trains to the end, once per (backend, dir, out)."""
    step_number = int(step_number)
    for backend, directory, out in zip(*[iter(jobs)] * 3, strict=True):
        step, init, batches = make_step(name, backend)
        with jdp.checkpoint.CheckpointManager(directory) as manager:
            state = manager.restore(step.replicate(init), step=step_number)
        for batch in batches[step_number:]:
            state, _ = step(state, step.shard(batch))
        np.savez(out, **flat_leaves(step.unreplicate(state)))


def save_large(directory, step_number, mib):
    size = int(mib) * 2**20 // 4
    values = np.random.default_rng(0).random(size, dtype=np.float32)
    step = jdp.parallelize(lambda s, b: (s, {}))
    state = step.replicate({"w": values})
    manager = jdp.checkpoint.CheckpointManager(directory)
    print("saving", flush=True)
    manager.save(int(step_number), state)
    manager.close()
    print("saved", flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"resume": resume, "save-large": save_large}[command](*args)
