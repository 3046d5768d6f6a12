"""What each process of the multi-process tests runs (through `jdp.launch.run`).

Kept apart from the test modules so that a child process imports only this (and
tests/helpers.py), never pytest's collection. Every function returns NumPy / Python
values, pickled back to the test.
"""

from __future__ import annotations

import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import init_mlp, make_batches, mlp_loss
from jax import lax

import jdp
from jdp.distributed import _batch_agreement

NUM_STEPS = 20
GLOBAL_BATCH = 32
HOST_MESH = ("host", "device")
CHECKPOINT_STEP = 5


def local_share(batch):
    """This process's contiguous share of a global batch (process order)."""
    n, r = jax.process_count(), jax.process_index()
    return jax.tree.map(lambda x: x[r * len(x) // n : (r + 1) * len(x) // n], batch)


def local_replicas(tree):
    """This process's replicas of a replicated tree, stacked in replica order."""

    def stack(x):
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])

    return jax.tree.map(stack, tree)


def _guarded(results, name, fn):
    """Runs one check; records its traceback instead of stopping the others."""
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}


def train(backend, *, axis_name="data", batches, params, tx, devices=None):
    """20 steps of the MLP; used by the processes and by the 1-process oracle."""
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, axis_name=axis_name),
        backend=backend,
        devices=devices,
        axis_name=axis_name,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    losses = []
    for batch in batches:
        state, metrics = step(state, step.shard(batch))
        losses.append(float(metrics["loss"]))
    return step, state, losses


def _train_check(backend, axis_name="data"):
    tx = optax.adam(1e-2)
    # Different initial params per process: `replicate` must take process 0's.
    params = init_mlp(jax.random.key(jax.process_index()))
    batches = [local_share(b) for b in make_batches(NUM_STEPS, GLOBAL_BATCH)]
    step, state, losses = train(
        backend, axis_name=axis_name, batches=batches, params=params, tx=tx
    )
    out = {
        "params": jax.device_get(step.unreplicate(state).params),
        "losses": losses,
        "in_sync": jdp.replicas_in_sync(state),
        "num_replicas": step.num_replicas,
        "mesh": dict(step.mesh.shape),
    }
    if not isinstance(axis_name, str):
        ops = step.collectives(state, step.shard(batches[0]))
        out["collectives"] = [(c.kind, c.replica_groups) for c in ops]
    return out


def wire_train(axis_name="data", *, batches, params, devices=None):
    """The MLP with an int8 exchange and error feedback (and the oracle's run)."""
    tx = optax.adam(1e-2)
    sync = jdp.all_reduce(wire=jdp.wire.int8(block_size=64), error_feedback=True)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=sync, axis_name=axis_name),
        devices=devices,
        axis_name=axis_name,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    losses = []
    for batch in batches:
        state, metrics = step(state, step.shard(batch))
        losses.append(float(metrics["loss"]))
    return step, state, losses


def _wire_check(axis_name):
    params = init_mlp(jax.random.key(0))
    batches = [local_share(b) for b in make_batches(NUM_STEPS, GLOBAL_BATCH)]
    step, state, losses = wire_train(axis_name, batches=batches, params=params)
    ops = step.collectives(state, step.shard(batches[0]))
    return {
        "params": jax.device_get(step.unreplicate(state).params),
        "losses": losses,
        "in_sync": jdp.replicas_in_sync(state.replace(sync_state=None)),
        "errors_differ": bool(
            np.any(np.diff(local_replicas(state.sync_state.worker[-1]), axis=0))
        ),
        "collectives": [(c.kind, c.dtype, c.replica_groups) for c in ops],
    }


def _replicate_check():
    own = init_mlp(jax.random.key(jax.process_index()))
    step = jdp.parallelize(lambda s, b: (s, {}))
    replicated = step.replicate(own)
    return {
        "own": jax.device_get(own),
        "local_replicas": local_replicas(replicated),
        "unreplicated": jax.device_get(step.unreplicate(replicated)),
    }


