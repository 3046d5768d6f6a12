"""Private: everything jdp assumes about JAX beyond its public API, in one place.

Each docstring names the JAX version it was checked against and what public API
is missing; `tests/test_jax_compat.py` checks each against the installed JAX.
Where JAX moved something, the answer is a safe default or "not recognised".
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def backends_started() -> bool:
    """Whether JAX's backends started (e.g. after `jax.devices()` or an array).

    `jax._src.xla_bridge.backends_are_initialized` (JAX 0.10): no public API
    asks without starting them.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX moved it
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(check()) if callable(check) else False


def coordination_client() -> Any:
    """This process's client of JAX's coordination service; None if not joined.

    `jax._src.distributed.global_state.client` (JAX 0.10): no public API reaches
    the service's key-value store.
    """
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - JAX moved it
        return None
    state = getattr(distributed, "global_state", None)
    return getattr(state, "client", None)


def slurm_config() -> tuple[str, int, int] | None:
    """`(coordinator_address, num_processes, process_id)` JAX detects under SLURM.

    None where JAX 0.10's `distributed.initialize()` would not pick SLURM.
    `jax._src.clusters.ClusterEnv`: no public API says what the detection finds,
    and jdp needs the address to watch the connection.
    """
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - JAX moved it
        return None
    env = None
    # JAX takes the first environment present, in this order; those after SLURM
    # are not asked (Cloud TPU's detection may query a metadata server).
    for cluster in getattr(clusters.ClusterEnv, "_cluster_types", []):
        if getattr(cluster, "opt_in_only_method", False):
            continue
        if cluster.is_env_present():
            env = cluster
            break
        if getattr(cluster, "name", None) == "slurm":
            break
    if env is None or getattr(env, "name", None) != "slurm":
        return None
    address = os.environ.get("JAX_COORDINATOR_ADDRESS") or env.get_coordinator_address(
        timeout_secs=None,
        override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"),
    )
    return address, env.get_process_count(), env.get_process_id()


def drop_failed_runtime_tokens(is_expected: Callable[[BaseException], bool]) -> int:
    """Forgets the failed runtime tokens whose errors `is_expected` accepts.

    JAX 0.10 waits at exit on each device's last side-effecting computation and
    prints a failed one's error; `jax._src.dispatch.runtime_tokens`: no public
    API clears it. Returns how many were dropped.
    """
    try:
        from jax._src import dispatch
    except ImportError:  # pragma: no cover - JAX moved it
        return 0
    tokens = getattr(dispatch, "runtime_tokens", None)
    dropped = 0
    for name in ("current_tokens", "output_runtime_tokens"):
        table = getattr(tokens, name, None)
        if not isinstance(table, dict):
            continue
        for key, token in list(table.items()):
            try:
                token.block_until_ready()
            except Exception as e:  # the computation's own error
                if is_expected(e):
                    del table[key]
                    dropped += 1
    return dropped


# -- JAX's errors, recognised by their text (JAX 0.10 has no type for them) --------


def is_initialize_too_late(error: BaseException) -> bool:
    """Whether `error` is JAX refusing `distributed.initialize` after backends start."""
    return isinstance(error, RuntimeError) and "must be called before" in str(error)


def is_no_cluster_found(error: BaseException) -> bool:
    """Whether `error` is JAX's `distributed.initialize` finding no job to join."""
    return isinstance(error, ValueError) and "coordinator_address" in str(error)


def is_symbolic_dimension_error(error: BaseException) -> bool:
    """Whether `error` comes from a shape-polymorphic export's symbolic dimension.

    Not all are `jax.errors.InconclusiveDimensionOperation`: some only say so.
    """
    if isinstance(error, jax.errors.InconclusiveDimensionOperation):
        return True
    text = str(error)
    return "_DimExpr" in text or "symbolic" in text.lower()


def error_names_type(error: BaseException, cls: type) -> bool:
    """Whether JAX's `TypeError` about a value it cannot use names the type `cls`."""
    return cls.__name__ in str(error)


def is_unbound_axis_error(error: BaseException) -> bool:
    """Whether `error` is a collective traced outside any mapping of its axis."""
    return isinstance(error, NameError) and "unbound axis name" in str(error)


# -- JAX's names -------------------------------------------------------------------

#: The loggers through which JAX 0.10 logs an exception raised inside a host
#: callback (`jax.pure_callback`, `jax.debug.callback`); no public switch for it.
CALLBACK_LOGGERS = ("jax._src.callback", "jax._src.debugging")

