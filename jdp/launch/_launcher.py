"""Private: start N processes of one job on this machine, watch them, stop them.

The JAX counterpart of `torchrun --standalone`: a free port on 127.0.0.1 for the
coordinator, the `JDP_*` variables that `jdp.distributed.initialize` reads
(`JDP_FAIL_FAST=1` among them: its fail-fast hooks), the CPU
device count per process, output prefixed with each line's process index, and a
job that fails as soon as one process fails. JAX notices a dead peer only at its
heartbeat timeout (100 s by default), and a process blocked in a collective with a
dead peer may never return, so the launcher itself kills the others, by the PIDs
it started. A process that is alive but stuck is found from the progress each
process reports (`_stall`), and the job is stopped too; so is a job whose
processes wait in a step for one that has finished (`_stall`'s `finished_early`).

When one process dies, the others fail soon after it (a collective whose peer
left fails with a connection error), often within the same few milliseconds,
and sometimes before the dead one is reaped (a large process's memory takes a
while to free, after its connections closed). So the launcher records when each
process ended: when its output closed (at the same moment as its connections)
or, if sooner, when it was reaped (a thread per process waits for it). When a
process fails while another's output has closed but it is not yet reaped, the
launcher waits for it (`ENDING_WAIT_S`) before it decides which ended first.

This module supervises one attempt, a `Job`. With restarts (`_restarts`:
`--max-restarts`, `--min-processes`), a failed or stalled job is started again
as a new `Job` on a fresh port, with `JDP_RESTART_COUNT` set, possibly with one
process fewer; the script resumes from its checkpoint. The launcher keeps
nothing of a failed attempt but the count. What each process is started with
is in `_setup`; the front ends are `_command` (`python -m jdp.launch`) and
`_run` (`jdp.launch.run`).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from jdp.launch._cause import (
    ENDING_WAIT_S,
    cause_first,
    describe_exit,
    finished_before,
)
from jdp.launch._stall import (
    UNEVEN_STEPS_HINT,
    StallError,
    StallMonitor,
    plural,
    process_list,
)

#: Seconds between SIGTERM and SIGKILL when stopping processes after a failure.
KILL_GRACE_S = 3.0
#: Seconds processes get to exit after a forwarded Ctrl-C / SIGTERM (time to save a
#: checkpoint) before SIGKILL; a second signal kills at once.
FORWARD_GRACE_S = 30.0
#: How often the launcher checks its processes.
POLL_S = 0.05
#: Output lines of each process kept for error messages.
TAIL_LINES = 40
#: Once a process failed, seconds to wait at most for the returncode of a process
#: known to have exited, which its reaping thread (late on a busy machine) has
#: yet to record.
PENDING_WAIT_S = 10.0
#: Once a process failed, seconds to wait in any case before deciding: a process
#: that died at the same moment (a peer that failed because of it, or its
#: cause) may not have been seen to end yet by the launcher's threads.
SETTLE_S = 0.5


def _exit_status(pid: int) -> tuple[bool, int | None]:
    """Whether child `pid` has exited, and its returncode if it is not reaped yet.

    The returncode as `subprocess.Popen.returncode` has it: the exit status, or
    minus the signal that killed it; None once a thread of ours reaped it (and
    is about to record it). The process is left to be reaped.
    """
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already: its reaping thread records it
        return True, None
    if info is None:
        return False, None
    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    return True, code


class Job:
    """N child processes, their prefixed output, and the rule "one fails, all stop".

    Args:
      commands: One command line per process.
      envs: One environment per process.
      stdout, stderr: Where the prefixed lines go.
      prefix: Prefix each line with `[process_id] `.
      echo: Print the processes' output (else only keep its tail for errors).
      stall: Follows the processes' progress reports; `wait` stops the job with a
        `StallError` when it finds stalled processes. None: no such check.
    """

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        envs: Sequence[Mapping[str, str]],
        *,
        stdout=None,
        stderr=None,
        prefix: bool = True,
        echo: bool = True,
        stall: StallMonitor | None = None,
    ):
        self.commands = [list(c) for c in commands]
        self.envs = [dict(e) for e in envs]
        self.stdout = stdout
        self.stderr = stderr
        self.prefix = prefix
        self.echo = echo
        self.stall = stall
        self.procs: list[subprocess.Popen] = []
        self.tails = [collections.deque(maxlen=TAIL_LINES) for _ in self.commands]
        self._pumps: list[threading.Thread] = []
        self._write_lock = threading.Lock()
        self.failure: tuple[int, int] | None = None  # (process_id, returncode)
        self.also_failed: list[tuple[int, int]] = []  # failed before being stopped
        self.stopped = 0  # processes still running when a failure stopped the job
        # (time.monotonic(), process_id, returncode) of each exit, in the order
        # reaped, and when each process's output pipes closed.
        self.exits: list[tuple[float, int, int]] = []
        self._closed: list[list[float]] = [[] for _ in self.commands]
        self._exits_lock = threading.Lock()
        self._failed_at: float | None = None  # when a failure was first seen
        self._seen_exits = 0  # exits the stall check has taken into account
        # A process that finished (exit 0) shortly before the failure, while the
        # failing one still ran: (process_id, seconds before the failure).
        self.finished_first: tuple[int, float] | None = None
        self._stop_requested_at: float | None = None

    @property
    def pids(self) -> list[int]:
        """PIDs of the processes started so far."""
        return [p.pid for p in self.procs]

    def start(self) -> None:
        """Starts every process, each in its own session (to stop it whole)."""
        try:
            for rank, (cmd, env) in enumerate(
                zip(self.commands, self.envs, strict=True)
            ):
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
                self.procs.append(proc)
                threading.Thread(
                    target=self._reap, args=(rank, proc), daemon=True
                ).start()
                for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                    t = threading.Thread(
                        target=self._pump, args=(rank, pipe, name), daemon=True
                    )
                    t.start()
                    self._pumps.append(t)
        except BaseException:
            self.kill()
            raise

    def _reap(self, rank: int, proc: subprocess.Popen) -> None:
        """Waits for `proc` to exit and records when (the exits' order)."""
        code = proc.wait()
        self._record_exit(rank, code, time.monotonic())

    def _record_exit(self, rank: int, code: int, now: float) -> None:
        """Records the exit of process `rank` once (the earliest observation)."""
        with self._exits_lock:
            if all(r != rank for _, r, _ in self.exits):
                self.exits.append((now, rank, code))

    def _notice_exits(self) -> set[int]:
        """Records the exits that the reaping threads have not recorded yet.

        On a busy machine a thread may run seconds late, while `wait`'s loop
        asks the kernel directly (without reaping): every process that has
        exited by a decision is known to it, whatever the threads' timing.

        Returns:
          The processes that exited but whose returncode is not known yet (a
          thread reaped them and has yet to record it).
        """
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

    def _exited(self) -> dict[int, tuple[float, int]]:
        """`{process_id: (exit time, returncode)}` of the processes that exited."""
        with self._exits_lock:
            return {r: (t, code) for t, r, code in self.exits}

    def _pump(self, rank: int, pipe, name: str) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tails[rank].append(line)
            if not self.echo:
                continue
            stream = self.stdout if name == "stdout" else self.stderr
            stream = stream or (sys.stdout if name == "stdout" else sys.stderr)
            text = f"[{rank}] {line}\n" if self.prefix else line + "\n"
            with self._write_lock:
                try:
                    stream.write(text)
                    stream.flush()
                except (ValueError, OSError):  # stream closed under us
                    pass
        now = time.monotonic()
        with self._exits_lock:
            self._closed[rank].append(now)
        pipe.close()

    def send(self, sig: int) -> None:
        """Sends `sig` to every live process (and to what it started, its session)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

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
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                pass
        for proc in self.procs:  # reap leftovers of the sessions too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._join_pumps()

    def _join_pumps(self) -> None:
        for t in self._pumps:
            t.join(timeout=2)

    def wait(
        self, timeout_s: float | None = None, *, limit_s: float | None = None
    ) -> bool:
        """Waits until all processes succeed (True) or one fails (False).

        On a failure the others are stopped at once and `self.failure` says which
        process failed first and how. Raises `TimeoutError` (after stopping every
        process) if the job is still running after `timeout_s` seconds (the
        message names `limit_s`, the limit of the whole run, if given), and
        `StallError` (a `TimeoutError`) if `stall` finds stalled processes.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                outcome = self._outcome()
                if outcome is not None:
                    return outcome
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
        except BaseException:
            self.kill()
            raise

    def _ends(self) -> tuple[list[tuple[float, int, int]], list[int]]:
        """The exits in the order they ended, and the processes that are ending.

        The exits are `(ended at, process_id, returncode)`; the processes ending
        are those not yet reaped whose output has closed. A process ended when
        its output pipes closed (the moment its connections closed too), or
        when it was reaped if that was sooner (a process it started may keep
        its pipes open).
        """
        with self._exits_lock:
            exits = list(self.exits)
            closed = [list(c) for c in self._closed]
        reaped = {r for _, r, _ in exits}
        # Each time is taken when a thread of the launcher runs, late on a busy
        # machine: the earliest of a process's observations is the best.
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
        if failed:
            # A peer of a dead process fails soon after it (a closed
            # connection), often before the dead one is reaped: wait for those
            # that are ending, then name the process that ended first.
            now = time.monotonic()
            if self._failed_at is None:
                self._failed_at = now
            waited = now - self._failed_at
            if (
                waited < SETTLE_S
                or (ending and waited < ENDING_WAIT_S)
                or (pending and waited < PENDING_WAIT_S)
            ):
                return None
            (self.failure, *self.also_failed) = cause_first(failed, self.tails)
            self.stopped = len(self.procs) - len(exits)
            finished = finished_before(exits, failed[0][0])
            if finished:
                self.finished_first = finished[0]
                if self.stall is not None:
                    self.stall.read(time.monotonic())  # the counts at the end
            self.kill()
            return False
        if len(exits) == len(self.procs):
            self._join_pumps()
            return True
        if (
            self._stop_requested_at is not None
            and time.monotonic() - self._stop_requested_at > FORWARD_GRACE_S
        ):
            self.kill(grace_s=0)
            return False
        return None

    def _check_stall(self) -> None:
        """Stops the job and raises `StallError` if `stall` finds stalled processes."""
        if self.stall is None or self._stop_requested_at is not None:
            return
        if self._failed_at is not None:  # the job is failing: `_outcome` decides
            return
        exited = self._exited()
        if len(exited) != self._seen_exits:  # their last records are written
            self._seen_exits = len(exited)
            self.stall.read(time.monotonic())
        running = [r for r in range(len(self.procs)) if r not in exited]
        finished = {r: t for r, (t, code) in exited.items() if code == 0}
        early = self.stall.finished_early(running=running, exited=finished)
        if early is not None:
            message = self.stall.finished_message(early, self.pids, finished)
            self.kill()
            raise StallError(message)
        behind = self.stall.stalled(running=running)
        if behind:
            message = self.stall.message(behind, self.pids, finished)
            self.kill()
            raise StallError(message)

    def failure_message(self, *, with_tail: bool = True) -> str:
        """Which process failed, how, and (optionally) its last output lines."""
        if self.failure is None:
            return ""
        rank, code = self.failure
        n = len(self.procs)
        pid = self.procs[rank].pid
        stopped = ""
        if self.stopped:
            stopped = "stopped the other " + (
                "process" if self.stopped == 1 else f"{self.stopped} processes"
            )
        early = self._finished_first_message()
        if early is not None:
            msg = early + (f" {stopped[0].upper()}{stopped[1:]}." if stopped else "")
        else:
            msg = f"process {rank} of {n} (pid {pid}) {describe_exit(code)}"
            for r, c in self.also_failed:
                msg += f"; then process {r} {describe_exit(c)}"
            msg += f"; {stopped}." if stopped else "."
        if with_tail and self.tails[rank]:
            lines = "\n    ".join(self.tails[rank])
            msg += f"\n  Last output of process {rank}:\n    {lines}"
        return msg

    def _finished_first_message(self) -> str | None:
        """The failure, told from the process that finished just before it.

        A process that finished (exit 0) while the others still ran, shortly
        before one of them failed (`finished_first`), most likely left them in
        a step without it. None if there is no such process, or if its count is
        final (its last record said it finished) and no failing process went
        past it (then they did not fail in a step it left).
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
        if exact and all(stall.beats[r] <= stall.beats[first] for r, _ in failures):
            return None
        pid = self.procs[first].pid
        msg = f"process {first} of {len(self.procs)} (pid {pid}) finished (exit 0)"
        if exact or (stall is not None and stall.beats[first]):
            count = plural(stall.beats[first], "step call")
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
