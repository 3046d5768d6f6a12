"""`jdp.TrainState`: the immutable state a train step takes and returns."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jdp import _sync
from jdp._tree import PyTree


class TrainState(struct.PyTreeNode):
    """An immutable training state: step counter, params, optimizer state, stats.

    A flax `struct` dataclass whose optimizer is a static field.
    `jdp.make_train_step` also takes a flax `TrainState`, or any pytree with
    `step`, `params`, `opt_state` and `replace`.

    Attributes:
      step: Number of updates applied (an int32 array).
      params: The trained parameters.
      opt_state: The optimizer's state.
      batch_stats: Non-trained state such as BatchNorm statistics, or None.
      skipped_steps: Steps skipped for non-finite gradients (an int32 array).
      dynamic_scale: A flax `DynamicScale` (float16 loss scaling), or None.
      rng: A PRNG key, or None; a `loss_fn` with an `rng` parameter receives
        `fold_in(fold_in(rng, step), replica)`.
      sync_state: The state of a sync piece that keeps one, or None.
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
    skipped_steps: jax.Array | None = None
    dynamic_scale: Any = None
    rng: jax.Array | None = None
    sync_state: PyTree = None
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation,
        batch_stats: PyTree = None,
        dynamic_scale: Any = None,
        rng: jax.Array | None = None,
        sync: _sync.Sync | None = None,
    ) -> TrainState:
        """Makes a state at step 0 with `tx.init(params)` as optimizer state.

        Pass the step's `sync` piece when it keeps state of its own: the state then
        holds `sync_state=sync.init(params)`.
        """
        if sync is not None and not isinstance(sync, _sync.Sync):
            raise TypeError(
                "`jdp.TrainState.create`: `sync` must be a `jdp.Sync` (the piece "
                f"given to `jdp.make_train_step`), or None; got {type(sync).__name__}."
            )
        sync_state = None if sync is None else sync.initial_state(params)
        return cls(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
            batch_stats=batch_stats, skipped_steps=jnp.zeros((), jnp.int32),
            dynamic_scale=dynamic_scale, rng=rng, tx=tx,
            sync_state=sync_state if jax.tree.leaves(sync_state) else None,
        )  # fmt: skip

    def apply_gradients(self, *, grads: PyTree) -> TrainState:
        """Applies one optimizer update; returns the new state."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state)
