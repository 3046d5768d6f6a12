"""Memory: `step.memory_analysis`, buffer donation and `jax.checkpoint` of a loss."""

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batches, mlp_loss

import jdp

SIZES = (8, 64, 64, 4)


def per_device_bytes(tree):
    """Bytes of `tree` on the first device, from the arrays' addressable shards."""
    device = jax.devices()[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


def make(tx=None, **kw):
    tx = tx or optax.adam(1e-3)
    parallel_kw = {k: kw.pop(k) for k in ("backend", "donate_state") if k in kw}
    step = jdp.parallelize(jdp.make_train_step(mlp_loss, tx, **kw), **parallel_kw)
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0), SIZES), tx=tx)
    )
    return step, state, step.shard(make_batches(1, 32)[0])


def test_memory_analysis_reports_per_device_bytes(backend):
    step, state, batch = make(backend=backend)
    mem = step.memory_analysis(state, batch)
    assert isinstance(mem, jdp.MemoryAnalysis)
    state_bytes, batch_bytes = per_device_bytes(state), per_device_bytes(batch)
    # One device's replica and batch slice, not the global arrays.
    assert 0 <= mem.argument_bytes - (state_bytes + batch_bytes) <= 64
    assert mem.output_bytes >= state_bytes
    assert mem.temp_bytes > 0
    assert mem.peak_bytes == (
        mem.argument_bytes + mem.output_bytes - mem.alias_bytes + mem.temp_bytes
    )


def test_donation_removes_the_second_copy():
    donated, state, batch = make(donate_state=True)
    kept, kept_state, _ = make(donate_state=False)
    on = donated.memory_analysis(state, batch)
    off = kept.memory_analysis(kept_state, batch)
    state_bytes = per_device_bytes(state)
    assert off.alias_bytes == 0
    assert on.alias_bytes >= state_bytes  # every state buffer is reused
    resident_on = on.argument_bytes + on.output_bytes - on.alias_bytes
    resident_off = off.argument_bytes + off.output_bytes
    assert resident_off - resident_on >= state_bytes
    # And the call really consumes the input state.
    # (Block on each call: on XLA:CPU two multi-device programs in flight at once
    # may run in different orders on different devices, deadlocking collectives.)
    new_state = jax.block_until_ready(donated(state, batch))[0]
    assert state.params["layer0"]["w"].is_deleted()
    assert not new_state.params["layer0"]["w"].is_deleted()
    jax.block_until_ready(kept(kept_state, batch))
    assert not kept_state.params["layer0"]["w"].is_deleted()


def test_sharded_optimizer_state_shrinks_the_arguments():
    plain, plain_state, batch = make()
    zero, zero_state, _ = make(jdp.zero(optax.adam(1e-3)), sync=jdp.local())
    saved = per_device_bytes(plain_state.opt_state) - per_device_bytes(
        zero_state.opt_state
    )
    assert saved > 0.8 * per_device_bytes(plain_state.opt_state)
    difference = (
        plain.memory_analysis(plain_state, batch).argument_bytes
        - zero.memory_analysis(zero_state, batch).argument_bytes
    )
    assert abs(difference - saved) <= 64


POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_remat_gives_the_same_numbers(name):
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0), SIZES)
    batches = make_batches(5, 16)
    results = []
    for loss_fn in (mlp_loss, jax.checkpoint(mlp_loss, policy=POLICIES[name])):
        step = jdp.parallelize(
            jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:4]
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        losses = []
        for batch in batches:
            state, metrics = step(state, step.shard(batch))
            losses.append(float(metrics["loss"]))
        text = step.lower(state, step.shard(batches[0])).as_text()
        forward_ops = text.count("dot_general") + text.count("tanh")
        results.append((step.unreplicate(state), losses, forward_ops))
    (plain, plain_losses, plain_ops), (remat, remat_losses, remat_ops) = results
    assert_trees_close(remat.params, plain.params, rtol=1e-6)
    np.testing.assert_allclose(remat_losses, plain_losses, rtol=1e-6)
    # The step issues (part of) the forward pass again, in the backward pass.
    # (XLA:CPU's optimiser may merge it again: see benchmarks/memory.py.)
    assert remat_ops > plain_ops
