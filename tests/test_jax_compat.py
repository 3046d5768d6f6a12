"""Every assumption of `jdp._jax_compat`, checked against the installed JAX.

Each test provokes the real behaviour (JAX's own error, its private function, its
primitives and loggers) and checks that jdp's matcher or name still fits, so a
JAX upgrade that breaks one fails the test named after it. Code that needs a fresh
interpreter (JAX not started yet, a job joined) runs in a subprocess.
"""

import gc
import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export
from jax import lax
from jax.extend import core as jex_core

from jdp import _jax_compat
from jdp.launch._setup import free_port


def run_fresh(code, *args, env=None):
    """Runs `code` in a fresh interpreter; its last stdout line, parsed as JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_pair(worker, *args):
    """Runs `worker` as processes 0 and 1 of a job on 127.0.0.1 (argv: the
    coordinator's address, the process id, `args`); their last lines, as JSON."""
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", worker, address, str(rank), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


# -- private JAX ------------------------------------------------------------------


def test_backends_started_is_false_until_jax_starts_them():
    found = run_fresh(
        """
        import json
        import jax
        from jdp import _jax_compat
        before = _jax_compat.backends_started()
        jax.devices()
        print(json.dumps([before, _jax_compat.backends_started()]))
        """
    )
    assert found == [False, True]
    jax.devices()  # this test process started JAX long ago
    assert _jax_compat.backends_started() is True


SLURM_STEP = {
    "SLURM_JOB_ID": "4101",
    "SLURM_STEP_NODELIST": "node[007-009],other",
    "SLURM_NTASKS": "6",
    "SLURM_PROCID": "4",
    "SLURM_LOCALID": "1",
}


@pytest.mark.parametrize(
    "more, address",
    [
        ({}, f"node007:{4101 % 4096 + 61440}"),
        ({"JAX_COORDINATOR_PORT": "1234"}, "node007:1234"),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:99"}, "10.0.0.1:99"),
    ],
    ids=["job-id-port", "port-given", "address-given"],
)
def test_slurm_config_is_what_jax_detects(monkeypatch, more, address):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR")):
            monkeypatch.delenv(name)
    assert _jax_compat.slurm_config() is None
    for name, value in {**SLURM_STEP, **more}.items():
        monkeypatch.setenv(name, value)
    assert _jax_compat.slurm_config() == (address, 6, 4)
    # Open MPI's variables win in JAX's detection: then not SLURM's.
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.0.0.2:34911")
    assert _jax_compat.slurm_config() is None


def test_drop_failed_runtime_tokens_forgets_a_handled_callback_failure():
    """A callback that fails in the first call of a 2-device step leaves JAX's
    runtime tokens failed for good (later calls do not replace them)."""
    found = run_fresh(
        """
        import json
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jdp import _jax_compat

        class CheckFailed(ValueError):
            pass

        def check(x):
            if x > 0:
                raise CheckFailed("bad")
            return np.asarray(True)

        def body(x):
            ok = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.bool_), x[0])
            return jnp.where(ok, x, -1)

        mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        for value in (1, 0):  # fails, then runs
            try:
                x = jax.device_put(jnp.full(2, value), NamedSharding(mesh, P("d")))
                f(x).block_until_ready()
            except jax.errors.JaxRuntimeError:
                pass
        try:
            jax.effects_barrier()
            stayed = False
        except jax.errors.JaxRuntimeError:
            stayed = True
        other = _jax_compat.drop_failed_runtime_tokens(lambda e: False)
        ours = _jax_compat.drop_failed_runtime_tokens(lambda e: "CheckFailed" in str(e))
        jax.effects_barrier()  # nothing left to raise
        print(json.dumps([stayed, other, ours > 0]))
        """,
        env={
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        },
    )
    assert found == [True, 0, True]


def test_coordination_client_is_none_outside_a_job():
    assert _jax_compat.coordination_client() is None


def test_coordination_client_of_a_job_serves_the_key_value_store():
    # The calls jdp makes: step.shard's batch comparison, the shutdown record.
    found = run_fresh(
        """
        import json, sys
        import jax
        from jdp import _jax_compat
        jax.distributed.initialize(sys.argv[1], 1, 0)
        client = _jax_compat.coordination_client()
        client.key_value_set("jdp_test/a", "1", allow_overwrite=True)
        got = client.blocking_key_value_get("jdp_test/a", 10_000)
        listed = client.key_value_dir_get("jdp_test/")
        client.key_value_delete("jdp_test/a")
        left = client.key_value_dir_get("jdp_test/")
        jax.distributed.shutdown()
        after = _jax_compat.coordination_client()
        print(json.dumps([got, listed, left, after]))
        """,
        f"127.0.0.1:{free_port()}",
    )
    assert found == ["1", [["jdp_test/a", "1"]], [], None]


SHARED_CACHE_WORKER = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jdp import _jax_compat
address, rank, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None
)
installed = _jax_compat.share_cpu_cache_entries()
jax.distributed.initialize(address, 2, rank)
found = {"installed": installed}
for name, order in (("first", jax.devices()), ("reversed", jax.devices()[::-1])):
    mesh = Mesh(np.array(order), ("r",))
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("r")), np.full((1,), rank + 1.0, np.float32)
    )
    gather = lambda a: jax.lax.all_gather(
        a + 10 * jax.lax.axis_index("r"), "r", tiled=True
    )
    f = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    for writer in (0, 1):  # process 0 compiles (and writes) first
        if rank == writer:
            before = len(hits)
            compiled = f.lower(x).compile()
            found[name + "_hit"] = len(hits) > before
        multihost_utils.sync_global_devices(f"{name}-{writer}")
    found[name] = np.asarray(compiled(x).addressable_data(0)).tolist()
