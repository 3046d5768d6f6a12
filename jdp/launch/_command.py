"""Private: `python -m jdp.launch`'s job: a script run in N processes.

`launch_command` checks the arguments and the port, runs the attempts (a `Job`
each, restarted as `Restarts` decides), forwards Ctrl-C and SIGTERM to the
processes, prints what happened on stderr, and returns the job's exit status.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from jdp.distributed._coordinator import listen_error, listen_reason
from jdp.launch._launcher import Job
from jdp.launch._restarts import Restarts, _after_restarts
from jdp.launch._setup import (
    _check_arguments,
    _progress_setup,
    free_port,
    process_env,
    script_command,
)
from jdp.launch._stall import DEFAULT_STALL_TIMEOUT_S, StallError

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
    still running `_launcher.FORWARD_GRACE_S` later, or after a second signal,
    are killed. Returns 2 without starting anything if `port` cannot be listened
    on, and 124 if the job runs past `timeout_s` (the whole run, restarts
    included) or stalls for `stall_timeout_s` (0 or None: no stall check) with
    no restart left.

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
