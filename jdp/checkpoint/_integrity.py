"""The checks of a checkpoint step's arrays against the record written at save.

`check_leaves` checks the leaves a restore read back (shape, dtype, CRC-32);
`verify_arrays` reads every array of a step, without a `like`, to tell whether
a step that would block a save is damaged.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from jdp.checkpoint._damage import corrupt, is_damage, not_damage
from jdp.checkpoint._format import (
    REPLICAS_ITEM,
    STATE_ITEM,
    crc32,
    dtype_name,
    item_array_names,
    read_arrays,
)


def check_leaves(
    directory: epath.Path,
    step: int,
    records: Sequence[dict[str, Any]],
    leaves: Sequence[Any],
) -> None:
    """Checks the leaves read back against their records: shape, dtype, CRC-32.

    Args:
      directory: The checkpoint directory.
      step: The step the leaves were read from.
      records: The step's leaf records, in the order of `leaves`.
      leaves: The arrays read back.

    Raises:
      CheckpointCorruptedError: Naming the first leaf that differs from its
        record.
    """
    for record, x in zip(records, leaves, strict=True):
        x = np.asarray(x)
        detail = None
        if x.shape != tuple(record["shape"]) or dtype_name(x.dtype) != record["dtype"]:
            detail = (
                f"leaf {record['path']} was read back with shape {x.shape} "
                f"{dtype_name(x.dtype)}, but was saved with shape "
                f"{tuple(record['shape'])} {record['dtype']}."
            )
        elif record.get("crc32") is not None and crc32(x) != record["crc32"]:
            detail = (
                f"leaf {record['path']} does not match the CRC-32 recorded when "
                "it was saved."
            )
        if detail:
            raise corrupt(directory, step, detail)


def verify_arrays(directory: epath.Path, step: int, meta: dict[str, Any]) -> str | None:
    """Reads every array of a step and checks its CRC-32.

    Needs no `like`: the arrays are matched to the records by shape, dtype and
    checksum. Reading a whole step is slow: only for a step that would block a
    save.

    Args:
      directory: The checkpoint directory.
      step: The step to read.
      meta: The step's record.

    Returns:
      What is wrong with the step, or None if every array matches its record.

    Raises:
      RuntimeError: If reading fails for a reason that is not damage
        (`is_damage`): the step is then neither damaged nor known intact.
    """
    want = collections.Counter()
    for r in meta["leaves"]:
        if r.get("crc32") is not None:
            want[(tuple(r["shape"]), r["dtype"], r["crc32"])] += 1
        per = r.get("per_replica") or {}
        if per.get("crc32") is not None:
            shape = (meta["num_replicas"], *r["shape"])
            want[(shape, r["dtype"], per["crc32"])] += 1
    have = collections.Counter()
    items = [STATE_ITEM]
    if any(r.get("per_replica") for r in meta["leaves"]):
        items.append(REPLICAS_ITEM)
    try:
        for item in items:
            names = item_array_names(directory, step, item)
            for x in read_arrays(directory, step, item, names):
                x = np.asarray(x)
                have[(x.shape, dtype_name(x.dtype), crc32(x))] += 1
    except Exception as e:  # tensorstore raises many types for bad files
        if not is_damage(e):
            raise not_damage(directory, step, e, caller="save") from e
        return f"reading its arrays failed ({type(e).__name__}: {e})"
    bad = sum((want - have).values())
    if bad:
        return f"{bad} of its arrays do not match the CRC-32 recorded at save"
    return None
