"""The suite compiles with `FAST_COMPILE_FLAG`; what the tests read holds without it.

The tests read compiled programs: their collectives, copies and memory. They
compile without XLA:CPU's MLIR fusion emitters, a third faster, so this checks,
for a program of each kind of sync, that those readings equal what a program
compiled with XLA's defaults gives (in a subprocess without the flag).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import FAST_COMPILE_FLAG

PROGRAMS = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, optax, jdp

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)

    key = jax.random.key(0)
    params = {"w1": jax.random.normal(key, (64, 128)), "b1": jnp.zeros(128),
              "w2": jax.random.normal(key, (128, 4))}
    batch = {"x": jnp.ones((16, 64)), "y": jnp.ones((16, 4))}
    cases = {
        "all_reduce": (jdp.all_reduce(), optax.adam(1e-3)),
        "int8+ef": (jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True),
                    optax.sgd(0.1)),
        "bmuf": (jdp.local(), jdp.bmuf(optax.sgd(0.1), sync_period=4)),
        "zero": (jdp.local(), jdp.zero(optax.adam(0.1))),
        "powersgd": (jdp.powersgd(rank=2), optax.sgd(0.1)),
    }
    readings = {}
    for name, (sync, tx) in cases.items():
        for backend in ("pmap", "shard_map"):
            step = jdp.parallelize(jdp.make_train_step(loss, tx, sync=sync),
                                   backend=backend, devices=jax.devices()[:2])
            state = step.replicate(jdp.TrainState.create(params=params, tx=tx,
                                                         sync=sync))
            sharded = step.shard(batch)
            text = step.lower(state, sharded).compile().as_text()
            mem = step.memory_analysis(state, sharded)
            readings[f"{name}/{backend}"] = {
                "collectives": [[c.kind, c.dtype, c.bytes, c.in_conditional]
                                for c in step.collectives(state, sharded)],
                "copies": text.count(" copy("),
                "memory": [mem.argument_bytes, mem.output_bytes, mem.alias_bytes,
                           mem.temp_bytes],
            }
    print("READINGS " + json.dumps(readings))
    """
)


def readings(flags):
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAMS],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("READINGS "))
    return json.loads(line.removeprefix("READINGS "))


@pytest.mark.slow
def test_the_suites_compile_flag_changes_no_reading():
    assert FAST_COMPILE_FLAG in os.environ["XLA_FLAGS"]
    default_flags = os.environ["XLA_FLAGS"].replace(FAST_COMPILE_FLAG, "").strip()
    fast = readings(os.environ["XLA_FLAGS"])
    default = readings(default_flags)
    assert len(default) == 10
    assert any(r["copies"] for r in default.values())  # something to compare
    assert fast == default
