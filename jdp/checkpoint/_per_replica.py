"""The leaves whose replicas differ (`jdp.bmuf` between syncs): found, written, read.

Saved with every replica as the item `jdp_replicas` (`leaf_<i>` by position in
the record); restored into as many replicas, else replica 0's copy (warned).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jdp import _replica_parts
from jdp._layout import compare_replicas, is_custom, place_like
from jdp._tree import PyTree, fill_empty, float_bits, keystr
from jdp.checkpoint._common import short_list
from jdp.checkpoint._damage import corrupt, reading
from jdp.checkpoint._format import REPLICAS_ITEM, crc32, host_copy

DIFFERING_MSG = (
    "`CheckpointManager.restore`: step {step} in {directory} was saved between "
    "syncs: its {saved} replicas held different values in {count} leaves "
    "({paths}). {why}, so it gets replica 0's copy of those leaves: the replicas' "
    "local work since their last sync is not carried over (restore into "
    "{saved} replicas to resume exactly).{note}"
)


def _bits(x: jax.Array) -> list[jax.Array]:
    """`x` as unsigned integers with the same bits (floats: -0.0 != 0.0, NaNs)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _bits(jnp.real(x)) + _bits(jnp.imag(x))
    if jnp.issubdtype(x.dtype, jnp.floating):
        return [float_bits(x)]
    return [x]


def _differ(leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """Per leaf, whether any replica's bits differ from replica 0's (a 0-d bool)."""
    return [
        functools.reduce(jnp.logical_or, [jnp.any(b != b[:1]) for b in _bits(x)])
        for x in leaves
    ]


def block_start_params(host: PyTree) -> tuple[PyTree, str]:
    """`(host, note)`: one copy with its params set to where the replicas restart."""
    tree_def = jax.tree.structure
    starts = _replica_parts.restart_params(host)
    if len(starts) != 1:
        return host, ""
    (start,) = starts
    is_dict = isinstance(host, dict)
    params = host.get("params") if is_dict else getattr(host, "params", None)
    if params is not None:  # a `jdp.bmuf` under one label: the others as they are
        start = fill_empty(start, params)
    settable = is_dict or hasattr(host, "replace") or hasattr(host, "_replace")
    if params is None or not settable or tree_def(params) != tree_def(start):
        return host, (
            " The state holds a `jdp.bmuf` state, but no `params` of the same "
            "structure to reset: set them to `jdp.bmuf_global_params(state)` "
            "(with flax NNX: `nnx.update(model, jdp.bmuf_global_params(state))`) "
            "before training on, so that a new block starts from the global model."
        )
    new = jax.tree.map(
        lambda p, s: np.asarray(s).astype(np.asarray(p).dtype), params, start
    )
    if is_dict:
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


def leaves_by_path(tree: PyTree) -> dict[str, Any]:
    """The leaves of `tree` by `keystr` path, a custom layout node as one leaf."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_custom)[0]
    return {keystr(path): x for path, x in flat}


def host_replicas(state: PyTree, flat: list[tuple[Any, Any]]) -> dict[str, Any]:
    """The `host_copy` of each leaf of `state` (`flat`) whose replicas' bits differ."""
    paths, flags = compare_replicas(_differ, state)
    differ = {path for path, flag in zip(paths, flags, strict=True) if bool(flag)}
    return {keystr(path): host_copy(x) for path, x in flat if keystr(path) in differ}


def replicas_save(
    meta: dict[str, Any], replicas: dict[str, Any]
) -> ocp.args.PyTreeSave:
    """Orbax's save arguments for `REPLICAS_ITEM` (`replicas` from `host_replicas`)."""
    index = {r["path"]: i for i, r in enumerate(meta["leaves"])}
    return ocp.args.PyTreeSave(
        {f"leaf_{index[path]}": x for path, x in replicas.items()}
    )


def records_of(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The records of the leaves saved with every replica, by position."""
    return {i: r for i, r in enumerate(records) if r.get("per_replica")}


def read_replicas(
    manager: ocp.CheckpointManager, directory: epath.Path, step: int,
    meta: dict[str, Any], per: dict[int, dict[str, Any]], like_by_path: dict[str, Any],
) -> dict[str, jax.Array]:  # fmt: skip
    """The leaves saved with every replica (records `per`), placed, by path."""
    num = meta["num_replicas"]
    item, restore_args = {}, {}
    for i, r in per.items():
        shape = (num, *r["shape"])
        item[f"leaf_{i}"] = jax.ShapeDtypeStruct(shape, r["dtype"])
        restore_args[f"leaf_{i}"] = ocp.ArrayRestoreArgs(
            sharding=like_by_path[r["path"]].sharding, global_shape=shape,
            dtype=np.dtype(r["dtype"]),
        )  # fmt: skip
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
    failed = "reading the leaves saved with every replica failed"
    with reading(directory, step, failed):
        got = manager.restore(step, args=ocp.args.Composite(**{REPLICAS_ITEM: args}))
    out = {}
    for i, r in per.items():
        x = got[REPLICAS_ITEM][f"leaf_{i}"]
        crc = r["per_replica"].get("crc32")
        if crc is not None and x.is_fully_addressable:
            host = np.asarray(x)
            if host.shape != (num, *r["shape"]) or crc32(host) != crc:
                raise corrupt(directory, step, f"leaf {r['path']} (saved with every "
                              "replica) does not match the CRC-32 recorded when it "
                              "was saved.")  # fmt: skip
        if r.get("key_impl"):
            x = jax.random.wrap_key_data(x, impl=r["key_impl"])
        out[r["path"]] = x
    return out


def place_with(host: PyTree, like: PyTree, own: dict[str, jax.Array]) -> PyTree:
    """`place_like(host, like)`, but the leaves in `own` (by path) taken as they are."""

    def mask(path, x):
        return None if keystr(path) in own else x

    like_rest = jax.tree_util.tree_map_with_path(mask, like, is_leaf=is_custom)
    host_rest = jax.tree_util.tree_map_with_path(mask, host)
    placed = leaves_by_path(place_like(host_rest, like_rest))

    def pick(path, _):
        name = keystr(path)
        return own[name] if name in own else placed[name]

    return jax.tree_util.tree_map_with_path(pick, like, is_leaf=is_custom)


def one_copy_of_differing(directory: epath.Path, step: int, meta: dict[str, Any],
                          host: PyTree, per: dict[int, dict[str, Any]],
                          why: str) -> PyTree:  # fmt: skip
    """`host` (replica 0's values) set to where replicas restart, warning `why`.

    The warning names `CheckpointManager.restore`'s caller: the frames between
    are `_newest_intact`, `read`, `restore_step` and `_restore_*`'s.
    """
    host, note = block_start_params(host)
    host, notes = _replica_parts.restart_local(host)
    note += "".join(" " + line for line in notes)
    paths = [r["path"] for r in per.values()]
    warnings.warn(DIFFERING_MSG.format(
        step=step, directory=directory, saved=meta["num_replicas"], count=len(paths),
        paths=short_list(paths), why=why, note=note,
    ), RuntimeWarning, stacklevel=7)  # fmt: skip
    return host
