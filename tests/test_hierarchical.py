"""Hierarchical local SGD on a (host, device) mesh laid out in one process.

`jdp.parallelize(devices=<2-D array>, axis_name=("host", "device"))` makes the
host mesh of a multi-process job in one process; `jdp.all_reduce(axis_name=
"device")` with `jdp.bmuf(..., axis_name="host")` averages within hosts every
step and across hosts every H steps.
"""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    init_mlp,
    linear_grads,
    linear_loss,
    make_batches,
    mlp_loss,
)

import jdp

HOSTS, PER_HOST = 2, 2
NUM = HOSTS * PER_HOST
AXES = ("host", "device")
IN, OUT = 5, 2
LR, H = 0.1, 3


def grid(hosts=HOSTS, per_host=PER_HOST):
    return np.array(jax.devices()[: hosts * per_host]).reshape(hosts, per_host)


def train(train_step, params, tx, batches, *, devices, axis_name, check_sync=100):
    step = jdp.parallelize(
        train_step, devices=devices, axis_name=axis_name, check_sync=check_sync
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    state, history = helpers.params_history(step, state, batches)
    return step, state, history


# -- the 2-D layout -------------------------------------------------------------


def test_a_2d_layout_in_one_process_matches_the_flat_mesh():
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0))
    batches = make_batches(4, 16)
    train_step = jdp.make_train_step(mlp_loss, tx)
    flat, _, flat_hist = train(
        train_step, params, tx, batches, devices=jax.devices()[:NUM], axis_name="data"
    )
    host, state, host_hist = train(
        train_step, params, tx, batches, devices=grid(), axis_name=AXES
    )
    nested, _, nested_hist = train(
        train_step,
        params,
        tx,
        batches,
        devices=[list(row) for row in grid()],
        axis_name=AXES,
    )
    assert dict(host.mesh.shape) == {"host": HOSTS, "device": PER_HOST}
    assert host.num_replicas == NUM
    assert jdp.replicas_in_sync(state)
    # The sums run within hosts first: equal numbers up to rounding.
    for a, b in zip(flat_hist, host_hist, strict=True):
        assert_trees_close(b, a, rtol=1e-6, atol=1e-7)
    # A nested list is the same layout as the array.
    for a, b in zip(host_hist, nested_hist, strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)
    # Within hosts first, then across: the host mesh's collectives.
    groups = {
        (c.kind, c.replica_groups)
        for c in host.collectives(
            host.replicate(jdp.TrainState.create(params=params, tx=tx)),
            host.shard(batches[0]),
        )
    }
    assert ("all-reduce", ((0, 1), (2, 3))) in groups
    assert ("all-reduce", ((0, 2), (1, 3))) in groups


def test_replicate_and_unreplicate_on_a_2d_layout():
    step = jdp.parallelize(lambda s, b: (s, {}), devices=grid(), axis_name=AXES)
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "n": jnp.int32(3)}
    placed = step.replicate(tree)
    assert placed["w"].shape == (NUM, 2, 3)
    jax.tree.map(np.testing.assert_array_equal, step.unreplicate(placed), tree)


# -- hierarchical local SGD against a NumPy reference ----------------------------


def linear_params(seed=0):
    return helpers.linear_params(IN, OUT, seed)


def linear_batches(steps, per_replica=4, seed=1):
    return helpers.noise_batches(steps, NUM * per_replica, IN, OUT, seed)


def reference(params, batches):
    """Within-host averages every step; hosts averaged every H steps (NumPy).

    With `jdp.block_momentum(learning_rate=1.0, momentum=0.0)`, BMUF's block update
    is model averaging: every replica restarts from the hosts' mean.
    """
    hosts = [{k: v.astype(np.float64) for k, v in params.items()}] * HOSTS
    history = []
    for t, batch in enumerate(batches, start=1):
        xs = np.split(batch["x"].astype(np.float64), NUM)
        ys = np.split(batch["y"].astype(np.float64), NUM)
        new = []
        for h, p in enumerate(hosts):
            own = range(h * PER_HOST, (h + 1) * PER_HOST)
            gs = [linear_grads(p, xs[r], ys[r]) for r in own]
            mean = {k: np.mean([g[k] for g in gs], axis=0) for k in p}
            new.append({k: p[k] - LR * mean[k] for k in p})
        if t % H == 0:
            avg = {k: np.mean([p[k] for p in new], axis=0) for k in params}
            new = [avg] * HOSTS
        hosts = new
        history.append(hosts)
    return history


def hierarchical_step():
    tx = jdp.bmuf(
        optax.sgd(LR),
        sync_period=H,
        outer=jdp.block_momentum(learning_rate=1.0, momentum=0.0),
        axis_name="host",
    )
    sync = jdp.all_reduce(axis_name="device")
    return jdp.make_train_step(linear_loss, tx, sync=sync), tx


