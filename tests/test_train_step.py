import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state
from helpers import (
    assert_trees_close,
    init_mlp,
    make_batches,
    mlp_loss,
    single_device_train,
)

import jdp
from jdp import _hlo, _train_step


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(4)(nn.relu(x))


def bn_setup():
    model = BNNet()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8)), train=False)

    def loss_fn(params, batch_stats, batch):
        out, updates = model.apply(
            {"params": params, "batch_stats": batch_stats},
            batch["x"],
            train=True,
            mutable=["batch_stats"],
        )
        return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]

    return variables, loss_fn


@pytest.mark.parametrize("mode", ["mean", "broadcast"])
def test_batch_stats_stay_in_sync(backend, mode):
    variables, loss_fn = bn_setup()
    tx = optax.sgd(0.05)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, batch_stats=mode),
        backend=backend,
    )
    state = step.replicate(
        jdp.TrainState.create(
            params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
        )
    )
    batches = make_batches(3, 32)
    for b in batches:
        state, _ = step(state, step.shard(b))
    jdp.assert_replicas_in_sync(state)
    one = step.unreplicate(state)
    assert not np.allclose(one.batch_stats["BatchNorm_0"]["mean"], 0.0)


def test_batch_stats_mean_matches_global_batch_statistics():
    variables, loss_fn = bn_setup()
    tx = optax.sgd(0.0)  # frozen params: only the statistics move
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
    state = step.replicate(
        jdp.TrainState.create(
            params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
        )
    )
    batch = make_batches(1, 32)[0]
    state, _ = step(state, step.shard(batch))
    kernel = variables["params"]["Dense_0"]["kernel"]
    bias = variables["params"]["Dense_0"]["bias"]
    h = batch["x"] @ kernel + bias
    expected = 0.1 * h.mean(0)  # momentum 0.9 from zeros
    np.testing.assert_allclose(
        step.unreplicate(state).batch_stats["BatchNorm_0"]["mean"],
        expected,
        rtol=1e-4,
        atol=1e-6,
    )


def test_frozen_batch_stats_train():
    """A state of flax `FrozenDict`s (older examples, restored states) was refused:
    `model.apply` returns plain dicts, and the state check dumped two tree
    structures without naming `batch_stats`."""
    from flax.core import freeze, unfreeze

    variables, loss_fn = bn_setup()
    tx = optax.sgd(0.05)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:2])
    plain = jdp.TrainState.create(
        params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
    )
    frozen = plain.replace(
        params=freeze(plain.params), batch_stats=freeze(plain.batch_stats)
    )
    batch = make_batches(1, 32)[0]
    got, _ = step(step.replicate(frozen), step.shard(batch))
    want, _ = step(step.replicate(plain), step.shard(batch))
    assert type(got.batch_stats) is type(frozen.batch_stats)
    assert_trees_close(unfreeze(got.batch_stats), want.batch_stats, rtol=0, atol=0)


def _loss_only(loss_fn):
    def loss_only(params, batch_stats, batch):
        return loss_fn(params, batch_stats, batch)[0]

    return loss_only


def _stats_and_aux(loss_fn):
    def with_aux(params, batch_stats, batch):
        loss, stats = loss_fn(params, batch_stats, batch)
        return loss, (stats, {"n": jnp.float32(1)})

    return with_aux


@pytest.mark.parametrize(
    ("wrap", "has_aux", "match"),
    [
        (
            _loss_only,
            False,
            r"must return `\(loss, new_batch_stats\)`; it returned a value of shape",
        ),
        (
            lambda f: f,
            True,
            r"`\(loss, \(new_batch_stats, aux\)\)` \(`has_aux=True`\); its second "
            r"item is a dict of 1",
        ),
        (
            _stats_and_aux,
            False,
            r"(?s)In the state, not returned:.*\['BatchNorm_0'\]\['mean'\].*"
            r"Returned, not in the state:.*\[1\]\['n'\].*pass `has_aux=True`",
        ),
    ],
    ids=["loss-only", "no-aux", "aux-without-has_aux"],
)
def test_what_a_batch_stats_loss_returns_is_named(wrap, has_aux, match):
    """Raw errors before: "iteration over a 0-d array", "data type 'BatchNorm_0'
    not understood", or two tree structures dumped."""
    variables, loss_fn = bn_setup()
    tx = optax.sgd(0.05)
    step = jdp.parallelize(
        jdp.make_train_step(wrap(loss_fn), tx, has_aux=has_aux),
        devices=jax.devices()[:2],
    )
    state = step.replicate(
        jdp.TrainState.create(
            params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
        )
    )
    with pytest.raises(TypeError, match=match):
        step(state, step.shard(make_batches(1, 32)[0]))


