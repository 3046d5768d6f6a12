"""The divergence guard in a step of one's own, whatever holds the state.

With an optimizer that trains replicas locally (`jdp.bmuf`, at any depth of the
optimizer) the params and the optimizer state shaped like them may differ
between syncs, and declared per-replica parts (error-feedback buffers) always
may; the guard finds them in any container. Everything else must agree, and a
step that changes replica 1's copy of such a part is caught, by the leaf's name.

Each case compiles one step: its first calls train past a block sync (the guard
on at every call), and the last call's batch tells replica 1 to nudge one leaf.
"""

import re

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from helpers import linear_loss, linear_params, noise_batches
from jax import lax

import jdp

IN_DIM, OUT_DIM, ROWS = 3, 2, 8
CALLS = 5  # calls that train: BMUF (sync_period=2) syncs at calls 2 and 4


@flax.struct.dataclass
class Model:
    weights: dict
    opt: optax.OptState
    steps: jax.Array


# Containers: `(make(params, tx), unpack(state), pack(state, params, opt_state))`.
CONTAINERS = {
    "tuple": (
        lambda p, tx: (p, tx.init(p)),
        lambda s: s,
        lambda s, p, o: (p, o),
    ),
    "list": (
        lambda p, tx: [p, tx.init(p)],
        lambda s: s,
        lambda s, p, o: [p, o],
    ),
    "dict": (
        lambda p, tx: {"weights": p, "optimizer": tx.init(p), "steps": jnp.int32(0)},
        lambda s: (s["weights"], s["optimizer"]),
        lambda s, p, o: {"weights": p, "optimizer": o, "steps": s["steps"] + 1},
    ),
    "dataclass": (
        lambda p, tx: Model(weights=p, opt=tx.init(p), steps=jnp.int32(0)),
        lambda s: (s.weights, s.opt),
        lambda s, p, o: s.replace(weights=p, opt=o, steps=s.steps + 1),
    ),
    "TrainState": (
        lambda p, tx: TrainState.create(apply_fn=None, params=p, tx=tx),
        lambda s: (s.params, s.opt_state),
        lambda s, p, o: s.replace(step=s.step + 1, params=p, opt_state=o),
    ),
}


def _bmuf(inner=None):
    return jdp.bmuf(inner or optax.sgd(0.1, momentum=0.5), sync_period=2)


def _local_lr(learning_rate):
    return optax.chain(jdp.bmuf(optax.sgd(learning_rate), sync_period=2))


# Optimizers: `(make(), the leaf replica 1 nudges in a tuple state)`.
OPTIMIZERS = {
    "bmuf": (_bmuf, "[1].count"),
    "chain": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), _bmuf(optax.adam(0.1))),
        "[1][1].global_params['w']",
    ),
    "inject_hyperparams": (
        lambda: optax.inject_hyperparams(_local_lr)(learning_rate=0.1),
        "[1].hyperparams['learning_rate']",
    ),
    "MultiSteps": (
        lambda: optax.MultiSteps(_bmuf(), every_k_schedule=2).gradient_transformation(),
        "[1].mini_step",
    ),
    # BMUF trains `w` only: `b` (frozen) must agree.
    "multi_transform": (
        lambda: optax.multi_transform(
            {"local": _bmuf(), "frozen": optax.set_to_zero()},
            {"w": "local", "b": "frozen"},
        ),
        "[0]['b']",
    ),
    # Nothing trains locally: the params must agree, the error buffers may differ.
    "sync_gradients(error_feedback)": (
        lambda: optax.chain(
            jdp.sync_gradients(
                jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
            ),
            optax.adam(0.1),
        ),
        "[0]['w']",
    ),
}

# The leaf replica 1 nudges in each container (with the "chain" optimizer).
CONTAINER_LEAVES = {
    "tuple": "[1][1].velocity['b']",
    "list": "[1][1].count",
    "dict": "['steps']",
    "dataclass": ".opt[1].global_params['b']",
    "TrainState": ".step",
}


def _nudged(state, leaf, nudge):
    """`state` with 1 added to `leaf` (its `keystr`) where `nudge` is true."""

    def one(path, x):
        if jax.tree_util.keystr(path) != leaf:
            return x
        return x + nudge.astype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, state)