jax.distributed.shutdown()
print(json.dumps(found))
"""


def test_share_cpu_cache_entries_lets_every_process_read_any_device_orders_entry(
    tmp_path,
):
    # JAX writes entries from process 0 only; with the shared keys process 1
    # reads them, and both read an entry compiled for another device order,
    # which then runs on the order it was loaded for.
    first, second = run_pair(SHARED_CACHE_WORKER, tmp_path)
    assert first["installed"] and second["installed"]
    assert first["first_hit"] is False  # nothing written yet
    assert second["first_hit"] is True  # process 0's entry
    assert first["reversed_hit"] is True and second["reversed_hit"] is True
    # Each replica adds 10 x its position in the mesh's order.
    assert first["first"] == second["first"] == [1.0, 12.0]
    assert first["reversed"] == second["reversed"] == [2.0, 11.0]


def test_share_cpu_cache_entries_keeps_the_cpu_model_in_the_key():
    # An entry is never read on another kind of CPU (it is compiled for this one).
    host = _jax_compat._host_cpu()
    assert os.uname().machine in host
    if os.path.exists("/proc/cpuinfo") and os.uname().machine == "x86_64":
        assert "flags" in host and "sse2" in host


IDLE_LOOP_WORKER = """
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jdp import _jax_compat
address, rank = sys.argv[1], int(sys.argv[2])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
installed = rank == 0 and _jax_compat.idle_gloo_loop()  # process 1: a control
jax.distributed.initialize(address, 2, rank)
mesh = Mesh(np.array(jax.devices()), ("r",))
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("r")), np.full((4,), rank + 1.0, np.float32)
)
f = jax.jit(jax.shard_map(
    lambda a: jax.lax.psum(a, "r"), mesh=mesh, in_specs=P("r"), out_specs=P("r")
))
total = np.asarray(f(x).addressable_data(0)).tolist()
idle = [t for t in os.listdir("/proc/self/task")
        if os.sched_getscheduler(int(t)) == os.SCHED_IDLE]
for _ in range(100):  # until the loop thread is back in its wait
    tasks = os.listdir("/proc/self/task")
    if loops := [t for t in tasks if _jax_compat._waits_as_gloo_loop(t)]:
        break
    time.sleep(0.01)
