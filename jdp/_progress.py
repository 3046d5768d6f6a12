"""Private: a process's progress count, and the judge of a job's counts.

`beat()` only counts, in memory, so it may run in every step of any program.
The launcher's workers (`launch/_worker.py`) or `initialize`'s stall check
(`distributed/_watchdog.py`) publish the count, and `Tracker` names a process
that stopped counting while the others wait for it. This module imports no
other jdp module, so that any layer of jdp may call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: Seconds without progress after which processes in a step that a finished
#: process never started are stopped (at most the stall limit): time for the
#: progress reports to arrive, and for steps that run on one process's devices.
FINISHED_GRACE_S = 15.0

#: What a process that finished early means, and what to do about it.
UNEVEN_STEPS_HINT = (
    "Every process must make the same number of step calls (calls of a "
    "`jdp.parallelize` step, and of `step.shard` across processes); a data set "
    "that ends at different steps on different processes (batches split "
    "unevenly between them, or a loader that yields fewer on some) is the usual "
    "cause: give every process the same number of batches (drop or pad the "
    "remainder; `step.shard(..., pad=True)` pads a short last batch)."
)

_beats = 0


def beat() -> None:
    """Records one unit of progress of this process (e.g. a step that starts)."""
    global _beats
    _beats += 1


def count() -> int:
    """The number of `beat` calls so far in this process."""
    return _beats


def plural(n: int, word: str) -> str:
    """`1 process`, `2 processes`, `3 step calls`."""
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def process_list(
    ranks: Sequence[int], pids: Sequence[int] | None = None, of: int | None = None
) -> str:
    """`process 1`, or `processes 0, 2 of 3 (pids 10, 12)` with `pids` and `of`."""
    one = len(ranks) == 1
    text = ("process " if one else "processes ") + ", ".join(map(str, ranks))
    if of is not None:
        text += f" of {of}"
    if pids is not None:
        text += f" ({'pid' if one else 'pids'} "
        text += ", ".join(str(pids[r]) for r in ranks) + ")"
    return text


class Tracker:
    """The progress counts of a job's processes: who stalled, who waits in vain.

    Nothing is judged before the first progress of any process (start-up does
    not count); from then on, every process has `timeout_s` seconds from its
    count's last change (or that first progress) to change it again. A process
    that finished (its count final) is never stalled: `finished_early` judges
    the others against it, after `finished_grace_s` (at most `timeout_s`).
    """

    def __init__(
        self,
        num_processes: int,
        timeout_s: float,
        finished_grace_s: float = FINISHED_GRACE_S,
    ):
        self.timeout_s = timeout_s
        self.finished_grace_s = min(finished_grace_s, timeout_s)
        self.counts = [0] * num_processes
        self.changed_at: list[float | None] = [None] * num_processes
        self.finished_at: list[float | None] = [None] * num_processes
        # Processes started again alone (`--live`): they joined the others part
        # way, so their counts are not the others' and `finished_early` leaves
        # them out.
        self.rejoined: set[int] = set()

    def update(self, reports: Mapping[int, tuple[int, bool]], now: float) -> None:
        """Takes `{process: (count, finished)}`; a changed count restarts its clock."""
        for rank, (count, finished) in reports.items():
            if not 0 <= rank < len(self.counts):
                continue
            if count != self.counts[rank]:
                self.counts[rank] = count
                self.changed_at[rank] = now
            if finished and self.finished_at[rank] is None:
                self.finished_at[rank] = now
        if any(self.counts) and None in self.changed_at:
            # The first progress of the job: every process's clock starts now.
            self.changed_at = [now if t is None else t for t in self.changed_at]

    def stalled(self, now: float, running: Sequence[int] | None = None) -> list[int]:
        """The running processes furthest behind, if none progressed for too long.

        `running`: the processes still running (all if None).
        """
        running = range(len(self.counts)) if running is None else running
        running = [r for r in running if self.finished_at[r] is None]
        if not any(self.counts) or not running:
            return []
        low = min(self.counts[r] for r in running)
        finished = [r for r, t in enumerate(self.finished_at) if t is not None]
        if any(self.counts[r] < low for r in finished):
            return []  # they are past a finished process: see `finished_early`
        behind = [r for r in running if self.counts[r] == low]
        if any(now - self.changed_at[r] <= self.timeout_s for r in behind):
            return []
        return behind

    def finished_early(
        self,
        now: float,
        running: Sequence[int] | None = None,
        exited: Mapping[int, float] | None = None,
    ) -> tuple[int, list[int]] | None:
        """`(finished process, processes that wait for it in vain)`, or None.

        That is: a process finished (with its exact count), some process still
        running is in a step it never started, and none of those still running
        progressed for `finished_grace_s` since it finished. `running` is as
        for `stalled`; `exited` maps the processes that exited with status 0
        to when they did.
        """
        done = {
            r: t
            for r, t in enumerate(self.finished_at)
            if t is not None and r not in self.rejoined
        }
        for r, t in (exited or {}).items():
            if r in done:
                done[r] = min(done[r], t)
        running = range(len(self.counts)) if running is None else running
        waiting = [r for r in running if r not in done and r not in self.rejoined]
        if not done or not waiting:
            return None
        first = min(done, key=lambda r: (self.counts[r], r))
        if not any(self.counts[r] > self.counts[first] for r in waiting):
            return None
        changes = [self.changed_at[r] for r in waiting]
        quiet_since = max([done[first]] + [t for t in changes if t is not None])
        if now - quiet_since <= self.finished_grace_s:
            return None
        return first, waiting
