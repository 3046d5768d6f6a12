"""Private: the replica layout, the one package that knows how state is laid out.

A *logical* pytree (one copy) becomes a *replicated* one whose every array leaf
has a leading replica axis sharded over the whole mesh; a `CustomLayout` node
(ZeRO's state) converts itself. Its modules (jdp/ARCHITECTURE.md, layer 1) each
import only those listed before them.
"""

from jdp._layout._agreed import compare_replicas, map_agreed
from jdp._layout._custom import CustomLayout, is_custom
from jdp._layout._keys import abstract, host_value, is_key, key_impl
from jdp._layout._mesh import AxisName, make_mesh, mesh_axis, mesh_for, replica_sharding
from jdp._layout._place import (
    is_replicated,
    logical_copy,
    logical_like,
    place_copies,
    place_like,
    replicate,
)
from jdp._layout._state_checks import (
    check_not_deleted,
    check_replicated,
    check_same_structure,
    check_unchanged,
    check_unreplicable,
    misplaced,
    whole_arrays,
)

__all__ = [
    "AxisName", "CustomLayout", "abstract", "check_not_deleted", "check_replicated",
    "check_unreplicable", "check_same_structure", "compare_replicas",
    "check_unchanged", "host_value",
    "is_custom", "is_key", "is_replicated", "key_impl", "logical_copy", "logical_like",
    "make_mesh", "map_agreed", "mesh_axis", "mesh_for", "misplaced", "place_copies",
    "place_like", "replica_sharding", "replicate", "whole_arrays",
]  # fmt: skip
