"""Private: a process's progress count, read by `python -m jdp.launch`.

`beat()` only counts, in memory, so it may run in every step of any program.
Under the launcher, the worker's reporter thread (`_worker.py`) publishes the
count, and the launcher names a process that stopped counting while the others
wait for it (`--stall-timeout`). This module imports nothing, so that any layer
of jdp may call it.
"""

from __future__ import annotations

_beats = 0


def beat() -> None:
    """Records one unit of progress of this process (e.g. a step that starts)."""
    global _beats
    _beats += 1


def count() -> int:
    """The number of `beat` calls so far in this process."""
    return _beats
