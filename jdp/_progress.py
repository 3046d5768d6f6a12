"""Private: a process's progress count, read by `python -m jdp.launch`.

`beat()` marks that this process moved on (a training step started). It only
counts, in memory: no I/O, no lock, nothing to set up, so it costs next to nothing
and may run in every step of every program, launched or not. Under the launcher,
the process's reporter thread (`_worker.py`) reads the count and writes it to a
file that the launcher watches; the launcher ends a job in which one process has
stopped counting while the others wait for it (`--stall-timeout`).

This module imports nothing, so that any layer of jdp may call it.
"""

from __future__ import annotations

_beats = 0


def beat() -> None:
    """Records one unit of progress of this process (e.g. a step that starts).

    Call it where the process starts work that its peers wait for (a training
    step), so that a process that stops calling it while the others go on is the
    one the launcher names as stuck.

    Example:
      >>> from jdp import _progress
      >>> before = _progress.count()
      >>> _progress.beat()
      >>> _progress.count() == before + 1
      True
    """
    global _beats
    _beats += 1


def count() -> int:
    """The number of `beat` calls so far in this process.

    Example:
      >>> from jdp import _progress
      >>> _progress.count() >= 0
      True
    """
    return _beats
