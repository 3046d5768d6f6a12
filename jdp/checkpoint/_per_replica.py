"""The leaves saved with every replica: writing them, reading and placing them.

Between the syncs of `jdp.bmuf` the replicas of some leaves differ
(`_replicas.differing_paths` finds them). A save writes those leaves with every
replica as one more orbax item, `jdp_replicas`, whose keys are `leaf_<i>` for the
leaf's position `i` in the step's record. A restore into as many replicas gives
each replica its own value back; into another layout, those leaves get replica
0's copy (with a warning, and for BMUF the params set to the block start).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jdp import _replica_parts
from jdp._layout import is_custom, place_like
from jdp._tree import keystr
from jdp.checkpoint._common import short_list
from jdp.checkpoint._damage import corrupt, is_damage, not_damage
from jdp.checkpoint._format import REPLICAS_ITEM, crc32, host_copy, restore_item
from jdp.checkpoint._replicas import block_start_params, differing_paths

PyTree = Any

DIFFERING_MSG = (
    "`CheckpointManager.restore`: step {step} in {directory} was saved between "
    "syncs: its {saved} replicas held different values in {count} leaves "
    "({paths}). {why}, so it gets replica 0's copy of those leaves: the replicas' "
    "local work since their last sync is not carried over (restore into "
    "{saved} replicas to resume exactly).{note}"
)


# -- save -------------------------------------------------------------------------


def host_replicas(state: PyTree, flat: list[tuple[Any, Any]]) -> dict[str, Any]:
    """The leaves of `state` whose replicas differ, with every replica, by path.

    Args:
      state: A replicated state.
      flat: `state` flattened with paths.

    Returns:
      Host copies (`_format.host_copy`) of those leaves, by `keystr` path.
    """
    per_replica = set(differing_paths(state))
    return {
        keystr(path): host_copy(x) for path, x in flat if keystr(path) in per_replica
    }


def replicas_save(
    meta: dict[str, Any], replicas: dict[str, Any]
) -> ocp.args.PyTreeSave:
    """The orbax item of the leaves saved with every replica.

    Args:
      meta: The step's record (its leaves give each path's position).
      replicas: The leaves to save, by path (`host_replicas`).

    Returns:
      Orbax's save arguments for `REPLICAS_ITEM`.
    """
    index = {r["path"]: i for i, r in enumerate(meta["leaves"])}
    return ocp.args.PyTreeSave(
        {f"leaf_{index[path]}": x for path, x in replicas.items()}
    )


# -- restore ----------------------------------------------------------------------


def records_of(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The records of the leaves saved with every replica, by position."""
    return {i: r for i, r in enumerate(records) if r.get("per_replica")}


def read_replicas(
    manager: ocp.CheckpointManager,
    directory: epath.Path,
    step: int,
    meta: dict[str, Any],
    per: dict[int, dict[str, Any]],
    like_by_path: dict[str, Any],
) -> dict[str, jax.Array]:
    """The leaves saved with every replica, placed like `like`'s leaves.

    Args:
      manager: The orbax manager of `directory`.
      directory: The checkpoint directory.
      step: The step to read.
      meta: The step's record.
      per: The records of those leaves, by position (`records_of`).
      like_by_path: The leaves of `like` (as many replicas as saved), by path.

    Returns:
      The arrays, by path (typed PRNG keys as keys).

    Raises:
      CheckpointCorruptedError: If the item's files are damaged or a leaf's
        CRC-32 differs.
      RuntimeError: If reading fails for another reason (not damage).
    """
    num = meta["num_replicas"]
    item, restore_args = {}, {}
    for i, r in per.items():
        shape = (num, *r["shape"])
        item[f"leaf_{i}"] = jax.ShapeDtypeStruct(shape, r["dtype"])
        restore_args[f"leaf_{i}"] = ocp.ArrayRestoreArgs(
            sharding=like_by_path[r["path"]].sharding,
            global_shape=shape,
            dtype=np.dtype(r["dtype"]),
        )
    try:
        got = restore_item(manager, step, REPLICAS_ITEM, item, restore_args)
    except Exception as e:  # tensorstore/orbax raise many types for bad files
        if not is_damage(e):
            raise not_damage(directory, step, e) from e
        detail = (
            "reading the leaves saved with every replica failed "
            f"({type(e).__name__}: {e})."
        )
        raise corrupt(directory, step, detail) from e
    out = {}
    for i, r in per.items():
        x = got[f"leaf_{i}"]
        crc = r["per_replica"].get("crc32")
        if crc is not None and x.is_fully_addressable:
            host = np.asarray(x)
            if host.shape != (num, *r["shape"]) or crc32(host) != crc:
                raise corrupt(
                    directory,
                    step,
                    f"leaf {r['path']} (saved with every replica) does not "
                    "match the CRC-32 recorded when it was saved.",
                )
        if r.get("key_impl"):
            x = jax.random.wrap_key_data(x, impl=r["key_impl"])
        out[r["path"]] = x
    return out


def place_with(host: PyTree, like: PyTree, own: dict[str, jax.Array]) -> PyTree:
    """`place_like(host, like)`, but the leaves in `own` (by path) taken as they are.

    Leaves saved with every replica are never inside a custom layout node, so
    they are top-level leaves of `like` flattened with `is_leaf=is_custom`.

    Args:
      host: One logical copy (NumPy leaves).
      like: The replicated state to place it like.
      own: The leaves read with every replica (`read_replicas`), by path.

    Returns:
      A tree like `like`.
    """

    def mask(path, x):
        return None if keystr(path) in own else x

    like_rest = jax.tree_util.tree_map_with_path(mask, like, is_leaf=is_custom)
    host_rest = jax.tree_util.tree_map_with_path(mask, host)
    placed = place_like(host_rest, like_rest)
    placed_by_path = {
        keystr(path): x
        for path, x in jax.tree_util.tree_flatten_with_path(placed, is_leaf=is_custom)[
            0
        ]
    }

    def pick(path, _):
        name = keystr(path)
        return own[name] if name in own else placed_by_path[name]

    return jax.tree_util.tree_map_with_path(pick, like, is_leaf=is_custom)


def one_copy_of_differing(
    directory: epath.Path,
    step: int,
    meta: dict[str, Any],
    host: PyTree,
    per: dict[int, dict[str, Any]],
    why: str,
) -> PyTree:
    """Warns that per-replica values are dropped; BMUF: params to block start.

    The warning names the caller of `CheckpointManager.restore`, four frames up:
    call this from the function that `_restore.restore_step` calls.

    Args:
      directory: The checkpoint directory.
      step: The step being restored.
      meta: The step's record.
      host: One logical copy read from the step (replica 0's values).
      per: The records of the leaves saved with every replica, by position.
      why: Why their replicas cannot be restored, e.g. "`like` is one copy".

    Returns:
      `host`, with the params of a `jdp.bmuf` state set to its block start and
      declared parts that restart (`_replica_parts.restart_local`) restarted.
    """
    host, note = block_start_params(host)
    host, notes = _replica_parts.restart_local(host)
    for line in notes:
        note += " " + line
    paths = [r["path"] for r in per.values()]
    warnings.warn(
        DIFFERING_MSG.format(
            step=step,
            directory=directory,
            saved=meta["num_replicas"],
            count=len(paths),
            paths=short_list(paths),
            why=why,
            note=note,
        ),
        RuntimeWarning,
        stacklevel=5,
    )
    return host
