"""Private: one logical copy to replicated arrays and back."""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jdp._layout._custom import is_custom
from jdp._layout._keys import abstract, host_value, is_key, key_impl
from jdp._layout._mesh import replica_sharding
from jdp._tree import PyTree, format_problems, keystr, repeated_paths

SHARED_VARIABLE_MSG = (
    "`step.replicate`: the state holds one flax NNX `Variable` at two paths, "
    "{0} and {1} (a weight shared between modules, e.g. tied "
    "embeddings). Passed as a pytree, each path would become its own array and "
    "the first update would silently untie them. Split the modules instead: "
    "`graphdef, state = nnx.split((model, optimizer))`, replicate `state` and "
    "`nnx.merge(graphdef, state)` in the step; `nnx.split` keeps one copy of a "
    "shared weight and `nnx.merge` shares it again."
)

ALREADY_REPLICATED_MSG = (
    "`step.replicate`: every array leaf of the tree is already replicated (a "
    "leading replica axis sharded over a mesh of {0} devices); replicating it "
    "again would give every replica the whole stack. Pass it to the step as it "
    "is, or re-place one copy with `step.replicate(other_step.unreplicate(tree))`."
)


PARTLY_REPLICATED_MSG = (
    "`step.replicate`: some array leaves of the tree are already replicated (a "
    "leading replica axis sharded over the mesh), and replicating them again "
    "would give every replica the whole stack:{probs}\nFix: replicate the new "
    "parts alone and put them in, e.g. `state.replace(opt_state="
    "step.replicate(tx.init(one_copy_of_params)))`, or unreplicate the rest first "
    "(`step.replicate(step.unreplicate(state))`)."
)


def _check_numeric(tree: PyTree) -> None:
    """Refuses leaves that are not numbers or arrays of numbers, naming them."""
    bad = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) or is_key(x):
            continue
        if isinstance(x, str | bytes) or np.asarray(x).dtype.kind in "USO":
            bad.append(f"{keystr(path)}: a {type(x).__name__} ({x!r:.40})")
    if bad:
        raise TypeError(
            "`step.replicate`: these leaves are not numbers or arrays of numbers, "
            f"which is what replicas hold:{format_problems(bad)}\nFix: keep them "
            "out of the state, or make the field static (a flax "
            "`struct.field(pytree_node=False)`, or NNX's `nnx.static`)."
        )


def logical_copy(tree: PyTree) -> PyTree:
    """One logical copy of a replicated pytree: replica 0's value of every leaf.

    Array leaves give this process's first replica (no gather); custom layouts
    convert themselves; other leaves pass through.
    """

    def first(x):
        if is_custom(x):
            return x.logical()
        if isinstance(x, jax.Array) and x.ndim >= 1:
            data = x.addressable_shards[0].data
            return data.reshape(data.shape[1:])
        return x

    return jax.tree.map(first, tree, is_leaf=is_custom)


def logical_like(tree: PyTree) -> PyTree:
    """What `logical_copy(tree)` would return, as `jax.ShapeDtypeStruct`s."""

    def one(x):
        if is_custom(x):
            return jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x
            ).logical()
        if hasattr(x, "shape") and hasattr(x, "dtype") and len(x.shape) >= 1:
            return jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype)
        return x

    return jax.tree.map(one, tree, is_leaf=is_custom)


def _place_leaf(x: Any, ref: Any) -> jax.Array:
    """One logical leaf placed like `ref` (replica axis, sharding), once per replica."""
    if is_key(ref):  # typed PRNG keys: place their data, then wrap it
        data = host_value(x)
        shape = tuple(ref.shape) + data.shape[len(ref.shape) - 1 :]
        view = np.broadcast_to(data, shape)
        placed = jax.make_array_from_callback(shape, ref.sharding, view.__getitem__)
        return jax.random.wrap_key_data(placed, impl=key_impl(ref))
    x = host_value(x).astype(ref.dtype, copy=False)
    view = np.broadcast_to(x, ref.shape)  # no copy until a device takes a slice
    return jax.make_array_from_callback(ref.shape, ref.sharding, view.__getitem__)


def place_like(host_tree: PyTree, like: PyTree) -> PyTree:
    """Replicates one logical copy into the layout of `like` (undoes `logical_copy`).

    `like` holds arrays or `jax.ShapeDtypeStruct`s with the replica axis and a
    sharding; every replica gets `host_tree` (custom layouts: its part).
    """

    def place(ref, x):
        return ref.place(x, _place_leaf) if is_custom(ref) else _place_leaf(x, ref)

    return jax.tree.map(place, like, host_tree, is_leaf=is_custom)


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """Gives every replica of `mesh` a copy of `tree` (process 0's, over processes)."""
    nnx = sys.modules.get("flax.nnx")  # no NNX objects unless it was imported
    variable = () if nnx is None else nnx.Variable
    if shared := repeated_paths(tree, is_leaf=lambda x: isinstance(x, variable)):
        raise ValueError(SHARED_VARIABLE_MSG.format(*shared[0]))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    arrays = [(p, x) for p, x in flat if isinstance(x, jax.Array)]
    if done := [(p, x) for p, x in arrays if is_replicated(x)]:
        if len(done) == len(arrays):
            raise ValueError(
                ALREADY_REPLICATED_MSG.format(done[0][1].sharding.mesh.size)
            )
        probs = [f"{keystr(p)}: shape {x.shape}" for p, x in done]
        raise ValueError(PARTLY_REPLICATED_MSG.format(probs=format_problems(probs)))
    _check_numeric(tree)
    host = jax.tree.map(host_value, tree)  # PRNG keys as their key data
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        host = multihost_utils.broadcast_one_to_all(host)
    return place_copies(tree, host, replica_sharding(mesh))


def place_copies(tree: PyTree, host: PyTree, sharding: NamedSharding) -> PyTree:
    """`host` (one logical copy of `tree`) on every replica of `sharding`, locally."""
    num = sharding.mesh.size
    shapes = jax.tree.map(  # custom layouts: their per-replica parts
        lambda x: x.layout(num) if is_custom(x) else x,
        jax.tree.map(abstract, tree),
        is_leaf=is_custom,
    )
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((num,) + x.shape, x.dtype, sharding=sharding),
        shapes,
    )
    return place_like(host, like)


def is_replicated(x: Any) -> bool:
    """Whether a leaf or `jax.ShapeDtypeStruct` has `replicate`'s layout (1-D/2-D)."""
    if not isinstance(x, jax.Array | jax.ShapeDtypeStruct) or x.ndim < 1:
        return False
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        return False
    return x.shape[0] == sharding.mesh.size and sharding.is_equivalent_to(
        replica_sharding(sharding.mesh), x.ndim
    )
