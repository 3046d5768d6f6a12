"""Leaves whose replicas differ: found on save, and what a restore does with them.

Synchronous steps keep every replica bit-identical, so one copy is the whole
state. Between the syncs of `jdp.bmuf` (or any step that updates replicas from
their own data) the replicas' params and inner optimizer state differ: those
leaves are saved with every replica. Parts of a `CustomLayout` node (ZeRO's
slices) differ by design and are left to their layout.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import _replica_parts
from jdp._layout import replica_leaves

PyTree = Any

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _bits(x: jax.Array) -> list[jax.Array]:
    """`x` as unsigned integers with the same bits (floats: -0.0 != 0.0, NaNs)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _bits(jnp.real(x)) + _bits(jnp.imag(x))
    if jnp.issubdtype(x.dtype, jnp.floating):
        return [jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])]
    return [x]


def _differ(leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """Per leaf, whether any replica's bits differ from replica 0's (a 0-d bool)."""
    out = []
    for x in leaves:
        flags = [jnp.any(b != b[:1]) for b in _bits(x)]
        out.append(functools.reduce(jnp.logical_or, flags))
    return out


@functools.cache
def _differ_fn(mesh: Mesh | None):
    """`_differ`, compiled once per mesh (and leaf structure).

    With several processes the flags come back replicated on `mesh`, so that
    every process makes the same decision (and saves the same items).
    """
    if mesh is None:
        return jax.jit(_differ)
    return jax.jit(_differ, out_shardings=NamedSharding(mesh, P()))


def differing_paths(state: PyTree) -> list[str]:
    """Paths of the leaves of a replicated state whose replicas are not all equal.

    Compares bits (so `-0.0` and `0.0`, or two NaNs with other payloads, count as
    different). Leaves inside a `CustomLayout` node are skipped: they differ by
    design and their layout restores them.

    Args:
      state: A replicated pytree (every array leaf with a leading replica axis).

    Returns:
      The `jax.tree_util.keystr` paths, in pytree order.
    """
    paths, arrays, mesh = replica_leaves(state)
    if not arrays:
        return []
    flags = jax.device_get(_differ_fn(mesh)(arrays))
    return [path for path, flag in zip(paths, flags, strict=True) if bool(flag)]


def block_start_params(host: PyTree) -> tuple[PyTree, str]:
    """Sets the params of one copy of a state to where replicas restart.

    A state part that declares `restart_params` (`_replica_parts`) says where
    every replica begins after a re-layout: for `jdp.bmuf`, the block start (the
    global model `global_params`, or `start` with
    `jdp.block_momentum(nesterov=True)`).

    Args:
      host: One logical copy (NumPy leaves) of a training state.

    Returns:
      `(tree, note)`: the tree with its params set to the block start (or
      unchanged), and a sentence for the warning saying what was done.
    """
    starts = _replica_parts.restart_params(host)
    if len(starts) != 1:
        return host, ""
    (start,) = starts
    params = getattr(host, "params", None)
    if params is None and isinstance(host, dict):
        params = host.get("params")
    same = (
        params is not None
        and (
            isinstance(host, dict)
            or hasattr(host, "replace")
            or hasattr(host, "_replace")
        )
        and jax.tree.structure(params) == jax.tree.structure(start)
    )
    if not same:
        return host, (
            " The state holds a `jdp.bmuf` state, but no `params` of the same "
            "structure to reset: set them to `jdp.bmuf_global_params(state)` "
            "(with flax NNX: `nnx.update(model, jdp.bmuf_global_params(state))`) "
            "before training on, so that a new block starts from the global model."
        )
    new = jax.tree.map(
        lambda p, s: np.asarray(s).astype(np.asarray(p).dtype), params, start
    )
    if isinstance(host, dict):
        host = {**host, "params": new}
    elif hasattr(host, "replace"):  # flax structs, e.g. `jdp.TrainState`
        host = host.replace(params=new)
    else:  # named tuples
        host = host._replace(params=new)
    return host, (
        " The state holds a `jdp.bmuf` state: its params are set to the block start "
        "(its `global_params`, or the look-ahead `start` with "
        "`jdp.block_momentum(nesterov=True)`), so "
        "a new block starts from the global model."
    )