@pytest.mark.parametrize(
    ("make_aux", "options", "error", "match"),
    [
        # With microbatches: NumPy's "Cannot interpret 'key<fry>' as a data type".
        (lambda loss: {"key": jax.random.key(0)}, {}, TypeError, "is a PRNG key"),
        (
            lambda loss: {"key": jax.random.key(0)},
            {"microbatches": 2},
            TypeError,
            "is a PRNG key",
        ),
        # An aux "skipped" silently hid the step's count of skipped steps (an aux
        # "loss" replaces the step's: the flax recipes' own loss metric).
        (
            lambda loss: {"loss": 2 * loss, "skipped": 0},
            {"skip_nonfinite": True},
            ValueError,
            r"auxiliary metrics \['skipped'\] have the names of metrics the step",
        ),
    ],
    ids=["key", "key-microbatches", "bookkeeping-name"],
)
def test_an_aux_metric_the_step_cannot_report_is_named(make_aux, options, error, match):
    def loss_fn(params, batch):
        loss = jnp.mean(batch * params["w"])
        return loss, make_aux(loss)

    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, has_aux=True, **options),
        devices=jax.devices()[:2],
    )
    state = step.replicate(jdp.TrainState.create(params={"w": jnp.ones(())}, tx=tx))
    with pytest.raises(error, match=match):
        step(state, step.shard(np.ones(4, np.float32)))


def test_flax_train_state_and_aux_metrics(backend):
    params = init_mlp(jax.random.key(0))
    tx = optax.adam(1e-2)
    state = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

    def loss_fn(params, batch):
        loss = mlp_loss(params, batch)
        return loss, {"half_loss": loss / 2}

    step = jdp.parallelize(jdp.make_train_step(loss_fn, has_aux=True), backend=backend)
    rep = step.replicate(state)
    batches = make_batches(4, 16)
    for b in batches:
        rep, metrics = step(rep, step.shard(b))
    assert set(metrics) == {"loss", "half_loss"}
    np.testing.assert_allclose(metrics["half_loss"], metrics["loss"] / 2, rtol=1e-6)
    # Same result as jdp.TrainState with the explicit optimizer.
    step2 = jdp.parallelize(jdp.make_train_step(mlp_loss, tx), backend=backend)
    rep2 = step2.replicate(jdp.TrainState.create(params=params, tx=tx))
    for b in batches:
        rep2, _ = step2(rep2, step2.shard(b))
    assert_trees_close(step.unreplicate(rep).params, step2.unreplicate(rep2).params)


def test_non_dict_aux_is_returned_under_aux():
    params = init_mlp(jax.random.key(0))
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(lambda p, b: (mlp_loss(p, b), 3.0), tx, has_aux=True)
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    _, metrics = step(state, step.shard(make_batches(1, 8)[0]))
    assert float(metrics["aux"]) == 3.0


def test_nnx_model():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    tx = optax.sgd(0.1)
    batches = make_batches(5, 16)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for b in batches:
        state, _ = step(state, step.shard(b))

    expected = params
    opt = tx.init(expected)
    for b in batches:
        g = jax.grad(loss_fn)(expected, b)
        u, opt = tx.update(g, opt, expected)
        expected = optax.apply_updates(expected, u)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)