def test_hierarchical_local_sgd_matches_numpy_reference():
    params, batches = linear_params(), linear_batches(2 * H + 1)
    train_step, tx = hierarchical_step()
    step = jdp.parallelize(train_step, devices=grid(), axis_name=AXES, check_sync=1)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    expected = reference(params, batches)
    for t, batch in enumerate(batches, start=1):
        state, _ = step(state, step.shard(batch))  # the guard checks every call
        got = jax.device_get(state.params)
        for r in range(NUM):
            mine = {k: v[r] for k, v in got.items()}
            assert_trees_close(mine, expected[t - 1][r // PER_HOST], rtol=2e-5)
            # The replicas of one host agree bit for bit at every step.
            same_host = (r // PER_HOST) * PER_HOST
            for k in got:
                np.testing.assert_array_equal(got[k][r], got[k][same_host])
        hosts_differ = not np.array_equal(got["w"][0], got["w"][PER_HOST])
        if t % H == 0:
            # After a host sync every replica holds the hosts' mean, bit for bit.
            for k in got:
                np.testing.assert_array_equal(got[k], got[k][:1].repeat(NUM, 0))
        else:
            assert hosts_differ


def test_hierarchical_bytes_sync_step_crosses_hosts():
    params, batches = linear_params(), linear_batches(1)
    train_step, tx = hierarchical_step()
    step = jdp.parallelize(train_step, devices=grid(), axis_name=AXES)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    ops = step.collectives(state, step.shard(batches[0]))
    across = ((0, 2), (1, 3))
    # Every step: the gradients within hosts, outside any conditional.
    # (Scalars are the metrics, averaged over every replica.)
    grads = [c for c in ops if any(shape != () for shape in c.shapes)]
    within = [c for c in grads if not c.in_conditional and c.kind == "all-reduce"]
    assert within and all(c.replica_groups == ((0, 1), (2, 3)) for c in within)
    # Only in the sync branch: the models across hosts.
    host_ops = [c for c in ops if c.replica_groups == across]
    assert host_ops and all(c.in_conditional for c in host_ops)


def test_hierarchical_checkpoint_between_syncs_resumes_exactly(tmp_path):
    params, batches = linear_params(), linear_batches(2 * H)
    train_step, tx = hierarchical_step()
    step = jdp.parallelize(train_step, devices=grid(), axis_name=AXES)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches[: H + 1]:
        state, _ = step(state, step.shard(batch))
    with jdp.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(H + 1, state, parallel=step)
    saved = jax.device_get(state)
    for batch in batches[H + 1 :]:
        state, _ = step(state, step.shard(batch))
    fresh = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    with jdp.checkpoint.CheckpointManager(tmp_path) as manager:
        restored = manager.restore(fresh, step=H + 1)
    # The hosts' params differ between syncs; each replica gets its own back.
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)
    for batch in batches[H + 1 :]:
        restored, _ = step(restored, step.shard(batch))
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(restored.params),
        jax.device_get(state.params),
    )


def test_a_checkpoint_restored_onto_another_mesh_of_as_many_replicas_regroups(
    tmp_path,
):
    """Saved on 2 hosts of 4, restored onto 4 hosts of 2: the replicas' own
    values went back by position, so the new hosts held replicas that disagree,
    without a word, and the hosts' syncs never agreed again. Now as for another
    count: a warning, and a new block from the global model."""
    params, batches = linear_params(), linear_batches(2 * H)
    train_step, tx = hierarchical_step()
    init = jdp.TrainState.create(params=params, tx=tx)
    wide = jdp.parallelize(train_step, devices=grid(2, 4), axis_name=AXES)
    state = wide.replicate(init)
    for batch in batches[: H + 1]:  # between syncs
        state, _ = wide(state, wide.shard(batch))
    narrow = jdp.parallelize(train_step, devices=grid(4, 2), axis_name=AXES)
    with jdp.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(H + 1, state)
        with pytest.warns(RuntimeWarning, match=r"laid out on a 4 x 2 mesh, not 2 x 4"):
            restored = manager.restore(narrow.replicate(init))
    jdp.assert_replicas_in_sync(restored)
    for batch in batches[H + 1 :]:
        restored, _ = narrow(restored, narrow.shard(batch))
    jdp.assert_replicas_in_sync(jdp.bmuf_global_params(restored))


# -- errors ------------------------------------------------------------------------


def test_devices_that_are_neither_1d_nor_2d_are_refused():
    cube = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    with pytest.raises(ValueError, match=r"1-D.*2-D.*shape \(2, 2, 2\)"):
        jdp.parallelize(lambda s, b: (s, {}), devices=cube, axis_name=AXES)


def test_a_2d_layout_needs_two_axis_names():
    with pytest.raises(ValueError, match=r"2-D layout of shape \(2, 2\).*two axis"):
        jdp.parallelize(lambda s, b: (s, {}), devices=grid(), axis_name="data")


def test_rows_of_different_lengths_are_refused():
    d = jax.devices()
    with pytest.raises(ValueError, match=r"rows \(hosts\) of equal length.*\[2, 1\]"):
        jdp.parallelize(lambda s, b: (s, {}), devices=[d[:2], d[2:3]], axis_name=AXES)
    with pytest.raises(ValueError, match=r"rows \(hosts\) of equal length"):
        jdp.parallelize(lambda s, b: (s, {}), devices=[d[:2], d[2]], axis_name=AXES)


def test_a_2d_layout_that_lists_a_device_twice_is_refused():
    d = jax.devices()
    with pytest.raises(ValueError, match="lists a device twice"):
        jdp.parallelize(lambda s, b: (s, {}), devices=[d[:2], d[1:3]], axis_name=AXES)


def test_entries_that_are_not_devices_are_refused():
    with pytest.raises(TypeError, match=r"`devices` must hold `jax.Device`s"):
        jdp.parallelize(lambda s, b: (s, {}), devices=[[0, 1], [2, 3]], axis_name=AXES)


def test_averaging_over_every_axis_with_bmuf_is_refused():
    tx = jdp.bmuf(optax.sgd(LR), sync_period=H, axis_name="host")
    params, batches = linear_params(), linear_batches(1)
    train_step = jdp.make_train_step(linear_loss, tx, sync=jdp.all_reduce())
    step = jdp.parallelize(train_step, devices=grid(), axis_name=AXES)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    with pytest.raises(ValueError, match=r"over 'device', 'host'.*jdp.local\(\)"):
        step(state, step.shard(batches[0]))


@pytest.mark.parametrize(
    ("bmuf_axis", "match"),
    [
        # Both over "device": the hosts would never sync.
        (
            "device",
            r"piece averages over 'device'; the optimizer syncs over 'device'\)",
        ),
        # Over both (the step's axes, its default) beside a piece over "device":
        # it was accepted, with a block all-reduce over every replica and a
        # default momentum counting them (1 - 1/8, not 1 - 1/2 over the hosts).
        (
            None,
            r"piece averages over 'device'; the optimizer syncs over 'device', "
            r"'host'\).*axis_name='host'",
        ),
    ],
    ids=["device", "both"],
)
def test_bmuf_must_sync_exactly_the_axes_the_piece_leaves_out(bmuf_axis, match):
    tx = jdp.bmuf(optax.sgd(LR), sync_period=H, axis_name=bmuf_axis)
    params, batches = linear_params(), linear_batches(1)
    sync = jdp.all_reduce(axis_name="device")
    train_step = jdp.make_train_step(linear_loss, tx, sync=sync)
    step = jdp.parallelize(train_step, devices=grid(), axis_name=AXES)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    with pytest.raises(ValueError, match=match):
        step(state, step.shard(batches[0]))


def test_averaging_within_hosts_without_bmuf_is_refused():
    # Nothing syncs the hosts: refused when the step is traced, not by the guard.
    tx = optax.sgd(LR)
    params, batches = linear_params(), linear_batches(1)
    sync = jdp.all_reduce(axis_name="device")
    train_step = jdp.make_train_step(linear_loss, tx, sync=sync)
    step = jdp.parallelize(
        train_step, devices=grid(), axis_name=AXES, backend="shard_map"
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    with pytest.raises(
        ValueError,
        match=r"averages the gradients over 'device' only, of the step's axes "
        r"'device', 'host', and nothing syncs 'host': .*the hosts\) are never "
        r"synced.*`jdp.all_reduce\(\)`.*`jdp.bmuf\(inner, sync_period=..., "
        r"axis_name='host'\)`",
    ):
        step(state, step.shard(batches[0]))


def test_a_flat_mesh_with_bmuf_and_all_reduce_is_still_refused():
    tx = jdp.bmuf(optax.sgd(LR), sync_period=H)
    params, batches = linear_params(), linear_batches(1)
    train_step = jdp.make_train_step(linear_loss, tx)
    step = jdp.parallelize(train_step, devices=jax.devices()[:NUM])
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    with pytest.raises(ValueError, match=r"over 'data'.*sync=jdp.local\(\)"):
        step(state, step.shard(batches[0]))


def test_the_guard_catches_replicas_that_drift_on_a_2d_layout():
    # Each replica on its own gradients, never synced: the guard names a leaf.
    params, batches = linear_params(), linear_batches(1)
    tx = optax.sgd(LR)
    train_step = jdp.make_train_step(
        linear_loss, tx, sync=jdp.partition(lambda p: "all", {"all": "broadcast"})
    )
    drifting = jdp.Sync(None, lambda g, s, params, axis: (g, s, {}))
    for sync, diverges in ((drifting, True), (None, False)):
        step_fn = (
            train_step
            if sync is None
            else jdp.make_train_step(linear_loss, tx, sync=sync)
        )
        step = jdp.parallelize(step_fn, devices=grid(), axis_name=AXES, check_sync=1)
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        if diverges:
            with pytest.raises(jdp.ReplicaDivergenceError, match=r"\['b'\]"):
                step(state, step.shard(batches[0]))
        else:
            state, _ = step(state, step.shard(batches[0]))
            assert jdp.replicas_in_sync(state)
