"""Private: start N processes of one job on this machine, watch them, stop them.

A `Job` is one attempt. JAX notices a dead peer only at its heartbeat timeout,
so the launcher kills the others itself; a stuck process is found from the
progress reports (`_stall`), and the cause of a failure named by `_cause`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from jdp.launch import _stall
from jdp.launch._cause import ENDING_WAIT_S, cause_first, describe_exit, finished_before
from jdp.launch._stall import UNEVEN_STEPS_HINT, StallError, plural, process_list

#: Seconds between SIGTERM and SIGKILL when stopping processes after a failure.
KILL_GRACE_S = 3.0
#: Seconds processes get to exit after a forwarded Ctrl-C / SIGTERM (time to save a
#: checkpoint) before SIGKILL; a second signal kills at once.
FORWARD_GRACE_S = 30.0
#: How often the launcher checks its processes.
POLL_S = 0.05
#: Output lines of each process kept for error messages.
TAIL_LINES = 40
#: Once a process failed, the longest wait for the returncode of a process known
#: to have exited, which its (late) reaping thread has yet to record.
PENDING_WAIT_S = 10.0
#: Once a process failed, the shortest wait before deciding: a process that died
#: at the same moment may not have been seen to end yet.
SETTLE_S = 0.5


def _exit_status(pid: int) -> tuple[bool, int | None]:
    """Whether child `pid` has exited, and its returncode (None once reaped)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already: its reaping thread records it
        return True, None
    if info is None:
        return False, None
    return True, info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _start_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


