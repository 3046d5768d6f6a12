"""A flax `pmap` training script, ported to jdp, takes the same steps.

The script is the flax ImageNet example's recipe, kept small: a linen ResNet
whose BatchNorm averages over `axis_name="batch"`, a flax `TrainState` subclass
with `batch_stats` and `dynamic_scale`, float16 compute with loss scaling
(`DynamicScale`), SGD with Nesterov momentum on a warmup-cosine schedule, and a
weight-decay penalty in the loss. The oracle is the hand-written recipe itself:
`jax.pmap(train_step, axis_name="batch")`, `DynamicScale.value_and_grad(...,
axis_name="batch")` (which `pmean`s the gradients), `lax.pmean` of the batch
statistics and of the metrics.
"""

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from flax.training import common_utils, train_state
from flax.training.dynamic_scale import DynamicScale
from jax import lax

import jdp

NUM_CLASSES = 10
IMAGE_SIZE = 16
GLOBAL_BATCH = 32
STEPS = 4
WEIGHT_DECAY = 1e-4

ModuleDef = Any

pytestmark = pytest.mark.slow


# -- the script: model, state, schedule (flax's ImageNet example, smaller) -----------


class ResNetBlock(nn.Module):
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.act(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(
                residual
            )
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 8
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)])(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                x = ResNetBlock(
                    self.num_filters * 2**i,
                    strides=(2, 2) if i > 0 and j == 0 else (1, 1),
                    conv=conv,
                    norm=norm,
                    act=nn.relu,
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


class TrainState(train_state.TrainState):
    batch_stats: Any
    dynamic_scale: DynamicScale


MODEL = ResNet(stage_sizes=[1, 1], num_classes=NUM_CLASSES)


def create_learning_rate_fn(base_learning_rate=0.1, warmup_steps=2, total_steps=8):
    warmup_fn = optax.linear_schedule(0.0, base_learning_rate, warmup_steps)
    cosine_fn = optax.cosine_decay_schedule(
        base_learning_rate, total_steps - warmup_steps
    )
    return optax.join_schedules([warmup_fn, cosine_fn], [warmup_steps])


@functools.cache
def initial_variables():
    # An "rbg" key: on CPU, XLA compiles this init in about a second, against
    # several for the default threefry key.
    init = jax.jit(MODEL.init, static_argnames="train")
    key = jax.random.key(0, impl="rbg")
    return init(key, jnp.ones((1, IMAGE_SIZE, IMAGE_SIZE, 3)), train=False)


def create_train_state():
    variables = initial_variables()
    tx = optax.sgd(create_learning_rate_fn(), momentum=0.9, nesterov=True)
    return TrainState.create(
        apply_fn=MODEL.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
        dynamic_scale=DynamicScale(growth_interval=2),
    )


def cross_entropy_loss(logits, labels):
    one_hot = common_utils.onehot(labels, num_classes=NUM_CLASSES)
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))


def weight_penalty(params):
    weight_l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return WEIGHT_DECAY * 0.5 * weight_l2


def compute_metrics(logits, labels):
    return {
        "loss": cross_entropy_loss(logits, labels),
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
    }


