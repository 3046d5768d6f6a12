"""Private: everything jdp assumes about JAX beyond its public API, in one place.

Where JAX has no public API for what jdp needs, jdp reads JAX's private modules
(`jax._src`), recognises JAX's errors by their text, or names JAX's primitives and
loggers. Each such assumption is one small function or constant here, whose
docstring names the JAX version it was checked against and the public API that is
missing; no other module of jdp does any of this. `tests/test_jax_compat.py` checks
each one against the installed JAX (it provokes the real error, calls the real
private function), so after a JAX upgrade a failing test there names the
assumption that broke, and the fix goes in this file.

The private functions fall back to a safe answer if JAX moved them (JAX's own
behaviour then shows through, e.g. its own error), and the text matchers to "not
recognised" (the error is raised unchanged, without jdp's explanation).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from typing import Any

import jax

# -- private JAX ------------------------------------------------------------------


def backends_started() -> bool:
    """Whether JAX's backends started (e.g. after `jax.devices()` or an array).

    Private JAX (`jax._src.xla_bridge.backends_are_initialized`, JAX 0.10): no
    public API asks this without starting the backends (`jax.devices()` and
    `jax.extend.backend.backends()` start them). `initialize` of
    `jax.distributed` uses this very function to refuse to run too late, but only
    to raise. False if JAX moved it (JAX's own check, `is_initialize_too_late`,
    still applies).

    Example:
      >>> import jax
      >>> from jdp import _jax_compat
      >>> _ = jax.devices()
      >>> _jax_compat.backends_started()
      True
    """
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX moved it
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(check()) if callable(check) else False


def coordination_client() -> Any:
    """This process's client of JAX's coordination service; None if not joined.

    Private JAX (`jax._src.distributed.global_state.client`, JAX 0.10): JAX has no
    public API for the coordination service's key-value store, which jdp uses
    through the client's `key_value_set`, `blocking_key_value_get`,
    `key_value_dir_get` and `key_value_delete`. None if JAX moved it.

    Example:
      >>> from jdp import _jax_compat
      >>> _jax_compat.coordination_client() is None  # a single process never joined
      True
    """
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - JAX moved it
        return None
    state = getattr(distributed, "global_state", None)
    return getattr(state, "client", None)


def slurm_config() -> tuple[str, int, int] | None:
    """What JAX's `distributed.initialize()` detects in a SLURM job step, or None.

    `(coordinator_address, num_processes, process_id)` as JAX 0.10 fills them in
    when none is given: `$JAX_COORDINATOR_ADDRESS`, else the first host of
    `$SLURM_STEP_NODELIST` with `$JAX_COORDINATOR_PORT` (else a port derived
    from `$SLURM_JOB_ID`); `$SLURM_NTASKS`; `$SLURM_PROCID`. None where JAX
    would not pick SLURM (its variables incomplete, or an environment JAX
    checks first, such as Open MPI's, present). Private JAX
    (`jax._src.clusters.ClusterEnv` and its `SlurmCluster`): no public API says
    what JAX's cluster detection would find, and jdp needs the address to watch
    the connection (JAX aborts the process when the coordinator never comes up).
    None if JAX moved them (JAX then detects SLURM itself).

    Example:
      >>> from jdp import _jax_compat
      >>> _jax_compat.slurm_config() is None  # not in a SLURM job step
      True
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
    """Forgets the failures of dispatched computations that `is_expected` accepts.

    JAX 0.10 keeps, per device, the runtime token of the last computation with
    side effects (a host callback) that it dispatched through its Python path,
    and waits on them at interpreter exit (`atexit`, twice), printing
    "Exception ignored in atexit callback" with the computation's error. A
    computation that failed on purpose in its first call (a host check that
    raised, its error delivered when the outputs were read) keeps its failed
    token there for good: its later calls (here: a `shard_map` step over
    several devices) do not replace it, and `jax.effects_barrier()` raises
    before it clears them. Private JAX (`jax._src.dispatch.runtime_tokens`):
    no public API clears a failed token. Waits for each token (they are done
    at exit); returns how many were dropped. 0 if JAX moved it.

    Example:
      >>> from jdp import _jax_compat
      >>> _jax_compat.drop_failed_runtime_tokens(lambda e: False)
      0
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


# -- JAX's errors, recognised by their text ----------------------------------------


def is_initialize_too_late(error: BaseException) -> bool:
    """Whether `error` is JAX's refusal to join a job after its backends started.

    `initialize` of `jax.distributed` (JAX 0.10) raises a plain `RuntimeError`
    ("... must be called before any JAX calls that might initialise the XLA
    backend ...") when the backends already started; JAX has no exception type of
    its own for this.

    Example:
      >>> from jdp import _jax_compat
      >>> _jax_compat.is_initialize_too_late(RuntimeError("other"))
      False
    """
    return isinstance(error, RuntimeError) and "must be called before" in str(error)


def is_no_cluster_found(error: BaseException) -> bool:
    """Whether `error` is JAX's `distributed.initialize` finding no job to join.

    Called without a coordinator address, and with none in the environment or
    from its cluster detection (SLURM, Open MPI, Kubernetes, Cloud TPU), JAX 0.10
    raises a plain `ValueError("coordinator_address should be defined.")`; no
    public API tells whether a cluster was detected.

    Example:
      >>> from jdp import _jax_compat
      >>> _jax_compat.is_no_cluster_found(ValueError("bad process_id"))
      False
    """
    return isinstance(error, ValueError) and "coordinator_address" in str(error)


def is_symbolic_dimension_error(error: BaseException) -> bool:
    """Whether `error` comes from a shape-polymorphic export's symbolic dimension.

    A model traced with a symbolic batch size (`jax.export.symbolic_shape`) fails
    where it needs a concrete one. In JAX 0.10 some of these errors are the
    public `jax.errors.InconclusiveDimensionOperation` (a comparison or a
    division of dimensions), others only say so in their text: a `TypeError`
    naming JAX's private class of symbolic dimensions, `_DimExpr` (e.g. from
    `float(x.shape[0])`), or a message about a "symbolic" dimension. JAX has no
    common exception type for them.

    Example:
      >>> import jax
      >>> from jdp import _jax_compat
      >>> _jax_compat.is_symbolic_dimension_error(
      ...     jax.errors.InconclusiveDimensionOperation("'batch' > '3'")
      ... )
      True
    """
    if isinstance(error, jax.errors.InconclusiveDimensionOperation):
        return True
    text = str(error)
    return "_DimExpr" in text or "symbolic" in text.lower()


def error_names_type(error: BaseException, cls: type) -> bool:
    """Whether JAX's `error` about a value it cannot use names the type `cls`.

    JAX 0.10 reports a value of a non-JAX type passed to (or returned from) a
    traced function with a `TypeError` whose text names its type (e.g. "The
    problematic value is of type <class '...Handle'>", "... returned a value of
    type <class '...Handle'>, which is not a valid JAX type"), or shows the
    value's default `repr`, which names it too. No public attribute of the error
    carries the value or its type.

    Example:
      >>> from jdp import _jax_compat
      >>> class Handle: ...
      >>> _jax_compat.error_names_type(TypeError("type <class 'Handle'>"), Handle)
      True
    """
    return cls.__name__ in str(error)


def is_unbound_axis_error(error: BaseException) -> bool:
    """Whether `error` is JAX's error for a collective over an unknown axis name.

    A collective (`lax.psum`, `lax.axis_index`, ...) traced outside any mapping of
    its axis name raises, in JAX 0.10, a plain `NameError` ("Found an unbound
    axis name: data. ..."); JAX has no exception type of its own for it.

    Example:
      >>> from jdp import _jax_compat
      >>> _jax_compat.is_unbound_axis_error(NameError("name 'x' is not defined"))
      False
    """
    return isinstance(error, NameError) and "unbound axis name" in str(error)


# -- JAX's names -------------------------------------------------------------------

#: The loggers through which JAX 0.10 logs an exception raised inside a host
#: callback (`jax.pure_callback`, `jax.debug.callback`) before the computation
#: fails: `logging.getLogger(__name__)` in the private modules that run them.
#: JAX has no public switch for this log; if the modules move, a filter added to
#: these loggers just stops applying.
CALLBACK_LOGGERS = ("jax._src.callback", "jax._src.debugging")

#: Names of JAX 0.10's primitives that reduce over, or combine elements across, a
#: whole operand (sums, norms, matrix products, scans, sorts). JAX has no public
#: classification of its primitives; `jax.extend.core.Primitive` gives only the
#: name.
REDUCTION_PRIMITIVES = frozenset(
    {
        "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
        "reduce_or", "reduce_xor", "argmax", "argmin", "dot_general", "cumsum",
        "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
        "conv_general_dilated", "reduce",
    }
)  # fmt: skip

#: Names of JAX 0.10's primitives that communicate across a mapped axis (or read
#: the position on it). As for `REDUCTION_PRIMITIVES`, no public classification.
COLLECTIVE_PRIMITIVES = frozenset(
    {
        "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
        "reduce_scatter", "psum_invariant", "pbroadcast", "axis_index",
    }
)  # fmt: skip

#: Names of JAX 0.10's primitives that only change an operand's rank or shape,
#: whose presence in a jaxpr depends on the operands' ranks (`jnp.expand_dims`
#: is a `broadcast_in_dim` or a `reshape`, not a primitive of its own).
SHAPE_ONLY_PRIMITIVES = frozenset({"broadcast_in_dim", "reshape", "squeeze"})


def equations(closed_jaxpr: Any) -> list[Any]:
    """Every equation of a traced function, those of nested jaxprs included.

    The one walk over a jaxpr in jdp (`jax.make_jaxpr`'s result in, equations in
    program order out, an equation holding a sub-jaxpr before that sub-jaxpr's
    own). Each has `.primitive.name`, `.outvars` (their `.aval`) and
    `.params`; read parameters through `collective_axes`.
    `jax.extend.core.jaxprs_in_params` is public; the nesting is JAX 0.10's.

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

    visit(closed_jaxpr.jaxpr)
    return out


def collective_axes(eqn: Any) -> tuple[Any, ...]:
    """The mapped axes a collective equation communicates over; () for others.

    JAX 0.10 names them `axes` (`psum`, `pmax`, ...) or `axis_name`
    (`all_gather`, `ppermute`, ...): equation parameters have no public schema.
    A name is a string, or a tuple of names for several axes.
    """
    axes = eqn.params.get("axes", eqn.params.get("axis_name"))
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def key_impl_name(dtype: Any) -> str:
    """The PRNG implementation's name of a typed-key dtype (`key<fry>`: "threefry2x32").

    `jax.random.key_impl` takes arrays only; no public API reads it from the
    dtype of an abstract key (a `ShapeDtypeStruct`), so this reads the dtype's
    private `_impl` (JAX 0.10).
    """
    return dtype._impl.name


#: What a process prints when it fails because a peer left: gloo's and gRPC's
#: "Connection reset/closed by peer", and the coordination service's "detected
#: fatal errors" / "another task died" (JAX 0.10 on CPU). JAX raises these as
#: `JaxRuntimeError` or aborts, with no error type of their own.
PEER_LEFT_TEXT = re.compile(
    r"Connection (reset|closed) by peer|detected fatal errors|another task died"
)


#: The modules of JAX's CUDA plugins (the `jax[cuda12]` and `jax[cuda13]`
#: extras install them); JAX has no public API listing the plugins installed.
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")

#: The names `$JAX_PLATFORMS` gives NVIDIA GPUs.
CUDA_PLATFORMS = ("cuda", "gpu")


def cuda_plugin_installed() -> bool:
    """Whether one of JAX's CUDA plugins is installed (without importing it).

    Example:
      >>> from jdp import _jax_compat
      >>> isinstance(_jax_compat.cuda_plugin_installed(), bool)
      True
    """
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def no_backend_message(requested: str | None) -> str:
    """Why JAX starts no backend for `$JAX_PLATFORMS` = `requested`, and the fix."""
    asked = f" for JAX_PLATFORMS={requested!r}" if requested else ""
    platforms = {p.strip() for p in (requested or "").split(",") if p.strip()}
    install = (
        'pip install "jdp[cuda12]" (NVIDIA driver 525 or newer) or "jdp[cuda13]" '
        "(driver 580 or newer)"
    )
    if platforms and platforms <= set(CUDA_PLATFORMS):
        why = (
            "no CUDA backend was found: JAX's CUDA plugin is installed, but it "
            "found no usable NVIDIA GPU (none on this machine, or a driver older "
            "than its CUDA needs; `nvidia-smi` shows the driver: "
            f"{install})"
            if cuda_plugin_installed()
            else "no CUDA backend was found: JAX's CUDA plugin is not installed "
            f"({install})"
        )
    else:
        why = (
            "the platform asked for is not available here (for a GPU: " + install + ")"
        )
    return (
        f"JAX could not start any backend{asked}: {why}. Or unset JAX_PLATFORMS, "
        "or set it to a platform this machine has (e.g. JAX_PLATFORMS=cpu); "
        "JAX's log above, if any, says why the backend failed."
    )


def check_platforms_available() -> None:
    """Raises where `$JAX_PLATFORMS` asks for CUDA alone and no plugin provides it.

    Checked without starting JAX's backends (they would fail a bare `assert`
    later, at the first array). The CUDA plugin installed on a machine without
    a usable GPU is found only when the backends start (`devices`).

    Raises:
      RuntimeError: Naming `$JAX_PLATFORMS` and what to install.
    """
    requested = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS")
    platforms = {p.strip() for p in (requested or "").split(",") if p.strip()}
    if platforms and platforms <= set(CUDA_PLATFORMS) and not cuda_plugin_installed():
        raise RuntimeError(no_backend_message(requested))


def devices() -> list[Any]:
    """`jax.devices()`, with a clear error where JAX found no backend at all.

    Asked for a platform it cannot start (`JAX_PLATFORMS=cuda` on a machine
    without a GPU, or without the `jax[cuda12]` / `jax[cuda13]` plugin), JAX
    0.10 fails an internal `assert` with no message; no public exception says
    so.

    Raises:
      RuntimeError: Naming `JAX_PLATFORMS` and how to fix it (what to install
        for CUDA), in place of JAX's bare `AssertionError`.
    """
    try:
        return jax.devices()
    except AssertionError as e:
        requested = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS")
        raise RuntimeError(no_backend_message(requested)) from e
