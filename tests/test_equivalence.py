"""`jdp.check_equivalence`: a ported loss that is silently wrong across replicas
is named; correct ports pass."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp

VOCAB, DIM, LENGTH = 11, 8, 6
TX = optax.sgd(0.1)


def lm_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "embed": jax.random.normal(k1, (VOCAB, DIM)) * 0.5,
        "out": jax.random.normal(k2, (DIM, VOCAB)) * 0.5,
    }


def token_losses(params, batch):
    logits = params["embed"][batch["inputs"]] @ params["out"]
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return xent, (batch["inputs"] > 0).astype(jnp.float32)


def lm1b_loss(params, batch):
    """flax's lm1b example as written: each replica divides by its own count."""
    xent, weights = token_losses(params, batch)
    return jnp.sum(xent * weights) / jnp.sum(weights)


def weighted_loss(params, batch):
    xent, weights = token_losses(params, batch)
    return jdp.weighted(jnp.sum(xent * weights), jnp.sum(weights))


def mean_loss(params, batch):
    return jnp.mean(token_losses(params, batch)[0])


def lm_batch(lengths):
    """One row per entry of `lengths` (its real inputs); 2 rows per replica of 4."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(len(lengths), LENGTH + 1))
    tokens[np.arange(LENGTH + 1)[None, :] >= np.array(lengths)[:, None]] = 0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


#: Every replica holds some tokens, but not as many as the others.
UNEVEN = [1, 2, 6, 6, 3, 5, 6, 4]


def check(loss_fn, batch, *, backend="shard_map", microbatches=1, **kwargs):
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, TX, microbatches=microbatches),
        devices=jax.devices()[:4],
        backend=backend,
    )
    state = step.replicate(jdp.TrainState.create(params=lm_params(), tx=TX))
    return jdp.check_equivalence(step, state, step.shard(batch), **kwargs)


def test_the_lm1b_loss_as_written_warns_naming_jdp_weighted(backend):
    with pytest.warns(RuntimeWarning, match=r"(?s)relative gap.*jdp\.weighted") as w:
        gap = check(lm1b_loss, lm_batch(UNEVEN), backend=backend)
    assert "['embed']" in str(w[0].message) and "['out']" in str(w[0].message)
    assert gap > 1e-2


def test_the_lm1b_loss_raises_when_asked():
    with pytest.raises(
        ValueError,
        match=r"(?s)differs from one device's.*\['(embed|out)'\]: relative gap.*"
        r"`jdp\.weighted\(jnp\.sum\(loss \* w\), jnp\.sum\(w\)\)`",
    ):
        check(lm1b_loss, lm_batch(UNEVEN), on_mismatch="raise")


def test_a_replica_of_only_padding_is_named_not_finite():
    """Its loss is 0 / 0 (whether XLA makes its gradient NaN too varies)."""
    with pytest.raises(
        ValueError, match=r"(?s)the loss: not finite on the replicas.*jdp\.weighted"
    ):
        check(lm1b_loss, lm_batch([0, 0, *UNEVEN[2:]]), on_mismatch="raise")


@pytest.mark.parametrize(
    ("loss_fn", "microbatches"),
    [(weighted_loss, 1), (weighted_loss, 2), (mean_loss, 2)],
    ids=["weighted", "weighted-microbatches", "mean-microbatches"],
)
def test_correct_ports_pass(loss_fn, microbatches):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gap = check(loss_fn, lm_batch([0, 0, *UNEVEN[2:]]), microbatches=microbatches)
    assert gap < 1e-4  # float32 rounding, far below the tolerance


def test_between_bmuf_syncs_replica_0s_state_is_compared(backend):
    """Between syncs the replicas' params differ: the check took each replica's
    own params beside replica 0's for the one device, and blamed a correct loss."""
    tx = jdp.bmuf(optax.sgd(0.5), sync_period=4)
    step = jdp.parallelize(
        jdp.make_train_step(mean_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:4],
        backend=backend,
    )
    state = step.replicate(jdp.TrainState.create(params=lm_params(), tx=tx))
    batch = step.shard(lm_batch(UNEVEN))
    for _ in range(2):
        state, _ = step(state, batch)
    assert not jdp.replicas_in_sync(state.params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gap = jdp.check_equivalence(step, state, batch, on_mismatch="raise")
    assert gap < 1e-4
    assert not jdp.replicas_in_sync(state.params)  # the state is left as it was


class Net(nn.Module):
    """A dense layer, BatchNorm (the flax ImageNet example's), a head."""

    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(6)(x)  # its bias is followed by BatchNorm: zero gradient
        x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x)
        return nn.Dense(2)(nn.relu(x))


def bn_check(axis_name, **kwargs):
    model = Net(axis_name=axis_name)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    x[8:] = 3 * x[8:] + 2  # the replicas' statistics differ
    y = rng.normal(size=(16, 2)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:2])

    def loss_fn(params, batch_stats, batch):
        out, new = model.apply(
            {"params": params, "batch_stats": batch_stats},
            batch["x"],
            mutable=["batch_stats"],
        )
        return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]

    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, TX), devices=jax.devices()[:4], axis_name="batch"
    )
    state = jdp.TrainState.create(
        params=variables["params"], tx=TX, batch_stats=variables["batch_stats"]
    )
    batch = step.shard({"x": x, "y": y})
    return jdp.check_equivalence(step, step.replicate(state), batch, **kwargs)


def test_batchnorm_with_the_replica_axis_passes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bn_check("batch") < 1e-4


def test_batchnorm_without_axis_name_is_named():
    with pytest.raises(ValueError, match=r"(?s)BatchNorm without `axis_name`.*'batch'"):
        bn_check(None, on_mismatch="raise")


def test_a_step_of_ones_own_is_refused():
    step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
    with pytest.raises(
        TypeError, match=r"needs the step.*make_train_step.*got Parallel"
    ):
        jdp.check_equivalence(step, step.replicate({}), step.shard(np.ones(2)))


def test_on_mismatch_is_checked():
    with pytest.raises(ValueError, match=r"`on_mismatch` must be 'warn' or 'raise'"):
        check(mean_loss, lm_batch(UNEVEN), on_mismatch="ignore")
