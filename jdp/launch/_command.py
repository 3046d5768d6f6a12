"""Private: `python -m jdp.launch`'s job: a script run in N processes."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Sequence

from jdp.distributed._coordinator import listen_error, listen_reason
from jdp.launch._launcher import Job
from jdp.launch._restarts import Restarts, run_attempts
from jdp.launch._setup import WORKER, _check_arguments, new_job
from jdp.launch._stall import DEFAULT_STALL_TIMEOUT_S


def _say(line: str) -> None:
    print(f"jdp.launch: {line}", file=sys.stderr, flush=True)


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
    live: bool = False,
) -> int:
    """Runs `target` in `num_processes` processes; returns the job's exit status.

    Forwards SIGINT/SIGTERM to every process (a second signal kills them).
    Returns 2 without starting anything if `port` cannot be listened on, and
    124 if the job runs past `timeout_s` or stalls with no restart left.
    """
    _check_arguments(num_processes, devices_per_process, timeout_s, stall_timeout_s)
    policy = Restarts(num_processes, max_restarts, min_processes, live=live)
    if port is not None and (error := listen_error(f"127.0.0.1:{port}")):
        _say(
            f"{listen_reason(error, f'127.0.0.1:{port}')}, so process 0 cannot host "
            "the job's coordinator there. Pick another port with `--port`, or leave "
            "`--port` out to let the launcher pick a free one."
        )
        return 2
    mode = "--module" if module else "--script"
    command = [sys.executable, WORKER, mode, target, *args]
    received: list[int] = []
    current: list[Job] = []

    def restart_one(rank: int, code: int) -> bool:
        if (line := policy.restart_one(rank, code)) is not None:
            _say(line)
        return line is not None

    def make_job(n: int, folder: str) -> Job:
        job = new_job(
            [command] * n,
            os.environ,
            folder,
            policy,
            devices_per_process=devices_per_process,
            stall_timeout_s=stall_timeout_s,
            stall_hint="raise the limit with `--stall-timeout SECONDS` (0 turns the "
            "check off)",
            port=port if policy.restarts == 0 else None,  # the last may linger
            restart_one=restart_one if live else None,
        )
        current[:] = [job]
        return job

    def forward(signum, frame):
        received.append(signum)
        for job in current:
            if len(received) > 1:
                job.send(signal.SIGKILL)
            else:
                job.request_stop(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with tempfile.TemporaryDirectory(prefix="jdp-launch-") as tmp:
            job, error = run_attempts(
                make_job, policy, tmp, timeout_s, _say, lambda: bool(received)
            )
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if error is not None:
        _say(str(error))
        return 124
    if received:
        _say(f"stopped by {signal.Signals(received[0]).name}.")
        return 128 + received[0]
    if job.failure is None:
        return 0
    _say(job.failure_message(with_tail=False))
    code = job.failure[1]
    return code if code > 0 else 128 - code
