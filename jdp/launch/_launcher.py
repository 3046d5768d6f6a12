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

With restarts (`Restarts`: `--max-restarts`, `--min-processes`), a failed or
stalled job is started again as a new `Job` on a fresh port, with
`JDP_RESTART_COUNT` set, possibly with one process fewer; the script resumes from
its checkpoint. The launcher keeps nothing of a failed attempt but the count.
"""

from __future__ import annotations

import collections
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jdp import _allocator, _validate
from jdp.distributed._config import (
    ENV_COORDINATOR_ADDRESS,
    ENV_FAIL_FAST,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from jdp.distributed._coordinator import listen_error, listen_reason
from jdp.launch._cause import (
    ENDING_WAIT_S,
    cause_first,
    describe_exit,
    finished_before,
)
from jdp.launch._stall import (
    DEFAULT_STALL_TIMEOUT_S,
    UNEVEN_STEPS_HINT,
    StallError,
    StallMonitor,
    plural,
    process_list,
)
from jdp.launch._worker import ENV_PROGRESS_FILE

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

#: The entry point of every process, run by path (see its docstring).
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")

#: How many times the job was restarted before this attempt (0 at first), set in
#: every process (torchrun's `TORCHELASTIC_RESTART_COUNT`).
ENV_RESTART_COUNT = "JDP_RESTART_COUNT"
#: The `--max-restarts` the job runs under (torchrun's `TORCHELASTIC_MAX_RESTARTS`).
ENV_MAX_RESTARTS = "JDP_MAX_RESTARTS"

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(
    base: Mapping[str, str],
    *,
    process_id: int,
    num_processes: int,
    port: int,
    devices_per_process: int | None,
    restart_count: int = 0,
    max_restarts: int = 0,
) -> dict[str, str]:
    """The environment of process `process_id`: `JDP_*` variables and device count.

    With glibc's allocator thresholds raised (`jdp._allocator`), unless the base
    environment sets them or `JDP_DEFAULT_MALLOC=1`.
    """
    env = _allocator.child_env(base)
    env[ENV_RESTART_COUNT] = str(restart_count)
    env[ENV_MAX_RESTARTS] = str(max_restarts)
    env[ENV_COORDINATOR_ADDRESS] = f"127.0.0.1:{port}"
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(process_id)
    # The coordinator listens on loopback only (JAX's default is every address).
    env["JAX_COORDINATOR_BIND_ADDRESS"] = f"127.0.0.1:{port}"
    # `initialize()` installs its fail-fast hooks: a failing process exits at once,
    # and SIGTERM from the launcher stops it.
    env[ENV_FAIL_FAST] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_process is not None:
        flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    return env


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


def script_command(target: str, args: Sequence[str], *, module: bool) -> list[str]:
    """The command line of one process running a script (or `-m module`)."""
    mode = "--module" if module else "--script"
    return [sys.executable, WORKER, mode, target, *args]


#: How `python -m jdp.launch` says to change the stall limit.
_CLI_STALL_HINT = (
    "raise the limit with `--stall-timeout SECONDS` (0 turns the check off)"
)


def _port_taken_message(port: int) -> str | None:
    """Why process 0 could not host the coordinator on 127.0.0.1:`port`, or None."""
    address = f"127.0.0.1:{port}"
    error = listen_error(address)
    if error is None:
        return None
    return (
        f"{listen_reason(error, address)}, so process 0 cannot host the job's "
        "coordinator there. Pick another port with `--port`, or leave `--port` out "
        "to let the launcher pick a free one."
    )


def _progress_setup(
    envs: list[dict[str, str]],
    directory: str,
    stall_timeout_s: float | None,
    hint: str,
) -> StallMonitor | None:
    """Points each process at its progress file; the monitor reading them (or None)."""
    if not stall_timeout_s:
        return None
    paths = [os.path.join(directory, f"progress-{r}.json") for r in range(len(envs))]
    for env, path in zip(envs, paths, strict=True):
        env[ENV_PROGRESS_FILE] = path
    return StallMonitor(paths, stall_timeout_s, how_to_change=hint)


def launch_command(
    target: str,
    args: Sequence[str],
    *,
    num_processes: int,
    module: bool = False,
    devices_per_process: int | None = None,
    timeout_s: float | None = None,
    port: int | None = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    max_restarts: int = 0,
    min_processes: int | None = None,
) -> int:
    """Runs `target` in `num_processes` processes; returns the job's exit status.

    Installs handlers that forward SIGINT/SIGTERM to every process; processes
    still running `FORWARD_GRACE_S` later, or after a second signal, are killed.
    Returns 2 without starting anything if `port` cannot be listened on, and 124
    if the job runs past `timeout_s` (the whole run, restarts included) or stalls
    for `stall_timeout_s` (0 or None: no stall check) with no restart left.

    A job that fails (a process exits non-zero or is killed) or stalls is
    started again, up to `max_restarts` times (`Restarts`), on a fresh port,
    with `JDP_RESTART_COUNT` set to the number of restarts so far; the script
    resumes from its latest checkpoint. With `min_processes` below
    `num_processes`, a process index that fails first in two attempts in a row
    makes the next attempt run with one process fewer, down to `min_processes`.
    """
    _check_arguments(num_processes, devices_per_process, timeout_s, stall_timeout_s)
    policy = Restarts(num_processes, max_restarts, min_processes)
    if port is not None and (problem := _port_taken_message(port)):
        print(f"jdp.launch: {problem}", file=sys.stderr, flush=True)
        return 2
    command = script_command(target, args, module=module)

    def make_job(n: int, restart: int, directory: str) -> Job:
        # A restart gets a fresh port: the last one's may linger.
        job_port = port if restart == 0 and port else free_port()
        envs = [
            process_env(
                os.environ,
                process_id=r,
                num_processes=n,
                port=job_port,
                devices_per_process=devices_per_process,
                restart_count=restart,
                max_restarts=max_restarts,
            )
            for r in range(n)
        ]
        stall = _progress_setup(envs, directory, stall_timeout_s, _CLI_STALL_HINT)
        return Job([command] * n, envs, stall=stall)

    with tempfile.TemporaryDirectory(prefix="jdp-launch-") as tmp:
        return _run_command_job(make_job, policy, tmp, timeout_s)


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


def _run_command_job(
    make_job: Callable[[int, int, str], Job],
    policy: Restarts,
    directory: str,
    timeout_s: float | None,
) -> int:
    """Runs the attempts of `launch_command`, forwarding signals; the exit status.

    Args:
      make_job: Builds an attempt's job: `(processes, restart, directory)`.
      policy: Decides restarts.
      directory: Where each attempt's progress files go (a folder each).
      timeout_s: The limit of the whole run, restarts included.
    """
    received: list[int] = []
    current: list[Job] = []

    def forward(signum, frame):
        received.append(signum)
        for job in current:
            if len(received) > 1:
                job.send(signal.SIGKILL)
            else:
                job.request_stop(signum)

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not received:
            folder = os.path.join(directory, f"attempt-{policy.restarts}")
            os.makedirs(folder)
            job = make_job(policy.num_processes, policy.restarts, folder)
            current[:] = [job]
            if received:
                break
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            code = _attempt(job, left, timeout_s, policy, received)
            if code is not None:
                return code
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    print(
        f"jdp.launch: stopped by {signal.Signals(received[0]).name}.",
        file=sys.stderr,
        flush=True,
    )
    return 128 + received[0]


def _after_restarts(policy: Restarts) -> str:
    """` (after 2 restarts)`, for a timeout that ends a restarted run; or ``."""
    n = policy.restarts
    return f" (after {n} restart{'s' if n > 1 else ''})" if n else ""


def _say(line: str) -> None:
    print(f"jdp.launch: {line}", file=sys.stderr, flush=True)


def _attempt(
    job: Job,
    left: float | None,
    timeout_s: float | None,
    policy: Restarts,
    received: list[int],
) -> int | None:
    """Runs one attempt of `launch_command`; its exit status, or None to go on.

    None means: restart (the policy has counted it), or a forwarded signal
    stopped the job (`received` is not empty).
    """
    job.start()
    try:
        ok = job.wait(left, limit_s=timeout_s)
    except StallError as e:
        if received:
            return None
        _say(str(e))
        line = policy.next_attempt(None, "The job stalled (see above).")
        if line is None:
            return 124
        _say(line)
        return None
    except TimeoutError as e:
        _say(str(e) + _after_restarts(policy))
        return 124
    if received:
        return None
    if ok:
        return 0
    message = job.failure_message(with_tail=False)
    rank, code = job.failure
    line = policy.next_attempt(rank, message)
    _say(message if line is None else line)
    if line is None:
        return code if code > 0 else 128 - code
    return None


def _check_arguments(
    num_processes: Any,
    devices_per_process: Any,
    timeout_s: Any,
    stall_timeout_s: Any = None,
) -> None:
    """Checks the arguments shared by `run` and `launch_command`, before any start."""
    _validate.positive_int("num_processes", num_processes)
    _validate.positive_int(
        "devices_per_process",
        devices_per_process,
        allow_none=True,
        note="or None to keep the environment's device count",
    )
    _check_seconds(
        "timeout_s", timeout_s, "a number of seconds > 0 (or None to wait forever)"
    )
    _check_seconds(
        "stall_timeout_s",
        stall_timeout_s,
        "a number of seconds >= 0 (0 or None turns the stall check off)",
        allow_zero=True,
    )


def _check_seconds(
    name: str, value: Any, requirement: str, *, allow_zero: bool = False
) -> None:
    """Checks a number of seconds (None passes): TypeError or ValueError."""
    if value is None:
        return
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be {requirement}, got {_validate.describe(value)}."
        )
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"`{name}` must be {requirement}, got {value!r}.")


def _main_path(fn: Callable[..., Any]) -> str | None:
    """The launching script, if `fn` lives in it (else None)."""
    if getattr(fn, "__module__", None) != "__main__":
        return None
    path = getattr(sys.modules["__main__"], "__file__", None)
    if path is None:
        raise ValueError(
            "`jdp.launch.run`: `fn` was defined interactively (in `__main__` "
            "without a file), so a fresh process cannot import it. Define it in "
            "a module or a script file."
        )
    return os.path.abspath(path)


def run(
    fn: Callable[..., Any],
    num_processes: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    devices_per_process: int | None = None,
    initialize: bool = True,
    timeout_s: float | None = 600.0,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    quiet: bool = False,
    max_restarts: int = 0,
) -> list[Any]:
    """Runs `fn(*args, **kwargs)` in `num_processes` new processes; returns the results.

    The Python form of `python -m jdp.launch` (like `torch.multiprocessing.spawn`
    plus torchrun's rendezvous). Each process starts a new interpreter, joins the
    job with `jdp.distributed.initialize()` (unless `initialize=False`) and calls
    `fn`. If one process fails, the others are stopped at once and a
    `RuntimeError` shows the failing process's last output.

    `fn` is pickled by reference, so it must be a module-level function: of an
    importable module (this process's `sys.path` is passed on), or of the script
    that calls `run`, which each process then imports as `__mp_main__`, as
    `multiprocessing` does (keep the script's own work under
    `if __name__ == "__main__":`). Its arguments and return value are pickled:
    use NumPy arrays and Python values (`jax.device_get` results), not arrays
    spread over processes.

    Args:
      fn: The function every process runs.
      num_processes: Number of processes.
      args: Positional arguments of `fn`.
      kwargs: Keyword arguments of `fn`.
      devices_per_process: CPU devices each process simulates
        (`--xla_force_host_platform_device_count`); None keeps the environment's.
      initialize: Call `jdp.distributed.initialize()` before `fn` (default).
      timeout_s: Stop every process and raise `TimeoutError` after this many
        seconds (600 by default; None waits forever).
      stall_timeout_s: Stop every process and raise `TimeoutError` when the
        processes furthest behind have reported no progress for this many
        seconds (300 by default; 0 or None turns the check off). A process
        reports progress as each jdp step starts; one that never reports is
        never stopped by this check.
      env: Extra environment variables for the processes.
      quiet: Do not print the processes' output (it still appears in errors).
        By default each line is printed with its process index, `[0] ...`.
      max_restarts: When a process fails (or the job stalls), stop the others
        and run the job again, up to this many times (0 by default), on a fresh
        port, printing a line per restart to stderr. Each process sees the
        number of restarts so far in `JDP_RESTART_COUNT`: `fn` resumes from
        its latest checkpoint. `timeout_s` bounds all attempts together.

    Returns:
      The list of return values, indexed by process id.

    Raises:
      RuntimeError: If a process fails (exits non-zero or is killed) and no
        restart is left.
      TimeoutError: If the job runs longer than `timeout_s`, or stalls for
        `stall_timeout_s` (the message names the processes that stalled), or
        its processes wait in a step for one that has finished (it made fewer
        step calls), for 15 s or `stall_timeout_s` if shorter (the message
        names it).
      TypeError: If `num_processes`, `devices_per_process`, `timeout_s`,
        `stall_timeout_s` or `max_restarts` has the wrong type, or `fn` or its
        arguments cannot be pickled.
      ValueError: If `num_processes` or `devices_per_process` is below 1,
        `timeout_s` is not positive, `stall_timeout_s` or `max_restarts` is
        negative, or `fn` was defined interactively.

    Example:
      >>> import jdp.launch
      >>> def fn():
      ...     import jax
      ...     return jax.process_index(), jax.device_count()
      >>> jdp.launch.run(fn, 2, devices_per_process=2)  # doctest: +SKIP
      [(0, 4), (1, 4)]
    """
    _check_arguments(num_processes, devices_per_process, timeout_s, stall_timeout_s)
    policy = Restarts(num_processes, max_restarts, None)
    base = dict(os.environ)
    base.update(env or {})
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="jdp-launch-") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        with open(payload, "wb") as f:
            # Read first: where `fn` (pickled by reference) can be imported from.
            pickle.dump({"sys_path": list(sys.path), "main": _main_path(fn)}, f)
            try:
                pickle.dump(
                    dict(
                        fn=fn,
                        args=tuple(args),
                        kwargs=dict(kwargs or {}),
                        initialize=initialize,
                    ),
                    f,
                )
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise TypeError(
                    "`jdp.launch.run`: `fn` and its arguments must be picklable; "
                    f"`fn` is pickled by reference, so it must be a module-level "
                    f"function, not a lambda or a nested function ({e})."
                ) from e
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            folder = os.path.join(tmp, f"attempt-{policy.restarts}")
            os.makedirs(folder)
            job = _call_job(
                payload,
                folder,
                base,
                num_processes,
                devices_per_process,
                stall_timeout_s,
                quiet,
                policy,
            )
            job.start()
            try:
                ok = job.wait(left, limit_s=timeout_s)
            except StallError as e:
                line = policy.next_attempt(None, str(e))
                if line is None:
                    raise TimeoutError(f"`jdp.launch.run`: {e}{_tails(job)}") from None
                _say_run(line)
                continue
            except TimeoutError as e:
                more = _after_restarts(policy) + _tails(job)
                raise TimeoutError(f"`jdp.launch.run`: {e}{more}") from None
            if not ok:
                line = policy.next_attempt(
                    job.failure[0], job.failure_message(with_tail=False)
                )
                if line is None:
                    raise RuntimeError(f"`jdp.launch.run`: {job.failure_message()}")
                _say_run(line)
                continue
            results = []
            for r in range(num_processes):
                with open(os.path.join(folder, f"result-{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results


def _say_run(line: str) -> None:
    print(f"jdp.launch.run: {line}", file=sys.stderr, flush=True)


def _tails(job: Job) -> str:
    """Every process's last output lines, for an error message."""
    return "".join(
        f"\n  Last output of process {r}:\n    " + "\n    ".join(t)
        for r, t in enumerate(job.tails)
        if t
    )


def _call_job(
    payload: str,
    folder: str,
    base: Mapping[str, str],
    num_processes: int,
    devices_per_process: int | None,
    stall_timeout_s: float | None,
    quiet: bool,
    policy: Restarts,
) -> Job:
    """One attempt of `run`: processes that call the pickled function."""
    port = free_port()
    envs = [
        process_env(
            base,
            process_id=r,
            num_processes=num_processes,
            port=port,
            devices_per_process=devices_per_process,
            restart_count=policy.restarts,
            max_restarts=policy.max_restarts,
        )
        for r in range(num_processes)
    ]
    commands = [
        [
            sys.executable,
            WORKER,
            "--call",
            payload,
            os.path.join(folder, f"result-{r}.pkl"),
        ]
        for r in range(num_processes)
    ]
    stall = _progress_setup(
        envs,
        folder,
        stall_timeout_s,
        "raise `stall_timeout_s` (0 or None turns the check off)",
    )
    return Job(commands, envs, echo=not quiet, stall=stall)
