"""flax NNX models trained by jdp: every recipe, dropout, metrics, BMUF, checkpoints.

The model is the CNN of flax's NNX MNIST tutorial (Conv, BatchNorm, Dropout,
Linear), sized for scikit-learn's 8x8 digits. The oracle is the tutorial's own
single-device step (`nnx.jit`, `nnx.value_and_grad`, `nnx.Optimizer`) on the
whole global batch.
"""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, run_steps
from sklearn.datasets import load_digits

import jdp
from jdp.checkpoint import CheckpointManager

TX = optax.sgd(0.1, momentum=0.9)
GLOBAL_BATCH = 64


class CNN(nnx.Module):
    """The NNX MNIST tutorial's CNN, for 8x8 digits.

    `axis_name` is the replica axis BatchNorm averages its batch statistics
    over (None on one device): with it, N replicas normalise with the
    statistics of the global batch, as one device does.
    """

    def __init__(self, *, rngs, dropout=0.025, axis_name=None):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=dropout)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(16, axis_name=axis_name, rngs=rngs)
        self.avg_pool = functools.partial(
            nnx.avg_pool, window_shape=(2, 2), strides=(2, 2)
        )
        self.linear1 = nnx.Linear(2 * 2 * 16, 32, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=dropout)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x, rngs=None):
        x = self.dropout1(self.conv1(x), rngs=rngs)
        x = self.avg_pool(nnx.relu(self.batch_norm1(x)))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


@functools.cache
def digits():
    data = load_digits()
    return (data.images / 16.0).astype(np.float32)[..., None], data.target


def make_batches(num, size=GLOBAL_BATCH, seed=0):
    x, y = digits()
    rng = np.random.default_rng(seed)
    picks = [rng.choice(len(x), size, replace=False) for _ in range(num)]
    return [{"x": x[i], "y": y[i].astype(np.int32)} for i in picks]


def cross_entropy(model, batch, rngs=None):
    logits = model(batch["x"], rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def nnx_train_step(graphdef, *, all_reduce=True):
    """The recipe: the NNX tutorial's step, run per replica by `jdp.parallelize`.

    The state is `nnx.split((model, optimizer, rngs))[1]`; `rngs` is the same on
    every replica and advances in step, and `jdp.replica_key` gives each replica
    its own dropout key from it. Gradients are averaged here, or (with
    `all_reduce=False`) by a `jdp.sync_gradients()` first in the optimizer.
    """

    def train_step(state, batch):
        model, optimizer, rngs = nnx.merge(graphdef, state)
        key = jdp.replica_key(rngs.dropout())

        def loss_fn(model):
            return cross_entropy(model, batch, nnx.Rngs(dropout=key))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        if all_reduce:
            grads = jdp.all_reduce_gradients(grads)
        optimizer.update(model, grads)
        metrics = {"loss": loss, "replica_loss": jdp.metrics.gather(loss)}
        return nnx.state((model, optimizer, rngs)), metrics

    return train_step


def split_for_jdp(model, tx=TX):
    """`(graphdef, state)` of the model, its optimizer and a dropout stream."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return nnx.split((model, optimizer, nnx.Rngs(dropout=1)))


def host_bits(tree):
    """Every leaf as NumPy, typed PRNG keys as their key data (to compare bits)."""

    def bits(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(bits, jax.device_get(tree))


def assert_bitwise_equal(actual, expected):
    assert_trees_close(host_bits(actual), host_bits(expected), rtol=0, atol=0)


@pytest.fixture(scope="module")
def single_device():
    """The NNX tutorial's training on one device; dropout off (see the dropout test)."""
    model = CNN(rngs=nnx.Rngs(0), dropout=0.0)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(cross_entropy)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, b)) for b in make_batches(4)]
    return nnx.state(model), losses


