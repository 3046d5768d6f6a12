"""What each process of tests/multiprocess/test_shard_check.py runs.

Kept apart from the test module so that a child process imports only this, never
pytest's collection. Every function returns Python values, pickled back.
"""

from __future__ import annotations

import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jdp
from jdp.distributed import _batch_agreement


def _threads() -> set:
    return {(t.ident, t.name) for t in threading.enumerate()}


def _try(fn):
    """None if `fn()` returns, else the message of the ValueError it raised."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _changed_on_one_process():
    """Process 1's batch changes in a steady loop; process 0's does not."""
    step = jdp.parallelize(lambda s, b: {"n": jnp.sum(b)})
    state = step.replicate({})
    r = jax.process_index()
    check = _batch_agreement._PROCESS_CHECK
    ones = np.ones(8, np.float32)
    # A first step on a batch placed by hand: what it starts is not `shard`'s.
    by_hand = jax.make_array_from_process_local_data(step.sharding, ones)
    float(step(state, by_hand)["n"])
    before = _threads()
    out = {}
    for _ in range(3):  # a steady loop
        placed = step.shard(ones)
        float(step(state, placed)["n"])
    waits = check.waits
    start = time.monotonic()
    out["changed"] = _try(lambda: step.shard(np.ones(6 if r == 1 else 8, np.float32)))
    out["changed_s"] = time.monotonic() - start
    out["waits"] = check.waits - waits
    # A step (a collective) both run, as a loop that goes on after the error would:
    # process 0's blocks until process 1 has raised and joins it.
    float(step(state, placed)["n"])
    # Process 0 sent nothing; it learns of the disagreement only if it asks.
    out["late"] = None if check.late is None else check.late.call
    out["next"] = _try(lambda: step.shard(ones))
    # The processes agree again: they train on.
    out["after"] = float(step(state, step.shard(ones))["n"])
    out["new_threads"] = sorted(name for _, name in _threads() - before)
    return out


def _different_pad_to():
    step = jdp.parallelize(lambda s, b: {"count": jnp.sum(b[1])})
    state = step.replicate({})
    r = jax.process_index()
    local = np.arange(8, dtype=np.float32)
    out = {}
    out["first"] = _try(
        lambda: step.shard(local, pad=True, pad_to=16 if r == 0 else 32)
    )
    out["none"] = _try(
        lambda: step.shard(local, pad=True, pad_to=16 if r == 0 else None)
    )
    for _ in range(2):  # a steady loop, pad_to agreed
        placed = step.shard(local, pad=True, pad_to=16)
        float(step(state, placed)["count"])
    # Process 1 passes another pad_to: it raises once its wait ran out; process
    # 0's pad_to did not change, it goes on into the step.
    out["changed"] = _try(
        lambda: step.shard(local, pad=True, pad_to=16 if r == 0 else 32)
    )
    float(step(state, placed)["count"])
    out["next"] = _try(lambda: step.shard(local, pad=True, pad_to=16))
    placed = step.shard(local[:5], pad=True, pad_to=16)  # agreed: a short batch
    out["count"] = float(step(state, placed)["count"]) * step.num_replicas
    return out


def scenario():
    """Every check of one 2-process job (the test reads each part)."""
    out = {}
    for name, fn in [
        ("one_changed", _changed_on_one_process),
        ("pad_to", _different_pad_to),
    ]:
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out
