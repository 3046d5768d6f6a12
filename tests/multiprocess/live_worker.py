"""One process of a live job: trains through `jdp.distributed.live`.

argv: PROCESS_ID NUM_PROCESSES PORT OUT_DIR DIE_PROCESS DIE_AT CONFIGS [STEPS
PAUSE_S REPLACEMENT BOOT_S]. CONFIGS names the models, comma-separated
(`all_reduce`, `partition`, `int8_ef`, `zero`, `bmuf`, `streaming`): one live step
trains them side by side, on the same batches and meshes. Process DIE_PROCESS
SIGKILLs itself a few milliseconds into step DIE_AT (-1: nobody dies) unless it
is a REPLACEMENT (1), which joins the others where they are after a start-up of
BOOT_S seconds once connected (as a real one builds its model and data). While
fewer replicas than processes train, each step completed writes OUT_DIR/shrunk
(the driver starts the replacement then), the step halfway waits until the
replacement has connected, the step 5 before the last until it has built its
state and calls `step.replicate` (however slow the machine), and from halfway on
each step waits PAUSE_S seconds first (time for it to join). Each process that
finishes writes its final params and loss history per model, its replica count
and end time per step, and a replacement the times it connected and called
`step.replicate`, to OUT_DIR.
Environment: LIVE_COLLECTIVE_TIMEOUT (seconds, default 10); LIVE_STALL
"PROCESS:STEP:SECONDS" pauses that live process before that step.
"""

import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

TIMEOUT_S = os.environ.get("LIVE_COLLECTIVE_TIMEOUT", "10")
os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=1 "
    f"--xla_cpu_collective_timeout_seconds={TIMEOUT_S} "
    "--xla_cpu_use_fusion_emitters=false"
)
# "PROCESS:STEP:SECONDS": that process pauses before that step, alive (a GC pause).
STALL = [float(v) for v in os.environ.get("LIVE_STALL", "-1:-1:0").split(":")]
pid, num, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
die_process, die_at, configs = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
steps, pause_s, replacement, boot_s = 12, 0.0, False, 0.0
if len(sys.argv) > 8:
    steps, pause_s, replacement, boot_s = (
        int(sys.argv[8]),
        float(sys.argv[9]),
        sys.argv[10] == "1",
        float(sys.argv[11]),
    )

import jax  # noqa: E402

jax.config.update("jax_enable_recoverability", True)

import jdp  # noqa: E402

jdp.distributed.initialize(
    f"127.0.0.1:{port}",
    num,
    pid,
    heartbeat_timeout_s=5,
    fail_fast=False,
)
boot = [time.time()]  # a replacement: connected, then `step.replicate` called
if replacement:
    (Path(out_dir) / f"replacement-{pid}-connected").touch()
    time.sleep(boot_s)

import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import init_mlp, make_batches, mlp_loss  # noqa: E402

GLOBAL_BATCH = 12  # divisible by 4, 3, 2 and 1 replicas


def model(config):
    """`(tx, sync)` of one configuration."""
    if config == "all_reduce":
        return optax.sgd(0.1, momentum=0.9), jdp.all_reduce()
    if config == "int8_ef":
        return optax.sgd(0.1), jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    if config == "zero":  # the momentum sliced over the replicas
        return jdp.zero(optax.sgd(0.1, momentum=0.9)), jdp.local()
    if config == "partition":  # the weights and the biases synced by two pieces
        pieces = {"w": jdp.all_reduce(), "b": jdp.all_reduce(bucket_bytes=None)}
        labels = lambda p: {k: {"w": "w", "b": "b"} for k in p}  # noqa: E731
        return optax.sgd(0.1, momentum=0.9), jdp.partition(labels, pieces)
    if config == "bmuf":
        return jdp.bmuf(optax.sgd(0.1), 3), jdp.local()
    if config == "streaming":  # Streaming DiLoCo: 2 fragments, one step's delay
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        streaming = jdp.Streaming(fragments=2, delay=1)
        return jdp.bmuf(
            optax.sgd(0.1), 4, outer=outer, streaming=streaming
        ), jdp.local()
    raise SystemExit(f"unknown config {config}")


models = {c: model(c) for c in configs.split(",")}
train_steps = {
    c: jdp.make_train_step(mlp_loss, tx, sync=sync) for c, (tx, sync) in models.items()
}


def train_step(states, batch):
    """Each model's own step on `batch`; the metrics are their losses."""
    out = {c: train_steps[c](states[c], batch) for c in models}
    return {c: s for c, (s, _) in out.items()}, {
        c: m["loss"] for c, (_, m) in out.items()
    }


step = jdp.distributed.live(train_step)
params = init_mlp(jax.random.key(0))
state = {
    c: jdp.TrainState.create(params=params, tx=tx, sync=sync)
    for c, (tx, sync) in models.items()
}
boot.append(time.time())
if replacement:  # built: `replicate` joins the others at their next step
    (Path(out_dir) / f"replacement-{pid}-ready").touch()
state = step.replicate(state)
losses, replicas, times = {c: [] for c in models}, [], []
batches = make_batches(steps, GLOBAL_BATCH)
connected = Path(out_dir) / f"replacement-{die_process}-connected"
ready = Path(out_dir) / f"replacement-{die_process}-ready"
while step.position < steps:  # a replacement starts where the others are
    i = step.position
    if (pid, i) == (STALL[0], STALL[1]):
        time.sleep(STALL[2])
    if pid == die_process and i == die_at and not replacement:
        # Killed a few milliseconds into the step, mid-collective as a real
        # failure is: the others' collectives must fail, not abort them.
        threading.Timer(0.003, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if pause_s and step.num_replicas < num and i >= steps // 2:
        # Halfway, wait for the replacement to connect (however slow the
        # machine), so that it joins before the others finish.
        # Then, 5 steps before the end, until it has built its state and calls
        # `step.replicate`, which joins it to the others at their next step.
        deadline = time.monotonic() + 120
        wait = {steps // 2: connected, steps - 5: ready}.get(i)
        while wait is not None and not wait.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"[{pid}] no {wait.name} in 120 s")
            time.sleep(0.1)
        time.sleep(pause_s)
    state, metrics = step(state, batches[i])
    if pause_s and step.num_replicas < num:
        (Path(out_dir) / "shrunk").touch()
    for c in models:
        losses[c].append(float(metrics[c]))
    replicas.append(step.num_replicas)
    times.append(time.time())
one = jax.tree.map(
    lambda x: x.addressable_shards[0].data[0] if isinstance(x, jax.Array) else x,
    state,
)
with open(Path(out_dir) / f"{pid}.pkl", "wb") as f:
    pickle.dump(
        {
            "params": {c: jax.device_get(s.params) for c, s in one.items()},
            "losses": losses,
            "replicas": replicas,
            "changes": step.membership_changes,
            "first": steps - len(replicas),
            "times": times,
            "boot": boot,
        },
        f,
    )
print(f"[{pid}] done", flush=True)
# Process 0 hosts the coordination service: it leaves after the others, which
# would otherwise be stopped by its exit before they write their results.
jdp.distributed.shutdown()
os._exit(0)