def test_bf16_reduce_dtype_trains_close():
    params = init_mlp(jax.random.key(0))
    tx = optax.sgd(0.1)
    batches = make_batches(5, 32)

    def run(reduce_dtype):
        step = jdp.parallelize(
            jdp.make_train_step(
                mlp_loss, tx, sync=jdp.all_reduce(reduce_dtype=reduce_dtype)
            )
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        for b in batches:
            state, _ = step(state, step.shard(b))
        return step.unreplicate(state).params

    assert_trees_close(run(jnp.bfloat16), run(None), rtol=2e-2, atol=2e-3)


def test_missing_optimizer_error():
    step = jdp.parallelize(jdp.make_train_step(mlp_loss))
    state = step.replicate(
        jdp.TrainState(
            step=jnp.int32(0), params=init_mlp(jax.random.key(0)), opt_state=()
        )
    )
    with pytest.raises(ValueError, match="got no optimizer"):
        step(state, step.shard(make_batches(1, 8)[0]))


def test_train_state_apply_gradients():
    params = {"w": jnp.ones(3)}
    state = jdp.TrainState.create(params=params, tx=optax.sgd(0.5))
    new = state.apply_gradients(grads={"w": jnp.ones(3)})
    assert int(new.step) == 1
    np.testing.assert_allclose(new.params["w"], 0.5)
    assert new.tx is state.tx
    assert jax.tree.leaves(state.replace(tx=None)) == jax.tree.leaves(state)


@pytest.mark.parametrize(
    "leaf, shown",
    [(jnp.zeros(2, jnp.int32), "int32"), (jax.random.key(0), "key<fry>")],
    ids=["int", "key"],
)
def test_params_that_cannot_be_differentiated_are_named(leaf, shown):
    tx = optax.sgd(0.1)
    params = {"w": jnp.zeros(2), "n": leaf}
    step = jdp.parallelize(
        jdp.make_train_step(lambda p, b: jnp.sum(p["w"] * b), tx),
        devices=jax.devices()[:2],
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    with pytest.raises(
        TypeError, match=rf"(?s)must be floating-point.*\['n'\]: {shown}"
    ):
        step(state, step.shard(np.ones(2, np.float32)))


@pytest.mark.parametrize(
    "loss_fn, has_aux, match",
    [
        (lambda p, b: b * p["w"], False, r"an array of shape \(1,\)\. A per-example"),
        (
            lambda p, b: (jnp.mean(b * p["w"]), {"n": 1.0}),
            False,
            r"a tuple of 2\. If it returns `\(loss, aux\)`, pass `has_aux=True`",
        ),
        (lambda p, b: {"loss": jnp.mean(b)}, False, r"a dict of 1\. Return the loss"),
        (lambda p, b: jnp.int32(1), False, r"dtype int32\. Compute it in floating"),
        (
            lambda p, b: jnp.mean(b * p["w"]) * 1j,
            False,
            r"dtype complex64\. A complex loss",
        ),
        (
            lambda p, b: jnp.mean(b * p["w"]),
            True,
            r"has_aux=True\)`: `loss_fn` must return `\(loss, aux\)`; it returned a "
            r"value of shape \(\)",
        ),
    ],
    ids=["per-example", "tuple", "dict", "int", "complex", "no-aux"],
)
def test_a_loss_that_is_not_one_number_is_named(loss_fn, has_aux, match):
    """JAX said "Gradient only defined for scalar-output functions", naming
    neither the loss nor the fix."""
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, has_aux=has_aux), devices=jax.devices()[:2]
    )
    state = step.replicate(jdp.TrainState.create(params={"w": jnp.ones(())}, tx=tx))
    with pytest.raises(TypeError, match=match) as caught:
        step(state, step.shard(np.ones(2, np.float32)))
    assert str(caught.value).startswith(("`loss_fn`", "`jdp.make_train_step"))


def test_a_state_that_is_not_a_train_state_is_named():
    """A params dict passed as the state raised "'dict' object has no attribute
    'params'" from inside the traced step."""
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(lambda p, b: jnp.mean(b * p["w"]), tx),
        devices=jax.devices()[:2],
    )
    state = step.replicate({"w": jnp.ones(())})
    with pytest.raises(
        TypeError, match=r"takes a train state.*got a dict with keys \['w'\].*Fix"
    ):
        step(state, step.shard(np.ones(2, np.float32)))


