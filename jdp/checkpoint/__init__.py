"""Checkpoints for replicated training states, on orbax-checkpoint.

Public names (stable):

- `CheckpointManager`: `save(step, state)` writes one copy of a replicated state
  plus a JSON record; `restore(like)` gives every replica of `like`'s layout the
  saved copy, on any number of replicas.

Modules whose names start with `_` are private and may change.
"""

from jdp.checkpoint._manager import CheckpointManager

__all__ = ["CheckpointManager"]
