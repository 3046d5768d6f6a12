"""One process of a live job: trains through `jdp.distributed.live`.

argv: PROCESS_ID NUM_PROCESSES PORT OUT_DIR DIE_PROCESS DIE_AT CONFIG [STEPS
PAUSE_S REPLACEMENT]. Process DIE_PROCESS SIGKILLs itself at step DIE_AT (-1:
nobody dies) unless it is a REPLACEMENT (1), which joins the others where they
are. Each process that finishes writes its final params, loss history and
replica count per step to OUT_DIR.
"""

import os
import pickle
import signal
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=1 --xla_cpu_collective_timeout_seconds=20"
)
pid, num, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
die_process, die_at, config = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
steps, pause_s, replacement = 12, 0.0, False
if len(sys.argv) > 8:
    steps, pause_s, replacement = (
        int(sys.argv[8]),
        float(sys.argv[9]),
        sys.argv[10] == "1",
    )

import jax  # noqa: E402

jax.config.update("jax_enable_recoverability", True)

import jdp  # noqa: E402

jdp.distributed.initialize(
    f"127.0.0.1:{port}",
    num,
    pid,
    heartbeat_timeout_s=10,
    fail_fast=False,
)

import time  # noqa: E402

import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import init_mlp, make_batches, mlp_loss  # noqa: E402

GLOBAL_BATCH = 12  # divisible by 3, 2 and 1 replicas

if config == "all_reduce":
    tx, sync = optax.sgd(0.1, momentum=0.9), jdp.all_reduce()
elif config == "int8_ef":
    tx = optax.sgd(0.1)
    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
elif config == "bmuf":
    tx, sync = jdp.bmuf(optax.sgd(0.1), 3), jdp.local()
else:
    raise SystemExit(f"unknown config {config}")

step = jdp.distributed.live(jdp.make_train_step(mlp_loss, tx, sync=sync))
state = step.replicate(
    jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx, sync=sync)
)
losses, replicas = [], []
batches = make_batches(steps, GLOBAL_BATCH)
while step.position < steps:  # a replacement starts where the others are
    i = step.position
    if pid == die_process and i == die_at and not replacement:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(pause_s)
    state, metrics = step(state, batches[i])
    losses.append(float(metrics["loss"]))
    replicas.append(step.num_replicas)
one = jax.tree.map(
    lambda x: x.addressable_shards[0].data[0] if isinstance(x, jax.Array) else x,
    state,
)
with open(Path(out_dir) / f"{pid}.pkl", "wb") as f:
    pickle.dump(
        {
            "params": jax.device_get(one.params),
            "losses": losses,
            "replicas": replicas,
            "changes": step.membership_changes,
            "first": steps - len(losses),
        },
        f,
    )
print(f"[{pid}] done", flush=True)
os._exit(0)