def test_a_string_metric_names_the_metric():
    step = jdp.parallelize(
        lambda s, b: (s, {"note": "hello"}), devices=jax.devices()[:2]
    )
    with pytest.raises(TypeError, match=r"metric \['note'\] is a str"):
        step(step.replicate({}), step.shard(np.ones(2, np.float32)))


def nan_on_request(params, batch):
    # Loss and gradients are NaN on a replica that sees a "poisoned" example.
    scale = jnp.where(jnp.any(batch["poison"] > 0), jnp.nan, 1.0)
    return mlp_loss(params, batch) * scale


@pytest.mark.parametrize("grad_sync", ["all_reduce", "local", "zero"])
def test_skip_nonfinite_leaves_params_and_optimizer_state_alone(backend, grad_sync):
    tx = optax.adam(1e-2)
    sync = jdp.local() if grad_sync != "all_reduce" else jdp.all_reduce()
    if grad_sync == "local":
        tx = jdp.bmuf(tx, sync_period=2)
    elif grad_sync == "zero":
        tx = jdp.zero(tx)
    step = jdp.parallelize(
        jdp.make_train_step(nan_on_request, tx, sync=sync, skip_nonfinite=True),
        backend=backend,
    )
    params = init_mlp(jax.random.key(0))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    good, bad = make_batches(2, 16)
    good["poison"] = np.zeros(16, np.float32)
    bad["poison"] = np.zeros(16, np.float32)
    bad["poison"][5] = 1.0  # one example, on one replica only
    state, metrics = step(state, step.shard(good))
    assert float(metrics["skipped"]) == 0.0
    before = jax.device_get(step.unreplicate(state))
    state, metrics = step(state, step.shard(bad))
    after = jax.device_get(step.unreplicate(state))
    assert float(metrics["skipped"]) == 1.0
    assert int(after.skipped_steps) == 1 and int(after.step) == 2
    assert_trees_close(after.params, before.params, rtol=0, atol=0)
    assert_trees_close(after.opt_state, before.opt_state, rtol=0, atol=0)
    jdp.assert_replicas_in_sync(state.params if grad_sync != "local" else state.step)
    state, metrics = step(state, step.shard(good))  # training goes on
    assert float(metrics["skipped"]) == 0.0
    assert np.isfinite(float(metrics["loss"]))


def test_skip_nonfinite_needs_a_counter_in_the_state():
    tx = optax.sgd(0.1)
    state = flax_train_state.TrainState.create(
        apply_fn=None, params=init_mlp(jax.random.key(0)), tx=tx
    )
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, skip_nonfinite=True),
        devices=jax.devices()[:2],
    )
    with pytest.raises(ValueError, match=r"`skipped_steps` field.*TrainState"):
        step(step.replicate(state), step.shard(make_batches(1, 4)[0]))


# -- gradient accumulation and loss scaling -------------------------------------


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatches_equal_the_whole_batch_on_one_device(backend, microbatches):
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0))
    batches = make_batches(3, 64)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, microbatches=microbatches), backend=backend
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    from helpers import single_device_train

    expected, _ = single_device_train(mlp_loss, params, tx, batches)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=2e-5)
    # One all-reduce per update, whatever the number of microbatches.
    ops = step.collectives(state, step.shard(batches[0]), stage="lowered")
    grads = [c for c in ops if c.kind == "all-reduce" and c.bytes > 4]
    assert sum(c.bytes for c in grads) == sum(
        x.size * 4 for x in jax.tree.leaves(params)
    )


def test_microbatches_hold_the_activations_of_one_microbatch():
    tx = optax.sgd(0.1)
    params = init_mlp(jax.random.key(0), sizes=(16, 256, 256, 4))

    def temp_bytes(k):
        step = jdp.parallelize(
            jdp.make_train_step(mlp_loss, tx, microbatches=k),
            devices=jax.devices()[:2],
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        batch = make_batches(1, 4096, in_dim=16)[0]
        return step.memory_analysis(state, step.shard(batch)).temp_bytes

    one, eight = temp_bytes(1), temp_bytes(8)
    assert eight < one / 2, (one, eight)


def test_microbatches_must_divide_the_replica_batch():
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, microbatches=3), devices=jax.devices()[:2]
    )
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    with pytest.raises(ValueError, match=r"(?s)microbatches=3.*\['x'\]: 4"):
        step(state, step.shard(make_batches(1, 8)[0]))
    with pytest.raises(ValueError, match=r"`microbatches` must be an int >= 1"):
        jdp.make_train_step(mlp_loss, tx, microbatches=0)