def _shard_checks():
    step = jdp.parallelize(lambda s, b: {"n": jnp.sum(b)})
    r = jax.process_index()
    out = {}
    try:  # process 0 passes 8 examples, process 1 passes 6
        step.shard(np.ones(8 if r == 0 else 6, np.float32))
        out["sizes"] = None
    except ValueError as e:
        out["sizes"] = str(e)
    try:  # same size, different dtype on process 1
        step.shard(np.ones(8, np.float32 if r == 0 else np.int32))
        out["layout"] = None
    except ValueError as e:
        out["layout"] = str(e)
    # A loop whose batches keep their shapes: no process waits for the check ...
    check = _batch_agreement._PROCESS_CHECK
    step.shard(np.ones(8, np.float32))
    waits = check.waits
    for _ in range(3):
        step.shard(np.ones(8, np.float32))
    out["waits_in_a_steady_loop"] = check.waits - waits
    # ... until one process's batch changes: that process raises at once, the
    # others once their background check has seen it (at their next call here:
    # the test gives the check time first).
    for key, size in [("changed", 8 if r == 0 else 6), ("next", 8)]:
        if key == "next":
            deadline = time.monotonic() + 30
            while r == 0 and check.late is None and time.monotonic() < deadline:
                time.sleep(0.01)
        try:
            step.shard(np.ones(size, np.float32))
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    # With pad=True every process pads to the largest local batch; the mask
    # counts the real examples (8 + 5).
    pad_step = jdp.parallelize(
        lambda s, b: {"count": jnp.sum(b[1]), "total": jnp.sum(b[0] * b[1])}
    )
    local = np.arange(8 if r == 0 else 5, dtype=np.float32) + 100 * r
    placed, mask = pad_step.shard(local, pad=True)
    metrics = pad_step(pad_step.replicate({}), (placed, mask))
    out["pad_global_shape"] = placed.shape
    out["pad_count"] = float(metrics["count"]) * pad_step.num_replicas
    out["pad_total"] = float(metrics["total"]) * pad_step.num_replicas
    # With pad_to the padded size is known: a steady loop does not wait either.
    placed, mask = pad_step.shard(local, pad=True, pad_to=16)
    waits = check.waits
    for _ in range(2):
        placed, mask = pad_step.shard(local, pad=True, pad_to=16)
    out["pad_to_waits"] = check.waits - waits
    metrics = pad_step(pad_step.replicate({}), (placed, mask))
    out["pad_to_global_shape"] = placed.shape
    out["pad_to_count"] = float(metrics["count"]) * pad_step.num_replicas
    # One process stops padding: it raises (its batch changed); the other, whose
    # batch did not change, sends nothing.
    try:
        if r == 0:
            pad_step.shard(np.ones(6, np.float32), pad=True, pad_to=16)
        else:
            pad_step.shard(np.ones(8, np.float32))
        out["pad_mismatch"] = None
    except ValueError as e:
        out["pad_mismatch"] = str(e)
    return out


def _in_sync_check():
    step = jdp.parallelize(
        lambda s, b: (s + lax.axis_index("data").astype(s.dtype), {}),
        donate_state=False,
        check_sync=None,  # the drift is the point
    )
    state = step.replicate(jnp.zeros(3))
    before = jdp.replicas_in_sync(state)
    drifted, _ = step(state, step.shard(np.zeros(2, np.float32)))
    try:
        jdp.assert_replicas_in_sync(drifted)
        message = None
    except AssertionError as e:
        message = str(e)
    synced = step.broadcast(drifted, root=0)
    guarded = jdp.parallelize(step.train_step, donate_state=False, check_sync=1)
    try:
        guarded(state, guarded.shard(np.zeros(2, np.float32)))
        guard = None
    except jdp.ReplicaDivergenceError as e:
        guard = (e.leaf, e.replica)
    return {
        "guard": guard,
        "before": before,
        "after": jdp.replicas_in_sync(drifted),
        "msg": message,
        "after_broadcast": jdp.replicas_in_sync(synced),
        "broadcast_values": local_replicas(synced),
    }


def bmuf_train(*, batches, params, devices=None):
    tx = jdp.bmuf(optax.sgd(0.05), 4, outer=jdp.block_momentum(momentum=0.5))
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), devices=devices
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return step, state


def _bmuf_check():
    batches = [local_share(b) for b in make_batches(10, GLOBAL_BATCH)]
    step, state = bmuf_train(batches=batches, params=init_mlp(jax.random.key(0)))
    return {
        "local_replicas": local_replicas(state.params),
        "global": jax.device_get(
            step.unreplicate(jdp.bmuf_global_params(state.opt_state))
        ),
    }


def hierarchical_train(*, batches, params, devices=None):
    """Hierarchical local SGD: within hosts every step, BMUF across every 4."""
    tx = jdp.bmuf(
        optax.sgd(0.05), 4, outer=jdp.block_momentum(momentum=0.5), axis_name="host"
    )
    sync = jdp.all_reduce(axis_name="device")
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=sync),
        devices=devices,
        axis_name=HOST_MESH,
        check_sync=1,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    losses = []
    for batch in batches:
        state, metrics = step(state, step.shard(batch))
        losses.append(float(metrics["loss"]))
    return step, state, losses


def partition_labels(params, *, embed="layer0"):
    return {k: "embed" if k == embed else "dense" for k in params}


