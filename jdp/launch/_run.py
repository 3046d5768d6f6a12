"""Private: `jdp.launch.run`, a function called in N new processes."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jdp.launch._launcher import Job
from jdp.launch._restarts import Restarts, run_attempts
from jdp.launch._setup import WORKER, _check_arguments, new_job
from jdp.launch._stall import DEFAULT_STALL_TIMEOUT_S


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

    The Python form of `python -m jdp.launch`. Each process starts a new
    interpreter, joins the job with `jdp.distributed.initialize()` (unless
    `initialize=False`) and calls `fn`; if one fails, the others are stopped at
    once. `fn` is pickled by reference, so it must be a module-level function of
    an importable module or of the calling script; its arguments and results
    are pickled too (see the Many hosts guide, docs/guides/multihost.md).

    Args:
      fn: The function every process runs.
      num_processes: Number of processes.
      args: Positional arguments of `fn`.
      kwargs: Keyword arguments of `fn`.
      devices_per_process: CPU devices each process simulates; None keeps the
        environment's.
      initialize: Call `jdp.distributed.initialize()` before `fn` (default).
      timeout_s: Stop every process and raise `TimeoutError` after this many
        seconds, restarts included (600 by default; None waits forever).
      stall_timeout_s: Stop every process and raise `TimeoutError` when the
        processes furthest behind report no progress (as each jdp step starts)
        for this many seconds (300 by default; 0 or None: no check).
      env: Extra environment variables for the processes.
      quiet: Do not print the processes' output, by default printed line by
        line as `[process_id] ...` (it still appears in errors).
      max_restarts: Run the job again, on a fresh port, when a process fails or
        the job stalls, up to this many times (0 by default); each process
        sees the restarts so far in `JDP_RESTART_COUNT`.

    Returns:
      The list of return values, indexed by process id.

    Raises:
      RuntimeError: If a process fails and no restart is left (with its last
        output).
      TimeoutError: If the job runs past `timeout_s` or stalls, or processes
        wait in a step for one that has finished; the message names them.
      TypeError: If an argument has the wrong type, or `fn` or its arguments
        cannot be pickled.
      ValueError: If an argument is out of range, or `fn` was defined
        interactively.

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
    base = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="jdp-launch-") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        with open(payload, "wb") as f:
            # Read first: where `fn` (pickled by reference) can be imported from.
            pickle.dump({"sys_path": list(sys.path), "main": _main_path(fn)}, f)
            call = dict(fn=fn, args=tuple(args), kwargs=dict(kwargs or {}))
            try:
                pickle.dump(dict(call, initialize=initialize), f)
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise TypeError(
                    "`jdp.launch.run`: `fn` and its arguments must be picklable; "
                    f"`fn` is pickled by reference, so it must be a module-level "
                    f"function, not a lambda or a nested function ({e})."
                ) from e

        def make_job(n: int, folder: str) -> Job:
            # Each command ends with the path of its process's result.
            commands = [
                [sys.executable, WORKER, "--call", payload, f"{folder}/result-{r}.pkl"]
                for r in range(n)
            ]
            return new_job(
                commands, base, folder, policy, devices_per_process=devices_per_process,
                stall_timeout_s=stall_timeout_s, echo=not quiet,
                stall_hint="raise `stall_timeout_s` (0 or None turns the check off)",
            )  # fmt: skip

        job, error = run_attempts(make_job, policy, tmp, timeout_s, _say)
        if error is not None:
            raise TimeoutError(f"`jdp.launch.run`: {error}{job.last_output()}")
        if job.failure is not None:
            raise RuntimeError(f"`jdp.launch.run`: {job.failure_message()}")
        results = [Path(c[-1]) for c in job.commands]
        if missing := [i for i, path in enumerate(results) if not path.exists()]:
            raise RuntimeError(
                f"`jdp.launch.run`: process(es) {missing} exited with status 0 "
                "without returning from `fn` (a `sys.exit(0)` in it?), so there is "
                "no result to give back. Return from `fn` instead."
            )
        return [pickle.loads(path.read_bytes()) for path in results]


def _say(line: str) -> None:
    print(f"jdp.launch.run: {line}", file=sys.stderr, flush=True)