def test_optax_multisteps_all_reduces_only_when_it_updates(backend):
    """`optax.MultiSteps(chain(jdp.sync_gradients(), inner))` with local gradients:
    the gradient all-reduce sits in a conditional (taken once per update), and
    the result equals single-device `optax.MultiSteps(inner)` on global batches."""
    inner = optax.adam(0.01)
    tx = optax.MultiSteps(optax.chain(jdp.sync_gradients(), inner), every_k_schedule=2)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:4],
        backend=backend,
    )
    params = init_mlp(jax.random.key(0))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batches = make_batches(4, 16)
    grads = [
        c
        for c in step.collectives(state, step.shard(batches[0]), stage="lowered")
        if c.kind == "all-reduce" and c.bytes > 4
    ]
    assert grads and all(c.in_conditional for c in grads), grads
    # One all-reduce of the gradients, in the branch that updates: the branch
    # that only accumulates issues none.
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert sum(c.bytes for c in grads) == param_bytes, grads
    history = []
    for batch in batches:
        state, _ = step(state, step.shard(batch))
        history.append(step.unreplicate(state.params))
    assert_trees_close(history[0], params, rtol=0, atol=0)  # accumulated only
    jdp.assert_replicas_in_sync(state)
    oracle = optax.MultiSteps(inner, every_k_schedule=2)
    expected, _ = single_device_train(mlp_loss, params, oracle, batches)
    assert_trees_close(history[-1], expected)


class _EmaState(flax_train_state.TrainState):
    ema: object = None


def test_a_state_field_the_step_would_ignore_is_refused():
    """A field `make_train_step` does not update (an EMA of the params) is an
    error naming it; the same field set to None passes, and the idiom the
    message gives (a step of one's own around it) updates it."""
    tx = optax.sgd(0.1)
    train_step = jdp.make_train_step(mlp_loss, tx)
    step = jdp.parallelize(train_step, devices=jax.devices()[:2])
    params = init_mlp(jax.random.key(0))
    plain = _EmaState.create(apply_fn=None, params=params, tx=tx)
    with_ema = plain.replace(ema=params)
    batch = step.shard(make_batches(1, 8)[0])
    message = r"_EmaState also has 'ema'.*replace\(ema=None\)"
    with pytest.raises(ValueError, match=message):
        step(step.replicate(with_ema), batch)
    state, _ = step(step.replicate(plain), batch)  # ema=None: nothing to ignore
    assert state.ema is None

    def with_ema_step(state, batch):
        new, metrics = train_step(state.replace(ema=None), batch)
        ema = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, state.ema, new.params)
        return new.replace(ema=ema), metrics

    own = jdp.parallelize(with_ema_step, devices=jax.devices()[:2])
    state, _ = own(own.replicate(with_ema), batch)
    one = own.unreplicate(state)
    expected = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, params, one.params)
    assert_trees_close(one.ema, expected)


