"""Checkpoints for replicated training states, on orbax-checkpoint.

`CheckpointManager` saves one copy of a replicated state and restores it into any
number of replicas, or as one copy; `restore` raises `CheckpointCorruptedError`
for a step whose files are damaged. Modules starting with `_` are private.
"""

from jdp.checkpoint._damage import CheckpointCorruptedError
from jdp.checkpoint._manager import CheckpointManager

__all__ = ["CheckpointCorruptedError", "CheckpointManager"]