#: JAX 0.10's primitives that reduce over, or combine elements across, a whole
#: operand. JAX has no public classification of its primitives.
REDUCTION_PRIMITIVES = frozenset(
    {
        "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
        "reduce_or", "reduce_xor", "argmax", "argmin", "dot_general", "cumsum",
        "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
        "conv_general_dilated", "reduce",
    }
)  # fmt: skip

#: JAX 0.10's primitives that communicate across a mapped axis (or read the
#: position on it).
COLLECTIVE_PRIMITIVES = frozenset(
    {
        "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
        "reduce_scatter", "psum_invariant", "pbroadcast", "axis_index",
    }
)  # fmt: skip

#: JAX 0.10's primitives that only change an operand's rank or shape (present or
#: not depending on the operands' ranks).
SHAPE_ONLY_PRIMITIVES = frozenset({"broadcast_in_dim", "reshape", "squeeze"})


def equations(closed_jaxpr: Any) -> list[Any]:
    """Every equation of a traced function, nested jaxprs' included: jdp's one walk.

    In program order, an equation before its sub-jaxprs' own.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jdp import _jax_compat
      >>> closed = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))
      >>> [e.primitive.name for e in _jax_compat.equations(closed(1.0))]
      ['gt', 'convert_element_type', 'cond', 'cos', 'sin']
    """
    from jax.extend import core as jex_core

    out: list[Any] = []

    def visit(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            out.append(eqn)
            for sub in jex_core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(getattr(closed_jaxpr, "jaxpr", closed_jaxpr))  # or an open jaxpr
    return out


def collective_axes(eqn: Any) -> tuple[Any, ...]:
    """The mapped axes a collective equation communicates over; () for others.

    JAX 0.10's parameter `axes` or `axis_name` (parameters have no public schema).
    """
    axes = eqn.params.get("axes", eqn.params.get("axis_name"))
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


#: Collectives whose result is the same on every replica of the axes they span
#: (JAX 0.10's primitive names; a name JAX adds is "not recognised": its result
#: counts as differing, which can only make `collectives_under_local_branches`
#: report more).
_AGREEING = frozenset(
    {"psum", "pmax", "pmin", "all_gather", "psum_invariant", "pbroadcast"}
)
_COMMUNICATING = COLLECTIVE_PRIMITIVES - {"axis_index"}


def collectives_under_local_branches(
    closed_jaxpr: Any, local_inputs: list[bool], axes: set[str]
) -> list[str]:
    """Where a `cond` on replica-local values holds a collective over `axes`.

    See `replica_locality`, which this returns the first part of.
    """
    return replica_locality(closed_jaxpr, local_inputs, axes)[0]


def local_outputs(
    closed_jaxpr: Any, local_inputs: list[bool], axes: set[str]
) -> list[bool]:
    """Per output of `closed_jaxpr`, whether it may differ between replicas.

    See `replica_locality`, which this returns the second part of.
    """
    return replica_locality(closed_jaxpr, local_inputs, axes)[1]


def replica_locality(
    closed_jaxpr: Any, local_inputs: list[bool], axes: set[str]
) -> tuple[list[str], list[bool]]:
    """`(collectives under local branches, local outputs)` of a traced function.

    The first part: where a `cond` on replica-local values holds a collective over
    `axes`.

    Such a branch is taken by some replicas and not by others, which then wait
    in the collective forever (XLA aborts the process after its rendezvous
    timeout). `local_inputs`: per input of `closed_jaxpr`, whether its value
    differs between replicas. A value is local when it depends on a local one,
    or on `axis_index`, except through a collective of `_AGREEING` over all of
    `axes`. Returns the primitive names of the offending collectives, and per
    output of `closed_jaxpr` whether it is local.

    Walks the jaxpr's equations (JAX 0.10: `cond`'s `branches`, one-jaxpr calls
    such as `pjit` mapped input for input; other nested jaxprs taken as local
    wherever an input is). No public API follows values through a jaxpr.
    """
    from jax.extend import core as jex_core

    found: list[str] = []

    def communicates(jaxpr) -> list[str]:
        return [
            e.primitive.name
            for e in equations(jaxpr)
            if e.primitive.name in _COMMUNICATING and set(collective_axes(e)) & axes
        ]

    def walk(jaxpr, local_in) -> list[bool]:
        local = {v for v, loc in zip(jaxpr.invars, local_in, strict=True) if loc}

        def is_local(v):
            return not isinstance(v, jex_core.Literal) and v in local

        for eqn in jaxpr.eqns:
            ins = [is_local(v) for v in eqn.invars]
            subs = list(jex_core.jaxprs_in_params(eqn.params))
            name = eqn.primitive.name
            if name == "axis_index":
                outs = [True] * len(eqn.outvars)
            elif name in _AGREEING and axes <= set(collective_axes(eqn)):
                outs = [False] * len(eqn.outvars)
            elif name == "cond":
                branches = [b.jaxpr for b in eqn.params["branches"]]
                if ins[0]:
                    found.extend(c for b in branches for c in communicates(b))
                per = [walk(b, ins[1:]) for b in branches]
                outs = [ins[0] or any(col) for col in zip(*per, strict=True)]
            elif (
                len(subs) == 1
                and len(subs[0].invars) == len(eqn.invars)
                and len(subs[0].outvars) == len(eqn.outvars)
            ):
                outs = walk(subs[0], ins)
            else:
                outs = [any(ins)] * len(eqn.outvars)
            local.update(v for v, loc in zip(eqn.outvars, outs, strict=True) if loc)
        return [is_local(v) for v in jaxpr.outvars]

    outputs = walk(closed_jaxpr.jaxpr, local_inputs)
    return found, outputs


def key_impl_name(dtype: Any) -> str:
    """The PRNG implementation's name of a typed-key dtype, e.g. "threefry2x32".

    `jax.random.key_impl` takes arrays only: the dtype's private `_impl` (JAX 0.10).
    """
    return dtype._impl.name


#: What a process prints when it fails because a peer left (gloo, gRPC and the
#: coordination service in JAX 0.10 on CPU; no error type of their own).
PEER_LEFT_TEXT = re.compile(
    r"Connection (reset|closed) by peer|detected fatal errors|another task died"
)


#: The modules of JAX's CUDA plugins (the `jax[cuda12]` and `jax[cuda13]` extras).
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")

#: The names `$JAX_PLATFORMS` gives NVIDIA GPUs.
CUDA_PLATFORMS = ("cuda", "gpu")


def cuda_plugin_installed() -> bool:
    """Whether one of JAX's CUDA plugins is installed (without importing it)."""
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def _requested_platforms() -> str | None:
    return jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS")


def _cuda_only(requested: str | None) -> bool:
    platforms = {p.strip() for p in (requested or "").split(",") if p.strip()}
    return bool(platforms) and platforms <= set(CUDA_PLATFORMS)


def no_backend_message(requested: str | None) -> str:
    """Why JAX starts no backend for `$JAX_PLATFORMS` = `requested`, and the fix."""
    asked = f" for JAX_PLATFORMS={requested!r}" if requested else ""
    install = (
        'pip install "jdp[cuda12]" (NVIDIA driver 525 or newer) or "jdp[cuda13]" '
        "(driver 580 or newer)"
    )
    if not _cuda_only(requested):
        why = f"the platform asked for is not available here (for a GPU: {install})"
    elif cuda_plugin_installed():
        why = (
            "no CUDA backend was found: JAX's CUDA plugin is installed, but it "
            "found no usable NVIDIA GPU (none on this machine, or a driver older "
            f"than its CUDA needs; `nvidia-smi` shows the driver: {install})"
        )
    else:
        why = (
            f"no CUDA backend was found: JAX's CUDA plugin is not installed ({install})"
        )
    return (
        f"JAX could not start any backend{asked}: {why}. Or unset JAX_PLATFORMS, "
        "or set it to a platform this machine has (e.g. JAX_PLATFORMS=cpu); "
        "JAX's log above, if any, says why the backend failed."
    )


def check_platforms_available() -> None:
    """A `RuntimeError` where `$JAX_PLATFORMS` asks for CUDA alone and no plugin has it.

    Checked without starting JAX's backends (they would fail a bare `assert`).
    """
    requested = _requested_platforms()
    if _cuda_only(requested) and not cuda_plugin_installed():
        raise RuntimeError(no_backend_message(requested))


def devices() -> list[Any]:
    """`jax.devices()`, with a clear `RuntimeError` where JAX found no backend.

    JAX 0.10 fails an internal `assert` for a platform it cannot start.
    """
    try:
        return jax.devices()
    except AssertionError as e:
        raise RuntimeError(no_backend_message(_requested_platforms())) from e


def _host_cpu() -> str:
    """This machine's architecture, and on Linux its CPU's model and features."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]  # the first processor's block
    except OSError:  # pragma: no cover - not Linux
        first = ""
    names = ("model name", "flags", "Features", "CPU part")
    kept = [x for x in first.splitlines() if x.split(":")[0].strip() in names]
    return "\n".join([platform.machine(), *kept])


def share_cpu_cache_entries() -> bool:
    """Persistent-cache keys of CPU programs alike in every process and device order.

    JAX 0.10's `jax._src.cache_key.get` drops the device assignment from keys on
    GPU only, and hashes the devices' topology, which on CPU differs per process:
    a CPU program written by process 0 (the only writer) is never read by another
    process, nor for another order of the same devices. A CPU executable is given
    its device assignment when it is loaded, as on GPU, so this drops it from CPU
    keys and hashes the number of devices and this machine's CPU (model and
    features: an entry is not read on another kind of CPU) instead of the
    topology. Installed once, for the process; False where JAX moved these.
    """
    try:
        import copy

        from jax._src import cache_key
        from jax._src.lib import xla_client
    except ImportError:  # pragma: no cover - JAX moved them
        return False
    get, config = cache_key.get, cache_key._hash_accelerator_config
    if getattr(get, "_jdp_shared", False):
        return True
    host = _host_cpu()

    def shared_get(module, devices, options, backend, *args, **kwargs):
        if backend.platform == "cpu" and options.device_assignment is not None:
            shape = (
                options.device_assignment.replica_count(),
                options.device_assignment.computation_count(),
            )
            options = copy.deepcopy(options)
            ids = np.arange(shape[0] * shape[1]).reshape(shape)
            options.device_assignment = xla_client.DeviceAssignment.create(ids)
        return get(module, devices, options, backend, *args, **kwargs)

    def shared_config(hash_obj, devices):
        if all(d.platform == "cpu" for d in devices.flat):
            hash_obj.update(f"cpu x {devices.size}\n{host}".encode())
        else:
            config(hash_obj, devices)

    shared_get._jdp_shared = True
    cache_key.get, cache_key._hash_accelerator_config = shared_get, shared_config
    return True


#: Linux's numbers of `epoll_wait` / `epoll_pwait`, by machine.
_EPOLL_WAITS = {"x86_64": ("232", "281"), "aarch64": ("22",)}


def _waits_as_gloo_loop(tid: str) -> bool:
    """Whether thread `tid` waits as gloo's TCP loop: `epoll_wait(fd, ev, 64, 10)`."""
    import platform

    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            call = f.read().split()
    except OSError:
        return False
    waits = _EPOLL_WAITS.get(platform.machine(), ())
    return len(call) > 4 and call[0] in waits and call[3:5] == ["0x40", "0xa"]


