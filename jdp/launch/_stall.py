"""Private: the launcher's side of progress reports: finding a stuck process.

Each process counts its progress (`jdp._progress.beat`, as a step starts) and a
thread of `_worker.py` writes the count, with where the process is, to a file,
which `StallMonitor` reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

#: Default seconds without progress after which a job is stopped (CLI and `run`).
DEFAULT_STALL_TIMEOUT_S = 300.0
#: How often the launcher reads the progress files.
READ_S = 0.5
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


class StallError(TimeoutError):
    """The processes furthest behind made no progress for the stall timeout."""


def plural(n: int, word: str) -> str:
    """`1 process`, `2 processes`, `3 step calls`."""
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def process_list(
    ranks: Sequence[int], pids: Sequence[int] | None = None, of: int | None = None
) -> str:
    """`process 1 (pid 11)` or `processes 0, 2 of 3 (pids 10, 12)`."""
    one = len(ranks) == 1
    text = ("process " if one else "processes ") + ", ".join(map(str, ranks))
    if of is not None:
        text += f" of {of}"
    if pids is not None:
        text += f" ({'pid' if one else 'pids'} "
        text += ", ".join(str(pids[r]) for r in ranks) + ")"
    return text


class StallMonitor:
    """Follows the progress files of a job's processes and finds a stalled one.

    Nothing is judged before the first report of any process (a program that
    never reports is never stopped; start-up does not count); from then on,
    every process has `timeout_s` seconds from its last report (or that first
    one) to make its next. A process whose record says `"finished": true` is
    never stalled: `finished_early` judges the others against it.

    Args:
      paths: The progress file of each process, in process order.
      timeout_s: Seconds without progress that stop the job.
      how_to_change: Ends the stall message (e.g. "raise the limit with ...").
      finished_grace_s: The limit of `finished_early` (at most `timeout_s`).
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

    def _read_due(self, now: float | None) -> float:
        """Reads the files if `READ_S` passed since the last read; returns now."""
        now = time.monotonic() if now is None else now
        if now >= self._next_read:
            self.read(now)
            self._next_read = now + READ_S
        return now

    def stalled(
        self, now: float | None = None, running: Sequence[int] | None = None
    ) -> list[int]:
        """The running processes furthest behind, if none progressed for too long.

        `now`: `time.monotonic()` if None; `running`: the processes still
        running (all if None).
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

    def finished_early(
        self,
        now: float | None = None,
        running: Sequence[int] | None = None,
        exited: Mapping[int, float] | None = None,
    ) -> tuple[int, list[int]] | None:
        """`(finished process, processes that wait for it in vain)`, or None.

        That is: a process reported that it finished (with its exact count),
        some process still running is in a step it never started, and none of
        those still running progressed for `finished_grace_s` since it finished.
        `now` and `running` are as for `stalled`; `exited` maps the processes
        that exited with status 0 to when they did.
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
        return first, waiting

    def _last_seen(self, ranks: Sequence[int]) -> str:
        return "".join(
            f" Process {r} was last seen at {self.where[r]}."
            for r in ranks
            if self.where[r]
        )

    def finished_message(
        self,
        found: tuple[int, list[int]],
        pids: Sequence[int],
        exited: Mapping[int, float] | None = None,
    ) -> str:
        """The message for `finished_early`'s finding: who finished, who waits."""
        first, waiting = found
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
        return (
            f"{process_list([first], pids, len(self.paths))} {how} after "
            f"{plural(self.beats[first], 'step call')} while "
            f"{process_list(waiting, pids)} {'is' if one else 'are'} still running "
            f"({at}) and {'has' if one else 'have'} stopped making progress "
            f"(none for {self.finished_grace_s:g} s): "
            f"{'it waits' if one else 'they wait'} in a step that process {first} "
            f"will never join. {UNEVEN_STEPS_HINT}{self._last_seen(waiting)} "
            "Stopped the job."
        )

    def message(
        self,
        behind: Sequence[int],
        pids: Sequence[int],
        exited: Mapping[int, float] | None = None,
    ) -> str:
        """Which processes stalled, how far they got, where they were last seen.

        A process of `exited` (as for `finished_early`) with fewer step calls
        than the stalled ones is named as a likely cause.
        """
        n, low, one = len(self.paths), self.beats[behind[0]], len(behind) == 1
        limit = f"{self.timeout_s:g} s"
        if max(self.beats) == low:
            if one:
                who = (
                    f"process {behind[0]} (pid {pids[behind[0]]}), the only one of "
                    f"{n} still running, made no progress"
                )
            else:
                of = "" if len(behind) == n else f" still running (of {n})"
                who = f"none of the {len(behind)} processes{of} made progress"
            msg = (
                f"{who} for more than {limit} (each reported progress "
                f"{plural(low, 'time')}): the processes wait for each other (a "
                "deadlock), or a step takes longer than that."
            )
        else:
            done = (
                "has reported no progress since it started"
                if low == 0
                else f"reported progress {plural(low, 'time')}"
            )
            msg = (
                f"{process_list(behind, pids, n)} made no progress for more than "
                f"{limit} while the others went on or waited for "
                f"{'it' if one else 'them'}: {'it' if one else 'each'} {done}, the "
                f"others up to {plural(max(self.beats), 'time')}."
            )
        msg += self._last_seen(behind)
        early = sorted(r for r in exited or {} if self.beats[r] < low)
        if early:
            counts = ", ".join(str(self.beats[r]) for r in early)
            msg += (
                f" {process_list(early).capitalize()} finished (exit 0) earlier, "
                f"after at least {counts} step calls: the others may wait in a "
                f"step that {'it' if len(early) == 1 else 'they'} never joined. "
                f"{UNEVEN_STEPS_HINT}"
            )
        return (
            f"{msg} Stopped the job. If a process may take longer than that between "
            f"two steps (an evaluation, a checkpoint), {self.how_to_change}."
        )
