"""Checkpoints of flax NNX containers and composite optax states.

`nnx.Sequential` and `nnx.List` key their children by integers next to string
attributes: orbax writes such trees but cannot list them again (it sorts the
saved keys, and `0 < "_pytree__state"` is a `TypeError`). The checkpoint is
fine; restoring must work, and a failure that is not damage must never be
reported as damage (nor move the files aside).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jdp
from jdp.checkpoint import CheckpointCorruptedError, CheckpointManager

NUM_DEVICES = 2


class Blocks(nnx.Module):
    """An `nnx.List` of layers and an `nnx.Dict` of layers in one module."""

    def __init__(self, rngs):
        self.blocks = nnx.List(
            [nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)]
        )
        self.heads = nnx.Dict(out=nnx.Linear(4, 2, rngs=rngs))

    def __call__(self, x):
        for block in self.blocks:
            x = nnx.relu(block(x))
        return self.heads["out"](x)


def sequential(rngs):
    return nnx.Sequential(
        nnx.Linear(4, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 2, rngs=rngs)
    )


MODELS = {"sequential": sequential, "list_and_dict": Blocks}

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "chain": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.add_decayed_weights(1e-4),
        optax.sgd(1e-2, momentum=0.9),
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-2
    ),
}


def train_step(state, batch):
    """The NNX recipe with the modules passed directly."""
    model, optimizer = state

    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, jdp.all_reduce_gradients(grads))
    return (model, optimizer), {"loss": loss}


def modules(model_name, tx_name, seed):
    model = MODELS[model_name](nnx.Rngs(seed))
    return model, nnx.Optimizer(model, OPTIMIZERS[tx_name](), wrt=nnx.Param)


def batches(num):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(8, 4)).astype(np.float32),
            "y": rng.normal(size=(8, 2)).astype(np.float32),
        }
        for _ in range(num)
    ]


def bits(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_same_bits(actual, expected):
    actual, expected = bits(actual), bits(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert a.tobytes() == e.tobytes()


@pytest.mark.parametrize("tx_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_nnx_modules_and_optimizer_passed_directly_resume_bit_for_bit(
    tmp_path, model_name, tx_name
):
    step = jdp.parallelize(train_step, devices=jax.devices()[:NUM_DEVICES])
    data = batches(4)
    state = step.replicate(modules(model_name, tx_name, 0))
    for batch in data[:2]:
        state, _ = step(state, step.shard(batch))
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state)
    saved = bits(step.unreplicate(state))
    uninterrupted = state
    for batch in data[2:]:
        uninterrupted, _ = step(uninterrupted, step.shard(batch))

    with CheckpointManager(tmp_path) as manager:
        restored = manager.restore(step.replicate(modules(model_name, tx_name, 1)))
        one = manager.restore(modules(model_name, tx_name, 1))  # one copy
    model, optimizer = one
    assert isinstance(model, type(MODELS[model_name](nnx.Rngs(0))))
    assert isinstance(optimizer, nnx.Optimizer)
    assert_same_bits(one, saved)
    assert model(np.ones((3, 4), np.float32)).shape == (3, 2)
    for batch in data[2:]:
        restored, _ = step(restored, step.shard(batch))
    assert_same_bits(step.unreplicate(restored), step.unreplicate(uninterrupted))


@pytest.mark.parametrize("form", ["state", "split"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_nnx_states_of_containers_round_trip(tmp_path, model_name, form):
    """`nnx.state` / `nnx.split` states (integer keys in `nnx.State`s)."""
    step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:NUM_DEVICES])

    def as_state(seed):
        model, optimizer = modules(model_name, "multi_steps", seed)
        if form == "split":
            return nnx.split((model, optimizer))[1]
        return nnx.state((model, optimizer))

    saved = as_state(0)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, step.replicate(saved))
        restored = manager.restore(step.replicate(as_state(1)))
        one = manager.restore(as_state(1))
    assert_same_bits(step.unreplicate(restored), saved)
    assert_same_bits(one, saved)


def _saved_sequential(directory):
    step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:NUM_DEVICES])
    with CheckpointManager(directory) as manager:
        manager.save(1, step.replicate(modules("sequential", "adam", 0)))
    return step


def test_a_step_orbax_cannot_list_is_not_damaged_and_is_never_moved_aside(
    tmp_path, monkeypatch
):
    """A failure that is not damage says so; the files stay where they are."""
    step = _saved_sequential(tmp_path)
    like = step.replicate(modules("sequential", "adam", 1))

    def broken(*args, **kwargs):
        raise TypeError("'<' not supported between instances of 'str' and 'int'")

    # As if orbax's array reader had a bug: not damage.
    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "deserialize", broken)
    for attempt in ({}, {"step": 1}):
        with CheckpointManager(tmp_path) as manager:
            with pytest.raises(RuntimeError) as info:
                manager.restore(like, **attempt)
            assert not isinstance(info.value, CheckpointCorruptedError)
            message = str(info.value)
            assert f"reading step 1 in {tmp_path} failed" in message
            assert "TypeError: '<' not supported" in message
            assert "not a sign of damaged files" in message
            assert "corrupted" not in message and "moves" not in message
            assert manager.all_steps() == [1]  # still complete
    # A later save neither moves the step aside nor reports it damaged.
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(RuntimeError, match="not a sign of damaged files"):
            manager.save(1, like)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["1"]
    monkeypatch.undo()
    with CheckpointManager(tmp_path) as manager:
        assert_same_bits(
            step.unreplicate(manager.restore(like)),
            modules("sequential", "adam", 0),
        )
