"""Private: what the replicas of a state must agree on, and the leaves compared.

Every leaf but the parts a `CustomLayout` holds out by design (`agreed`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp._layout._custom import is_custom
from jdp._layout._keys import is_key
from jdp._tree import PyTree, keystr


def agreed(tree: PyTree) -> PyTree:
    """`tree` with the leaves that differ between replicas by design set to None."""
    return jax.tree.map(
        lambda x: x.agreed() if is_custom(x) else x, tree, is_leaf=is_custom
    )


def replica_leaves(tree: PyTree) -> tuple[list[str], list[jax.Array], Mesh | None]:
    """`(paths, arrays, mesh)`: the leaves whose replicas every comparison reads.

    Agreed array leaves with more than one replica and some data (PRNG keys as
    their key data); `mesh` is the mesh to replicate a comparison's result over
    when some replicas live on other processes, else None.
    """
    paths, arrays = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(agreed(tree))[0]:
        if isinstance(x, jax.Array) and x.ndim >= 1 and x.shape[0] > 1 and x.size:
            paths.append(keystr(path))
            arrays.append(jax.random.key_data(x) if is_key(x) else x)
    local = all(x.is_fully_addressable for x in arrays)
    return paths, arrays, None if local else arrays[0].sharding.mesh


def compare_replicas(fn: Callable[[list[jax.Array]], Any], tree: PyTree):
    """`(paths, fn(arrays))` of `replica_leaves(tree)`, the result on the host.

    `fn` is compiled once per mesh and its result replicated over the mesh, so
    that every process reads the same; `([], [])` if there are no such leaves.
    """
    paths, arrays, mesh = replica_leaves(tree)
    if not arrays:
        return [], []
    return paths, jax.device_get(_compiled(fn, mesh)(arrays))


@functools.cache
def _compiled(fn: Callable, mesh: Mesh | None) -> Callable:
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(fn, out_shardings=NamedSharding(mesh, P()))


def map_agreed(fn: Callable[[PyTree], PyTree], tree: PyTree) -> PyTree:
    """Applies `fn` to `agreed(tree)`; the leaves held out come back unchanged."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_custom)
    done = jax.tree.flatten(fn(agreed(tree)), is_leaf=is_custom)[0]
    out = [
        old.with_agreed(new) if is_custom(old) else new
        for old, new in zip(leaves, done, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)