def partition_train(*, batches, params, devices=None, embed="layer0"):
    """`jdp.partition`: one layer local with BMUF, the others all-reduced."""
    labels = partition_labels(params, embed=embed)
    adam = optax.adam(1e-2)
    tx = optax.multi_transform(
        {"dense": adam, "embed": jdp.bmuf(adam, sync_period=4)}, labels
    )
    sync = jdp.partition(labels, {"dense": jdp.all_reduce(), "embed": jdp.local()})
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=sync), devices=devices, check_sync=1
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return step, state


def _hierarchical_check():
    """Hierarchical local SGD on the 2-D host mesh, and `jdp.partition`, across
    processes; then labels that differ between the processes."""
    batches = [local_share(b) for b in make_batches(10, GLOBAL_BATCH)]
    params = init_mlp(jax.random.key(0))
    step, state, losses = hierarchical_train(batches=batches, params=params)
    _, mixed = partition_train(batches=batches, params=params)
    # Process 1 labels another layer "embed" (the optimizer state is the same
    # on both processes: what differs is only which leaves are all-reduced).
    embed = "layer0" if jax.process_index() == 0 else "layer1"
    labels = partition_labels(params, embed=embed)
    sync = jdp.partition(labels, {"dense": jdp.all_reduce(), "embed": "per_replica"})
    tx = optax.adam(1e-2)
    wrong = jdp.parallelize(jdp.make_train_step(mlp_loss, tx, sync=sync))
    wrong_state = wrong.replicate(jdp.TrainState.create(params=params, tx=tx))
    try:
        wrong(wrong_state, wrong.shard(batches[0]))
        differ = None
    except ValueError as e:
        differ = str(e)
    return {
        "mesh": dict(step.mesh.shape),
        "replicas": local_replicas(state.params),
        "losses": losses,
        "partition": local_replicas(mixed.params),
        "labels_differ": differ,
    }


def nnx_modules(seed):
    """A flax NNX MLP and its `nnx.Optimizer` (Adam), from `seed`."""
    from flax import nnx

    rngs = nnx.Rngs(seed)
    model = nnx.Sequential(
        nnx.Linear(8, 16, rngs=rngs), jnp.tanh, nnx.Linear(16, 4, rngs=rngs)
    )
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def nnx_mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _nnx_check():
    """NNX modules passed directly: each process builds its own (another seed);
    `replicate` gives every replica process 0's."""
    from flax import nnx

    def train_step(state, batch):
        model, optimizer = state
        loss, grads = nnx.value_and_grad(nnx_mse)(model, batch)
        optimizer.update(model, jdp.all_reduce_gradients(grads))
        return (model, optimizer), {"loss": loss}

    step = jdp.parallelize(train_step)
    state = step.replicate(nnx_modules(seed=jax.process_index()))
    losses = []
    for batch in make_batches(5, GLOBAL_BATCH):
        state, metrics = step(state, step.shard(local_share(batch)))
        losses.append(float(metrics["loss"]))
    jdp.assert_replicas_in_sync(state)
    model, _ = step.unreplicate(state)
    return {"losses": losses, "params": jax.device_get(jax.tree.leaves(model))}


def _checkpoint_check(restore_dir, save_dir):
    tx = optax.adam(1e-2)
    batches = [local_share(b) for b in make_batches(NUM_STEPS, GLOBAL_BATCH)]
    params = init_mlp(jax.random.key(0))
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx))
    out = {}
    # 1 process x 4 devices saved CHECKPOINT_STEP steps: resume here on 2 x 2.
    like = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    with jdp.checkpoint.CheckpointManager(restore_dir) as manager:
        state = manager.restore(like)
    out["restored_step"] = int(step.unreplicate(state).step)
    for batch in batches[CHECKPOINT_STEP:]:
        state, _ = step(state, step.shard(batch))
    out["resumed_params"] = jax.device_get(step.unreplicate(state).params)
    # Save from 2 x 2 after CHECKPOINT_STEP steps (restored on 1 x 4 by the test).
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches[:CHECKPOINT_STEP]:
        state, _ = step(state, step.shard(batch))
    with jdp.checkpoint.CheckpointManager(save_dir) as manager:
        manager.save(CHECKPOINT_STEP, state, parallel=step)
    out["saved_params"] = jax.device_get(step.unreplicate(state).params)
    return out


