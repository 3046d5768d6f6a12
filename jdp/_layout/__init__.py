"""Private: the replica layout, the one package that knows how state is laid out.

jdp keeps one copy of the state per replica on both backends. A *logical* pytree
(one copy: what the user writes, `step.unreplicate` returns and checkpoints save)
becomes a *replicated* pytree whose every array leaf has a leading replica axis of
size `num_replicas`, sharded over every axis of the mesh:
`NamedSharding(mesh, P(axis_name))`, with `axis_name` the mesh's one axis name or
the tuple of both names of a `(hosts, devices per host)` mesh.

A pytree node can lay its leaves out differently by subclassing `CustomLayout`
(e.g. ZeRO's sharded optimizer state, where replica `r` holds only slice `r`).
Every conversion here (`logical_copy`, `logical_like`, `place_like`, `agreed`)
asks such a node to convert itself, so the rest of jdp never needs to know which
custom layouts exist.

Typed PRNG keys are placed as their key data and wrapped back.

One module per part, each importing only those listed before it:

- `_mesh`: the mesh (`mesh_for` checks `devices` and `axis_name`) and the
  replica sharding;
- `_keys`: typed PRNG keys, and a leaf's host value and abstract value;
- `_custom`: the `CustomLayout` protocol;
- `_agreed`: what replicas must agree on, and the leaves compared;
- `_place`: replicate / place-like / logical copy and shapes / is-replicated;
- `_state_checks`: the checks of the state a step receives and returns.

This module re-exports their names: the rest of jdp imports from `jdp._layout`.
"""

from jdp._layout._agreed import agreed, map_agreed, replica_leaves
from jdp._layout._custom import CustomLayout, is_custom
from jdp._layout._keys import abstract, host_value, is_key, key_impl
from jdp._layout._mesh import (
    AxisName,
    host_groups,
    make_mesh,
    mesh_axis,
    mesh_for,
    replica_sharding,
)
from jdp._layout._place import (
    ALREADY_REPLICATED_MSG,
    SHARED_VARIABLE_MSG,
    is_replicated,
    logical_copy,
    logical_like,
    place_like,
    replicate,
    shared_variables,
)
from jdp._layout._state_checks import (
    DONATED_MSG,
    NOT_REPLICATED_MSG,
    STATE_CHANGED_MSG,
    changes,
    check_replicated,
    check_same_structure,
    check_unchanged,
    deleted,
    describe,
    misplaced,
)

__all__ = [
    "ALREADY_REPLICATED_MSG",
    "DONATED_MSG",
    "NOT_REPLICATED_MSG",
    "SHARED_VARIABLE_MSG",
    "STATE_CHANGED_MSG",
    "AxisName",
    "CustomLayout",
    "abstract",
    "agreed",
    "changes",
    "check_replicated",
    "check_same_structure",
    "check_unchanged",
    "deleted",
    "describe",
    "host_groups",
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
    "shared_variables",
]
