"""A script for `python -m jdp.launch --live`: process 2, then 0, SIGKILL themselves.

argv: OUT_DIR STEPS. Process 2 kills itself at step 5, once (a marker file says
it did): the launcher starts it again alone and it rejoins the others. Process 0
kills itself at step 15, once: the launcher restarts the whole job (which starts
from the beginning here, having no checkpoint). Each process writes its final
params and the step it started at to OUT_DIR.
"""

import os
import pickle
import signal
import sys
import time
from pathlib import Path

import jax

import jdp

# `--live` set the rest: JAX's fault tolerance, a 10 s heartbeat, fail_fast off,
# the collective timeout; and process 0 leaves last at exit.
jdp.distributed.initialize()

import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import init_mlp, make_batches, mlp_loss  # noqa: E402

out, steps = Path(sys.argv[1]), int(sys.argv[2])
tx = optax.sgd(0.1, momentum=0.9)
step = jdp.distributed.live(jdp.make_train_step(mlp_loss, tx))
state = step.replicate(jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx))
first = step.position  # 0, or where the others were when this one joined
if first:
    (out / f"joined-{jax.process_index()}").write_text(str(first))
batches = make_batches(steps, 12)
while step.position < steps:
    i = step.position
    me = jax.process_index()
    marker = out / f"killed-{me}"
    if (me, i) in ((2, 5), (0, 15)) and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)
    state, _ = step(state, batches[i])
one = jax.tree.map(lambda x: x.addressable_shards[0].data[0], state.params)
with open(out / f"{jax.process_index()}.pkl", "wb") as f:
    pickle.dump({"params": jax.device_get(one), "first": first}, f)
