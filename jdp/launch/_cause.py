"""Private: which process of a failed job caused the failure, from what was seen.

When one process dies, its peers fail within milliseconds (a collective whose
peer left fails with a connection error), closer together than the launcher's
threads can tell apart on a busy machine. These pure functions decide from the
launcher's observations (when each process ended, how, its last output lines)
which failure to name first, and which process most likely left the others in a
step without it. `tests/test_cause.py` checks them from tables.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from jdp import _jax_compat

#: Failures within this many seconds of the first one are ordered by their kind
#: (a process killed by one of `CAUSE_SIGNALS` first, one whose peer left last),
#: not by the moment the launcher saw them end. The launcher also waits this long
#: for processes whose output has closed (they are ending) before deciding.
ENDING_WAIT_S = 2.0

#: A failure this many seconds (or less) after a process finished (exit 0) while
#: the failing one still ran is reported as most likely caused by that finish (a
#: step that the finished process never joined fails at once on the others).
FINISHED_THEN_FAILED_S = 5.0

#: Signals that end a process by themselves (an operator's or the OOM killer's
#: SIGKILL, a crash), never because a peer left: a peer of a dead process fails
#: with an error status, or aborts (SIGABRT, JAX's coordination service).
CAUSE_SIGNALS = frozenset(
    -s
    for s in (
        signal.SIGKILL,
        signal.SIGSEGV,
        signal.SIGBUS,
        signal.SIGILL,
        signal.SIGFPE,
    )
)

#: The last output of a process that failed because a peer left (its
#: connections closed): never the cause when another process failed with it.
PEER_LEFT = _jax_compat.PEER_LEFT_TEXT


def cause_first(
    failed: Sequence[tuple[float, int, int]], tails: Sequence[Sequence[str]] = ()
) -> list[tuple[int, int]]:
    """The failures `(ended at, process_id, returncode)`, the likely cause first.

    In the order they ended, except within `ENDING_WAIT_S` of the first
    failure: a process killed by one of `CAUSE_SIGNALS` goes first, and one
    whose last output (`tails[process_id]`) says a peer left (`PEER_LEFT`) goes
    last. A restart policy must count the failure against the right slot.

    Example:
      >>> from jdp.launch._cause import cause_first
      >>> cause_first([(0.0, 0, 1), (0.01, 1, -9)])  # SIGKILL: the cause
      [(1, -9), (0, 1)]
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
    """Processes that finished (exit 0) just before a failure at `failed_at`.

    `(process_id, seconds before the failure)` for each process of `exits`
    (`(ended at, process_id, returncode)`) that finished up to
    `FINISHED_THEN_FAILED_S` before it, or that the launcher saw end up to
    `ENDING_WAIT_S` after it: its peers fail within milliseconds of its leaving,
    closer than the launcher's threads can order, and a program does not
    complete because a peer failed.

    Example:
      >>> from jdp.launch._cause import finished_before
      >>> finished_before([(9.0, 0, 0), (10.0, 1, 1), (1.0, 2, 0)], failed_at=10.0)
      [(0, 1.0)]
    """
    return [
        (r, failed_at - t)
        for t, r, c in exits
        if c == 0 and -ENDING_WAIT_S <= failed_at - t <= FINISHED_THEN_FAILED_S
    ]


def describe_exit(code: int) -> str:
    """How a process ended, from its returncode (minus the signal that killed it).

    Example:
      >>> from jdp.launch._cause import describe_exit
      >>> describe_exit(-9), describe_exit(3)
      ('was killed by SIGKILL', 'exited with status 3')
    """
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"