jax.distributed.shutdown()
print(json.dumps({"installed": installed, "idle": idle, "loops": loops, "sum": total}))
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_idle_gloo_loop_lowers_only_the_thread_of_jaxs_gloo_loop():
    # Process 0 installs it, process 1 does not; their all-reduce still runs.
    first, second = run_pair(IDLE_LOOP_WORKER)
    assert first["installed"] is True
    assert first["sum"] == second["sum"] == [3.0] * 4
    # One thread at SCHED_IDLE, and it is the one that waits as gloo's loop does.
    assert len(first["idle"]) == 1 and first["idle"] == first["loops"]
    assert second["idle"] == [] and len(second["loops"]) == 1


# -- JAX's errors ------------------------------------------------------------------


def test_is_initialize_too_late_recognises_jax_refusing_to_join_late():
    jax.devices()  # the backends started
    with pytest.raises(RuntimeError) as e:
        jax.distributed.initialize("127.0.0.1:1234", 2, 0)
    assert _jax_compat.is_initialize_too_late(e.value), e.value
    assert not _jax_compat.is_initialize_too_late(RuntimeError("something else"))
    assert not _jax_compat.is_initialize_too_late(ValueError(str(e.value)))


def test_is_no_cluster_found_recognises_jax_finding_no_job():
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COORDINATOR", "JDP_", "SLURM_", "OMPI_", "PMI_"))
    }
    found = run_fresh(
        """
        import json
        import jax
        from jdp import _jax_compat
        found = []
        for args in [(), ("127.0.0.1:1234", 2, 5)]:  # no job; a bad process_id
            try:
                jax.distributed.initialize(*args)
            except ValueError as e:
                found.append([str(e), _jax_compat.is_no_cluster_found(e)])
        print(json.dumps(found))
        """,
        env=env,
    )
    assert [recognised for _, recognised in found] == [True, False], found


def _symbolic_export(fn):
    (batch,) = jax_export.symbolic_shape("batch")
    spec = jax.ShapeDtypeStruct((batch, 3), np.float32)
    with pytest.raises(Exception) as e:
        jax_export.export(jax.jit(fn))(spec)
    return e.value


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: jnp.zeros(int(x.shape[0])),  # "Symbolic dimension ... constant"
        lambda x: x.reshape(2, -1),  # InconclusiveDimensionOperation, no "symbolic"
        lambda x: x * float(x.shape[0]),  # TypeError naming `_DimExpr`
    ],
    ids=["int-of-dimension", "reshape", "float-of-dimension"],
)
def test_is_symbolic_dimension_error_recognises_a_symbolic_batch(fn):
    error = _symbolic_export(fn)
    assert _jax_compat.is_symbolic_dimension_error(error), repr(error)


def test_is_symbolic_dimension_error_leaves_other_errors():
    spec = jax.ShapeDtypeStruct((4, 3), np.float32)
    with pytest.raises(TypeError) as e:
        jax_export.export(jax.jit(lambda x: x @ x))(spec)  # (4, 3) @ (4, 3)
    assert not _jax_compat.is_symbolic_dimension_error(e.value), e.value


class _Handle:
    """Stands in for a value JAX cannot use (as `jdp.sparse`'s table handles)."""


@pytest.mark.parametrize(
    "use",
    [
        lambda h: jnp.take(h, jnp.arange(2), axis=0),  # passed to a jnp function
        lambda h: jnp.asarray(h),  # made an array
        lambda h: jax.eval_shape(lambda: h),  # returned from a traced function
    ],
    ids=["argument", "asarray", "returned"],
)
def test_error_names_type_recognises_a_value_of_another_type(use):
    with pytest.raises(TypeError) as e:
        use(_Handle())
    assert _jax_compat.error_names_type(e.value, _Handle), e.value
    assert not _jax_compat.error_names_type(e.value, np.ndarray)


