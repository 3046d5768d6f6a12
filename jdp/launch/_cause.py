"""Private: which process of a failed job caused the failure, from what was seen.

A process's peers fail within milliseconds of it, closer together than the
launcher can tell apart: these pure functions name the likely cause first.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from signal import SIGBUS, SIGFPE, SIGILL, SIGKILL, SIGSEGV

from jdp import _jax_compat

#: Failures within this many seconds of the first are ordered by their kind; the
#: launcher also waits this long for processes whose output has closed.
ENDING_WAIT_S = 2.0

#: A failure this soon after a process finished (exit 0) is most likely caused by
#: it (a step it never joined fails on the others).
FINISHED_THEN_FAILED_S = 5.0

#: Signals that end a process by themselves (SIGKILL, a crash), never because a
#: peer left: such a peer fails with an error status, or aborts (SIGABRT).
CAUSE_SIGNALS = frozenset(-s for s in (SIGKILL, SIGSEGV, SIGBUS, SIGILL, SIGFPE))

#: The last output of a process that failed because a peer left.
PEER_LEFT = _jax_compat.PEER_LEFT_TEXT


def cause_first(
    failed: Sequence[tuple[float, int, int]], tails: Sequence[Sequence[str]] = ()
) -> list[tuple[int, int]]:
    """The failures `(ended at, process_id, returncode)`, the likely cause first.

    In the order they ended, except within `ENDING_WAIT_S` of the first
    failure: a process killed by one of `CAUSE_SIGNALS` goes first, and one
    whose last output (`tails[process_id]`) says a peer left goes last.
    """
    first = failed[0][0]

    def rank(f):
        t, r, c = f
        if t - first > ENDING_WAIT_S:
            return 3
        if c in CAUSE_SIGNALS:
            return 0
        left = r < len(tails) and any(PEER_LEFT.search(line) for line in tails[r])
        return 2 if left else 1

    order = sorted(failed, key=rank)  # stable: the order they ended within each
    return [(r, c) for _, r, c in order]


def finished_before(
    exits: Sequence[tuple[float, int, int]], failed_at: float
) -> list[tuple[int, float]]:
    """`(process_id, seconds before the failure)` of the processes that finished.

    Of `exits` (`(ended at, process_id, returncode)`), those with exit 0 from
    `FINISHED_THEN_FAILED_S` before the failure to `ENDING_WAIT_S` after it.
    """
    return [
        (r, failed_at - t)
        for t, r, c in exits
        if c == 0 and -ENDING_WAIT_S <= failed_at - t <= FINISHED_THEN_FAILED_S
    ]


def describe_exit(code: int) -> str:
    """`exited with status 3` or `was killed by SIGKILL` (returncode -9)."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"