def make_batches():
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.normal(size=(GLOBAL_BATCH, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(
                np.float32
            ),
            "label": rng.integers(0, NUM_CLASSES, GLOBAL_BATCH).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


# -- the hand-written recipe --------------------------------------------------------


def flax_train_step(state, batch):
    """flax's ImageNet `train_step` (loss scaling branch), batch stats `pmean`'d."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        loss = cross_entropy_loss(logits, batch["label"]) + weight_penalty(params)
        return loss, (new_model_state, logits)

    grad_fn = state.dynamic_scale.value_and_grad(
        loss_fn, has_aux=True, axis_name="batch"
    )
    dynamic_scale, is_fin, aux, grads = grad_fn(state.params)
    new_model_state, logits = aux[1]
    metrics = lax.pmean(compute_metrics(logits, batch["label"]), axis_name="batch")
    batch_stats = lax.pmean(new_model_state["batch_stats"], axis_name="batch")
    new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    keep = functools.partial(jnp.where, is_fin)
    new_state = new_state.replace(
        opt_state=jax.tree.map(keep, new_state.opt_state, state.opt_state),
        params=jax.tree.map(keep, new_state.params, state.params),
        dynamic_scale=dynamic_scale,
    )
    metrics["scale"] = dynamic_scale.scale
    return new_state, metrics


def run_flax_recipe(batches):
    p_train_step = jax.pmap(flax_train_step, axis_name="batch")
    state = jax_utils.replicate(create_train_state())
    history = []
    for batch in batches:
        state, metrics = p_train_step(state, common_utils.shard(batch))
        history.append(jax_utils.unreplicate(metrics))
    return jax.device_get(jax_utils.unreplicate(state)), history


# -- the same script on jdp ---------------------------------------------------------


def jdp_loss_fn(params, batch_stats, batch):
    """What is left of `flax_train_step`: the loss, for one replica."""
    logits, new_model_state = MODEL.apply(
        {"params": params, "batch_stats": batch_stats},
        batch["image"],
        mutable=["batch_stats"],
    )
    loss = cross_entropy_loss(logits, batch["label"]) + weight_penalty(params)
    metrics = compute_metrics(logits, batch["label"])  # averaged by jdp
    return loss, (new_model_state["batch_stats"], metrics)


def run_jdp(batches, backend):
    step = jdp.parallelize(
        jdp.make_train_step(jdp_loss_fn, has_aux=True),
        axis_name="batch",
        backend=backend,
    )
    state = step.replicate(create_train_state())
    history = []
    for batch in batches:
        state, metrics = step(state, step.shard(batch))
        history.append(metrics)
    return jax.device_get(step.unreplicate(state)), history


def assert_same_training(actual, expected, *, rtol, label):
    """Same state (params, batch stats, momentum, step, loss scale) and metrics."""
    (state, history), (want, want_history) = actual, expected
    check = functools.partial(np.testing.assert_allclose, rtol=rtol, atol=0)
    if rtol == 0:
        check = np.testing.assert_array_equal
    for part in ("step", "params", "batch_stats", "opt_state", "dynamic_scale"):
        got, ref = getattr(state, part), getattr(want, part)
        assert jax.tree.structure(got) == jax.tree.structure(ref), f"{label}: {part}"
        for (path, a), b in zip(
            jax.tree_util.tree_flatten_with_path(got)[0],
            jax.tree.leaves(ref),
            strict=True,
        ):
            where = f"{label}: {part}{jax.tree_util.keystr(path)}"
            check(np.asarray(a), np.asarray(b), err_msg=where)
    for i, (got, ref) in enumerate(zip(history, want_history, strict=True)):
        for name in ("loss", "accuracy"):
            where = f"{label}: metric {name!r} of step {i + 1}"
            check(np.asarray(got[name]), np.asarray(ref[name]), err_msg=where)


def test_jdp_takes_the_same_steps_as_the_flax_pmap_recipe():
    batches = make_batches()
    expected = run_flax_recipe(batches)
    # The steps include float16 overflows (skipped, scale halved) and taken ones.
    state, history = expected
    scales = [DynamicScale().scale] + [float(m["scale"]) for m in history]
    backoffs = sum(new < old for old, new in itertools.pairwise(scales))
    taken = int(state.opt_state[1].count)  # the schedule's count of updates
    assert backoffs == STEPS - taken and 0 < taken < STEPS

    # `backend="pmap"` computes the same arithmetic as the recipe: bit for bit.
    pmap = run_jdp(batches, "pmap")
    assert_same_training(pmap, expected, rtol=0, label="pmap")
    # `shard_map` compiles one program for all devices: equal up to rounding.
    shard_map = run_jdp(batches, "shard_map")
    assert_same_training(shard_map, expected, rtol=1e-5, label="shard_map")