def idle_gloo_loop() -> bool:
    """Runs gloo's TCP loop thread, started by JAX's CPU backend, at `SCHED_IDLE`.

    The gloo of jaxlib 0.10 spins in `epoll_wait` while a peer's data waits for a
    receive not yet posted, and keeps the core the thread that would post it was
    woken on: on a process bound to one core each all-reduce waited for the
    scheduler's tick (4 ms for 4 KiB, against 0.2 ms). A thread at `SCHED_IDLE` is
    preempted by any other. Wraps JAX 0.10's CPU backend factory
    (`jax._src.xla_bridge._backend_factories["cpu"]`, no public hook runs before
    a backend starts) to find the thread among those it starts. Installed once,
    before the backends start; False where not on Linux or JAX moved the factory.
    """
    if not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"):
        return False
    try:
        from jax._src import xla_bridge

        registration = xla_bridge._backend_factories["cpu"]
    except (ImportError, AttributeError, KeyError):  # pragma: no cover - moved
        return False
    make = registration.factory
    if getattr(make, "_jdp_idle_loop", False):
        return True

    def make_cpu_client(*args, **kwargs):
        before = set(os.listdir("/proc/self/task"))
        client = make(*args, **kwargs)
        new = set(os.listdir("/proc/self/task")) - before
        for _ in range(50):  # started, the loop thread waits in `epoll_wait`
            if loops := [int(t) for t in new if _waits_as_gloo_loop(t)]:
                for tid in loops:
                    with contextlib.suppress(OSError):  # the thread ended
                        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                break
            time.sleep(0.002)
        return client

    make_cpu_client._jdp_idle_loop = True
    registration.factory = make_cpu_client
    return True
