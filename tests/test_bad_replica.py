"""Dropping a bad replica: `jdp.bmuf(..., on_bad_replica="drop")` and
`jdp.all_reduce(on_bad_replica="drop")`, against NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp

NUM = 4  # replicas
ROWS = 2  # batch rows per replica
DIM = 5
LR = 0.1


def data_loss(params, batch):
    """A loss whose gradient is the batch: the mean of this replica's rows."""
    return jnp.sum(jnp.mean(batch["g"], axis=0) * params["w"])


def make_grads(num_steps, seed=0, bad=None):
    """Per-step batches `(NUM * ROWS, DIM)`; `bad`: {step: replica} gets a NaN."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(num_steps):
        g = rng.normal(size=(NUM * ROWS, DIM)).astype(np.float32)
        if bad and t in bad:
            g[bad[t] * ROWS, 1] = np.nan
        out.append(g)
    return out


def reference_bmuf(w0, grads, *, sync_period, block_momentum, max_norm=None):
    """BMUF with plain SGD inside, averaging only the valid replicas (float64)."""
    g = np.asarray(w0, np.float64)
    v = np.zeros_like(g)
    local = [g.copy() for _ in range(NUM)]
    dropped = 0
    for t, batch in enumerate(grads):
        for r in range(NUM):
            local[r] = local[r] - LR * batch[r * ROWS : (r + 1) * ROWS].mean(0)
        if (t + 1) % sync_period:
            continue
        valid = [
            np.all(np.isfinite(p))
            and (max_norm is None or np.linalg.norm(p - g) <= max_norm)
            for p in local
        ]
        dropped += NUM - sum(valid)
        if any(valid):
            avg = np.mean([p for p, ok in zip(local, valid, strict=True) if ok], axis=0)
            v = block_momentum * v + (avg - g)
            g = g + v
        local = [g.copy() for _ in range(NUM)]
    return g, dropped


def run_bmuf(backend, grads, **kw):
    tx = jdp.bmuf(optax.sgd(LR), **kw)
    step = jdp.parallelize(
        jdp.make_train_step(data_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:NUM],
        backend=backend,
    )
    w0 = np.linspace(-1, 1, DIM).astype(np.float32)
    state = step.replicate(jdp.TrainState.create(params={"w": w0}, tx=tx))
    for g in grads:
        state, _ = step(state, step.shard({"g": g}))
    return w0, state


@pytest.mark.parametrize("block_momentum", [0.0, 0.5])
def test_bmuf_drops_the_replica_with_a_nan_gradient(backend, block_momentum):
    rng = np.random.default_rng(7)
    sync_period, blocks = 4, 3
    # A NaN at a random step of the second block, in a random replica.
    bad = {int(rng.integers(4, 8)): int(rng.integers(NUM))}
    grads = make_grads(sync_period * blocks, bad=bad)
    w0, state = run_bmuf(
        backend,
        grads,
        sync_period=sync_period,
        block_momentum=block_momentum,
        on_bad_replica="drop",
    )
    params = np.asarray(state.params["w"])
    assert np.all(np.isfinite(params))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
    np.testing.assert_array_equal(params, np.broadcast_to(params[0], params.shape))
    g = np.asarray(jdp.bmuf_global_params(state.opt_state)["w"])
    expected, dropped = reference_bmuf(
        w0, grads, sync_period=sync_period, block_momentum=block_momentum
    )
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(params[0], expected, rtol=1e-5, atol=1e-6)
    assert dropped == 1
    assert np.all(np.asarray(state.opt_state.dropped) == 1)
