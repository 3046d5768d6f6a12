"""Private: the launcher's side of progress reports: finding a stuck process.

A process that is alive but stuck (an endless loop, a deadlock, a sleep, a read
that never returns) is invisible to JAX: its heartbeats go on, and the other
processes wait for it in their next collective, forever. Each process of a job
counts its progress (`jdp._progress.beat`, called as a step starts) and a
thread writes the count, with where the process is, to a file (`_worker.py`).
`StallMonitor` reads those files and says when the processes furthest behind have
made no progress for `timeout_s` seconds: they hold up the others.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

#: Default seconds without progress after which a job is stopped (CLI and `run`).
DEFAULT_STALL_TIMEOUT_S = 300.0
#: How often the launcher reads the progress files.
READ_S = 0.5


class StallError(TimeoutError):
    """The processes furthest behind made no progress for the stall timeout."""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class StallMonitor:
    """Follows the progress files of a job's processes and finds a stalled one.

    Nothing is judged until some process reports progress for the first time, so
    a program that never reports (one that does not use jdp's steps) is never
    stopped, and start-up (imports, `initialize`, the first compilation if it
    precedes the first report) does not count. From then on, every process has
    `timeout_s` seconds from its last report (or from that first report, if it
    has made none) to make its next one.

    Args:
      paths: The progress file of each process, in process order.
      timeout_s: Seconds without progress that stop the job.
      how_to_change: How to change the limit, ending the stall message (e.g.
        "raise the limit with `--stall-timeout SECONDS`").
    """

    def __init__(self, paths: Sequence[str], timeout_s: float, *, how_to_change: str):
        self.paths = list(paths)
        self.timeout_s = timeout_s
        self.how_to_change = how_to_change
        self.beats = [0] * len(self.paths)
        self.where: list[str | None] = [None] * len(self.paths)
        self.changed_at: list[float | None] = [None] * len(self.paths)
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
        now = time.monotonic() if now is None else now
        if now >= self._next_read:
            self.read(now)
            self._next_read = now + READ_S
        running = range(len(self.paths)) if running is None else running
        if not any(self.beats) or not running:
            return []
        low = min(self.beats[r] for r in running)
        behind = [r for r in running if self.beats[r] == low]
        if any(now - self.changed_at[r] <= self.timeout_s for r in behind):
            return []
        return behind

    def message(self, behind: Sequence[int], pids: Sequence[int]) -> str:
        """Which processes stalled, how far they got, where they were last seen."""
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
                f"progress {_plural(low, 'time')}): the processes wait for each "
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
                else f"reported progress {_plural(low, 'time')}"
            )
            msg = (
                f"{subject} made no progress for more than {limit} while the "
                f"others went on or waited for {'it' if one else 'them'}: "
                f"{'it' if one else 'each'} {done}, the others up to "
                f"{_plural(max(self.beats), 'time')}."
            )
        for r in behind:
            if self.where[r]:
                msg += f" Process {r} was last seen at {self.where[r]}."
        return (
            f"{msg} Stopped the job. If a process may take longer than that between "
            f"two steps (an evaluation, a checkpoint), {self.how_to_change}."
        )
