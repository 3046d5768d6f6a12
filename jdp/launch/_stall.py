"""Private: the launcher's side of progress reports: finding a stuck process.

A process that is alive but stuck (an endless loop, a deadlock, a sleep, a read
that never returns) is invisible to JAX: its heartbeats go on, and the other
processes wait for it in their next collective, forever. Each process of a job
counts its progress (`jdp._progress.beat`, called as a step starts) and a
thread writes the count, with where the process is, to a file (`_worker.py`).
`StallMonitor` reads those files and says when the processes furthest behind have
made no progress for `timeout_s` seconds: they hold up the others.

A process that has finished (its target returned: its last record says so, with
its exact count) makes no more steps. If the others are in a step it never
started (their count is above its final count) and make no progress, they wait
for it in vain: every process must make the same number of step calls, and a
data set that ends at different steps on different processes is the usual
reason one does not. `StallMonitor.finished_early` finds this after a short
grace period (`FINISHED_GRACE_S`) instead of the stall limit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

#: Default seconds without progress after which a job is stopped (CLI and `run`).
DEFAULT_STALL_TIMEOUT_S = 300.0
#: How often the launcher reads the progress files.
READ_S = 0.5
#: Seconds without progress after which processes in a step that a finished
#: process never started are stopped (at most the stall limit). A step that
#: spans the processes cannot end without it; this only leaves time for the
#: progress reports to arrive, and for steps that run on one process's devices.
FINISHED_GRACE_S = 15.0


class StallError(TimeoutError):
    """The processes furthest behind made no progress for the stall timeout."""


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def process_list(ranks: Sequence[int], pids: Sequence[int] | None = None) -> str:
    """`process 1 (pid 11)` or `processes 0, 2 (pids 10, 12)`."""
    one = len(ranks) == 1
    text = ("process " if one else "processes ") + ", ".join(map(str, ranks))
    if pids is not None:
        text += f" ({'pid' if one else 'pids'} "
        text += ", ".join(str(pids[r]) for r in ranks) + ")"
    return text


#: What a process that finished early means, and what to do about it.
UNEVEN_STEPS_HINT = (
    "Every process must make the same number of step calls (calls of a "
    "`jdp.parallelize` step, and of `step.shard` across processes); a data set "
    "that ends at different steps on different processes (batches split "
    "unevenly between them, or a loader that yields fewer on some) is the usual "
    "cause: give every process the same number of batches (drop or pad the "
    "remainder; `step.shard(..., pad=True)` pads a short last batch)."
)


class EarlyFinish(NamedTuple):
    """A finished process that others wait for in vain (`finished_early`)."""

    #: The finished process with the fewest step calls.
    process: int
    #: The processes still running (and not finished), which stopped progressing.
    waiting: list[int]


class StallMonitor:
    """Follows the progress files of a job's processes and finds a stalled one.

    Nothing is judged until some process reports progress for the first time, so
    a program that never reports (one that does not use jdp's steps) is never
    stopped, and start-up (imports, `initialize`, the first compilation if it
    precedes the first report) does not count. From then on, every process has
    `timeout_s` seconds from its last report (or from that first report, if it
    has made none) to make its next one.

    A process whose target has finished (its record says `"finished": true`) is
    not judged as stalled: it makes no more steps, and waits at shutdown for the
    others (or has exited). `finished_early` judges the others against it.

    Args:
      paths: The progress file of each process, in process order.
      timeout_s: Seconds without progress that stop the job.
      how_to_change: How to change the limit, ending the stall message (e.g.
        "raise the limit with `--stall-timeout SECONDS`").
      finished_grace_s: Seconds without progress of processes in a step that a
        finished process never started, after which `finished_early` reports
        them (at most `timeout_s`).
    """

    def __init__(
        self,
        paths: Sequence[str],
        timeout_s: float,
        *,
        how_to_change: str,
        finished_grace_s: float = FINISHED_GRACE_S,
    ):
        self.paths = list(paths)
        self.timeout_s = timeout_s
        self.how_to_change = how_to_change
        self.finished_grace_s = min(finished_grace_s, timeout_s)
        self.beats = [0] * len(self.paths)
        self.where: list[str | None] = [None] * len(self.paths)
        self.changed_at: list[float | None] = [None] * len(self.paths)
        # When a process was first seen finished (its count is then final).
        self.finished_at: list[float | None] = [None] * len(self.paths)
        self._next_read = 0.0

    def read(self, now: float) -> None:
        """Reads every progress file; a count that changed restarts its clock."""
        for rank, path in enumerate(self.paths):
            try:
                with open(path) as f:
                    record = json.load(f)
                beats = int(record["beats"])
            except (OSError, ValueError, TypeError, KeyError):
                continue  # not written yet (or being replaced): keep the last one
            self.where[rank] = record.get("where")
            if beats != self.beats[rank]:
                self.beats[rank] = beats
                self.changed_at[rank] = now
            if record.get("finished") and self.finished_at[rank] is None:
                self.finished_at[rank] = now
        if any(self.beats) and None in self.changed_at:
            # The first report of the job: every process's clock starts now.
            self.changed_at = [now if t is None else t for t in self.changed_at]

    def stalled(
        self, now: float | None = None, running: Sequence[int] | None = None
    ) -> list[int]:
        """The running processes furthest behind, if none progressed for too long.

        Args:
          now: The time (`time.monotonic()`); now if None.
          running: The processes still running (a finished one is not stuck);
            all if None.
        """
        now = self._read_due(now)
        running = range(len(self.paths)) if running is None else running
        running = [r for r in running if self.finished_at[r] is None]
        if not any(self.beats) or not running:
            return []
        low = min(self.beats[r] for r in running)
        finished = [r for r, t in enumerate(self.finished_at) if t is not None]
        if any(self.beats[r] < low for r in finished):
            return []  # they are past a finished process: see `finished_early`
        behind = [r for r in running if self.beats[r] == low]
        if any(now - self.changed_at[r] <= self.timeout_s for r in behind):
            return []
        return behind

    def _read_due(self, now: float | None) -> float:
        """Reads the files if `READ_S` passed since the last read; returns now."""
        now = time.monotonic() if now is None else now
        if now >= self._next_read:
            self.read(now)
            self._next_read = now + READ_S
        return now

    def finished_early(
        self,
        now: float | None = None,
        running: Sequence[int] | None = None,
        exited: Mapping[int, float] | None = None,
    ) -> EarlyFinish | None:
        """A finished process that the others wait for in vain, if any.

        That is: a process reported that it finished (its last record, with its
        exact count), some process still running is in a step it never started
        (a count above its final count), and none of the processes still
        running progressed for `finished_grace_s` seconds since it finished.
        A process that finishes while the others finish too is not one: they
        make no step beyond its count.

        Args:
          now: The time (`time.monotonic()`); now if None.
          running: The processes still running (not exited); all if None.
          exited: When the processes that exited with status 0 did so, by
            process (`time.monotonic()`); such a process counts as finished
            only if its last record says so (its count is then exact).
        """
        now = self._read_due(now)
        done = {r: t for r, t in enumerate(self.finished_at) if t is not None}
        for r, t in (exited or {}).items():
            if r in done:
                done[r] = min(done[r], t)
        running = range(len(self.paths)) if running is None else running
        waiting = [r for r in running if r not in done]
        if not done or not waiting:
            return None
        first = min(done, key=lambda r: (self.beats[r], r))
        if not any(self.beats[r] > self.beats[first] for r in waiting):
            return None
        changes = [self.changed_at[r] for r in waiting]
        quiet_since = max([done[first]] + [t for t in changes if t is not None])
        if now - quiet_since <= self.finished_grace_s:
            return None
        return EarlyFinish(first, waiting)

    def finished_message(
        self,
        found: EarlyFinish,
        pids: Sequence[int],
        exited: Mapping[int, float] | None = None,
    ) -> str:
        """The message for `finished_early`'s finding: who finished, who waits."""
        first, waiting = found
        n = len(self.paths)
        how = (
            "finished (exit 0)"
            if first in (exited or {})
            else "finished its program (it waits at shutdown for the others)"
        )
        counts = [self.beats[r] for r in waiting]
        at = (
            f"at step call {counts[0]}"
            if len(set(counts)) == 1
            else "at step calls " + ", ".join(map(str, counts))
        )
        one = len(waiting) == 1
        grace = f"{self.finished_grace_s:g} s"
        msg = (
            f"process {first} of {n} (pid {pids[first]}) {how} after "
            f"{plural(self.beats[first], 'step call')} while "
            f"{process_list(waiting, pids)} {'is' if one else 'are'} still running "
            f"({at}) and {'has' if one else 'have'} stopped making progress "
            f"(none for {grace}): {'it waits' if one else 'they wait'} in a step "
            f"that process {first} will never join. {UNEVEN_STEPS_HINT}"
        )
        for r in waiting:
            if self.where[r]:
                msg += f" Process {r} was last seen at {self.where[r]}."
        return msg + " Stopped the job."

    def message(
        self,
        behind: Sequence[int],
        pids: Sequence[int],
        exited: Mapping[int, float] | None = None,
    ) -> str:
        """Which processes stalled, how far they got, where they were last seen.

        `exited`: the processes that exited with status 0 (as for
        `finished_early`); one with fewer step calls than the stalled ones is
        named as a likely cause.
        """
        n, low = len(self.paths), self.beats[behind[0]]
        limit = f"{self.timeout_s:g} s"
        if max(self.beats) == low:
            if len(behind) == 1:
                who = (
                    f"process {behind[0]} (pid {pids[behind[0]]}), the only one of "
                    f"{n} still running, made no progress"
                )
            else:
                of = "" if len(behind) == n else f" still running (of {n})"
                who = f"none of the {len(behind)} processes{of} made progress"
            msg = (
                f"{who} for more than {limit} (each reported "
                f"progress {plural(low, 'time')}): the processes wait for each "
                "other (a deadlock), or a step takes longer than that."
            )
        else:
            one = len(behind) == 1
            ranks = ", ".join(map(str, behind))
            pid_list = ", ".join(str(pids[r]) for r in behind)
            subject = (
                f"process {ranks} of {n} (pid {pid_list})"
                if one
                else f"processes {ranks} of {n} (pids {pid_list})"
            )
            done = (
                "has reported no progress since it started"
                if low == 0
                else f"reported progress {plural(low, 'time')}"
            )
            msg = (
                f"{subject} made no progress for more than {limit} while the "
                f"others went on or waited for {'it' if one else 'them'}: "
                f"{'it' if one else 'each'} {done}, the others up to "
                f"{plural(max(self.beats), 'time')}."
            )
        for r in behind:
            if self.where[r]:
                msg += f" Process {r} was last seen at {self.where[r]}."
        early = sorted(r for r in exited or {} if self.beats[r] < low)
        if early:
            one = len(early) == 1
            counts = ", ".join(str(self.beats[r]) for r in early)
            msg += (
                f" {process_list(early).capitalize()} finished (exit 0) earlier, "
                f"after at least {counts} step calls: the others may wait in a "
                f"step that {'it' if one else 'they'} never joined. "
                f"{UNEVEN_STEPS_HINT}"
            )
        return (
            f"{msg} Stopped the job. If a process may take longer than that between "
            f"two steps (an evaluation, a checkpoint), {self.how_to_change}."
        )
