"""Private: when the launcher starts a failed job again, and with how many processes.

`Restarts` is the policy; `run_attempts` runs the attempts of either front end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from jdp import _validate
from jdp.launch._cause import describe_exit
from jdp.launch._launcher import Job
from jdp.launch._stall import StallError, plural


class Restarts:
    """When to start a failed job again, and with how many processes.

    Torchrun's `--max-restarts`, plus an elastic rule: when the same process
    index fails first in two attempts in a row (a bad device or host slot), the
    next attempt runs with one process fewer, down to `min_processes`.

    Args:
      num_processes: The processes of the first attempt.
      max_restarts: How many times the job may be started again (0: never).
      min_processes: The fewest processes an attempt may run with; None means
        `num_processes` (no shrinking).
      live: A failed process other than 0 is started again alone while the
        others train on (`jdp.distributed.live`), counted as a restart.
    """

    def __init__(
        self,
        num_processes: int,
        max_restarts: int,
        min_processes: int | None,
        *,
        live: bool = False,
    ):
        _validate.positive_int("num_processes", num_processes)
        _validate.non_negative_int("max_restarts", max_restarts, note="0: never")
        _validate.positive_int(
            "min_processes", min_processes, allow_none=True,
            note="or None for `num_processes`",
        )  # fmt: skip
        min_processes = num_processes if min_processes is None else min_processes
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
        self.live = live
        self.num_processes = num_processes  # of the current attempt
        self.restarts = 0  # done so far
        self._last_first: int | None = None  # who failed first, last attempt

    def restart_one(self, rank: int, code: int) -> str | None:
        """With `live`: the line for starting failed process `rank` again alone.

        None for process 0 (it hosts JAX's coordination service: the whole job
        restarts) or when no restart is left.
        """
        if not self.live or rank == 0 or self.restarts >= self.max_restarts:
            return None
        self.restarts += 1
        return (
            f"process {rank} {describe_exit(code)}; started it again alone (restart "
            f"{self.restarts}/{self.max_restarts}): the other processes train on, "
            "and it rejoins them at a step boundary (`jdp.distributed.live`)."
        )

    def next_attempt(self, first_failed: int | None, how: str) -> str | None:
        """Records a failed attempt; returns the restart line, or None to stop.

        `first_failed`: who failed first (None for a stall); `how`: a sentence
        that starts the line.
        """
        if self.restarts >= self.max_restarts:
            return None
        self.restarts += 1
        if self.live and first_failed == 0:
            how += (
                " Process 0 hosts JAX's coordination service, so live recovery "
                "cannot go on without it."
            )
        line = f"{how} Restarting the job (restart {self.restarts}/{self.max_restarts})"
        repeat = first_failed is not None and first_failed == self._last_first
        if repeat and self.num_processes > self.min_processes:
            self.num_processes -= 1
            self._last_first = None
            return line + (
                f" with {plural(self.num_processes, 'process')}, one fewer: process "
                f"{first_failed} failed first in two attempts in a row "
                f"(--min-processes {self.min_processes})."
            )
        self._last_first = first_failed
        return line + f" with {plural(self.num_processes, 'process')}."


def run_attempts(
    make_job: Callable[[int, str], Job],
    policy: Restarts,
    directory: str,
    timeout_s: float | None,
    say: Callable[[str], None],
    interrupted: Callable[[], bool] = lambda: False,
) -> tuple[Job, TimeoutError | None]:
    """Runs attempts until one needs no restart; returns it, and its timeout.

    `make_job(processes, folder)` builds each attempt, `say` prints the restart
    lines, `timeout_s` bounds all attempts together. Returns the last attempt
    and the `TimeoutError` (or `StallError`) that ended it, or None; once
    `interrupted()`, the attempt as it is.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        folder = os.path.join(directory, f"attempt-{policy.restarts}")
        os.makedirs(folder)
        job = make_job(policy.num_processes, folder)
        if interrupted():
            return job, None
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        job.start()
        try:
            ok = job.wait(left, limit_s=timeout_s)
        except StallError as e:
            if interrupted():
                return job, None
            line = policy.next_attempt(None, "The job stalled (see above).")
            if line is None:
                return job, e
            say(str(e))
            say(line)
            continue
        except TimeoutError as e:
            n = policy.restarts
            after = f" (after {plural(n, 'restart')})" if n else ""
            return job, TimeoutError(f"{e}{after}")
        if ok or interrupted():
            return job, None
        line = policy.next_attempt(job.failure[0], job.failure_message(with_tail=False))
        if line is None:
            return job, None
        say(line)
