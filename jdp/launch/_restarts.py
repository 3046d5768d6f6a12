"""Private: when the launcher starts a failed job again, and with how many processes.

`Restarts` is the policy of `--max-restarts` and `--min-processes` (and of
`jdp.launch.run`'s `max_restarts`); it decides, and words, each restart. It
starts nothing itself: the front ends (`_command`, `_run`) run the attempts.
"""

from __future__ import annotations

from jdp import _validate


class Restarts:
    """When to start a failed job again, and with how many processes.

    Torchrun's `--max-restarts`, plus a simple elastic rule: when the same
    process index is the first to fail in two attempts in a row (a bad device
    or host slot, not a one-off fault), the next attempt runs with one process
    fewer, down to `min_processes`. Each restart counts towards `max_restarts`.

    Args:
      num_processes: The processes of the first attempt.
      max_restarts: How many times the job may be started again (0: never).
      min_processes: The fewest processes an attempt may run with; None means
        `num_processes` (no shrinking).

    Raises:
      TypeError: If an argument is not an integer.
      ValueError: If `max_restarts` is negative, if `min_processes` is not
        between 1 and `num_processes`, or if it is below `num_processes` with
        fewer than 2 restarts (it could never apply).
    """

    def __init__(
        self, num_processes: int, max_restarts: int, min_processes: int | None
    ):
        _validate.positive_int("num_processes", num_processes)
        _validate.non_negative_int("max_restarts", max_restarts, note="0: never")
        _validate.positive_int(
            "min_processes",
            min_processes,
            allow_none=True,
            note="or None for `num_processes`",
        )
        if min_processes is None:
            min_processes = num_processes
        if min_processes > num_processes:
            raise ValueError(
                f"`min_processes` ({min_processes}) must be at most "
                f"`num_processes` ({num_processes}): it is the fewest processes a "
                "restarted job may shrink to."
            )
        if min_processes < num_processes and max_restarts < 2:
            raise ValueError(
                f"`min_processes={min_processes}` needs `max_restarts` of 2 or more "
                f"(got {max_restarts}): a job shrinks only when the same process "
                "fails first in two attempts in a row, so with fewer restarts it "
                "never would. Raise `max_restarts`, or leave `min_processes` out."
            )
        self.max_restarts = max_restarts
        self.min_processes = min_processes
        self.num_processes = num_processes  # of the current attempt
        self.restarts = 0  # done so far
        self._last_first: int | None = None  # who failed first, last attempt
        #: `(restart, processes, who failed and how)` for each restart made.
        self.history: list[tuple[int, int, str]] = []

    def next_attempt(self, first_failed: int | None, how: str) -> str | None:
        """Records a failed attempt; returns the restart line, or None to stop.

        Args:
          first_failed: The process index that failed first (None for a
            stall: no process is to blame alone).
          how: What happened, a sentence that starts the line (e.g. `process 1
            of 2 (pid 7) was killed by SIGKILL.`).

        Returns:
          The line to print about the restart (it has been decided: the
          attempt's process count is updated), or None when no restart is
          left.
        """
        if self.restarts >= self.max_restarts:
            return None
        self.restarts += 1
        repeat = first_failed is not None and first_failed == self._last_first
        shrink = repeat and self.num_processes > self.min_processes
        line = f"{how} Restarting the job (restart {self.restarts}/"
        line += f"{self.max_restarts})"
        if shrink:
            self.num_processes -= 1
            self._last_first = None
            line += (
                f" with {_processes(self.num_processes)}, one "
                f"fewer: process {first_failed} failed first in two attempts in a "
                f"row (--min-processes {self.min_processes})"
            )
        else:
            self._last_first = first_failed
            line += f" with {_processes(self.num_processes)}"
        self.history.append((self.restarts, self.num_processes, how))
        return line + "."


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _after_restarts(policy: Restarts) -> str:
    """` (after 2 restarts)`, for a timeout that ends a restarted run; or ``."""
    n = policy.restarts
    return f" (after {n} restart{'s' if n > 1 else ''})" if n else ""
