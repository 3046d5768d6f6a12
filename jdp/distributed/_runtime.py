"""Private: jdp's use of `jax.distributed`, JAX's own multi-process runtime.

`initialize` wraps `jax.distributed.initialize` with what a data-parallel job needs
around it: the configuration read from `JDP_*` environment variables (set by
`python -m jdp.launch`), gloo collectives on CPU, arguments checked before anything
starts, a clear error instead of a native abort (or crash) when the processes cannot
meet, leave, or host the coordinator, a coordinator that listens on loopback only
when the job is on one machine, and, when asked (`fail_fast`, the default under
`python -m jdp.launch`), a failing process that exits at once instead of waiting
for its peers. Under a cluster's scheduler it also gives each process its own
GPUs and refuses to run a process alone in a job of several (`_cluster`), and,
when asked (`stall_timeout_s`), stops a job in which a process is stuck
(`_watchdog`).

This module joins and leaves the job: it is the one caller of `jax.distributed`.
The configuration and its checks are in `_config`, the coordinator's address
and port in `_coordinator`, how a process exits (`fail_fast`) in `_exit`, and
what `initialize` set up in `_state`.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Literal

import jax

from jdp import _coordination, _jax_compat
from jdp.distributed import _watchdog
from jdp.distributed._config import (
    _GIVEN_ADDRESS,
    _check_alone,
    _check_config,
    _check_options,
    _detected_config,
    _fail_fast,
    _incomplete_config_error,
    _joined_config,
    _requested_config,
    local_devices,
)
from jdp.distributed._coordinator import _check_coordinator_port, _start_watchdog
from jdp.distributed._exit import (
    _install_fail_fast,
    _python_sigterm_handler,
    _restore_sigterm,
    flush_and_exit,
)
from jdp.distributed._state import _this

#: Extra seconds JAX's own connection deadline gets over `timeout_s`, so that
#: jdp's watchdog (a clear message) fires before JAX's native abort.
_JAX_GRACE_S = 10

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
    heartbeat_timeout_s: int = 100,
    fail_fast: bool | None = None,
    stall_timeout_s: float | None = None,
) -> None:
    """Connects this process to the others of a multi-process job.

    Call it once, first thing, in every process (before any other JAX call). It
    wraps `jax.distributed.initialize`: afterwards `jax.devices()` lists the
    devices of every process and `jdp.parallelize` spans them all (Caffe2's
    `rendezvous`, `torch.distributed.init_process_group`, Horovod's `hvd.init`).

    Where the configuration comes from, in order: the arguments; the environment
    variables `JDP_COORDINATOR_ADDRESS`, `JDP_NUM_PROCESSES` and `JDP_PROCESS_ID`
    (set by `python -m jdp.launch`); otherwise JAX's own detection of SLURM, Open
    MPI, Kubernetes or Cloud TPU. With none of these, it does nothing and the
    program runs as one process, so one script runs alone or under a launcher;
    but where the environment says that the job has several processes (a task
    count such as `$SLURM_NTASKS=4` or `$OMPI_COMM_WORLD_SIZE=4`, an indexed
    Kubernetes Job's `$JOB_COMPLETION_INDEX` above 0, a JobSet's
    `$REPLICATED_JOB_REPLICAS`), a process that finds itself alone raises
    instead of training a model of its own (an indexed Job at index 0 without
    the `kubernetes` package, which may have one pod, only logs a warning).

    A process that SLURM or Open MPI started gets the GPUs that belong to it
    (JAX alone would give it one, numbered like its local rank): the only task
    on its node, all of them; several tasks sharing the node's GPUs
    (`$SLURM_NTASKS_PER_NODE`, `$OMPI_COMM_WORLD_LOCAL_SIZE`), an equal share
    each by local rank (`$SLURM_LOCALID`, `$OMPI_COMM_WORLD_LOCAL_RANK`); a task
    whose `$CUDA_VISIBLE_DEVICES` is a subset of the node's
    (`$SLURM_GPUS_ON_NODE`; SLURM's `--gpus-per-task`), all it sees. The choice
    is logged at INFO (logger `jdp.distributed`).

    On CPU, collectives between processes use gloo over TCP. Calling it again with
    the same (or no) arguments does nothing.

    Process 0 hosts the job's coordinator (JAX's coordination service). It listens
    on the loopback address only when `coordinator_address` is one (`127.x.y.z`,
    `::1` or `localhost`: a job on one machine, so no other machine can reach
    it), and on every address of the machine otherwise (JAX's default), since
    the other machines connect to it; `$JAX_COORDINATOR_BIND_ADDRESS`
    (`"host:port"`) chooses the address itself. The coordinator accepts any
    process that connects, so on a shared network keep its port behind a
    firewall. Before starting it, process 0 checks that it can listen on the
    port, which JAX does not do (its process crashes).

    Leaving the job is a barrier: at `shutdown` a process waits for the others,
    for up to `timeout_s`; past that it prints which processes did not arrive and
    exits with status 1. At the interpreter's exit, with `fail_fast`, the same;
    without it, JAX's own exit handler waits (for `timeout_s` + 10 s) and then
    aborts the process.

    With `fail_fast` (as under `python -m jdp.launch`), SIGTERM stops the process
    as in any Python program. Otherwise JAX's preemption service takes SIGTERM
    over: it only records a preemption notice (see
    `jax.experimental.multihost_utils`) and the process runs on.

    By default `initialize` changes nothing process-wide beyond JAX's own set-up:
    not `sys.excepthook`, not a signal handler, no `atexit` handler; a program
    (or a library calling it) keeps its own. `fail_fast=True` asks for them
    (and `stall_timeout_s` adds an `atexit` handler that tells the other
    processes' stall checks that this one has finished).

    Args:
      coordinator_address: `"host:port"` of process 0, which hosts JAX's
        coordination service on that port; every process passes the same value.
      num_processes: Number of processes in the job.
      process_id: This process's index, in `[0, num_processes)`.
      local_device_ids: Restricts this process to these local accelerator ids
        (e.g. one GPU per process); passed to `jax.distributed.initialize`.
        None (default): under SLURM or Open MPI, the GPUs of this process as
        described above; otherwise every device the process sees. Given, it
        always wins.
      cpu_collectives: CPU collectives between processes: `"gloo"` (default),
        `"mpi"` (needs an MPI installation), or None to leave JAX's setting.
      timeout_s: Seconds to wait for all processes to connect (300 by default);
        also how long a finishing process waits for the others at shutdown
        before it exits with status 1.
      heartbeat_timeout_s: Seconds without a heartbeat after which the runtime
        declares a process dead and stops the others (100 by default).
      fail_fast: Whether a failing process ends at once instead of holding up
        the job. None (default): `$JDP_FAIL_FAST` decides, which
        `python -m jdp.launch` sets to "1" (unset: False). If True, once the job
        is joined, `initialize` installs three process-wide hooks: a
        `sys.excepthook` that prints an uncaught exception's traceback and exits
        the process at once (status 1; 130 for Ctrl-C), where the interpreter's
        exit would wait for the other processes at JAX's shutdown barrier (up to
        `timeout_s` + 10 s) and the job would hang; an `atexit` handler that
        leaves the job through `shutdown` (which names the processes that did
        not arrive, see above); and SIGTERM's handler from before the call, put
        back after JAX's preemption service took SIGTERM over. If False, none of
        these.
      stall_timeout_s: Seconds after which a job whose processes furthest
        behind made no progress (no jdp step started) is stopped, or None.
        None (default): `$JDP_STALL_TIMEOUT_S` decides (unset, empty or "0":
        no check). Off by default because what is a stall depends on the job
        (a long evaluation or checkpoint between two steps is not one). When
        on, each process publishes its step count through JAX's coordination
        service and a daemon thread reads the others'; when the processes
        furthest behind made no progress for `stall_timeout_s` (or processes
        wait in a step that a finished process never started), every process
        prints on stderr which process stopped first and at which step call,
        with that process's Python stack, and exits with status 124 within a
        few seconds. Nothing is judged before the first step of some process.
        Under `python -m jdp.launch`, the launcher's own check
        (`--stall-timeout`) does this already.

    Raises:
      TypeError: If an argument has the wrong type (e.g. `num_processes="2"`;
        counts, ids and seconds are ints, not bools; `fail_fast` is a bool or
        None; `stall_timeout_s` is a number or None).
      ValueError: If an argument, a `JDP_*` variable or a scheduler's variable
        read as a number (e.g. `$SLURM_NTASKS`) is malformed (e.g.
        `$JDP_FAIL_FAST` other than "0" or "1", `$JDP_STALL_TIMEOUT_S` not a
        number), a count or timeout is below 1 (`stall_timeout_s`: not above
        0), `process_id` is outside `[0, num_processes)`, or the configuration
        is incomplete; or if the SLURM / Open MPI variables contradict each
        other or the tasks of a node cannot share its GPUs evenly (the message
        names the variables; pass `local_device_ids` to choose yourself).
      RuntimeError: If `$JAX_PLATFORMS` asks for CUDA alone and JAX's CUDA
        plugin is not installed (the message says what to install), or if
        JAX's backends already started, or this process was
        already initialized with different arguments, or the environment says
        that the job has several processes (`$SLURM_NTASKS`,
        `$OMPI_COMM_WORLD_SIZE`, `$PMI_SIZE`, `$JOB_COMPLETION_INDEX`, a
        JobSet's counts) but this process would run alone (the message names
        the variable and the fix, e.g. install `jdp[k8s]` or start the
        processes with `srun`).
      OSError: On process 0, if the coordinator cannot listen on its port
        (`errno.EADDRINUSE` if the port is in use: the message names the port).
      TimeoutError: If process 0's coordinator accepts no connection within
        `timeout_s` (on processes other than 0, which log a warning every few
        seconds while they wait, naming the address and where it came from; in
        a SLURM job step, JAX's detection, which jdp asks first so that this
        applies there too).

    If the coordinator is reachable but not all `num_processes` processes connect
    within `timeout_s` (for instance a wrong process count), JAX aborts the
    process; jdp prints which process gave up, why, and how to fix it, and exits
    with status 1 just before.

    Example:
      >>> import jdp
      >>> jdp.distributed.initialize("10.0.0.1:1234", 2, 0)  # doctest: +SKIP
      >>> jdp.distributed.initialize()  # under `python -m jdp.launch` # doctest: +SKIP

      A job started otherwise (SLURM, by hand) that should fail fast too, and
      stop within a minute when a process gets stuck:

      >>> jdp.distributed.initialize(fail_fast=True)  # doctest: +SKIP
      >>> jdp.distributed.initialize(stall_timeout_s=60)  # doctest: +SKIP
    """
    _check_options(cpu_collectives, timeout_s, heartbeat_timeout_s)
    fail_fast = _fail_fast(fail_fast)
    stall_timeout_s = _watchdog.timeout_from(stall_timeout_s, os.environ)
    requested = _requested_config(coordinator_address, num_processes, process_id)
    _check_config(**requested)
    if _this.config is not None or jax.distributed.is_initialized():
        _check_same_job(requested)
        return
    given = [k for k, v in requested.items() if v is not None]
    if _jax_compat.backends_started():
        if not given:  # nothing configured: a single process, already running
            _check_alone(
                "JAX's backends started before `jdp.distributed.initialize` "
                "(call it first, before any other JAX call), so this process "
                "runs alone"
            )
            return
        raise RuntimeError(_TOO_LATE_MSG)
    # A platform that cannot start fails a bare `assert` in JAX at the first
    # array, in every process: say so now.
    _jax_compat.check_platforms_available()
    detected, where = _detected_config(requested)
    bind = _check_coordinator_port(detected, where)
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    sigterm = _python_sigterm_handler()
    joined = _join(
        detected,
        local_device_ids=local_device_ids,
        timeout_s=timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        bind=bind,
        where=where,
    )
    if not joined:
        return
    _this.config = _joined_config(detected)
    _this.shutdown_timeout_s = timeout_s
    if requested["num_processes"] is None and _this.config["num_processes"] == 1:
        _leave_alone_job()
    if fail_fast:
        _install_exit_hook()
        _restore_sigterm(sigterm)
        _install_fail_fast()
    if stall_timeout_s is not None:
        _start_stall_watch(stall_timeout_s)


def _leave_alone_job() -> None:
    """Raises if JAX's cluster detection made a job of one where there are several."""
    try:
        _check_alone("JAX's cluster detection made a job of one process")
    except RuntimeError:
        _this.config = None
        jax.distributed.shutdown()
        raise


def _start_stall_watch(timeout_s: float) -> None:
    """Starts this process's stall check (see `initialize`'s `stall_timeout_s`)."""
    client = _coordination.store()
    if client is None or _this.config is None:
        return
    _this.stall_watch = _watchdog.Watchdog(
        client,
        _this.config["process_id"],
        _this.config["num_processes"],
        timeout_s,
        exit_fn=flush_and_exit,
    ).start()
    _log.info(
        "Stall check on: a process with no progress for %g s while others wait "
        "stops the job.",
        timeout_s,
    )
    if not _this.finish_hook_installed:
        # Runs before JAX's own exit handler (registered earlier): a process at
        # its exit makes no more steps, and is not to be judged as stuck.
        atexit.register(_finished)
        _this.finish_hook_installed = True


def _finished() -> None:
    """Tells the other processes' stall checks that this one made its last step."""
    if _this.stall_watch is not None:
        _this.stall_watch.mark_finished()


def _check_same_job(requested: dict) -> None:
    """Raises if this process already joined a job other than `requested`."""
    current = _this.config or {}
    clash = {
        k: (v, current[k])
        for k, v in requested.items()
        if v is not None and k in current and current[k] != v
    }
    if clash:
        listed = ", ".join(f"{k}={v!r} (now {c!r})" for k, (v, c) in clash.items())
        raise RuntimeError(
            "`jdp.distributed.initialize` was already called in this process "
            f"with other arguments: {listed}. A process joins one job; call it "
            "once (later calls with the same or no arguments do nothing)."
        )


def _join(
    requested: dict,
    *,
    local_device_ids: int | Sequence[int] | None,
    timeout_s: int,
    heartbeat_timeout_s: int,
    bind: str | None,
    where: str = _GIVEN_ADDRESS,
) -> bool:
    """Calls `jax.distributed.initialize`; False if there is no job to join.

    With the whole configuration given, a watchdog ends the process with a clear
    message before JAX's own connection deadline aborts it. With part of it (or
    none), JAX's cluster detection fills in the rest (or fails).
    """
    given = [k for k, v in requested.items() if v is not None]
    args = jax_initialize_args(
        requested,
        local_device_ids=local_device_ids,
        timeout_s=timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        bind=bind,
    )
    watchdog = _start_watchdog(**requested, timeout_s=timeout_s, where=where)
    try:
        jax.distributed.initialize(**args)
    except ValueError as e:
        if not given and _jax_compat.is_no_cluster_found(e):
            _check_alone("JAX's cluster detection found no job to join")
            _log.info("No multi-process configuration found; running as one process.")
            return False
        raise _incomplete_config_error(e, requested) from e
    except RuntimeError as e:
        if _jax_compat.is_initialize_too_late(e):
            raise RuntimeError(_TOO_LATE_MSG) from e
        raise
    finally:
        if watchdog is not None:
            watchdog.cancel()
    return True


def jax_initialize_args(
    requested: dict,
    *,
    local_device_ids: int | Sequence[int] | None,
    timeout_s: int,
    heartbeat_timeout_s: int,
    bind: str | None,
    environ: dict | None = None,
) -> dict:
    """The keyword arguments of jdp's call of `jax.distributed.initialize`.

    An empty `local_device_ids` (a process that has its node's devices to itself)
    is passed as such: JAX 0.10 then restricts nothing, where None would let its
    cluster detection restrict the process to one device.
    """
    return dict(
        coordinator_address=requested["coordinator_address"],
        num_processes=requested["num_processes"],
        process_id=requested["process_id"],
        local_device_ids=local_devices(local_device_ids, environ),
        initialization_timeout=timeout_s + _JAX_GRACE_S,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        # jdp's own watchdog (`shutdown`) ends the wait first, with a message.
        shutdown_timeout_seconds=timeout_s + _JAX_GRACE_S,
        coordinator_bind_address=bind,
    )


def _install_exit_hook() -> None:
    """Makes the interpreter's exit leave the job through `shutdown` (its watchdog).

    Registered after JAX's own exit handler, so it runs first (handlers run in
    reverse order); JAX's then finds the job already left.
    """
    if not _this.exit_hook_installed:
        atexit.register(_shutdown_at_exit)
        _this.exit_hook_installed = True


def _shutdown_at_exit() -> None:
    if _this.config is not None:
        shutdown()


def shutdown() -> None:
    """Leaves the multi-process job (a barrier: waits for the other processes).

    Called automatically when the interpreter exits (by jdp's exit hook with
    `initialize`'s `fail_fast`, else by JAX's own); call it yourself to leave
    earlier. Does nothing if this process is not initialized.

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
            watch.stop()
            _this.stall_watch = None


def _leave(process_id: int, num_processes: int, timeout_s: int) -> None:
    """`jax.distributed.shutdown()`, ended after `timeout_s` s with a clear message.

    JAX's shutdown is a barrier of every process; past its deadline JAX aborts the
    process (SIGABRT) with a message about "Shutdown barrier has failed". Here a
    watchdog stops the wait first and names the processes that did not arrive
    (each process notes its arrival in the coordination service first).
    """
    client = _coordination.store()
    watchdog = threading.Timer(
        timeout_s,
        _shutdown_timed_out,
        args=(client, process_id, num_processes, timeout_s),
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        if client is not None:
            try:
                client.put(f"{_ARRIVED_KEY}{process_id}", "1")
            except Exception:  # the service may be gone; the barrier then says so
                pass
        jax.distributed.shutdown()
    finally:
        watchdog.cancel()


def _not_arrived(client, num_processes: int, wait_s: float = 2.0) -> list[int] | None:
    """The processes that did not note their arrival at shutdown (None: unknown)."""
    found: list = []

    def read():
        try:
            found.append(client.entries(_ARRIVED_KEY))
        except Exception:  # the service is gone (process 0 left): unknown
            pass

    if client is None:
        return None
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(wait_s)  # the service may not answer: do not wait for it
    if not found:
        return None
    arrived = set()
    for key in found[0]:
        tail = key.rstrip("/").rpartition("/")[2]
        if tail.isdigit():
            arrived.add(int(tail))
    return [p for p in range(num_processes) if p not in arrived]


def _shutdown_timed_out(client, process_id: int, num: int, timeout_s: int) -> None:
    missing = _not_arrived(client, num)
    if missing:
        noun = "process" if len(missing) == 1 else "processes"
        who = f"{noun} {', '.join(map(str, missing))}"
    else:
        who = "the other processes"
    print(
        _SHUTDOWN_TIMEOUT_MSG.format(
            pid=process_id, num=num, timeout=timeout_s, who=who
        ),
        file=sys.stderr,
        flush=True,
    )
    flush_and_exit(1)


def is_initialized() -> bool:
    """Whether this process has joined a multi-process job.

    Example:
      >>> import jdp
      >>> jdp.distributed.is_initialized()
      False
    """
    return jax.distributed.is_initialized()
