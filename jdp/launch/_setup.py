"""Private: what each process of a launched job is started with (nothing starts).

A free port, each process's environment and progress file, an attempt's `Job`,
and the checks of the arguments both front ends share.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jdp import _allocator, _validate
from jdp.distributed._config import (
    ENV_COORDINATOR_ADDRESS,
    ENV_FAIL_FAST,
    ENV_LIVE,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from jdp.launch._launcher import Job
from jdp.launch._restarts import Restarts
from jdp.launch._stall import StallMonitor
from jdp.launch._worker import ENV_PROGRESS_FILE

#: The entry point of every process, run by path (see its docstring).
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")

#: Restarts before this attempt (torchrun's `TORCHELASTIC_RESTART_COUNT`).
ENV_RESTART_COUNT = "JDP_RESTART_COUNT"
#: The job's `--max-restarts` (torchrun's `TORCHELASTIC_MAX_RESTARTS`).
ENV_MAX_RESTARTS = "JDP_MAX_RESTARTS"

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")

#: XLA flags of a `--live` job, unless set already: on CPU a collective that a
#: dead peer never joins ends after 10 s; on GPU, the flags of JAX's fault
#: tolerance guide (a failed NCCL collective does not end the process).
LIVE_XLA_FLAGS = (
    "--xla_cpu_collective_timeout_seconds=10",
    "--xla_gpu_nccl_terminate_on_error=false",
    "--xla_gpu_nccl_async_execution=true",
    "--xla_gpu_nccl_blocking_communicators=false",
)
#: Environment variables of a `--live` job on GPU, from the same guide.
LIVE_ENV = {
    "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "1",
    "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1",
}


def cpu_device_flags(xla_flags: str, count: int) -> str:
    """`xla_flags` asking for `count` CPU devices (replacing any count it has)."""
    flags = _DEVICE_COUNT_FLAG.sub("", xla_flags).split()
    return " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
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
    live: bool = False,
) -> dict[str, str]:
    """The environment of process `process_id`: `JDP_*` variables, device count.

    And glibc's allocator thresholds (`_allocator.child_env`); the coordinator
    listens on loopback only (JAX's default is every address). With `live`, the
    settings of JAX's fault tolerance (`LIVE_XLA_FLAGS`, `LIVE_ENV`).
    """
    env = _allocator.child_env(base)
    env[ENV_RESTART_COUNT] = str(restart_count)
    env[ENV_MAX_RESTARTS] = str(max_restarts)
    env[ENV_COORDINATOR_ADDRESS] = f"127.0.0.1:{port}"
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(process_id)
    env["JAX_COORDINATOR_BIND_ADDRESS"] = f"127.0.0.1:{port}"
    env[ENV_FAIL_FAST] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_process is not None:
        env["XLA_FLAGS"] = cpu_device_flags(
            env.get("XLA_FLAGS", ""), devices_per_process
        )
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    if live:
        env[ENV_LIVE], env[ENV_FAIL_FAST] = "1", "0"
        flags = env.get("XLA_FLAGS", "")
        given = {f.split("=")[0] for f in flags.split()}
        extra = [f for f in LIVE_XLA_FLAGS if f.split("=")[0] not in given]
        env["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
        env.update({k: v for k, v in LIVE_ENV.items() if k not in env})
    return env


def _progress_setup(
    envs: list[dict[str, str]], directory: str, stall_timeout_s: float | None, hint: str
) -> StallMonitor | None:
    """Points each process at its progress file; the monitor reading them (or None)."""
    if not stall_timeout_s:
        return None
    paths = [os.path.join(directory, f"progress-{r}.json") for r in range(len(envs))]
    for env, path in zip(envs, paths, strict=True):
        env[ENV_PROGRESS_FILE] = path
    return StallMonitor(paths, stall_timeout_s, how_to_change=hint)


def new_job(
    commands: Sequence[Sequence[str]],
    base: Mapping[str, str],
    folder: str,
    policy: Restarts,
    *,
    devices_per_process: int | None,
    stall_timeout_s: float | None,
    stall_hint: str,
    port: int | None = None,
    echo: bool = True,
    restart_one: Callable[[int, int], bool] | None = None,
) -> Job:
    """The `Job` of `policy`'s next attempt: a process per command, on `port`."""
    port = port or free_port()
    envs = [
        process_env(
            base, process_id=r, num_processes=len(commands), port=port,
            devices_per_process=devices_per_process, restart_count=policy.restarts,
            max_restarts=policy.max_restarts, live=policy.live,
        )
        for r in range(len(commands))
    ]  # fmt: skip
    stall = _progress_setup(envs, folder, stall_timeout_s, stall_hint)
    return Job(commands, envs, echo=echo, stall=stall, restart_one=restart_one)


def _check_arguments(
    num_processes: Any, devices_per_process: Any, timeout_s: Any, stall_timeout_s: Any
) -> None:
    """Checks the arguments shared by `run` and `launch_command`, before any start."""
    _validate.positive_int("num_processes", num_processes)
    _validate.positive_int(
        "devices_per_process", devices_per_process, allow_none=True,
        note="or None to keep the environment's device count",
    )  # fmt: skip
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
    if value is not None:
        real = isinstance(value, int | float) and not isinstance(value, bool)
        fits = (lambda v: v >= 0) if allow_zero else (lambda v: v > 0)
        _validate.checked(name, value, requirement, real, fits)
