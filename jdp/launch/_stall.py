"""Private: the launcher's side of progress reports: finding a stuck process.

Each process counts its progress (`jdp._progress.beat`, as a step starts) and a
thread of `_worker.py` writes the count, with where the process is, to a file,
which `StallMonitor` reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

from jdp._progress import (
    FINISHED_GRACE_S,
    UNEVEN_STEPS_HINT,
    Tracker,
    plural,
    process_list,
)

#: Default seconds without progress after which a job is stopped (CLI and `run`).
DEFAULT_STALL_TIMEOUT_S = 300.0
#: How often the launcher reads the progress files.
READ_S = 0.5


class StallError(TimeoutError):
    """The processes furthest behind made no progress for the stall timeout."""


class StallMonitor(Tracker):
    """A `Tracker` of the progress files of a job's processes (in process order).

    `how_to_change` ends the stall message (e.g. "raise the limit with ...");
    `stalled` and `finished_early` read the files first if `READ_S` passed, and
    take `now=None` for `time.monotonic()`.
    """

    def __init__(
        self,
        paths: Sequence[str],
        timeout_s: float,
        *,
        how_to_change: str,
        finished_grace_s: float = FINISHED_GRACE_S,
    ):
        super().__init__(len(paths), timeout_s, finished_grace_s)
        self.paths = list(paths)
        self.how_to_change = how_to_change
        self.where: list[str | None] = [None] * len(self.paths)
        self._next_read = 0.0

    def read(self, now: float) -> None:
        """Reads every progress file; a count that changed restarts its clock."""
        reports = {}
        for rank, path in enumerate(self.paths):
            try:
                with open(path) as f:
                    record = json.load(f)
                reports[rank] = (int(record["beats"]), bool(record.get("finished")))
            except (OSError, ValueError, TypeError, KeyError):
                continue  # not written yet (or being replaced): keep the last one
            self.where[rank] = record.get("where")
        self.update(reports, now)

    def _read_due(self, now: float | None) -> float:
        now = time.monotonic() if now is None else now
        if now >= self._next_read:
            self.read(now)
            self._next_read = now + READ_S
        return now

    def stalled(
        self, now: float | None = None, running: Sequence[int] | None = None
    ) -> list[int]:
        return super().stalled(self._read_due(now), running)

    def finished_early(
        self,
        now: float | None = None,
        running: Sequence[int] | None = None,
        exited: Mapping[int, float] | None = None,
    ) -> tuple[int, list[int]] | None:
        return super().finished_early(self._read_due(now), running, exited)

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
        how = "finished its program (it waits at shutdown for the others)"
        if first in (exited or {}):
            how = "finished (exit 0)"
        counts = [self.counts[r] for r in waiting]
        at = "at step calls " + ", ".join(map(str, counts))
        if len(set(counts)) == 1:
            at = f"at step call {counts[0]}"
        one = len(waiting) == 1
        return (
            f"{process_list([first], pids, len(self.paths))} {how} after "
            f"{plural(self.counts[first], 'step call')} while "
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
        n, low, one = len(self.paths), self.counts[behind[0]], len(behind) == 1
        limit = f"{self.timeout_s:g} s"
        if max(self.counts) == low:
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
            done = f"reported progress {plural(low, 'time')}"
            if low == 0:
                done = "has reported no progress since it started"
            msg = (
                f"{process_list(behind, pids, n)} made no progress for more than "
                f"{limit} while the others went on or waited for "
                f"{'it' if one else 'them'}: {'it' if one else 'each'} {done}, the "
                f"others up to {plural(max(self.counts), 'time')}."
            )
        msg += self._last_seen(behind)
        if early := sorted(r for r in exited or {} if self.counts[r] < low):
            counts = ", ".join(str(self.counts[r]) for r in early)
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
