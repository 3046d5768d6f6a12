"""The gradients' all-reduce can overlap the backward pass, in the compiled program.

Reverse-mode differentiation computes the last layer's gradient first. With one
layer per bucket, each bucket's all-reduce must wait for its own gradients only,
not for the backward pass of the layers before it, so that it can run while they
are computed (what PyTorch DDP does with its buckets). These tests read XLA's
compiled HLO, after its combiners, which merge independent all-reduces into one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ancestors, entry_instructions

import jdp

#: Layer i is a SIZES[i] x SIZES[i + 1] matrix; no two layers, and no activation
#: (3 rows a replica), have the same number of elements, so sizes name layers.
SIZES = (8, 16, 24, 32, 40)
ROWS = 3
LAYER_OF = {
    a * b: i for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=False))
}
#: Opcodes that compute (rather than move, slice or pass on) a value.
COMPUTE = {"dot", "fusion", "convolution", "custom-call"}
ALL_REDUCE = {"all-reduce", "all-reduce-start"}


def loss_fn(params, batch):
    h = batch["x"]
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean((h - batch["y"]) ** 2)


def init():
    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
    return [
        jax.random.normal(k, (a, b)) / np.sqrt(a)
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]


def layers_of(counts):
    return {LAYER_OF[c] for c in counts if c in LAYER_OF}


def gradient_all_reduces(instrs):
    """`{layer: the all-reduce carrying that layer's gradient}`."""
    found = {}
    for name, (opcode, counts, _) in instrs.items():
        if opcode in ALL_REDUCE:
            for layer in layers_of(counts):
                assert layer not in found, f"layer {layer} is all-reduced twice"
                found[layer] = name
    assert sorted(found) == list(range(len(SIZES) - 1)), found
    return found


def gradient_computations(instrs, layer):
    """The instructions computing a value of the size of `layer`'s weights."""
    return {
        name
        for name, (opcode, counts, _) in instrs.items()
        if opcode in COMPUTE and layer in layers_of(counts)
    }


def compiled_step(backend, sync=None, step_fn=None, live=False):
    tx = optax.sgd(0.1)
    train_step = step_fn or jdp.make_train_step(loss_fn, tx, sync=sync)
    step = jdp.parallelize(train_step, backend=backend, devices=jax.devices()[:2])
    state = step.replicate(jdp.TrainState.create(params=init(), tx=tx))
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(2 * ROWS, SIZES[0])).astype(np.float32),
        "y": rng.normal(size=(2 * ROWS, SIZES[-1])).astype(np.float32),
    }
    batch = step.shard(batch)
    if live:  # a live step's input: the batch and a flag per replica
        flag = lambda index: np.zeros((1,), np.int32)  # noqa: E731
        batch = (batch, jax.make_array_from_callback((2,), step.sharding, flag))
    return step.lower(state, batch).compile().as_text()


def hand_written(flatten):
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        grads = jdp.all_reduce_gradients(grads, bucket_bytes=16, flatten=flatten)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return train_step


CASES = {
    "train_step": {"sync": jdp.all_reduce(bucket_bytes=16)},
    "tuple": {"step_fn": hand_written(False)},
    "flat": {"step_fn": hand_written(True)},
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_bucket_waits_only_for_its_own_gradients(backend, case):
    # bucket_bytes=16: every layer is a bucket of its own, issued last layer first.
    instrs = entry_instructions(compiled_step(backend, **CASES[case]))
    reduce_of = gradient_all_reduces(instrs)
    assert len(set(reduce_of.values())) == len(reduce_of), (
        f"XLA merged buckets into one all-reduce: {reduce_of}"
    )
    for layer, name in reduce_of.items():
        before = ancestors(instrs, name)
        grads = gradient_computations(instrs, layer)
        assert grads & before, f"no computation of layer {layer}'s gradient found"
        for earlier in range(layer):
            waits_for = gradient_computations(instrs, earlier) & before
            assert not waits_for, (
                f"layer {layer}'s all-reduce {name} waits for {sorted(waits_for)}, "
                f"the backward pass of layer {earlier}"
            )


def test_buckets_are_issued_last_layer_first(backend):
    # Each bucket's all-reduce comes after the previous one's: the same order on
    # every replica (which the transport needs), the last layer's first.
    instrs = entry_instructions(compiled_step(backend, jdp.all_reduce(bucket_bytes=16)))
    reduce_of = gradient_all_reduces(instrs)
    for layer in range(len(SIZES) - 2):
        assert reduce_of[layer + 1] in ancestors(instrs, reduce_of[layer])


def test_a_live_step_reduces_its_metrics_after_the_gradients(backend):
    # The CPU collectives give every all-reduce the same tag. A process that leaves
    # one early (its peer died) keeps a receive posted there; a larger message of
    # a later all-reduce from another peer then aborts it. Under
    # `jdp.distributed.live` the small metrics go last, so whatever arrives fits.
    from jdp.distributed import _live

    train_step = jdp.make_train_step(
        loss_fn, optax.sgd(0.1), sync=CASES["train_step"]["sync"]
    )
    instrs = entry_instructions(
        compiled_step(backend, step_fn=_live._metrics_last(train_step), live=True)
    )
    grads = set(gradient_all_reduces(instrs).values())
    metrics = [
        name
        for name, (opcode, _, _) in instrs.items()
        if opcode in ALL_REDUCE and name not in grads
    ]
    # (Without it XLA merges them into the first bucket's all-reduce, or issues
    # them first: their inputs are ready first.)
    assert metrics, "no all-reduce of the metrics alone found"
    for name in metrics:
        missing = grads - ancestors(instrs, name)
        assert not missing, (
            f"the metrics' all-reduce {name} does not wait for {missing}"
        )
