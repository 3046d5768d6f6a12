"""Private: `jdp.launch.run`, a function called in N new processes.

`run` pickles the function and its arguments, runs the attempts (a `Job` each,
whose processes call it through `_worker.py`, restarted as `Restarts` decides),
and returns the processes' results, or raises with the failing process's last
output.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jdp.launch._launcher import Job
from jdp.launch._restarts import Restarts, _after_restarts
from jdp.launch._setup import (
    WORKER,
    _check_arguments,
    _progress_setup,
    free_port,
    process_env,
)
from jdp.launch._stall import DEFAULT_STALL_TIMEOUT_S, StallError


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