def test_dynamic_scale_is_honoured_and_skips_overflowing_steps(backend):
    from flax.training.dynamic_scale import DynamicScale

    tx = optax.sgd(0.1)
    params = jax.tree.map(lambda x: x.astype(jnp.float16), init_mlp(jax.random.key(0)))

    def loss_fn(p, batch):  # overflows on a batch with `blow_up` set
        return mlp_loss(p, batch) * jnp.where(
            jnp.any(batch["blow_up"] > 0), jnp.inf, 1.0
        )

    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), backend=backend)
    scale = DynamicScale(growth_interval=1, scale=2.0**10)
    state = step.replicate(
        jdp.TrainState.create(params=params, tx=tx, dynamic_scale=scale)
    )
    good, bad = make_batches(2, 16)
    good["blow_up"] = np.zeros(16, np.float32)
    bad["blow_up"] = np.zeros(16, np.float32)
    bad["blow_up"][-1] = 1.0  # one replica overflows: every replica skips
    state, m = step(state, step.shard(good))
    assert float(m["skipped"]) == 0.0 and float(m["loss_scale"]) == 2.0**10
    before = jax.device_get(step.unreplicate(state))
    state, m = step(state, step.shard(bad))
    after = jax.device_get(step.unreplicate(state))
    assert float(m["skipped"]) == 1.0
    assert float(after.dynamic_scale.scale) < float(before.dynamic_scale.scale)
    assert_trees_close(after.params, before.params, rtol=0, atol=0)
    assert int(after.skipped_steps) == 1
    jdp.assert_replicas_in_sync(state)


def test_dynamic_scale_with_a_piece_that_takes_sparse_rows_is_refused():
    from flax.training.dynamic_scale import DynamicScale

    tx = jdp.sparse.optimizer(optax.sgd(0.1), {"layer0/w": jdp.sparse.sgd(0.1)})
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.sparse.rows()),
        devices=jax.devices()[:2],
    )
    state = step.replicate(
        jdp.TrainState.create(
            params=init_mlp(jax.random.key(0)), tx=tx, dynamic_scale=DynamicScale()
        )
    )
    with pytest.raises(ValueError, match=r"`dynamic_scale`.*needs dense gradients"):
        step(state, step.shard(make_batches(1, 4)[0]))


# -- what the loss may ask for: rng and step ----------------------------------------


class _DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, *, train):
        x = nn.Dense(16)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(4)(x)


def _dropout_setup():
    model = _DropoutMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 8)), train=False)["params"]

    def loss_fn(params, batch, rng):
        out = model.apply(
            {"params": params}, batch["x"], train=True, rngs={"dropout": rng}
        )
        loss = jnp.mean((out - batch["y"]) ** 2)
        return loss, {"mask": jdp.metrics.gather(jnp.sum(out, axis=1))}

    return model, params, loss_fn


def test_linen_dropout_draws_a_mask_per_replica_and_step_and_again_on_restore(
    backend, tmp_path
):
    _, params, loss_fn = _dropout_setup()
    tx = optax.sgd(0.0)  # params stay put: only the masks change the outputs
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, has_aux=True),
        backend=backend,
        devices=jax.devices()[:4],
        donate_state=False,
    )
    state = step.replicate(
        jdp.TrainState.create(params=params, tx=tx, rng=jax.random.key(7))
    )
    batch = {"x": np.ones((8, 8), np.float32), "y": np.zeros((8, 4), np.float32)}
    batch = step.shard(batch)  # every replica sees the same examples
    with jdp.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(0, state, parallel=step)
    first, m1 = step(state, batch)
    _, m2 = step(first, batch)
    with jdp.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
        restored = manager.restore(state)
    _, again = step(restored, batch)  # the restored checkpoint draws alike
    rows = np.asarray(m1["mask"]).reshape(4, 2)
    assert len({tuple(r) for r in rows}) == 4  # a different mask per replica
    assert not np.allclose(np.asarray(m1["mask"]), np.asarray(m2["mask"]))
    np.testing.assert_array_equal(np.asarray(again["mask"]), np.asarray(m1["mask"]))


def test_a_loss_that_takes_rng_needs_a_key_in_the_state():
    _, params, loss_fn = _dropout_setup()
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, has_aux=True), devices=jax.devices()[:2]
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batch = {"x": np.ones((4, 8), np.float32), "y": np.zeros((4, 4), np.float32)}
    with pytest.raises(ValueError, match=r"takes `rng`, but the state has no `rng`"):
        step(state, step.shard(batch))


def test_the_loss_may_read_the_step_counter():
    def loss_fn(params, batch, *, step):
        return mlp_loss(params, batch), {"seen_step": step}

    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, has_aux=True, microbatches=2),
        devices=jax.devices()[:2],
    )
    state = step.replicate(
        jdp.TrainState.create(params=init_mlp(jax.random.key(0)), tx=tx)
    )
    for expected, batch in enumerate(make_batches(3, 8)):
        state, metrics = step(state, step.shard(batch))
        assert float(metrics["seen_step"]) == expected