@pytest.mark.parametrize(
    "trace",
    [
        lambda: jax.make_jaxpr(lambda x: lax.psum(x, "data"))(1.0),
        lambda: jax.jit(lambda x: x + lax.axis_index("data"))(1.0),
    ],
    ids=["psum", "axis_index"],
)
def test_is_unbound_axis_error_recognises_a_collective_outside_its_axis(trace):
    with pytest.raises(NameError) as e:
        trace()
    assert _jax_compat.is_unbound_axis_error(e.value), e.value
    assert not _jax_compat.is_unbound_axis_error(NameError("name 'x' is not defined"))
    assert not _jax_compat.is_unbound_axis_error(ValueError(str(e.value)))


# -- JAX's names -------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names = []

    def emit(self, record):
        self.names.append(record.name)


def _failing(x):
    raise ValueError("a host callback fails on purpose")


def _pure_callback():
    shape = jax.ShapeDtypeStruct((), jnp.float32)
    jax.jit(lambda x: jax.pure_callback(_failing, shape, x))(1.0).block_until_ready()


def _debug_callback():
    jax.jit(lambda x: jax.debug.callback(_failing, x))(1.0)
    jax.effects_barrier()


@pytest.mark.parametrize(
    ("run", "logger"),
    [(_pure_callback, "jax._src.callback"), (_debug_callback, "jax._src.debugging")],
    ids=["pure_callback", "debug.callback"],
)
def test_callback_loggers_log_a_failed_host_callback(run, logger):
    # A filter on a logger sees only the records created by that very logger.
    assert logger in _jax_compat.CALLBACK_LOGGERS
    records = _Records()
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(records)
    try:
        with pytest.raises(Exception, match="a host callback fails on purpose"):
            run()
    finally:
        jax_logger.removeHandler(records)
    assert logger in records.names, records.names


@pytest.fixture(scope="module")
def primitive_names():
    """The names of every primitive the installed JAX defines (and imported)."""
    return {p.name for p in gc.get_objects() if isinstance(p, jex_core.Primitive)}


@pytest.mark.parametrize(
    "name",
    sorted(
        _jax_compat.REDUCTION_PRIMITIVES
        | _jax_compat.COLLECTIVE_PRIMITIVES
        | _jax_compat.SHAPE_ONLY_PRIMITIVES
    ),
)
def test_listed_primitive_exists(primitive_names, name):
    assert name in primitive_names


def _primitive_names(fn, *args, axis_env=()):
    """The primitives of `fn`'s jaxpr, inner jaxprs included (as `_zero` reads it)."""
    closed = jax.make_jaxpr(fn, axis_env=list(axis_env))(*args)
    return {eqn.primitive.name for eqn in _jax_compat.equations(closed)}


def test_equations_reach_into_every_kind_of_nested_jaxpr():
    def fn(x):
        y = lax.cond(x.sum() > 0, lambda v: lax.psum(v, "i"), lambda v: v, x)
        y = lax.while_loop(lambda v: v.sum() > 1e9, lambda v: lax.pmax(v, "i"), y)
        y = jax.checkpoint(lambda v: lax.all_gather(v, "i"))(y)
        return lax.scan(lambda c, v: (c + lax.ppermute(v, "i", [(0, 1)]), None), y, y)

    closed = jax.make_jaxpr(fn, axis_env=[("i", 2)])(jnp.ones((2, 3)))
    names = [eqn.primitive.name for eqn in _jax_compat.equations(closed)]
    for name in ("cond", "psum", "while", "pmax", "all_gather", "scan", "ppermute"):
        assert name in names, names
    # Program order, each equation before the ones of its sub-jaxprs.
    assert names.index("cond") < names.index("psum") < names.index("while")
    assert names.index("while") < names.index("pmax")