def test_nnx_step_equals_single_device_training(single_device):
    model = CNN(rngs=nnx.Rngs(0), dropout=0.0, axis_name="data")
    graphdef, state = split_for_jdp(model)
    step = jdp.parallelize(nnx_train_step(graphdef))
    state, losses = run_steps(step, step.replicate(state), make_batches(4))

    expected, expected_losses = single_device
    jdp.assert_replicas_in_sync(state)
    trained, _, _ = nnx.merge(graphdef, step.unreplicate(state))
    # Params and BatchNorm statistics, equal up to float rounding.
    assert_trees_close(nnx.state(trained), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    assert not np.allclose(trained.batch_norm1.mean[...], 0.0)  # they did move


def test_make_train_step_trains_an_nnx_model(single_device):
    """`nnx.split(model, nnx.Param, ...)` into a `jdp.TrainState`, plain `nnx.merge`.

    Without jdp rebuilding the batch statistics inside the differentiated
    function, BatchNorm would fail here with "Cannot mutate BatchStat from a
    different trace level".
    """
    model = CNN(rngs=nnx.Rngs(0), dropout=0.0, axis_name="data")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        return cross_entropy(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    step = jdp.parallelize(jdp.make_train_step(loss_fn, TX), backend="pmap")
    state = step.replicate(
        jdp.TrainState.create(params=params, batch_stats=rest, tx=TX)
    )
    state, losses = run_steps(step, state, make_batches(4))

    expected, expected_losses = single_device
    one = step.unreplicate(state)
    trained = nnx.merge(graphdef, one.params, one.batch_stats)
    assert_trees_close(nnx.state(trained), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)


def test_make_train_step_options_work_with_nnx_state():
    """ZeRO lays out an optimizer state mirroring NNX `State`s: same numbers."""
    rngs = nnx.Rngs(0)
    # No bias before BatchNorm: its gradient would be rounding noise around 0,
    # which Adam scales up to a full step, differently for each summation order.
    model = nnx.Sequential(
        nnx.Linear(64, 32, use_bias=False, rngs=rngs),
        nnx.BatchNorm(32, rngs=rngs),
        nnx.relu,
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        out = model(batch["x"].reshape(batch["x"].shape[0], -1))
        return jnp.mean(out**2), nnx.state(model, nnx.Not(nnx.Param))

    tx = optax.adam(1e-2)

    def train(tx, sync):
        train_step = jdp.make_train_step(loss_fn, tx, sync=sync)
        step = jdp.parallelize(train_step, devices=jax.devices()[:4])
        state = jdp.TrainState.create(params=params, batch_stats=rest, tx=tx)
        state, _ = run_steps(step, step.replicate(state), make_batches(3, 16))
        return step.unreplicate(state)

    zero = train(jdp.zero(tx), jdp.local())
    plain = train(tx, jdp.all_reduce())
    assert_trees_close(zero.params, plain.params, rtol=1e-6, atol=1e-7)
    assert_trees_close(zero.opt_state.chunks, plain.opt_state, rtol=1e-6, atol=1e-7)
    assert_trees_close(zero.batch_stats, plain.batch_stats, rtol=1e-6, atol=1e-7)


def test_each_replica_draws_its_own_dropout_masks_reproducibly():
    model = CNN(rngs=nnx.Rngs(0), dropout=0.5, axis_name="data")
    graphdef, init = split_for_jdp(model)
    step = jdp.parallelize(nnx_train_step(graphdef), devices=jax.devices()[:4])
    # Every replica gets the same 4 images: only dropout tells them apart.
    x, y = digits()
    batch = {"x": np.tile(x[:4], (4, 1, 1, 1)), "y": np.tile(y[:4], 4).astype(np.int32)}

    def replica_losses():
        state, out = step.replicate(init), []
        for _ in range(2):
            state, metrics = step(state, step.shard(batch))
            out.append(np.asarray(metrics["replica_loss"]))
        return state, np.stack(out)

    state, losses = replica_losses()
    assert losses.shape == (2, 4)
    assert all(len(set(row.tolist())) == 4 for row in losses)  # 4 different masks
    assert not np.array_equal(losses[0], losses[1])  # new masks every step
    jdp.assert_replicas_in_sync(state)  # the masks differ, the state does not
    again, losses_again = replica_losses()
    np.testing.assert_array_equal(losses_again, losses)  # the same on every run
    assert_bitwise_equal(step.unreplicate(again), step.unreplicate(state))


def test_params_with_nnx_rng_state_name_the_leaf_and_the_split():
    model = nnx.Sequential(
        nnx.Linear(64, 10, rngs=nnx.Rngs(0)), nnx.Dropout(0.1, rngs=nnx.Rngs(1))
    )

    def loss_fn(params, batch):
        return jnp.mean(nnx.merge(graphdef, params)(batch["x"]) ** 2)

    graphdef, everything = nnx.split(model)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, TX), devices=jax.devices()[:2])
    state = step.replicate(jdp.TrainState.create(params=everything, tx=TX))
    batch = step.shard({"x": np.ones((2, 64), np.float32)})
    with pytest.raises(
        TypeError,
        match=r"(?s)\['layers'\]\[1\]\['rngs'\]\['count'\]\.value: uint32.*"
        r"nnx\.split\(model, nnx\.Param, \.\.\.\)",
    ):
        step(state, batch)


# -- checkpoints ------------------------------------------------------------------


def resumed_and_uninterrupted(step, init, fresh, batches, directory):
    """Trains on `batches` straight through, and with a save/restore halfway.

    The restore goes into `step.replicate(fresh)`, a state with other values.
    Returns the resumed and the uninterrupted states, and one copy of the saved
    state.
    """
    uninterrupted, _ = run_steps(step, step.replicate(init), batches)
    half = len(batches) // 2
    state, _ = run_steps(step, step.replicate(init), batches[:half])
    with CheckpointManager(directory) as manager:
        manager.save(half, state)
    with CheckpointManager(directory) as manager:
        restored = manager.restore(step.replicate(fresh))
    saved = jax.device_get(step.unreplicate(state))
    resumed, _ = run_steps(step, restored, batches[half:])
    return resumed, uninterrupted, saved


def test_checkpoint_of_an_nnx_sequential_resumes_bit_for_bit(tmp_path):
    def make(seed):
        rngs = nnx.Rngs(seed)
        return nnx.Sequential(
            nnx.Linear(64, 32, rngs=rngs),
            nnx.BatchNorm(32, rngs=rngs),
            nnx.relu,
            nnx.Linear(32, 10, rngs=rngs),
        )

    graphdef, params, rest = nnx.split(make(0), nnx.Param, ...)

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        logits = model(batch["x"].reshape(batch["x"].shape[0], -1))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return loss.mean(), nnx.state(model, nnx.Not(nnx.Param))

    def train_state(model):
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return jdp.TrainState.create(params=params, batch_stats=rest, tx=TX)

    step = jdp.parallelize(jdp.make_train_step(loss_fn, TX), devices=jax.devices()[:4])
    resumed, uninterrupted, saved = resumed_and_uninterrupted(
        step, train_state(make(0)), train_state(make(1)), make_batches(4), tmp_path
    )
    assert_bitwise_equal(resumed, uninterrupted)
    # The Sequential's integer layer keys come back as integers: `nnx.merge` works.
    one = step.unreplicate(resumed)
    assert sorted(one.params["layers"]) == [0, 1, 3]
    model = nnx.merge(graphdef, one.params, one.batch_stats)
    assert model(jnp.ones((2, 64))).shape == (2, 10)
    # And as one copy, for evaluation.
    with CheckpointManager(tmp_path) as manager:
        copy = manager.restore(jax.device_get(train_state(make(1))))
    assert_bitwise_equal(copy, saved)


def four_replicas(tx):
    """`(graphdef, init, fresh, step)`: the recipe on 4 devices, gradients
    averaged (or not) by `tx`; `fresh` is another model's state to restore into."""
    graphdef, init = split_for_jdp(CNN(rngs=nnx.Rngs(0), axis_name="data"), tx)
    _, fresh = split_for_jdp(CNN(rngs=nnx.Rngs(1), axis_name="data"), tx)
    step = jdp.parallelize(
        nnx_train_step(graphdef, all_reduce=False), devices=jax.devices()[:4]
    )
    return graphdef, init, fresh, step


def test_checkpoint_of_an_nnx_module_and_optimizer_resumes_bit_for_bit(tmp_path):
    """The recipe's state: model, `nnx.Optimizer` (Adam) and dropout stream."""
    tx = optax.chain(jdp.sync_gradients(), optax.adam(1e-2))
    graphdef, init, fresh, step = four_replicas(tx)
    resumed, uninterrupted, saved = resumed_and_uninterrupted(
        step, init, fresh, make_batches(4, 32), tmp_path
    )
    assert_bitwise_equal(resumed, uninterrupted)
    _, optimizer, rngs = nnx.merge(graphdef, saved)
    assert int(optimizer.step[...]) == 2 and int(rngs.dropout.count[...]) == 2


def test_bmuf_in_an_nnx_optimizer_equals_make_train_step():
    """`nnx.Optimizer(model, jdp.bmuf(...))` in the tutorial's own step.

    The block sync then runs inside the optimizer; `make_train_step` runs it
    after the update: the same algorithm. The divergence guard, on at every
    call, compares only what BMUF's replicas agree on, and `bmuf_global_params`
    finds the global model in the state NNX lays out.
    """
    tx = jdp.bmuf(TX, sync_period=2)
    batches = make_batches(5)  # two blocks and one step into the third

    model = CNN(rngs=nnx.Rngs(0), dropout=0.0, axis_name="data")
    graphdef, state = split_for_jdp(model, tx)
    step = jdp.parallelize(nnx_train_step(graphdef, all_reduce=False), check_sync=1)
    state, losses = run_steps(step, step.replicate(state), batches)
    assert not jdp.replicas_in_sync(nnx.state(nnx.merge(graphdef, state)[0]))
    hand_written = step.unreplicate(jdp.bmuf_global_params(state))

    model = CNN(rngs=nnx.Rngs(0), dropout=0.0, axis_name="data")
    split_graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, batch):
        model = nnx.merge(split_graphdef, params, rest)
        return cross_entropy(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    made = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=jdp.local()))
    made_state = made.replicate(
        jdp.TrainState.create(params=params, batch_stats=rest, tx=tx)
    )
    made_state, made_losses = run_steps(made, made_state, batches)
    expected = made.unreplicate(jdp.bmuf_global_params(made_state))

    np.testing.assert_allclose(losses, made_losses, rtol=1e-5)
    assert_trees_close(
        jax.tree.leaves(hand_written), jax.tree.leaves(expected), rtol=1e-5, atol=1e-6
    )
    # The global model loads into the module for evaluation.
    trained = nnx.merge(graphdef, step.unreplicate(state))[0]
    nnx.update(trained, hand_written)
    assert_trees_close(
        jax.tree.leaves(nnx.state(trained, nnx.Param)),
        jax.tree.leaves(expected),
        rtol=1e-5,
        atol=1e-6,
    )

    # The modules passed directly (the NNX guide's recipe without its all-reduce):
    # the same numbers.
    def direct_step(state, batch):
        model, optimizer = state
        loss, grads = nnx.value_and_grad(cross_entropy)(model, batch)
        optimizer.update(model, grads)
        return (model, optimizer), {"loss": loss}

    model = CNN(rngs=nnx.Rngs(0), dropout=0.0, axis_name="data")
    step = jdp.parallelize(direct_step, check_sync=1)
    direct = step.replicate((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
    direct, direct_losses = run_steps(step, direct, batches)
    np.testing.assert_allclose(direct_losses, made_losses, rtol=1e-5)
    assert_trees_close(
        jax.tree.leaves(step.unreplicate(jdp.bmuf_global_params(direct))),
        jax.tree.leaves(expected),
        rtol=1e-5,
        atol=1e-6,
    )


def test_bmuf_in_an_nnx_optimizer_resumes_mid_block_bit_for_bit(tmp_path):
    """Saved between syncs, every replica's local model and optimizer come back."""
    tx = jdp.bmuf(TX, sync_period=4)
    graphdef, init, fresh, step = four_replicas(tx)
    # Saved after 3 steps, in the first block; resumed across the sync.
    resumed, uninterrupted, saved = resumed_and_uninterrupted(
        step, init, fresh, make_batches(6, 32), tmp_path
    )
    assert_bitwise_equal(resumed, uninterrupted)
    with CheckpointManager(tmp_path) as manager:
        per_replica = [
            r["path"] for r in manager.metadata()["leaves"] if r.get("per_replica")
        ]
    assert any("conv1" in p and "kernel" in p for p in per_replica)
    assert not any("global_params" in p for p in per_replica)
    # Into 2 replicas: replica 0's copy, and how to start from the global model.
    two = jdp.parallelize(
        nnx_train_step(graphdef, all_reduce=False), devices=jax.devices()[:2]
    )
    with CheckpointManager(tmp_path) as manager:
        with pytest.warns(
            RuntimeWarning,
            match=r"(?s)saved between syncs.*`like` has 2 replicas.*"
            r"nnx\.update\(model, jdp\.bmuf_global_params\(state\)\)",
        ):
            restored = manager.restore(two.replicate(fresh))
    assert_bitwise_equal(two.unreplicate(restored), saved)


def metrics_train_step(graphdef, *, all_replicas):
    """The NNX tutorial's step with its `nnx.MultiMetric` in the state.

    With `all_replicas`, the metrics are updated with every replica's values
    (the global batch), the adaptation the divergence error suggests.
    """

    def train_step(state, batch):
        model, optimizer, metrics = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(batch["x"])
            labels = batch["y"]
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return loss.mean(), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        labels = batch["y"]
        if all_replicas:
            loss = jax.lax.pmean(loss, "data")
            logits = jax.lax.all_gather(logits, "data", tiled=True)
            labels = jax.lax.all_gather(labels, "data", tiled=True)
        metrics.update(loss=loss, logits=logits, labels=labels)
        optimizer.update(model, jdp.all_reduce_gradients(grads))
        return nnx.state((model, optimizer, metrics)), {"loss": loss}

    return train_step


def tutorial_metrics():
    return nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
    )


def test_nnx_metrics_in_the_state_count_the_global_batch():
    """Per-replica accumulators are named as such; updated with every replica's
    values they give the single-device tutorial's numbers."""
    batches = make_batches(3)

    def split():
        model = CNN(rngs=nnx.Rngs(0), dropout=0.0, axis_name="data")
        optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
        return nnx.split((model, optimizer, tutorial_metrics()))

    graphdef, init = split()
    step = jdp.parallelize(metrics_train_step(graphdef, all_replicas=False))
    with pytest.raises(
        jdp.ReplicaDivergenceError,
        match=r"\['accuracy'\]\['total'\].*all of them flax NNX metric accumulators"
        r".*lax\.all_gather\(logits, 'data', tiled=True\)",
    ):
        run_steps(step, step.replicate(init), batches)

    step = jdp.parallelize(metrics_train_step(graphdef, all_replicas=True))
    state, _ = run_steps(step, step.replicate(init), batches)
    jdp.assert_replicas_in_sync(state)
    metrics = nnx.merge(graphdef, step.unreplicate(state))[2].compute()

    model = CNN(rngs=nnx.Rngs(0), dropout=0.0)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    expected = tutorial_metrics()

    @nnx.jit
    def train_step(model, optimizer, metrics, batch):
        def loss_fn(model):
            logits = model(batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return loss.mean(), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])
        optimizer.update(model, grads)

    for batch in batches:
        train_step(model, optimizer, expected, batch)
    expected = expected.compute()
    assert 0 < float(expected["accuracy"]) < 1
    np.testing.assert_allclose(metrics["accuracy"], expected["accuracy"], rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=1e-5)


GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides" / "nnx.md"


def readme_recipe(model, optimizer):
    """Runs the NNX guide's recipe: returns its `step` and replicated `state`.

    The guide's step and `step.replicate`, applied to this test's modules.
    """
    text = GUIDE.read_text()
    code = re.search(
        r"## Modules as they are\n.*?```python\n.*?(def train_step.*?"
        r"state = step\.replicate\([^\n]*\n)",
        text,
        re.S,
    ).group(1)
    namespace = {
        "jdp": jdp,
        "nnx": nnx,
        "model": model,
        "optimizer": optimizer,
        "loss_of": cross_entropy,
    }
    exec(compile(code, str(GUIDE), "exec"), namespace)
    return namespace["step"], namespace["state"]


def modules(seed):
    model = CNN(rngs=nnx.Rngs(seed), dropout=0.0, axis_name="data")
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def test_modules_passed_directly_train_like_the_tutorial(single_device, tmp_path):
    """The NNX guide's recipe: no split or merge, `step.replicate((model, optimizer,
    rngs))` and the tutorial's step returning the modules. Same numbers as one
    device; checkpoints resume bit for bit."""
    step, init = readme_recipe(*modules(0))
    start = jax.device_get(step.unreplicate(init))  # the run donates `init`
    state, losses = run_steps(step, init, make_batches(4))
    expected, expected_losses = single_device
    model, optimizer, rngs = step.unreplicate(state)
    assert isinstance(model, CNN) and isinstance(optimizer, nnx.Optimizer)
    assert_trees_close(nnx.state(model), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    assert int(optimizer.step[...]) == 4 and int(rngs.dropout.count[...]) == 4

    fresh = (*modules(1), nnx.Rngs(dropout=7))
    resumed, uninterrupted, _ = resumed_and_uninterrupted(
        step, start, fresh, make_batches(4), tmp_path
    )
    assert isinstance(resumed[0], CNN)
    # Leaves only: each CNN holds its own `functools.partial`, static pytree data
    # that compares by identity.
    assert_bitwise_equal(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted))

    # The trained module exports as it is (switched to eval mode first: a module
    # cannot change its mode inside the exported function's trace).
    trained = resumed[0]
    trained.eval()
    predictor = jdp.load_predictor(
        jdp.export_predictor(lambda m, x: m(x), trained, make_batches(1)[0]["x"])
    )
    x = make_batches(1, size=5, seed=1)[0]["x"]
    one = step.unreplicate(resumed)[0]
    one.eval()
    np.testing.assert_allclose(predictor(x), one(x), rtol=1e-5, atol=1e-6)


