"""Private: `initialize`'s configuration: where it comes from, and its checks."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import jax

from jdp import _jax_compat, _validate
from jdp.distributed import _cluster

_log = logging.getLogger("jdp.distributed")

ENV_COORDINATOR_ADDRESS = "JDP_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDP_PROCESS_ID"
#: The default of `initialize`'s `fail_fast`: "1" or "0" (unset: "0").
ENV_FAIL_FAST = "JDP_FAIL_FAST"
#: "1": the job trains with `jdp.distributed.live` (`python -m jdp.launch --live`).
ENV_LIVE = "JDP_LIVE"
#: "1": gloo's TCP loop thread at `SCHED_IDLE`; "0": not; unset: if bound to one core.
ENV_GLOO_LOOP_IDLE = "JDP_GLOO_LOOP_IDLE"

CPU_COLLECTIVES = ("gloo", "mpi", None)

#: Where a coordinator address given to `initialize` comes from, for messages.
_GIVEN_ADDRESS = f"`coordinator_address` (or ${ENV_COORDINATOR_ADDRESS})"


def _split_address(address: str) -> tuple[str, int]:
    if not isinstance(address, str):
        raise TypeError(
            "`coordinator_address` must be a str 'host:port' (e.g. "
            f"'127.0.0.1:1234'), got {_validate.describe(address)}."
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"`coordinator_address` must look like 'host:port' (e.g. "
            f"'127.0.0.1:1234'), got {address!r}."
        )
    return host.strip("[]"), int(port)


def _check_alone(found: str) -> None:
    """Raises (or warns) if the environment says that this job has several processes."""
    expected = _cluster.expected_processes(
        os.environ, kubernetes=_cluster.kubernetes_installed()
    )
    if expected is None:
        return
    message = _cluster.one_process_message(expected, found=found)
    if expected.certain:
        raise RuntimeError(message)
    _log.warning(message)


def _check_options(
    cpu_collectives: str | None, timeout_s: int, heartbeat_timeout_s: int
) -> None:
    """Checks the arguments of `initialize` that are not the job's configuration."""
    if cpu_collectives not in CPU_COLLECTIVES:
        raise ValueError(
            f"`cpu_collectives` must be one of {CPU_COLLECTIVES}; got "
            f"{cpu_collectives!r}."
        )
    _validate.positive_int("timeout_s", timeout_s, note="seconds")
    _validate.positive_int("heartbeat_timeout_s", heartbeat_timeout_s, note="seconds")


def _env_flag(environ, name: str, choices: str, fix: str) -> bool | None:
    """`environ[name]`, "1" or "0", as a bool; None if unset or empty."""
    if (value := environ.get(name, "")) not in ("", "0", "1"):
        raise ValueError(
            f"Environment variable ${name} must be {choices}, got {value!r}. {fix}"
        )
    return None if value == "" else value == "1"


def _fail_fast(fail_fast: bool | None) -> bool:
    """`initialize`'s `fail_fast`, checked; None: from `$JDP_FAIL_FAST`."""
    if fail_fast is None:
        fix = "Set it to one of these, or pass `fail_fast` to "
        fix += "`jdp.distributed.initialize`."
        return bool(_env_flag(os.environ, ENV_FAIL_FAST, "'1' (fail fast) or '0'", fix))
    if not isinstance(fail_fast, bool):
        raise TypeError(
            f"`fail_fast` must be a bool, or None to read ${ENV_FAIL_FAST}; got "
            f"{_validate.describe(fail_fast)}."
        )
    return fail_fast


def _gloo_loop_idle(environ, cores: int | None = None, online: int | None = None):
    """Whether gloo's loop thread runs at `SCHED_IDLE`: the variable, else 1 core."""
    choices = "'1' (gloo's TCP loop thread at SCHED_IDLE) or '0' (default priority)"
    fix = "Unset, it is SCHED_IDLE where the process is bound to one core."
    if (flag := _env_flag(environ, ENV_GLOO_LOOP_IDLE, choices, fix)) is not None:
        return flag
    if cores is None and hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    return cores == 1 < (online or os.cpu_count() or 1)


