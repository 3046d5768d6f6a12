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
    """Cross-entropy on one replica's slice; returns `(loss, new_batch_stats)`.

    The signature `jdp.make_train_step` expects for a state with `batch_stats`.
    """
    logits, updates = MODEL.apply(
        {"params": params, "batch_stats": batch_stats},
        batch["x"],
        train=True,
        mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates["batch_stats"]


def predict(variables, x):
    """Inference: logits with BatchNorm's running statistics."""
    return MODEL.apply(variables, x, train=False)


def eval_step(variables, batch):
    """Forward-only step: counts correct predictions among the real examples.

    `batch` carries the mask `step.shard(..., pad=True)` returns, so padding is
    not counted; the two sums are averaged over replicas and their ratio is the
    exact accuracy.
    """
    logits = predict(variables, batch["x"])
    correct = (jnp.argmax(logits, -1) == batch["y"]) & batch["mask"]
    return {"correct": jnp.sum(correct), "count": jnp.sum(batch["mask"])}