class TiedEmbeddings(nnx.Module):
    """Input and output embeddings that share one `nnx.Param`."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(10, 4, rngs=rngs)
        self.unembed = self.embed.embedding  # the same Variable

    def __call__(self, ids):
        return self.embed(ids) @ self.unembed[...].T


def test_a_shared_weight_passed_as_a_pytree_is_refused():
    """Flattened, a tied weight becomes two arrays and would silently untie;
    `nnx.split` keeps the tie through training."""

    def train_step(state, batch):
        model, optimizer = state

        def loss_fn(model):
            logits = model(batch["ids"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["ids"]
            ).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, jdp.all_reduce_gradients(grads))
        return (model, optimizer), {"loss": loss}

    model = TiedEmbeddings(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = jdp.parallelize(train_step)
    with pytest.raises(
        ValueError,
        match=r"one flax NNX `Variable` at two paths, \[0\]\.embed\.embedding and "
        r"\[0\]\.unembed .*nnx\.split",
    ):
        step.replicate((model, optimizer))

    graphdef, state = nnx.split((model, optimizer))

    def split_step(state, batch):
        out, metrics = train_step(nnx.merge(graphdef, state), batch)
        return nnx.state(out), metrics

    step = jdp.parallelize(split_step)
    batch = step.shard({"ids": np.arange(16, dtype=np.int32) % 10})
    state, _ = step(step.replicate(state), batch)
    trained, _ = nnx.merge(graphdef, step.unreplicate(state))
    assert trained.unembed is trained.embed.embedding
    assert not np.allclose(trained.embed.embedding[...], model.embed.embedding[...])


def test_batchnorm_without_the_replica_axis_is_named_as_the_cause():
    """Without `axis_name`, each replica's BatchNorm keeps its own statistics."""
    model = CNN(rngs=nnx.Rngs(0), dropout=0.0)  # no axis_name
    graphdef, state = split_for_jdp(model)
    step = jdp.parallelize(nnx_train_step(graphdef))
    with pytest.raises(
        jdp.ReplicaDivergenceError,
        match=r"\['batch_norm1'\]\['mean'\].*all of them BatchNorm statistics.*"
        r"`axis_name='data'`",
    ) as info:
        run_steps(step, step.replicate(state), make_batches(1))
    # The gradients were averaged: the params agree.
    model, _, _ = nnx.merge(graphdef, info.value.state)
    jdp.assert_replicas_in_sync(nnx.state(model, nnx.Param))