class Job:
    """N child processes, their prefixed output, and the rule "one fails, all stop".

    Args:
      commands: One command line per process.
      envs: One environment per process.
      echo: Print the processes' output, each line prefixed with `[process_id] `
        (else only keep its tail for errors).
      stall: Follows the processes' progress reports; `wait` stops the job with a
        `StallError` when it finds stalled processes. None: no such check.
      restart_one: `restart_one(process_id, returncode)`: whether to start a
        failed process again alone while the others run on (live recovery; it
        announces it). Only while process 0 runs. None: one fails, all stop.
    """

    def __init__(self, commands: Sequence[Sequence[str]],
                 envs: Sequence[Mapping[str, str]], *, echo: bool = True,
                 stall: _stall.StallMonitor | None = None,
                 restart_one: Callable[[int, int], bool] | None = None):  # fmt: skip
        self.commands = [list(c) for c in commands]
        self.envs = [dict(e) for e in envs]
        self.echo, self.stall, self.restart_one = echo, stall, restart_one
        self.procs: list[subprocess.Popen] = []
        self.tails = [collections.deque(maxlen=TAIL_LINES) for _ in self.commands]
        self._pumps: dict[int, list[threading.Thread]] = {}
        self._write_lock = threading.Lock()
        self.failure: tuple[int, int] | None = None  # (process_id, returncode)
        self.also_failed: list[tuple[int, int]] = []  # failed before being stopped
        self.stopped = 0  # processes still running when a failure stopped the job
        self.exits: list[tuple[float, int, int]] = []  # (monotonic, id, returncode)
        self._closed: list[list[float]] = [[] for _ in self.commands]
        self._exits_lock = threading.Lock()
        self._failed_at: float | None = None  # when a failure was first seen
        self._seen_exits = 0  # exits the stall check has taken into account
        # `(process_id, seconds before the failure)`, from `finished_before`.
        self.finished_first: tuple[int, float] | None = None
        self._stop_requested_at: float | None = None

    @property
    def pids(self) -> list[int]:
        """PIDs of the processes started so far."""
        return [p.pid for p in self.procs]

    def start(self) -> None:
        """Starts every process, each in its own session (to stop it whole)."""
        try:
            for rank in range(len(self.commands)):
                self._spawn(rank)
        except BaseException:
            self.kill()
            raise

    def _spawn(self, rank: int) -> None:
        proc = subprocess.Popen(
            self.commands[rank], env=self.envs[rank], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        if rank < len(self.procs):
            self.procs[rank] = proc
        else:
            self.procs.append(proc)
        _start_thread(self._reap, rank, proc)
        self._pumps[rank] = [
            _start_thread(self._pump, rank, getattr(proc, name), name)
            for name in ("stdout", "stderr")
        ]

    def _restarted(self, rank: int, code: int) -> bool:
        """Whether failed process `rank` was started again alone (`restart_one`)."""
        if self.procs[0].poll() is not None or not self.restart_one(rank, code):
            return False
        for t in self._pumps[rank]:  # the dead process's output, to its end
            t.join(timeout=2)
        with self._exits_lock:
            self.exits = [e for e in self.exits if e[1] != rank]
            self._closed[rank] = []
        if self.stall is not None:  # it joins part way: its count starts again
            self.stall.rejoined.add(rank)
        self._spawn(rank)
        return True

    def _reap(self, rank: int, proc: subprocess.Popen) -> None:
        self._record_exit(rank, proc.wait(), time.monotonic())

    def _record_exit(self, rank: int, code: int, now: float) -> None:
        """Records the exit of process `rank` once (the earliest observation)."""
        with self._exits_lock:
            if all(r != rank for _, r, _ in self.exits):
                self.exits.append((now, rank, code))

    def _notice_exits(self) -> set[int]:
        """Records exits not recorded yet; the processes reaped but not recorded."""
        with self._exits_lock:
            seen = {r for _, r, _ in self.exits}
        now = time.monotonic()
        pending = set()
        for rank, proc in enumerate(self.procs):
            if rank not in seen:
                exited, code = _exit_status(proc.pid)
                if code is not None:
                    self._record_exit(rank, code, now)
                elif exited:
                    pending.add(rank)
        return pending

    def _pump(self, rank: int, pipe, name: str) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tails[rank].append(line)
            if not self.echo:
                continue
            stream = getattr(sys, name)
            with self._write_lock, contextlib.suppress(ValueError, OSError):
                stream.write(f"[{rank}] {line}\n")  # the stream may be closed
                stream.flush()
        with self._exits_lock:
            self._closed[rank].append(time.monotonic())
        pipe.close()

    def send(self, sig: int, *, live_only: bool = True) -> None:
        """Sends `sig` to every live process (and to what it started, its session)."""
        for proc in self.procs:
            if not live_only or proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    def request_stop(self, sig: int) -> None:
        """Forwards `sig`; `wait` kills what still runs `FORWARD_GRACE_S` later."""
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
        self.send(sig)

    def kill(self, grace_s: float = KILL_GRACE_S) -> None:
        """SIGTERM to every live process, then SIGKILL after `grace_s` seconds."""
        self.send(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_S)
        self.send(signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable
                proc.wait(timeout=5)
        self.send(signal.SIGKILL, live_only=False)  # leftovers of the sessions
        self._join_pumps()

    def _join_pumps(self) -> None:
        for pumps in self._pumps.values():
            for t in pumps:
                t.join(timeout=2)

    def wait(
        self, timeout_s: float | None = None, *, limit_s: float | None = None
    ) -> bool:
        """Waits until all processes succeed (True) or one fails (False).

        On a failure the others are stopped and `self.failure` set. Raises
        `TimeoutError` after `timeout_s` (naming `limit_s`, the whole run's
        limit, if given), or `StallError`; either stops every process first.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while (outcome := self._outcome()) is None:
                self._check_stall()
                if deadline is not None and time.monotonic() > deadline:
                    running = [
                        f"{r} (pid {p.pid})"
                        for r, p in enumerate(self.procs)
                        if p.poll() is None
                    ]
                    self.kill()
                    limit = timeout_s if limit_s is None else limit_s
                    raise TimeoutError(
                        f"the job did not finish within {limit:g} s; stopped it "
                        f"(processes still running: {', '.join(running)})."
                    )
                time.sleep(POLL_S)
            return outcome
        except BaseException:
            self.kill()
            raise

    def _ends(self) -> tuple[list[tuple[float, int, int]], list[int]]:
        """The exits `(ended at, process_id, returncode)` in order, and those ending.

        A process ended when its output pipes closed (with its connections), or
        when it was reaped if sooner; ending: output closed, not reaped yet.
        """
        with self._exits_lock:
            exits = list(self.exits)
            closed = [list(c) for c in self._closed]
        reaped = {r for _, r, _ in exits}
        ends = sorted(
            (min(t, *closed[r]) if len(closed[r]) == 2 else t, r, code)
            for t, r, code in exits
        )
        ending = [r for r in range(len(closed)) if len(closed[r]) == 2]
        return ends, [r for r in ending if r not in reaped]

    def _outcome(self) -> bool | None:
        """True if every process succeeded, False if the job failed, else None."""
        pending = self._notice_exits()
        exits, ending = self._ends()
        failed = [(t, r, c) for t, r, c in exits if c != 0]
        if failed and self.restart_one is not None:
            if [r for _, r, c in failed if self._restarted(r, c)]:
                return None
        if failed:
            # Wait for the processes that are ending, then name the cause.
            if self._failed_at is None:
                self._failed_at = time.monotonic()
            waited = time.monotonic() - self._failed_at
            settling = waited < SETTLE_S or (ending and waited < ENDING_WAIT_S)
            if settling or (pending and waited < PENDING_WAIT_S):
                return None
            (self.failure, *self.also_failed) = cause_first(failed, self.tails)
            self.stopped = len(self.procs) - len(exits)
            if finished := finished_before(exits, failed[0][0]):
                self.finished_first = finished[0]
                if self.stall is not None:
                    self.stall.read(time.monotonic())  # the counts at the end
            self.kill()
            return False
        if len(exits) == len(self.procs):
            self._join_pumps()
            return True
        asked = self._stop_requested_at
        if asked is not None and time.monotonic() - asked > FORWARD_GRACE_S:
            self.kill(grace_s=0)
            return False
        return None

    def _check_stall(self) -> None:
        """Stops the job and raises `StallError` if `stall` finds stalled processes."""
        stopping = self._stop_requested_at is not None or self._failed_at is not None
        if self.stall is None or stopping:  # a failing job: `_outcome` decides
            return
        with self._exits_lock:
            exited = {r: (t, code) for t, r, code in self.exits}
        if len(exited) != self._seen_exits:  # their last records are written
            self._seen_exits = len(exited)
            self.stall.read(time.monotonic())
        running = [r for r in range(len(self.procs)) if r not in exited]
        finished = {r: t for r, (t, code) in exited.items() if code == 0}
        if early := self.stall.finished_early(running=running, exited=finished):
            message = self.stall.finished_message(early, self.pids, finished)
        elif behind := self.stall.stalled(running=running):
            message = self.stall.message(behind, self.pids, finished)
        else:
            return
        self.kill()
        raise StallError(message)

    def last_output(self, ranks: Sequence[int] | None = None) -> str:
        """The last output lines of `ranks` (all processes if None), for errors."""
        return "".join(
            f"\n  Last output of process {r}:\n    " + "\n    ".join(self.tails[r])
            for r in (range(len(self.tails)) if ranks is None else ranks)
            if self.tails[r]
        )

    def failure_message(self, *, with_tail: bool = True) -> str:
        """Which process failed, how, and (optionally) its last output lines."""
        if self.failure is None:
            return ""
        rank, code = self.failure
        others = "process" if self.stopped == 1 else f"{self.stopped} processes"
        if (msg := self._finished_first_message()) is not None:
            msg += f" Stopped the other {others}." if self.stopped else ""
        else:
            msg = process_list([rank], self.pids, len(self.procs))
            msg += f" {describe_exit(code)}"
            for r, c in self.also_failed:
                msg += f"; then process {r} {describe_exit(c)}"
            msg += f"; stopped the other {others}." if self.stopped else "."
        return msg + (self.last_output([rank]) if with_tail else "")

    def _finished_first_message(self) -> str | None:
        """The failure, told from the process that finished just before it.

        None without one, or if its count is final and no failing one went past it.
        """
        if self.finished_first is None or self.failure is None:
            return None
        first, before = self.finished_first
        failures = [self.failure, *self.also_failed]
        ended = {r: t for t, r, _ in self._ends()[0]}
        failed = {r for r, _ in failures}
        others = [
            r
            for r in range(len(self.procs))
            if r != first and (r not in ended or ended[r] > ended[first] or r in failed)
        ]
        stall = self.stall
        exact = stall is not None and stall.finished_at[first] is not None
        if exact and all(stall.counts[r] <= stall.counts[first] for r, _ in failures):
            return None
        msg = f"{process_list([first], self.pids, len(self.procs))} finished (exit 0)"
        if exact or (stall is not None and stall.counts[first]):
            count = plural(stall.counts[first], "step call")
            msg += f" after {count}" if exact else f" after at least {count}"
        # (Not the others' counts: their last reports may lag behind.)
        one = len(others) == 1
        msg += f" while {process_list(others)} {'was' if one else 'were'} still running"
        (r, c), *later = failures
        when = f"{before:.2g} s later" if before >= 0 else "as it left"
        msg += f"; {when} process {r} {describe_exit(c)}"
        for r, c in later:
            msg += f", then process {r} {describe_exit(c)}"
        return (
            f"{msg}, most likely in a step that process {first} never joined (a "
            f"collective whose peer has left fails). {UNEVEN_STEPS_HINT}"
        )