def test_float16_params_under_adam_and_a_loss_scaler_name_the_cause():
    from flax.training.dynamic_scale import DynamicScale

    params = {"w": jnp.ones((3, 2), jnp.float16)}

    def loss_fn(p, b):
        return jnp.mean((b["x"].astype(jnp.float16) @ p["w"]) ** 2).astype(jnp.float32)

    tx = optax.adam(1e-3)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:2])
    state = step.replicate(
        jdp.TrainState.create(params=params, tx=tx, dynamic_scale=DynamicScale())
    )
    batch = step.shard({"x": np.ones((4, 3), np.float32)})
    with pytest.raises(
        TypeError,
        match=r"(?s)mu\['w'\]: float16.*came back in float32.*master weights.*Or "
        r"keep Adam's first moment \(`mu`\) in the params' dtype: "
        r"`optax\.adam\(learning_rate, mu_dtype=jnp\.float16\)`",
    ):
        step(state, batch)
    # What the message offers works: the state keeps its float16 moments.
    tx = optax.adam(1e-3, mu_dtype=jnp.float16)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:2])
    state = step.replicate(
        jdp.TrainState.create(params=params, tx=tx, dynamic_scale=DynamicScale())
    )
    state, _ = step(state, batch)
    assert state.opt_state[0].mu["w"].dtype == jnp.float16


def test_a_collapsed_loss_scale_is_reported():
    from flax.training.dynamic_scale import DynamicScale

    def loss_fn(params, batch):
        return mlp_loss(params, batch) * jnp.nan  # never finite

    tx = optax.sgd(0.1)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:2])
    scale = DynamicScale(scale=4.0)
    state = step.replicate(
        jdp.TrainState.create(
            params=init_mlp(jax.random.key(0)), tx=tx, dynamic_scale=scale
        )
    )
    batch = step.shard(make_batches(1, 4)[0])
    state, metrics = step(state, batch)  # 4 -> 2
    state, metrics = step(state, batch)  # 2 -> 1
    jax.effects_barrier()
    with pytest.warns(RuntimeWarning, match=r"loss scale collapsed to 0\.5"):
        state, metrics = step(state, batch)  # 1 -> 0.5
        jax.effects_barrier()
    assert int(step.unreplicate(state).skipped_steps) == 3


def test_all_computed_keeps_every_bit_and_holds_only_large_float_leaves():
    big = np.arange(128 * 128, dtype=np.float32).reshape(128, 128)  # 64 KiB
    big[0, 0], big[0, 1], big[1, 0] = -0.0, np.nan, -np.inf
    tree = {
        "big": big,
        "small": np.full(3, -0.0, np.float32),
        "count": np.arange(20000, dtype=np.int32),  # large, not a float
        "empty": np.zeros((0, 4), np.float32),
    }
    out = jax.jit(_train_step.all_computed)(tree)
    for key, value in tree.items():
        assert out[key].shape == value.shape and out[key].dtype == value.dtype, key
        np.testing.assert_array_equal(
            np.asarray(out[key]).view(np.uint8), value.view(np.uint8), err_msg=key
        )
    held = jax.make_jaxpr(_train_step.all_computed)(tree)
    # One in-place update of one element, for the one float leaf of 64 KiB or more.
    assert str(held).count("dynamic_update_slice") == 1
    assert _train_step.all_computed({"small": tree["small"]})["small"] is tree["small"]


def test_a_local_step_on_one_device_updates_its_weights_without_copying_them():
    # XLA may update a weight while the backward pass still reads it, and then
    # copies it first (every step); the gradients held until all are computed
    # order the update after the last read, as an all-reduce of them would.
    params = init_mlp(jax.random.key(0), sizes=(16, 256, 256, 4))
    tx = optax.sgd(0.1, momentum=0.9)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=jdp.local()), devices=jax.devices()[:1]
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    batch = step.shard(make_batches(1, 8, in_dim=16, out_dim=4)[0])
    text = step.lower(state, batch).compile().as_text()
    copied = [line for line in text.splitlines() if " copy(" in line]
    assert not [line for line in copied if "[256,256]" in line], copied
    host_batch = jax.device_get(batch)
    new, _ = step(state, batch)
    oracle, _ = single_device_train(mlp_loss, params, tx, [host_batch])
    assert_trees_close(step.unreplicate(new).params, oracle, rtol=1e-6)


