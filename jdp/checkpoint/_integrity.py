"""The checks of a checkpoint step's arrays against the record written at save."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from jdp.checkpoint import _format
from jdp.checkpoint._common import error_text
from jdp.checkpoint._damage import corrupt, is_damage, not_damage


def check_leaves(directory: epath.Path, step: int, records: Sequence[dict[str, Any]],
                 leaves: Sequence[Any]) -> None:  # fmt: skip
    """Raises a `CheckpointCorruptedError` for the first leaf unlike its record."""
    for record, x in zip(records, leaves, strict=True):
        x = np.asarray(x)
        shape, dtype = tuple(record["shape"]), record["dtype"]
        got = _format.dtype_name(x.dtype)
        if (x.shape, got) != (shape, dtype):
            raise corrupt(directory, step, f"leaf {record['path']} was read back with "
                          f"shape {x.shape} {got}, but was saved with shape {shape} "
                          f"{dtype}.")  # fmt: skip
        if record.get("crc32") is not None and _format.crc32(x) != record["crc32"]:
            raise corrupt(directory, step, f"leaf {record['path']} does not match the "
                          "CRC-32 recorded when it was saved.")  # fmt: skip


def verify_arrays(directory: epath.Path, step: int, meta: dict[str, Any]) -> str | None:
    """What is wrong with a step's arrays (shape, dtype, CRC-32 of each), or None."""
    want = collections.Counter()
    for r in meta["leaves"]:
        if r.get("crc32") is not None:
            want[(tuple(r["shape"]), r["dtype"], r["crc32"])] += 1
        per = r.get("per_replica") or {}
        if per.get("crc32") is not None:
            shape = (meta["num_replicas"], *r["shape"])
            want[(shape, r["dtype"], per["crc32"])] += 1
    have = collections.Counter()
    items = [_format.STATE_ITEM]
    if any(r.get("per_replica") for r in meta["leaves"]):
        items.append(_format.REPLICAS_ITEM)
    try:
        for item in items:
            names = _format.item_array_names(directory, step, item)
            for x in _format.read_arrays(directory, step, item, names):
                x = np.asarray(x)
                have[(x.shape, _format.dtype_name(x.dtype), _format.crc32(x))] += 1
    except Exception as e:  # tensorstore raises many types for bad files
        if not is_damage(e):
            raise not_damage(directory, step, e, caller="save") from e
        return f"reading its arrays failed ({error_text(e)})"
    if bad := sum((want - have).values()):
        return f"{bad} of its arrays do not match the CRC-32 recorded at save"
    return None