def _batches():
    """`CALLS` batches, then one whose `nudge` column tells replica 1 to nudge."""
    batches = noise_batches(CALLS + 1, ROWS, IN_DIM, OUT_DIM)
    for i, batch in enumerate(batches):
        batch["nudge"] = np.full(ROWS, i == CALLS)
    return batches


def _nudge(batch):
    return batch["nudge"][0] & (lax.axis_index("data") == 1)


def _run(step, state, leaf, *, local=True):
    """Trains `CALLS` calls; the next call's nudge is caught, naming `leaf`.

    `local`: whether the optimizer trains locally (the message says what may
    differ then), else a synchronous step's message.
    """
    batches = _batches()
    for batch in batches[:CALLS]:
        state, _ = step(state, step.shard(batch))
    # Mid-block: something differs between replicas, by design.
    assert not jdp.replicas_in_sync(state)
    with pytest.raises(jdp.ReplicaDivergenceError, match=r"during step call 6") as info:
        step(state, step.shard(batches[CALLS]))
    assert info.value.leaf == leaf
    assert info.value.replica == 1
    local_msg = r"trains each replica on its own gradients .*must be equal on every"
    if local:
        assert re.search(local_msg, str(info.value))
    else:
        assert "does not average its gradients" in str(info.value)


def _own_step(tx, unpack, pack, leaf):
    """The plainest step of one's own: `tx.update`, `optax.apply_updates`."""

    def step_fn(state, batch):
        params, opt_state = unpack(state)
        grads = jax.grad(linear_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        state = pack(state, optax.apply_updates(params, updates), opt_state)
        return _nudged(state, leaf, _nudge(batch)), {}

    return step_fn


def _check(container, optimizer, leaf, backend):
    make, unpack, pack = CONTAINERS[container]
    tx = OPTIMIZERS[optimizer][0]()
    step = jdp.parallelize(
        _own_step(tx, unpack, pack, leaf),
        devices=jax.devices()[:2],
        backend=backend,
        check_sync=1,
    )
    state = step.replicate(make(linear_params(IN_DIM, OUT_DIM), tx))
    _run(step, state, leaf, local=optimizer != "sync_gradients(error_feedback)")


@pytest.mark.parametrize("container", sorted(CONTAINER_LEAVES))
def test_local_training_in_any_container(container, backend):
    _check(container, "chain", CONTAINER_LEAVES[container], backend)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_local_training_at_any_depth_of_the_optimizer(optimizer, backend):
    _check("tuple", optimizer, OPTIMIZERS[optimizer][1], backend)


class Linear(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(IN_DIM, OUT_DIM, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def _nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize(
    "layout, leaf",
    [
        ("nnx.split", "[1]['opt_state'][1]['global_params']['dense']['kernel'].value"),
        ("nnx.state", "[1]['step'].value"),
        ("modules", "[1].opt_state[1].count.value"),
    ],
)
def test_local_training_in_an_nnx_optimizer(layout, leaf, backend):
    """`nnx.Optimizer(model, optax.chain(..., jdp.bmuf(...)))`: the state split
    with `nnx.split` (or `nnx.state`), or the modules passed directly."""
    model = Linear(nnx.Rngs(0))
    tx = optax.chain(optax.clip_by_global_norm(1.0), _bmuf())
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, _ = nnx.split((model, optimizer))

    def step_fn(state, batch):
        if layout == "modules":
            model, optimizer = state
        else:
            model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(_nnx_loss)(model, batch)
        optimizer.update(model, grads)
        new = (
            (model, optimizer) if layout == "modules" else nnx.state((model, optimizer))
        )
        return _nudged(new, leaf, _nudge(batch)), {}

    step = jdp.parallelize(
        step_fn, devices=jax.devices()[:2], backend=backend, check_sync=1
    )
    if layout == "modules":
        state = (model, optimizer)
    elif layout == "nnx.split":
        state = nnx.split((model, optimizer))[1]
    else:
        state = nnx.state((model, optimizer))
    _run(step, step.replicate(state), leaf)