def step_copies(hlo_text):
    """The `copy` lines of a compiled step's entry computation (run every step)."""
    comps, entry = _hlo._parse_computations(hlo_text)
    return [line for line in comps[entry] if " copy(" in line]


@pytest.mark.filterwarnings("ignore:The sync piece leaves each replica its own")
@pytest.mark.parametrize(
    "make",
    [
        lambda: (jdp.local(), optax.adam(1e-3)),
        lambda: (jdp.local(), jdp.bmuf(optax.adam(1e-3), 8)),
        lambda: (
            jdp.local(),
            jdp.bmuf(
                optax.adam(1e-3),
                8,
                streaming=jdp.Streaming(2, delay=1),
                outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
            ),
        ),
        lambda: (
            jdp.local(),
            optax.chain(jdp.sync_gradients(jdp.all_reduce()), optax.adam(1e-3)),
        ),
        lambda: (jdp.local(), jdp.zero(optax.adam(1e-3))),
        lambda: (jdp.local(), optax.adam(1e-3), {"skip_nonfinite": True}),
        lambda: (jdp.powersgd(rank=2), optax.adam(1e-3), {}, 1),
        lambda: (
            jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True),
            optax.adam(1e-3),
            {},
            1,
        ),
    ],
    ids=[
        "local",
        "bmuf",
        "streaming-diloco",
        "sync_gradients",
        "zero",
        "skip",
        "powersgd-one-device",
        "int8-error-feedback-one-device",
    ],  # fmt: skip
)
def test_a_step_without_a_collective_of_the_gradients_copies_none_of_them(make):
    # Held gradients wait for one value made from all of them (with
    # `skip_nonfinite`, their finiteness): each read another directly before, and
    # XLA copied every one of 64 KiB or more, every step.
    sync, tx, *rest = make()
    options = rest[0] if rest else {}
    devices = rest[1] if len(rest) > 1 else 4
    params = init_mlp(jax.random.key(0), sizes=(16, 128, 256, 128))  # 2 of 128 KiB
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=sync, **options),
        devices=jax.devices()[:devices],
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    batch = step.shard(make_batches(1, 16, in_dim=16, out_dim=128)[0])
    text = step.lower(state, batch).compile().as_text()
    copied = step_copies(text)
    assert not [x for x in copied if "[128,256]" in x or "[256,128]" in x], copied


def test_a_sparse_rows_step_updates_the_weight_after_the_rows_are_made():
    # The rows of `jdp.sparse.rows` travel apart from the dense all-reduce, and the
    # gradient of the looked-up rows reads `w`: held until the rows are made, `w`'s
    # update waits for that read (XLA copied `w` every step before).
    def loss_fn(params, batch):
        x = jdp.sparse.lookup(params["embed"], batch["ids"])
        return jnp.mean((jnp.tanh(x @ params["w"]) @ params["out"] - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    params = {
        "embed": 0.1 * rng.normal(size=(1000, 64)).astype(np.float32),
        "w": 0.1 * rng.normal(size=(64, 512)).astype(np.float32),  # 128 KiB
        "out": 0.1 * rng.normal(size=(512, 1)).astype(np.float32),
    }
    batch = {
        "ids": rng.integers(0, 1000, (64,)),
        "y": rng.normal(size=(64, 1)).astype(np.float32),
    }
    tx = jdp.sparse.optimizer(optax.adam(1e-3), {"embed": jdp.sparse.sgd(0.1)})
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, sync=jdp.sparse.rows()),
        devices=jax.devices()[:4],
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    text = step.lower(state, step.shard(batch)).compile().as_text()
    copied = step_copies(text)
    assert not [x for x in copied if "[64,512]" in x], copied
