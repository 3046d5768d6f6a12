"""`jdp.BMUFState`, and the small tree helpers every part of the sync uses."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp import _replica_parts
from jdp._tree import PyTree, float_map, is_float


@_replica_parts.declare(
    local=("inner_state", "pending"),
    required=("count", "synced", "global_params"),
    trains_locally=True,
)
class BMUFState(NamedTuple):
    """State of `jdp.bmuf`: per replica, equal but for `inner_state` and `pending`.

    Attributes:
      count: Number of updates applied so far, warmup included (int32, shape ()).
      global_params: The global model `g`: what to evaluate and export
        (`jdp.bmuf_global_params`); during warmup, the replicas' params.
      start: With `jdp.block_momentum(nesterov=True)`, the model every replica
        began the current block from, `g + η v`; None otherwise (the block
        start is `g`).
      velocity: The block velocity `v`, shaped like the params; with another
        `outer`, its state (with a `jdp.Streaming` schedule, a tuple of one per
        fragment, over the list of that fragment's slices).
      inner_state: The state of the `inner` optimizer.
      synced: Whether the last update ended a block, or a fragment's sync (bool,
        shape ()).
      pending: With a streaming `delay` >= 1, the fragment sync in flight,
        shaped like the params; None otherwise.
      dropped: With `jdp.BlockAverage(on_bad_replica="drop")`, how many
        replicas were left out of the averages so far (int32, shape ()); None
        otherwise.
    """

    count: jax.Array  # int32, shape ()
    global_params: PyTree
    start: PyTree
    velocity: PyTree
    inner_state: optax.OptState
    synced: jax.Array  # bool, shape ()
    pending: PyTree = None
    dropped: jax.Array | None = None  # int32, shape ()

    #: The checkpoint's warning when `restart_local` reset `pending`.
    RESTART_NOTE = (
        "The fragment sync in flight (`delay`) restarts from the block start too: "
        "its snapshot is the block start, so that sync applies no local progress."
    )

    def restart_params(self) -> PyTree:
        """The block start: where every replica begins after a re-layout."""
        return block_start(self.global_params, self.start)

    def restart_local(self) -> BMUFState:
        """`pending` set to the block start (`RESTART_NOTE`), for a re-layout."""
        if self.pending is None:
            return self

        def like(s, p):
            return np.asarray(s, dtype=np.result_type(p)).reshape(np.shape(p))

        pending = jax.tree.map(like, self.restart_params(), self.pending)
        return self._replace(pending=pending)


def find_states(tree: PyTree) -> list[BMUFState]:
    """Every `BMUFState` inside `tree`, in order (flax NNX's mappings too)."""
    return [x for x in _replica_parts.find(tree) if isinstance(x, BMUFState)]


def replace_states(tree: PyTree, state: BMUFState) -> PyTree:
    """`tree` with every `BMUFState` inside it replaced by `state`."""
    is_state = lambda x: isinstance(x, BMUFState)  # noqa: E731
    return jax.tree.map(lambda x: state if is_state(x) else x, tree, is_leaf=is_state)


def block_start(g: PyTree, start: PyTree) -> PyTree:
    """The model every replica began the block from: `start`, or `g` if None."""
    return g if start is None else start


def float_where(pred, tree, other):
    """`tree`'s floating leaves where `pred` holds, else `other`'s; others `tree`'s."""
    return float_map(lambda x, o: jnp.where(pred, x, o), tree, other)


def lookahead(g, v, eta):
    """Nesterov's look-ahead point `g + eta * v` (floating leaves)."""
    return float_map(lambda g, v: g + eta * v, g, v)


def cast_like(tree, like):
    """`tree`'s leaves as arrays of the dtypes of `like`'s."""
    return jax.tree.map(
        lambda x, y: jnp.asarray(x).astype(jnp.result_type(y)), tree, like
    )


def _holds_hyperparams(x) -> bool:
    """Whether `x` is the state of `optax.inject_hyperparams(...)`."""
    return isinstance(
        x, optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState
    )


def reset(state, initial):
    """Floating leaves from `initial` (accumulators), integer leaves kept (counters).

    Hyperparameters that `optax.inject_hyperparams` holds in the state are not
    accumulators: they are kept (a learning rate set in the state stays set).
    """

    def one(cur, x):
        if _holds_hyperparams(cur):
            return cur._replace(inner_state=reset(cur.inner_state, x.inner_state))
        if is_float(cur):
            return jnp.asarray(x).astype(cur.dtype)
        return cur

    return jax.tree.map(one, state, initial, is_leaf=_holds_hyperparams)
