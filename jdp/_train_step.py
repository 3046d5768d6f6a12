"""`jdp.TrainState` and `jdp.make_train_step` (Caffe2's `Parallelize_GPU`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import optax
from flax import struct

from jdp import _collectives

PyTree = Any


class TrainState(struct.PyTreeNode):
    """An immutable training state: step counter, params, optimizer state, stats.

    A flax `struct` dataclass (a pytree); the optimizer is a static field.
    `jdp.make_train_step` also accepts flax's own `flax.training.train_state.
    TrainState` or any pytree with `step`, `params`, `opt_state` and `replace`.

    Attributes:
      step: Number of updates applied (an int32 array).
      params: The trained parameters.
      opt_state: The optimizer's state.
      batch_stats: Computed, non-trained state such as BatchNorm statistics, or
        None.
      tx: The optax optimizer (static: not a pytree leaf).

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> state = jdp.TrainState.create(params={"w": jnp.zeros(2)}, tx=optax.adam(1e-3))
      >>> int(state.step)
      0
    """

    step: jax.Array
    params: PyTree
    opt_state: optax.OptState
    batch_stats: PyTree = None
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation,
        batch_stats: PyTree = None,
    ) -> TrainState:
        """Makes a state at step 0 with `tx.init(params)` as optimizer state."""
        return cls(
            step=jax.numpy.zeros((), jax.numpy.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=batch_stats,
            tx=tx,
        )

    def apply_gradients(self, *, grads: PyTree) -> TrainState:
        """Applies one optimizer update; returns the new state."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(
            step=self.step + 1,
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
        )


def _contains_bmuf_state(opt_state: PyTree) -> bool:
    try:
        from jdp._bmuf import BMUFState
    except ImportError:  # pragma: no cover - BMUF lives in its own module
        return False
    found = []
    jax.tree.map(
        lambda x: found.append(isinstance(x, BMUFState)),
        opt_state,
        is_leaf=lambda x: isinstance(x, BMUFState),
    )
    return any(found)


def make_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation | None = None,
    *,
    has_aux: bool = False,
    all_reduce: bool = True,
    axis_name: str = "data",
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
    batch_stats_mode: Literal["mean", "broadcast"] = "mean",
) -> Callable[[PyTree, PyTree], tuple[PyTree, dict[str, jax.Array]]]:
    """Builds the per-replica training step for `jdp.parallelize`.

    The step computes `loss_fn` and its gradients on the replica's slice of the
    batch, averages the gradients over replicas with `jdp.all_reduce_gradients`
    (bucketed, reverse leaf order), applies `tx`, syncs batch statistics when the
    state has them, and returns `{"loss": ...}` plus the auxiliary metrics. Because
    every replica's loss is a mean over its slice and the gradients are averaged,
    N replicas on a global batch of B examples take the same step as one device on
    all B (the seed's loss scale `1 / (devices * shards)`, written as a mean).

    Args:
      loss_fn: `loss_fn(params, batch) -> loss` (or `-> (loss, aux)` with
        `has_aux`). When the state has `batch_stats` (not None), it is called as
        `loss_fn(params, batch_stats, batch)` and returns `(loss, new_batch_stats)`
        (or `(loss, (new_batch_stats, aux))` with `has_aux`).
      tx: The optax optimizer; None uses the state's own `tx` (flax `TrainState`).
      has_aux: Whether `loss_fn` returns auxiliary data; a dict of scalars becomes
        extra metrics, anything else is returned under `"aux"`.
      all_reduce: Average gradients across replicas (default). False keeps each
        replica's own gradients, for optimizers that communicate themselves
        (`jdp.bmuf`).
      axis_name: The replica axis given to `jdp.parallelize`.
      bucket_bytes: Bucket size for `jdp.all_reduce_gradients` (25 MiB).
      reduce_dtype: Wire dtype for the gradient all-reduce (e.g. `jnp.bfloat16`).
      batch_stats_mode: How `jdp.sync_batch_stats` syncs statistics: `"mean"`
        (default) or `"broadcast"`.

    Returns:
      `train_step(state, batch) -> (state, metrics)`, to give to `jdp.parallelize`.

    Raises:
      ValueError: At trace time, if `all_reduce=True` and the optimizer state holds
        BMUF state (BMUF must see each replica's own gradients).

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> train_step = jdp.make_train_step(loss_fn, optax.sgd(0.1))
      >>> step = jdp.parallelize(train_step)
    """

    def train_step(state, batch):
        optimizer = state.tx if tx is None else tx
        if optimizer is None:
            raise ValueError(
                "`make_train_step` got no optimizer: pass `tx` or use a state that "
                "carries one (`jdp.TrainState.create(params=..., tx=...)`)."
            )
        if all_reduce and _contains_bmuf_state(state.opt_state):
            raise ValueError(
                "`jdp.make_train_step(..., all_reduce=True)` would average gradients "
                "across replicas, but the optimizer contains `jdp.bmuf`, which "
                "trains each replica on its own gradients and syncs the models "
                "itself. Use `jdp.make_train_step(loss_fn, tx, all_reduce=False)`."
            )
        batch_stats = getattr(state, "batch_stats", None)
        if batch_stats is None:
            grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
            out, grads = grad_fn(state.params, batch)
            new_stats = None
            loss, aux = out if has_aux else (out, None)
        else:

            def wrapped(params):
                loss, rest = loss_fn(params, batch_stats, batch)
                return loss, rest

            (loss, rest), grads = jax.value_and_grad(wrapped, has_aux=True)(
                state.params
            )
            new_stats, aux = rest if has_aux else (rest, None)
        if all_reduce:
            grads = _collectives.all_reduce_gradients(
                grads,
                axis_name=axis_name,
                bucket_bytes=bucket_bytes,
                dtype=reduce_dtype,
            )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        changes = dict(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
        )
        if new_stats is not None:
            changes["batch_stats"] = _collectives.sync_batch_stats(
                new_stats, mode=batch_stats_mode, axis_name=axis_name
            )
        metrics = {"loss": loss}
        if has_aux:
            if isinstance(aux, dict):
                metrics.update(aux)
            else:
                metrics["aux"] = aux
        return state.replace(**changes), metrics

    return train_step
