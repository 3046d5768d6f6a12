"""Losses normalised by a count that differs between replicas: `jdp.weighted`.

The flax language-model recipe divides a padded batch's summed loss by its
number of real tokens. Each replica dividing by its own count and jdp averaging
the per-replica means is not the global per-token mean; `jdp.weighted(total,
weight)` makes the step divide the global sums once (fairseq's `sample_size`).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp

VOCAB, DIM, LENGTH = 11, 8, 6


def init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "embed": jax.random.normal(k1, (VOCAB, DIM)) * 0.5,
        "out": jax.random.normal(k2, (DIM, VOCAB)) * 0.5,
    }


def token_losses(params, inputs, targets):
    """Per-token cross-entropy and whether each token is real (not padding)."""
    logits = params["embed"][inputs] @ params["out"]
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = jnp.argmax(logits, -1) == targets
    return xent, correct, (inputs > 0).astype(jnp.float32)


def lm_loss(params, batch):
    """As the flax lm1b example, but the division left to jdp."""
    xent, correct, weights = token_losses(params, batch["inputs"], batch["targets"])
    accuracy = jdp.weighted(jnp.sum(correct * weights), jnp.sum(weights))
    return jdp.weighted(jnp.sum(xent * weights), jnp.sum(weights)), {
        "accuracy": accuracy
    }


def lm_loss_per_replica_mean(params, batch):
    """The lm1b example as written: each replica divides by its own count."""
    xent, _, weights = token_losses(params, batch["inputs"], batch["targets"])
    return jnp.sum(xent * weights) / jnp.sum(weights)


def one_device_loss(params, batch):
    xent, correct, weights = token_losses(params, batch["inputs"], batch["targets"])
    total = jnp.sum(weights)
    return jnp.sum(xent * weights) / total, jnp.sum(correct * weights) / total


def padded_batches(num_steps, rows=8, seed=0):
    """Sequences whose real lengths differ a lot: replica 0 of 4 gets only padding.

    With 4 replicas of 2 rows each, rows 0-1 (replica 0) are all padding, rows
    2-3 are short, the rest long.
    """
    rng = np.random.default_rng(seed)
    lengths = np.resize(np.array([0, 0, 1, 2, 6, 6, 5, 6]), rows)
    out = []
    for _ in range(num_steps):
        tokens = rng.integers(1, VOCAB, size=(rows, LENGTH + 1))
        tokens[np.arange(LENGTH + 1)[None, :] >= lengths[:, None] + 1] = 0
        out.append(
            {
                "inputs": tokens[:, :-1].astype(np.int32),
                "targets": tokens[:, 1:].astype(np.int32),
            }
        )
    return out


def one_device(tx, batches):
    params = init_params()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, acc), grads = jax.value_and_grad(one_device_loss, has_aux=True)(
            params, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    losses, accs = [], []
    for b in batches:
        params, opt_state, loss, acc = step(params, opt_state, b)
        losses.append(float(loss))
        accs.append(float(acc))
    return params, losses, accs


def run(loss_fn, tx, batches, *, backend="shard_map", sync=None, microbatches=1):
    train_step = jdp.make_train_step(
        loss_fn,
        tx,
        sync=sync or jdp.all_reduce(),
        has_aux=loss_fn is lm_loss,
        microbatches=microbatches,
    )
    step = jdp.parallelize(train_step, backend=backend, devices=jax.devices()[:4])
    state = step.replicate(jdp.TrainState.create(params=init_params(), tx=tx))
    losses, accs = [], []
    for b in batches:
        state, metrics = step(state, step.shard(b))
        losses.append(float(metrics["loss"]))
        accs.append(float(metrics.get("accuracy", np.nan)))
    return step.unreplicate(state).params, losses, accs


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_token_weighted_loss_equals_one_device(backend, microbatches):
    tx = optax.adam(0.05)
    batches = padded_batches(6)
    expected, expected_losses, expected_accs = one_device(tx, batches)
    params, losses, accs = run(
        lm_loss, tx, batches, backend=backend, microbatches=microbatches
    )
    assert np.isfinite(losses).all()
    chex.assert_trees_all_close(params, expected, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    np.testing.assert_allclose(accs, expected_accs, rtol=1e-6)


def test_the_per_replica_mean_is_not_one_device():
    """What `jdp.weighted` fixes: the port as written moves away from one device
    (and an all-padding replica computes 0 / 0)."""
    tx = optax.sgd(0.5)
    batches = [
        {k: np.where(np.arange(8)[:, None] < 2, 1, v) for k, v in b.items()}
        for b in padded_batches(3)
    ]  # no all-padding replica, or the port is NaN at once
    expected, _, _ = one_device(tx, batches)
    per_replica, _, _ = run(lm_loss_per_replica_mean, tx, batches)
    weighted, _, _ = run(lm_loss, tx, batches)
    gap = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(per_replica), jax.tree.leaves(expected), strict=True
        )
    )
    assert gap > 1e-3
    chex.assert_trees_all_close(weighted, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("piece", ["zero", "local"])
def test_other_pieces_normalise_by_the_global_count(piece):
    """ZeRO gives one device's numbers; under `jdp.local()` each replica steps by
    its own token sum over the global mean count per replica, so BMUF that syncs
    every step with plain SGD also equals one device."""
    tx = optax.sgd(0.5)
    batches = padded_batches(4)
    expected, expected_losses, _ = one_device(tx, batches)
    if piece == "zero":
        params, losses, _ = run(lm_loss, jdp.zero(tx), batches, sync=jdp.local())
    else:
        local_tx = jdp.bmuf(tx, 1, outer=jdp.block_momentum(momentum=0.0))
        params, losses, _ = run(lm_loss, local_tx, batches, sync=jdp.local())
    chex.assert_trees_all_close(params, expected, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


def test_weighted_metrics_in_a_step_of_ones_own():
    def eval_step(state, batch):
        _, correct, weights = token_losses(state, batch["inputs"], batch["targets"])
        return {
            "accuracy": jdp.weighted(jnp.sum(correct * weights), jnp.sum(weights)),
            "tokens": jdp.metrics.sum(jnp.sum(weights).astype(jnp.int32)),
        }

    step = jdp.parallelize(eval_step, devices=jax.devices()[:4])
    params = init_params()
    (batch,) = padded_batches(1)
    metrics = step(step.replicate(params), step.shard(batch))
    _, acc = one_device_loss(params, batch)
    np.testing.assert_allclose(float(metrics["accuracy"]), float(acc), rtol=1e-6)
    assert int(metrics["tokens"]) == int((batch["inputs"] > 0).sum())


def test_a_batch_of_only_padding_trains_nothing_and_stays_finite():
    tx = optax.adam(0.05)
    empty = {k: np.zeros_like(v) for k, v in padded_batches(1)[0].items()}
    params, losses, _ = run(lm_loss, tx, [empty])
    chex.assert_trees_all_equal(params, init_params())
    assert np.isfinite(losses).all()


def test_weighted_refuses_what_is_not_a_scalar():
    with pytest.raises(ValueError, match=r"`jdp.weighted`.*scalar.*shape \(3,\)"):
        jdp.weighted(jnp.ones(3), 3.0)


def test_an_lm1b_style_port_equals_one_device():
    """The flax lm1b recipe's conventions together: a token-weighted loss on
    padded sequences, dropout through `rng` (rate 0 here, so one device can be
    the oracle), microbatches, then evaluation on a padded short last batch
    weighted by `inputs > 0` alone (padded rows hold padding ids)."""
    rate = 0.0

    def loss_fn(params, batch, rng):
        keep = jax.random.bernoulli(rng, 1 - rate, (DIM,)) / (1 - rate)
        logits = (params["embed"][batch["inputs"]] * keep) @ params["out"]
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        weights = (batch["inputs"] > 0).astype(jnp.float32)
        return jdp.weighted(jnp.sum(xent * weights), jnp.sum(weights))

    def eval_step(params, batch):
        _, correct, weights = token_losses(params, batch["inputs"], batch["targets"])
        return {"accuracy": jdp.weighted(jnp.sum(correct * weights), jnp.sum(weights))}

    tx = optax.adamw(0.05, weight_decay=0.01)
    batches = padded_batches(5, rows=16, seed=1)
    expected, expected_losses, _ = one_device(tx, batches)
    train_step = jdp.make_train_step(loss_fn, tx, microbatches=2)
    step = jdp.parallelize(train_step, devices=jax.devices()[:4])
    state = jdp.TrainState.create(params=init_params(), tx=tx, rng=jax.random.key(1))
    state = step.replicate(state)
    losses = []
    for b in batches:
        state, metrics = step(state, step.shard(b))
        losses.append(float(metrics["loss"]))
    params = step.unreplicate(state).params
    chex.assert_trees_all_close(params, expected, rtol=5e-5, atol=5e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)

    evaluate = jdp.parallelize(eval_step, devices=jax.devices()[:4])
    last = {k: v[:5] for k, v in padded_batches(1, rows=16, seed=2)[0].items()}
    placed, _ = evaluate.shard(last, pad=True)  # 5 sequences on 4 replicas
    got = evaluate(evaluate.replicate(params), placed)["accuracy"]
    _, want = one_device_loss(params, last)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_grad_of_a_weighted_loss_outside_a_step_says_how_to_get_the_scalar():
    def loss(p):
        return jdp.weighted(jnp.sum(p**2), 4.0)

    with pytest.raises(
        TypeError,
        match=r"Gradient only defined for scalar-output functions\. Output was "
        r"Weighted\(.*\) \(a `jdp\.weighted` pair, which a `jdp\.make_train_step` "
        r"step divides over all replicas; outside one, differentiate "
        r"`w\.total / w\.weight`",
    ):
        jax.grad(loss)(jnp.ones(3))
    # What it says works: the replica's mean.
    p = jnp.arange(3.0)
    got = jax.grad(lambda p: (lambda w: w.total / w.weight)(loss(p)))(p)
    np.testing.assert_allclose(got, jax.grad(lambda p: jnp.sum(p**2) / 4.0)(p))


def test_a_bfloat16_total_is_normalised_by_the_exact_token_count():
    """The weights are summed in float32: cast to a bfloat16 loss's dtype, 257
    tokens per replica counted as 256, and the gradient came out 257/256 too big."""

    def loss_fn(params, batch):
        total = params["w"].astype(jnp.bfloat16) * jnp.bfloat16(256)  # d/dw: 256
        return jdp.weighted(total, jnp.sum(batch))  # 257 tokens on each replica

    tx = optax.sgd(1.0)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:8])
    state = step.replicate(jdp.TrainState.create(params={"w": jnp.ones(())}, tx=tx))
    state, metrics = step(state, step.shard(np.ones((8, 257), np.float32)))
    # Each replica's gradient is 256 over the mean count of 257 tokens.
    np.testing.assert_allclose(
        float(step.unreplicate(state).params["w"]), 1 - 256 / 257, rtol=1e-5
    )
    assert metrics["loss"].dtype == jnp.bfloat16
    assert float(metrics["loss"]) == float(jnp.bfloat16(256 / 257))


def test_an_integer_weighted_metric_is_a_float_mean():
    def eval_step(state, batch):
        return {"acc": jdp.weighted(jnp.sum(batch > 1), jnp.int32(batch.size))}

    step = jdp.parallelize(eval_step, devices=jax.devices()[:4])
    out = step(step.replicate({}), step.shard(np.arange(8, dtype=np.float32)))
    assert out["acc"].dtype == jnp.float32 and float(out["acc"]) == 6 / 8