@pytest.mark.parametrize(
    ("fn", "axes"),
    [
        (lambda x: lax.psum(x, "i"), ("i",)),
        (lambda x: lax.psum(x, ("i", "j")), ("i", "j")),
        (lambda x: lax.pmax(x, "j"), ("j",)),
        (lambda x: lax.all_gather(x, "i"), ("i",)),
        (lambda x: lax.ppermute(x, "j", [(0, 1), (1, 0)]), ("j",)),
        (lambda x: lax.psum_scatter(x, "i", tiled=True), ("i",)),
        (lambda x: x * lax.axis_index("j"), ("j",)),
    ],
    ids=["psum", "psum2", "pmax", "all_gather", "ppermute", "psum_scatter", "index"],
)
def test_collective_axes_names_the_axes_of_each_collective(fn, axes):
    closed = jax.make_jaxpr(fn, axis_env=[("i", 2), ("j", 2)])(jnp.ones((4, 3)))
    found = [
        _jax_compat.collective_axes(eqn)
        for eqn in _jax_compat.equations(closed)
        if eqn.primitive.name in _jax_compat.COLLECTIVE_PRIMITIVES
    ]
    assert found == [axes]


def _local(x):
    return x.sum() > 0


def _if(pred, then, y):
    return lax.cond(pred, then, lambda: y)


@pytest.mark.parametrize(
    ("fn", "local", "found"),
    [
        # A branch on a local value around a collective: reported.
        (lambda x, y: _if(_local(x), lambda: lax.psum(y, "i"), y), 1, ["psum"]),
        # Through a jit and arithmetic; a reduce-scatter does not agree.
        (
            lambda x, y: _if(
                jax.jit(_local)(lax.psum_scatter(x * 2, "i", tiled=True)),
                lambda: lax.pmin(y, "i"),
                y,
            ),
            1,
            ["pmin"],
        ),
        # The replica index is local too.
        (
            lambda x, y: _if(lax.axis_index("i") == 0, lambda: lax.pmax(y, "i"), y),
            0,
            ["pmax"],
        ),
        # Agreed first (a psum over the axis): fine.
        (
            lambda x, y: _if(_local(lax.psum(x, "i")), lambda: lax.psum(y, "i"), y),
            1,
            [],
        ),
        # A local branch that does not communicate, or an agreed one that does.
        (lambda x, y: _if(_local(x), lambda: y * 2, y), 1, []),
        (lambda x, y: _if(y > 0, lambda: lax.psum(y, "i"), y), 1, []),
        (lambda x, y: _if(_local(x), lambda: lax.axis_index("i") + y, y), 1, []),
    ],
    ids=[
        "cond",
        "jit-scatter",
        "axis_index",
        "agreed",
        "quiet",
        "agreed-pred",
        "index",
    ],
)
def test_collectives_under_local_branches(fn, local, found):
    closed = jax.make_jaxpr(fn, axis_env=[("i", 2)])(jnp.ones(4), jnp.ones(()))
    flags = [bool(local), False]
    assert _jax_compat.collectives_under_local_branches(closed, flags, {"i"}) == found


def test_local_outputs_follow_values_through_collectives():
    def fn(x, y):
        scattered = lax.psum_scatter(x, "i", tiled=True)
        return lax.psum(x, "i"), x * 2, y + lax.axis_index("i"), scattered, y

    closed = jax.make_jaxpr(fn, axis_env=[("i", 2)])(jnp.ones(4), jnp.ones(()))
    got = _jax_compat.local_outputs(closed, [True, False], {"i"})
    assert got == [False, True, True, True, False]


def test_collective_axes_of_an_element_wise_equation_is_empty():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3))
    eqns = _jax_compat.equations(closed)
    assert eqns and all(not _jax_compat.collective_axes(e) for e in eqns)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_key_impl_name_of_an_abstract_key_is_the_arrays_impl(impl):
    key = jax.random.key(0, impl=impl)
    abstract = jax.ShapeDtypeStruct(key.shape, key.dtype)
    assert _jax_compat.key_impl_name(abstract.dtype) == str(jax.random.key_impl(key))


@pytest.mark.parametrize(
    "line",
    [
        "[1] Gloo: Connection reset by peer [127.0.0.1]:53412",
        "[0] E1203 ... Connection closed by peer",
        "Terminating process because the coordinator detected fatal errors",
        "UNAVAILABLE: ... another task died",
    ],
)
def test_peer_left_text_recognises_a_peer_that_left(line):
    assert _jax_compat.PEER_LEFT_TEXT.search(line)