class WideMLP(nnx.Module):
    """An MLP whose first weight (64 x 512 floats, 128 KiB) is large enough for
    jdp's donating step to run it on the concatenated view of its buffers."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 512, rngs=rngs)
        self.out = nnx.Linear(512, 10, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def test_modules_with_large_leaves_train_like_one_device():
    """NNX modules passed directly, with leaves that take the concatenated-view
    path, equal the tutorial's single-device step; the large weight is updated in
    place (its buffer is the one it was given)."""

    def fresh():
        model = WideMLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def one_device(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(cross_entropy)(model, batch)
        optimizer.update(model, grads)
        return loss

    model, optimizer = fresh()
    expected = [float(one_device(model, optimizer, b)) for b in make_batches(3)]

    def train_step(state, batch):
        model, optimizer = state
        loss, grads = nnx.value_and_grad(cross_entropy)(model, batch)
        optimizer.update(model, jdp.all_reduce_gradients(grads))
        return (model, optimizer), {"loss": loss}

    def pointer(state):
        kernel = state[0].hidden.kernel[...]
        assert kernel.shape == (4, 64, 512)
        return kernel.addressable_shards[0].data.unsafe_buffer_pointer()

    step = jdp.parallelize(train_step, devices=jax.devices()[:4])
    first, *rest = make_batches(3)
    # The first step moves out of `replicate`'s buffers; later ones update in place.
    state, losses = run_steps(step, step.replicate(fresh()), [first])
    before = pointer(state)
    state, more = run_steps(step, state, rest)
    assert pointer(state) == before
    np.testing.assert_allclose(losses + more, expected, rtol=1e-5)
    assert_trees_close(
        nnx.state(step.unreplicate(state)[0]), nnx.state(model), rtol=1e-5, atol=1e-6
    )


class _Counting(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
        self.calls = 0


@pytest.mark.parametrize("change", ["counter", "eval"])
def test_a_python_attribute_changed_in_the_step_is_refused_by_name(backend, change):
    """`nnx.jit` would keep it; jdp returns arrays only, so it says which."""

    def step_fn(model, batch):
        if change == "counter":
            model.calls += 1
        else:
            model.eval()  # flips BatchNorm's `use_running_average`
        return model, {"s": model.lin(batch).sum()}

    step = jdp.parallelize(step_fn, backend=backend, devices=jax.devices()[:2])
    model = step.replicate(_Counting())
    expected = (
        r"`state.calls`: 0 -> 1"
        if change == "counter"
        else r"`state.bn.use_running_average`: False -> True"
    )
    with pytest.raises(TypeError, match=expected):
        step(model, step.shard(jnp.ones((4, 2))))


class Annotated(nnx.Module):
    """A layer with the sharding annotations of a tensor-parallel model."""

    def __init__(self, rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        bias = nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",))
        self.lin = nnx.Linear(3, 2, kernel_init=kernel, bias_init=bias, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def test_a_model_with_sharding_annotations_trains_with_eager_sharding_off():
    """flax refuses to build it without a mesh (its message, which the
    troubleshooting page quotes); built with eager sharding off, the annotations
    stay metadata and jdp trains it like one device."""
    with pytest.raises(ValueError, match=r"An auto mesh context or metadata is"):
        Annotated(nnx.Rngs(0))
    with nnx.use_eager_sharding(False):
        model = Annotated(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params, rest)
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    tx = optax.sgd(0.1)
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx), devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 3)), "y": rng.normal(size=(8, 2))}
    batch = {k: v.astype(np.float32) for k, v in batch.items()}
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    state, _ = step(state, step.shard(batch))
    grads = jax.grad(loss_fn)(params, batch)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)