def _requested_config(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> dict:
    """The job's configuration, checked: the arguments, else the `JDP_*` variables."""
    if coordinator_address is None:
        coordinator_address = os.environ.get(ENV_COORDINATOR_ADDRESS) or None
    if num_processes is None:
        num_processes = _cluster.env_int(os.environ, ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _cluster.env_int(os.environ, ENV_PROCESS_ID)
    _validate.positive_int("num_processes", num_processes, allow_none=True)
    if process_id is not None and num_processes is not None:
        _validate.index(
            "process_id", process_id, num_processes, size_name="num_processes"
        )
    else:
        _validate.non_negative_int("process_id", process_id, allow_none=True)
    if coordinator_address is not None:
        _split_address(coordinator_address)
    return dict(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )


def _detected_config(requested: dict) -> tuple[dict, str]:
    """The configuration and its source, with what JAX detects in a SLURM job step.

    Known here, the values get jdp's wait for the coordinator (JAX's aborts).
    """
    if None not in requested.values():
        return requested, _GIVEN_ADDRESS
    _cluster.check_integers(os.environ)
    detected = _jax_compat.slurm_config()
    if detected is None:
        return requested, _GIVEN_ADDRESS
    filled = {
        k: d if v is None else v
        for (k, v), d in zip(requested.items(), detected, strict=True)
    }
    if requested["coordinator_address"] is not None:
        return filled, _GIVEN_ADDRESS
    source = _cluster.slurm_source(os.environ)
    _log.info(
        "SLURM job step: coordinator %(coordinator_address)s (%(source)s), process "
        "%(process_id)d of %(num_processes)d.",
        {**filled, "source": source},
    )
    return (
        filled,
        f"{source}, which `coordinator_address` or $JAX_COORDINATOR_PORT override",
    )


def local_devices(
    local_device_ids: int | Sequence[int] | None, environ: dict | None = None
) -> int | Sequence[int] | None:
    """The `local_device_ids` to pass to JAX (logged): given, else the cluster's."""
    environ = os.environ if environ is None else environ
    if local_device_ids is not None:
        _log.info("local_device_ids=%s (given).", local_device_ids)
        return local_device_ids
    if ids := environ.get("JAX_LOCAL_DEVICE_IDS"):
        _log.info("local_device_ids from $JAX_LOCAL_DEVICE_IDS=%s (JAX reads it).", ids)
        return None
    plan = _cluster.plan_local_devices(environ, node_gpus=_cluster.node_gpus())
    if plan is None:
        return None
    shown = "every device it sees" if plan.local_device_ids == [] else None
    _log.info("local_device_ids=%s (%s).", shown or plan.local_device_ids, plan.reason)
    return plan.local_device_ids


def _incomplete_config_error(error: ValueError, requested: dict) -> ValueError:
    """The error for a configuration that neither jdp nor JAX could complete."""
    given = [k for k, v in requested.items() if v is not None]
    missing = [k for k in requested if k not in given]
    return ValueError(
        "`jdp.distributed.initialize` could not complete the configuration "
        f"(JAX said: {error}). Given: {given or 'nothing'}; missing: {missing}. Pass "
        f"all three arguments, or set ${ENV_COORDINATOR_ADDRESS}, "
        f"${ENV_NUM_PROCESSES} and ${ENV_PROCESS_ID} (as `python -m jdp.launch` "
        "does), or run under SLURM / Open MPI / Kubernetes."
    )


def _joined_config(requested: dict) -> dict:
    """The configuration of the job joined; what JAX detected filled in."""
    config = dict(requested)
    if None in config.values():  # detected by JAX: ask it (starts the backends)
        config["num_processes"] = jax.process_count()
        config["process_id"] = jax.process_index()
    return config