def _features_check():
    """Prefetch, metrics.sum/gather, replica_key, microbatches across processes."""
    out = {}
    for backend in ("shard_map", "pmap"):

        def eval_step(state, batch):
            # Raw key data: pmap across processes cannot take typed keys as input.
            key = jdp.replica_key(jax.random.wrap_key_data(state["key"]))
            return {
                "ids": jdp.metrics.gather(batch["i"]),
                "count": jdp.metrics.sum(jnp.sum(batch["i"] >= 0)),
                "draw": jdp.metrics.gather(jax.random.uniform(key)),
            }

        step = jdp.parallelize(eval_step, backend=backend)
        state = step.replicate({"key": jax.random.key_data(jax.random.key(3))})
        globals_ = [{"i": np.arange(8, dtype=np.int32) + 8 * k} for k in range(3)]
        seen = [
            step(state, batch)
            for batch in step.prefetch(local_share(b) for b in globals_)
        ]
        out[backend] = {
            "ids": [np.asarray(m["ids"]).reshape(-1).tolist() for m in seen],
            "count": [int(m["count"]) for m in seen],
            "draws": len(set(np.asarray(seen[0]["draw"]).tolist())),
        }
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0))
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx, microbatches=2))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in make_batches(3, GLOBAL_BATCH):
        state, _ = step(state, step.shard(local_share(batch)))
    out["microbatch_params"] = jax.device_get(step.unreplicate(state).params)
    out.update(_multisteps_and_loss_scaling())
    return out


def _multisteps_and_loss_scaling():
    """optax.MultiSteps with jdp.sync_gradients, and a DynamicScale whose overflow
    is on one process only, across processes."""
    from flax.training.dynamic_scale import DynamicScale

    out = {}
    tx = optax.MultiSteps(
        optax.chain(jdp.sync_gradients(), optax.adam(1e-2)), every_k_schedule=2
    )
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx, sync=jdp.local()))
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    for batch in make_batches(4, GLOBAL_BATCH):
        state, _ = step(state, step.shard(local_share(batch)))
    out["multisteps_params"] = jax.device_get(step.unreplicate(state).params)
    out["multisteps_in_sync"] = jdp.replicas_in_sync(state)

    def loss_fn(p, batch):  # overflows on the replicas whose rows have `blow_up`
        blow_up = jnp.any(batch["blow_up"] > 0)
        return mlp_loss(p, batch) * jnp.where(blow_up, jnp.inf, 1.0)

    tx = optax.sgd(0.1)
    params = jax.tree.map(lambda x: x.astype(jnp.float16), init_mlp(jax.random.key(0)))
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
    state = step.replicate(
        jdp.TrainState.create(params=params, tx=tx, dynamic_scale=DynamicScale())
    )
    bad = make_batches(1, GLOBAL_BATCH)[0]
    bad["blow_up"] = np.zeros(GLOBAL_BATCH, np.float32)
    bad["blow_up"][-1] = 1.0  # the last replica, on the last process only
    state, metrics = step(state, step.shard(local_share(bad)))
    one = jax.device_get(step.unreplicate(state))
    out["scaled"] = {
        "skipped": int(one.skipped_steps),
        "metric": float(metrics["skipped"]),
        "unchanged": all(
            np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(one.params), jax.tree.leaves(params), strict=True
            )
        ),
        "in_sync": jdp.replicas_in_sync(state),
    }
    return out


def _initialize_again():
    jdp.distributed.initialize()  # same job: nothing to do
    try:
        jdp.distributed.initialize(num_processes=5)
        return None
    except RuntimeError as e:
        return str(e)


def scenario(restore_dir, save_dir):
    """Every correctness check of one 2-process job (the test reads each part)."""
    results = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "is_initialized": jdp.distributed.is_initialized(),
    }
    _guarded(results, "replicate", _replicate_check)
    _guarded(results, "train_shard_map", lambda: _train_check("shard_map"))
    _guarded(results, "train_pmap", lambda: _train_check("pmap"))
    _guarded(results, "train_host_mesh", lambda: _train_check("shard_map", HOST_MESH))
    _guarded(results, "wire", lambda: _wire_check("data"))
    _guarded(results, "wire_host_mesh", lambda: _wire_check(HOST_MESH))
    _guarded(results, "shard", _shard_checks)
    _guarded(results, "in_sync", _in_sync_check)
    _guarded(results, "bmuf", _bmuf_check)
    _guarded(results, "hierarchical", _hierarchical_check)
    _guarded(results, "checkpoint", lambda: _checkpoint_check(restore_dir, save_dir))
    _guarded(results, "features", _features_check)
    _guarded(results, "nnx", _nnx_check)
    _guarded(results, "initialize_again", _initialize_again)
    return results


def initialize_only(**kwargs):
    """Joins a job with explicit arguments (the bad-input tests)."""
    start = time.monotonic()
    jdp.distributed.initialize(**kwargs)
    return time.monotonic() - start


def pid_and_env():
    import jdp.distributed._config as rt

    return {
        "pid": os.getpid(),
        "env": {
            k: os.environ.get(k)
            for k in (
                rt.ENV_COORDINATOR_ADDRESS,
                rt.ENV_NUM_PROCESSES,
                rt.ENV_PROCESS_ID,
            )
        },
        "local_device_count": jax.local_device_count(),
    }
