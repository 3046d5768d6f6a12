"""Private: the replica layout, the one package that knows how state is laid out.

A *logical* pytree (one copy: what the user writes, `step.unreplicate` returns
and checkpoints save) becomes a *replicated* pytree whose every array leaf has a
leading replica axis of size `num_replicas`, sharded over every axis of the mesh
(`replica_sharding`). Typed PRNG keys are placed as their key data. A node that
lays its leaves out otherwise (ZeRO's sharded optimizer state) subclasses
`CustomLayout`, and every conversion here asks it to convert itself.

Modules, each importing only those before it: `_mesh` (the mesh and its
sharding), `_keys` (PRNG keys, a leaf's host and abstract value), `_custom`
(`CustomLayout`), `_agreed` (what replicas must agree on), `_place` (replicate
and take one copy back), `_state_checks` (checks of the state a step receives
and returns). The rest of jdp imports their names from here.
"""

from jdp._layout._agreed import map_agreed, replica_leaves
from jdp._layout._custom import CustomLayout, is_custom
from jdp._layout._keys import abstract, host_value, is_key, key_impl
from jdp._layout._mesh import AxisName, make_mesh, mesh_axis, mesh_for, replica_sharding
from jdp._layout._place import (
    is_replicated,
    logical_copy,
    logical_like,
    place_like,
    replicate,
)
from jdp._layout._state_checks import (
    check_replicated,
    check_same_structure,
    check_unchanged,
    misplaced,
)

__all__ = [
    "AxisName",
    "CustomLayout",
    "abstract",
    "check_replicated",
    "check_same_structure",
    "check_unchanged",
    "host_value",
    "is_custom",
    "is_key",
    "is_replicated",
    "key_impl",
    "logical_copy",
    "logical_like",
    "make_mesh",
    "map_agreed",
    "mesh_axis",
    "mesh_for",
    "misplaced",
    "place_like",
    "replica_leaves",
    "replica_sharding",
    "replicate",
]
