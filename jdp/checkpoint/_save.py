"""What a save checks and writes: a replicated state, never over a saved step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jdp import _layout
from jdp._layout import logical_copy
from jdp._tree import PyTree, format_problems, keystr
from jdp.checkpoint import _format
from jdp.checkpoint._extra import encode_extra
from jdp.checkpoint._per_replica import host_replicas, replicas_save
from jdp.checkpoint._store import StepStore

NOT_REPLICATED_MSG = (
    "`CheckpointManager.save`: `state` is not a replicated state. Expected every "
    "leaf to be a `jax.Array` with a leading replica axis, as returned by a "
    "`jdp.Parallel` step or `step.replicate`. Offending leaves:{probs}\n"
    "Fix: `manager.save(step_number, step.replicate(state))`."
)


def check_replicated(
    state: PyTree, flat: Sequence[tuple[Any, Any]], parallel: Any
) -> None:
    """Raises a `ValueError` unless every leaf (of `flat`) has a replica axis."""
    if not flat:
        raise ValueError("`CheckpointManager.save`: `state` has no array leaves.")
    probs = []
    for path, x in flat:
        if not isinstance(x, jax.Array) or x.ndim == 0:
            kind = "0-d jax.Array" if isinstance(x, jax.Array) else type(x).__name__
            probs.append(f"{keystr(path)}: a {kind} of shape {np.shape(x)}")
    if probs:
        raise ValueError(NOT_REPLICATED_MSG.format(probs=format_problems(probs)))
    _layout.check_not_deleted(state, "CheckpointManager.save")
    check_unique_names(flat)
    if probs := _layout.whole_arrays(state):
        raise ValueError(NOT_REPLICATED_MSG.format(probs=format_problems(probs)))
    if parallel is not None:
        parallel._check_state(state)


def check_unique_names(flat: Sequence[tuple[Any, Any]]) -> None:
    """Raises if two leaves would be written under one name (keys with dots)."""
    seen: dict[str, str] = {}
    for path, _ in flat:
        name = _format.param_name(path)
        if (other := seen.setdefault(name, keystr(path))) != keystr(path):
            raise ValueError(
                f"`CheckpointManager.save`: leaves {other} and {keystr(path)} would "
                f"both be written as {name!r} (a leaf is named by its keys joined "
                "with '.'), and one would be lost. Fix: rename a key so that no "
                "key holds a '.' that another path spells out."
            )


def check_not_overwriting(store: StepStore, step: int) -> dict[int, str]:
    """Raises if an intact step >= `step` is on disk; else `{damaged step: why}`."""
    damaged, intact = {}, []
    for s in store.steps_on_disk():
        if s < step:
            continue
        if reason := store.incomplete(s) or store.verify_arrays(s):
            damaged[s] = reason
        else:
            intact.append(s)
    if step in intact:
        raise ValueError(
            f"`CheckpointManager.save`: step {step} already has a checkpoint in "
            f"{store.directory}; checkpoints are never overwritten. Save under a "
            "new step number, or delete that step's directory first."
        )
    if intact:
        raise ValueError(
            f"`CheckpointManager.save`: step {step} is older than the latest "
            f"checkpoint ({max(intact)}) in {store.directory}. Step numbers must "
            "increase; to branch off an older step, save into a new directory."
        )
    return damaged


def save_items(step: int, state: PyTree, flat: Sequence[tuple[Any, Any]],
               parallel: Any, extra: Any = None) -> dict[str, Any]:  # fmt: skip
    """Orbax's save arguments of a step by item name, every array in host memory."""
    replicas = host_replicas(state, flat)
    logical = logical_copy(state)
    host = jax.tree.map(_format.host_copy, logical)
    meta = _format.make_metadata(step, state, logical, host, replicas, parallel)
    if extra is not None:
        meta["extra"] = encode_extra(extra)
    items = {
        _format.STATE_ITEM: ocp.args.PyTreeSave(_format.written(host)),
        _format.METADATA_ITEM: ocp.args.JsonSave(meta),
    }
    if replicas:
        items[_format.REPLICAS_ITEM] = replicas_save(meta, replicas)
    return items
