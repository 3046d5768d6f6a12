"""Private: `CustomLayout`, the protocol of a pytree node with its own layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jdp._tree import PyTree


class CustomLayout:
    """A pytree node that holds something other than a full copy per replica."""

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
        """This abstract node's layout holding `host_value` (one logical copy).

        `place_leaf(value, ref)` places a leaf every replica holds whole.
        """
        raise NotImplementedError

    def agreed(self):
        """The node with the leaves that differ between replicas replaced by None."""
        raise NotImplementedError

    def with_agreed(self, agreed):
        """The inverse of `agreed`: this node with its agreed leaves from `agreed`."""
        raise NotImplementedError

    def relayout(self, rewrap: Callable[[Any], Any], sharding, holds: bool, total):
        """This node over the replicas of `sharding`, after the replica set changed.

        Every process of the new replica set calls it at once. `rewrap(x)` moves
        a leaf every replica holds whole; the parts that differ between replicas
        come from the devices that hold them (none where `holds` is False: a
        replacement's placed state), through `total(tree)`, which sums a
        pytree of per-replica arrays over the new replicas.
        """
        raise NotImplementedError


def is_custom(x: Any) -> bool:
    """Whether `x` is a `CustomLayout` node (an `is_leaf` for tree maps)."""
    return isinstance(x, CustomLayout)
