"""Private: `CustomLayout`, the protocol of a pytree node with its own layout.

The default layout gives every replica a full copy of every leaf. A node that
holds something else per replica (ZeRO's sharded optimizer state: replica `r`
holds slice `r`) subclasses `CustomLayout` and converts itself; the rest of jdp
only asks `is_custom` and calls the protocol's methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PyTree = Any


class CustomLayout:
    """A pytree node that lays its leaves out in its own way across replicas.

    The default layout gives every replica a full copy. A subclass (a pytree node,
    e.g. a flax `struct.PyTreeNode`) that holds something else per replica (a
    slice) says how to convert between that and one logical copy.
    """

    #: Whether the node's optimizer averages the gradients itself (`jdp.zero`),
    #: so that the step's sync piece must not.
    syncs_gradients = False

    def layout(self, num_replicas: int):
        """The abstract per-replica layout of this abstract logical node."""
        del num_replicas
        return self

    def logical(self) -> PyTree:
        """One logical copy of the replicated node (arrays, or abstract values)."""
        raise NotImplementedError

    def place(self, host_value: PyTree, place_leaf: Callable[[Any, Any], Any]):
        """This node's layout holding `host_value` (one logical copy).

        `self` is abstract (`jax.ShapeDtypeStruct`s with the replica axis and a
        sharding); `place_leaf(value, ref)` places a leaf every replica holds
        whole.
        """
        raise NotImplementedError

    def agreed(self):
        """The node with the leaves that differ between replicas replaced by None."""
        raise NotImplementedError

    def with_agreed(self, agreed):
        """The inverse of `agreed`: this node with its agreed leaves from `agreed`."""
        raise NotImplementedError


def is_custom(x: Any) -> bool:
    """Whether `x` is a `CustomLayout` node (an `is_leaf` for tree maps)."""
    return isinstance(x, CustomLayout)