def test_peer_left_text_leaves_the_cause():
    assert not _jax_compat.PEER_LEFT_TEXT.search("ValueError: the batch is empty")


@pytest.mark.parametrize(
    ("fn", "axis_env", "listed"),
    [
        (jnp.sum, (), _jax_compat.REDUCTION_PRIMITIVES),
        (jnp.linalg.norm, (), _jax_compat.REDUCTION_PRIMITIVES),
        (lambda x: x @ x.T, (), _jax_compat.REDUCTION_PRIMITIVES),
        (jnp.cumsum, (), _jax_compat.REDUCTION_PRIMITIVES),
        (lambda x: lax.psum(x, "i"), (("i", 2),), _jax_compat.COLLECTIVE_PRIMITIVES),
        (lambda x: lax.pmax(x, "i"), (("i", 2),), _jax_compat.COLLECTIVE_PRIMITIVES),
        (
            lambda x: x * lax.axis_index("i"),
            (("i", 2),),
            _jax_compat.COLLECTIVE_PRIMITIVES,
        ),
        (lambda x: x.reshape(-1), (), _jax_compat.SHAPE_ONLY_PRIMITIVES),
        (lambda x: jnp.expand_dims(x, 0), (), _jax_compat.SHAPE_ONLY_PRIMITIVES),
        (lambda x: x[None].squeeze(0), (), _jax_compat.SHAPE_ONLY_PRIMITIVES),
        (
            lambda x: jnp.broadcast_to(x, (2, 2, 3)),
            (),
            _jax_compat.SHAPE_ONLY_PRIMITIVES,
        ),
    ],
    ids=[
        "sum",
        "norm",
        "matmul",
        "cumsum",
        "psum",
        "pmax",
        "axis_index",
        "reshape",
        "expand_dims",
        "squeeze",
        "broadcast",
    ],
)
def test_operations_trace_to_listed_primitives(fn, axis_env, listed):
    names = _primitive_names(fn, jnp.ones((2, 3)), axis_env=axis_env)
    assert names & listed, f"{sorted(names)} has none of {sorted(listed)}"


def test_element_wise_operations_trace_to_no_listed_primitive():
    names = _primitive_names(lambda x: jnp.sqrt(x * x + 1.0) / 2.0, jnp.ones(3))
    listed = (
        _jax_compat.REDUCTION_PRIMITIVES
        | _jax_compat.COLLECTIVE_PRIMITIVES
        | _jax_compat.SHAPE_ONLY_PRIMITIVES
    )
    assert not names & listed, sorted(names & listed)


def test_no_backend_for_the_requested_platform_is_a_clear_error():
    """JAX fails a bare `assert`; jdp names JAX_PLATFORMS (in a fresh process)."""
    code = "import jdp; jdp.parallelize(lambda s, b: (s, {}))"
    env = {**os.environ, "JAX_PLATFORMS": "cuda"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "RuntimeError: JAX could not start any backend for JAX_PLATFORMS='cuda'" in (
        done.stderr
    ), done.stderr[-2000:]
    assert "no CUDA backend was found" in done.stderr
    assert 'pip install "jdp[cuda12]"' in done.stderr


def test_initialize_asking_for_cuda_without_its_plugin_says_what_to_install():
    """Every process would fail JAX's bare `assert` at its first array."""
    if _jax_compat.cuda_plugin_installed():
        pytest.skip("a CUDA plugin is installed: JAX decides when it starts")
    code = "import jdp; jdp.distributed.initialize(); print('not reached')"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COORDINATOR", "JDP_", "SLURM_", "OMPI_", "PMI_"))
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "JAX_PLATFORMS": "cuda"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "not reached" not in done.stdout
    assert (
        "RuntimeError: JAX could not start any backend for JAX_PLATFORMS='cuda': no "
        "CUDA backend was found: JAX's CUDA plugin is not installed (pip install "
        '"jdp[cuda12]" (NVIDIA driver 525 or newer) or "jdp[cuda13]"'
    ) in done.stderr, done.stderr[-2000:]
    assert "AssertionError" not in done.stderr
