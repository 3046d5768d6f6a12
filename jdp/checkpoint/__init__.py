"""Checkpoints for replicated training states, on orbax-checkpoint.

Public names (stable):

- `CheckpointManager`: `save(step, state)` writes one copy of a replicated state
  plus a JSON record (and every replica of the leaves whose replicas differ, as
  between `jdp.bmuf` syncs); `restore(like)` gives every replica of `like`'s
  layout the saved copy, on any number of replicas, or returns one copy for a
  `like` without replica axis. One manager at a time saves into a directory.
- `CheckpointCorruptedError`: raised by `restore` for a step whose files are
  damaged (a CRC-32 that differs, a file missing, truncated or undecodable); a
  `ValueError`. Other failures to read a step are never reported as damage.

Modules whose names start with `_` are private and may change.
"""

from jdp.checkpoint._damage import CheckpointCorruptedError
from jdp.checkpoint._manager import CheckpointManager

__all__ = ["CheckpointCorruptedError", "CheckpointManager"]
