"""Private: the demo's CNN, its loss and its evaluation step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jdp.demo._data import NUM_CLASSES


class CNN(nn.Module):
    """Two 3x3 convolutions with BatchNorm, then two dense layers (38k params)."""

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        """Maps images `(B, 8, 8, 1)` to logits `(B, 10)`."""
        for features, stride in ((16, 1), (32, 2)):
            x = nn.Conv(features, (3, 3), strides=stride)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(NUM_CLASSES)(x)


MODEL = CNN()


def init_variables(seed: int, example_x) -> dict:
    """`{"params": ..., "batch_stats": ...}` for the CNN."""
    return MODEL.init(jax.random.key(seed), example_x[:1], train=False)


def loss_fn(params, batch_stats, batch):
    """Cross-entropy on one replica's slice: `(loss, new_batch_stats)`."""
    logits, updates = MODEL.apply(
        {"params": params, "batch_stats": batch_stats}, batch["x"], train=True,
        mutable=["batch_stats"],
    )  # fmt: skip
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates["batch_stats"]


def eval_step(variables, batch):
    """Counts the correct predictions among the examples `batch["mask"]` marks.

    The mask is `step.shard(..., pad=True)`'s: padding does not count, and the
    ratio of the two sums (averaged over replicas) is the exact accuracy.
    """
    logits = MODEL.apply(variables, batch["x"], train=False)
    correct = (jnp.argmax(logits, -1) == batch["y"]) & batch["mask"]
    return {"correct": jnp.sum(correct), "count": jnp.sum(batch["mask"])}
