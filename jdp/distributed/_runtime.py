"""Private: joining and leaving the job: the one caller of `jax.distributed`."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Literal

import jax
from jax.experimental import multihost_utils

from jdp import _coordination, _jax_compat
from jdp.distributed import _config, _coordinator, _exit, _watchdog
from jdp.distributed._state import _this

#: Extra seconds of JAX's own deadlines over `timeout_s`: jdp's watchdogs (a
#: clear message) fire before JAX's native abort.
_JAX_GRACE_S = 10
#: `heartbeat_timeout_s`'s default with JAX's fault tolerance on: how soon the
#: survivors of a dead process may go on without it (`jdp.distributed.live`).
LIVE_HEARTBEAT_S = 10

_SHUTDOWN_TIMEOUT_MSG = (
    "jdp.distributed: process {pid} of {num} waited {timeout} s at shutdown for "
    "{who}, which did not arrive. The processes of a job leave it together (at "
    "`jdp.distributed.shutdown()` or at their normal exit): a process that ends "
    "another way (`os._exit`, a crash, a kill) or is still working holds up the "
    "others. Look for an error in the output of {who}; if the processes finish at "
    "different times, raise `timeout_s` of `jdp.distributed.initialize` (now "
    "{timeout} s). Exiting with status 1."
)

#: Coordination-service keys under which each process notes its arrival at shutdown.
_ARRIVED_KEY = "jdp/shutdown/arrived/"

_TOO_LATE_MSG = (
    "`jdp.distributed.initialize` must run before JAX starts its backends, but "
    "something already did (a call such as `jax.devices()` or the creation of an "
    "array). Call it first, right after the imports."
)

_log = logging.getLogger("jdp.distributed")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    cpu_collectives: Literal["gloo", "mpi"] | None = "gloo",
    timeout_s: int = 300,
    heartbeat_timeout_s: int | None = None,
    fail_fast: bool | None = None,
    stall_timeout_s: float | None = None,
) -> None:
    """Connects this process to the others of a multi-process job.

    Call it once, first thing, in every process (before any other JAX call); it
    wraps `jax.distributed.initialize`, after which `jdp.parallelize` spans the
    devices of every process. The job comes from, in order: the arguments; the
    `JDP_COORDINATOR_ADDRESS`, `JDP_NUM_PROCESSES` and `JDP_PROCESS_ID` variables
    (set by `python -m jdp.launch`); JAX's detection of SLURM, Open MPI,
    Kubernetes or Cloud TPU. With none, the program runs as one process, unless
    the environment says that the job has several. Under SLURM or Open MPI, each
    process gets the GPUs that are its own. Calling it again with the same (or
    no) arguments does nothing. On a process bound to one core, the thread of gloo's
    TCP loop runs at `SCHED_IDLE` (`$JDP_GLOO_LOOP_IDLE`: docs/guides/performance.md).
    See the Many hosts guide (docs/guides/multihost.md) and the Clusters guide
    (docs/guides/clusters.md).

    Args:
      coordinator_address: `"host:port"` of process 0, which hosts JAX's
        coordination service on that port; the same in every process.
      num_processes: Number of processes in the job.
      process_id: This process's index, in `[0, num_processes)`.
      local_device_ids: This process's local accelerator ids. None (default):
        under SLURM or Open MPI, its own GPUs; otherwise every device it sees.
      cpu_collectives: CPU collectives between processes: `"gloo"` (default),
        `"mpi"` (needs an MPI installation), or None to leave JAX's setting.
      timeout_s: Seconds to wait for all processes to connect (300 by default),
        and for the others when leaving the job; past it, a process says which
        did not arrive and exits with status 1.
      heartbeat_timeout_s: Seconds without a heartbeat after which the runtime
        declares a process dead and stops the others. None (default): 100, or
        10 with JAX's fault tolerance on (`jax_enable_recoverability`, which
        `$JDP_LIVE=1` turns on, as `python -m jdp.launch --live` sets it).
      fail_fast: If True, an uncaught exception exits the process at once
        (status 1; 130 for Ctrl-C) instead of waiting at JAX's shutdown barrier,
        SIGTERM stops the process again, and the exit leaves the job through
        `shutdown`. None (default): `$JDP_FAIL_FAST` decides ("1" under
        `python -m jdp.launch`; unset: False).
      stall_timeout_s: Seconds after which a job whose processes furthest behind
        made no progress (no jdp step started) is stopped: every process prints
        which process stopped first, with its Python stack, and exits with
        status 124. None (default): `$JDP_STALL_TIMEOUT_S` decides (unset, empty
        or "0": no check).

    Raises:
      TypeError: If an argument has the wrong type (counts, ids and seconds are
        ints, not bools; `fail_fast` is a bool or None; `stall_timeout_s` is a
        number or None).
      ValueError: If an argument or a variable read as one (`JDP_*`, or a
        scheduler's count such as `$SLURM_NTASKS`) is malformed or out of
        range, the configuration is incomplete, or the SLURM / Open MPI
        variables contradict each other or a node's GPUs cannot be shared
        evenly between its tasks.
      RuntimeError: If JAX's backends already started, this process already
        joined another job, `$JAX_PLATFORMS` asks for CUDA alone without JAX's
        CUDA plugin, or the environment says that the job has several
        processes but this one would run alone.
      OSError: On process 0, if the coordinator cannot listen on its port.
      TimeoutError: If process 0's coordinator accepts no connection within
        `timeout_s` (on the other processes).

    Example:
      >>> import jdp
      >>> jdp.distributed.initialize()  # under `python -m jdp.launch` # doctest: +SKIP
      >>> jdp.distributed.initialize("10.0.0.1:1234", 2, 0)  # doctest: +SKIP
    """
    if os.environ.get(_config.ENV_LIVE) == "1":  # before JAX joins the job
        jax.config.update("jax_enable_recoverability", True)
    live = jax.config.jax_enable_recoverability
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = LIVE_HEARTBEAT_S if live else 100
    _config._check_options(cpu_collectives, timeout_s, heartbeat_timeout_s)
    fail_fast = _config._fail_fast(fail_fast)
    idle_loop = _config._gloo_loop_idle(os.environ)
    stall_timeout_s = _watchdog.timeout_from(stall_timeout_s, os.environ)
    requested = _config._requested_config(
        coordinator_address, num_processes, process_id
    )
    if _this.config is not None or jax.distributed.is_initialized():
        _check_same_job(requested)
        return
    given = [k for k, v in requested.items() if v is not None]
    if _jax_compat.backends_started():
        if not given:  # nothing configured: a single process, already running
            _config._check_alone(
                "JAX's backends started before `jdp.distributed.initialize` (call it "
                "first, before any other JAX call), so this process runs alone"
            )
            return
        raise RuntimeError(_TOO_LATE_MSG)
    # A platform that cannot start fails a bare `assert` in JAX at the first
    # array, in every process: say so now.
    _jax_compat.check_platforms_available()
    detected, where = _config._detected_config(requested)
    bind = _coordinator._check_coordinator_port(detected, where)
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    args = jax_initialize_args(
        detected, local_device_ids=local_device_ids, timeout_s=timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s, bind=bind,
    )  # fmt: skip
    sigterm = _exit.sigterm_handler()
    if not _join(detected, args, timeout_s=timeout_s, where=where):
        return
    _this.config = _config._joined_config(detected)
    gloo = jax.config.jax_cpu_collectives_implementation == "gloo"
    if idle_loop and gloo and _this.config["num_processes"] > 1:
        _jax_compat.idle_gloo_loop()  # see "gloo's loop thread" in performance.md
    _this.shutdown_timeout_s = timeout_s
    if requested["num_processes"] is None and _this.config["num_processes"] == 1:
        _leave_alone_job()
    if fail_fast or live:  # live: process 0 must leave last
        _run_at_exit(_shutdown_at_exit)
    if fail_fast:
        _exit.install_fail_fast(sigterm)
    if stall_timeout_s is not None:
        _start_stall_watch(stall_timeout_s)


def _leave_alone_job() -> None:
    """Raises if JAX's cluster detection made a job of one where there are several."""
    try:
        _config._check_alone("JAX's cluster detection made a job of one process")
    except RuntimeError:
        _this.config = None
        jax.distributed.shutdown()
        raise


def _start_stall_watch(timeout_s: float) -> None:
    """Starts this process's stall check (see `initialize`'s `stall_timeout_s`)."""
    client = _coordination.store()
    if client is None:
        return
    pid, n = _this.config["process_id"], _this.config["num_processes"]
    watch = _watchdog.Watchdog(client, pid, n, timeout_s, exit_fn=_exit.flush_and_exit)
    _this.stall_watch = watch.start()
    _log.info(
        "Stall check on: a process with no progress for %g s while others wait "
        "stops the job.",
        timeout_s,
    )
    # At the exit: finished (not stuck), watching the others until JAX's shutdown
    # ends, and the check's thread ended before the interpreter is (a thread still
    # inside a call of JAX's client then aborts the process).
    _run_at_exit(_shutdown_at_exit)


def _check_same_job(requested: dict) -> None:
    """Raises if this process already joined a job other than `requested`."""
    current = _this.config or {}
    clash = [k for k, v in requested.items() if v not in (None, current.get(k, v))]
    if clash:
        listed = ", ".join(f"{k}={requested[k]!r} (now {current[k]!r})" for k in clash)
        raise RuntimeError(
            "`jdp.distributed.initialize` was already called in this process "
            f"with other arguments: {listed}. A process joins one job; call it "
            "once (later calls with the same or no arguments do nothing)."
        )


def _join(requested: dict, args: dict, *, timeout_s: int, where: str) -> bool:
    """`jax.distributed.initialize(**args)`; False if there is no job to join."""
    watchdog = _coordinator._start_watchdog(requested, timeout_s=timeout_s, where=where)
    try:
        jax.distributed.initialize(**args)
    except ValueError as e:
        nothing_given = all(v is None for v in requested.values())
        if nothing_given and _jax_compat.is_no_cluster_found(e):
            _config._check_alone("JAX's cluster detection found no job to join")
            _log.info("No multi-process configuration found; running as one process.")
            return False
        raise _config._incomplete_config_error(e, requested) from e
    except RuntimeError as e:
        if _jax_compat.is_initialize_too_late(e):
            raise RuntimeError(_TOO_LATE_MSG) from e
        raise
    finally:
        if watchdog is not None:
            watchdog.cancel()
    return True


def jax_initialize_args(requested: dict, *, local_device_ids, timeout_s: int,
                        heartbeat_timeout_s: int, bind: str | None,
                        environ: dict | None = None) -> dict:  # fmt: skip
    """The keyword arguments of jdp's call of `jax.distributed.initialize`."""
    return dict(
        **requested,
        local_device_ids=_config.local_devices(local_device_ids, environ),
        initialization_timeout=timeout_s + _JAX_GRACE_S,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=timeout_s + _JAX_GRACE_S,
        coordinator_bind_address=bind,
    )


def _run_at_exit(hook) -> None:
    """Registers `hook` at exit once; it runs before JAX's own (registered earlier)."""
    if hook not in _this.exit_hooks:
        atexit.register(hook)
        _this.exit_hooks.append(hook)


def _shutdown_at_exit() -> None:
    """Leaves the job through `shutdown` (its watchdog) before JAX's handler."""
    if _this.config is not None:
        shutdown()


def shutdown() -> None:
    """Leaves the multi-process job (a barrier: waits for the other processes).

    Also done at the interpreter's exit; does nothing if this process is not
    initialized.

    Example:
      >>> import jdp
      >>> jdp.distributed.shutdown()  # nothing to do in a single process
    """
    config, _this.config = _this.config, None
    watch = _this.stall_watch
    if watch is not None:
        watch.mark_finished()  # waiting for the others is not being stuck
    try:
        if config is None or config["num_processes"] < 2 or not is_initialized():
            jax.distributed.shutdown()
            return
        _leave(config["process_id"], config["num_processes"], _this.shutdown_timeout_s)
    finally:
        if watch is not None:
            watch.stop(wait_s=_watchdog.STOP_WAIT_S)
            _this.stall_watch = None


def _leave(process_id: int, num_processes: int, timeout_s: int) -> None:
    """`jax.distributed.shutdown()`, ended after `timeout_s` with a clear message."""
    client = _coordination.store()
    args = (client, process_id, num_processes, timeout_s)
    watchdog = _exit.exit_timer(timeout_s, _shutdown_timed_out, *args)
    try:
        if client is not None:
            # The service may be gone; the barrier then says so.
            with contextlib.suppress(Exception):
                client.put(f"{_ARRIVED_KEY}{process_id}", "1")
        if process_id == 0 and jax.config.jax_enable_recoverability:
            _after_the_others()
        jax.distributed.shutdown()
    finally:
        watchdog.cancel()


def _after_the_others() -> None:
    """Process 0 waits until every other live process has left the job.

    With JAX's fault tolerance on, its shutdown does not wait for the others, and
    process 0 hosts the coordination service, whose end kills the processes
    still connected. JAX's barrier of live processes returns once every other
    process has called it or disconnected.
    """
    while True:
        with contextlib.suppress(multihost_utils.ProcessFailureError):
            with multihost_utils.live_devices(jax.devices()):
                pass
        left = multihost_utils.live_devices.devices or {}
        if all(d.process_index == 0 for d in left):
            return


def _shutdown_timed_out(client, pid: int, num: int, timeout_s: int) -> None:
    """Exits naming the processes that did not note their arrival, where known."""
    found: list = []

    def read():
        with contextlib.suppress(Exception):  # the service is gone: unknown
            found.append(client.entries(_ARRIVED_KEY))

    if client is not None:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(2.0)  # the service may not answer: do not wait for it
    arrived = _coordination.by_number(found[0], _ARRIVED_KEY) if found else None
    missing = [p for p in range(num) if arrived is not None and p not in arrived]
    who = _watchdog.process_list(missing) if missing else "the other processes"
    _exit.print_and_exit(
        _SHUTDOWN_TIMEOUT_MSG.format(pid=pid, num=num, timeout=timeout_s, who=who)
    )


def is_initialized() -> bool:
    """Whether this process has joined a multi-process job.

    Example:
      >>> import jdp
      >>> jdp.distributed.is_initialized()
      False
    """
    return jax.distributed.is_initialized()
