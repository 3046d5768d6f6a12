"""`jdp.distributed` checks and the 2-D `(host, device)` mesh, in one process.

Real multi-process jobs live in tests/multiprocess/. Here the 8 simulated devices of
this process are split into 2 pretend hosts of 4 (by patching how devices are
grouped), which exercises the same hierarchical program on one machine.
"""

import errno
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    init_mlp,
    make_batches,
    mlp_loss,
    single_device_train,
)

import jdp
from jdp._layout import _mesh
from jdp.distributed import _config, _coordinator
from jdp.launch import _setup
from jdp.launch._setup import free_port

HOST_MESH = ("host", "device")


@pytest.fixture
def two_hosts(monkeypatch):
    """Groups the 8 local devices as 2 hosts of 4, as 2 processes would be."""

    def host_groups(devices):
        devices = list(devices)
        half = len(devices) // 2
        return [devices[:half], devices[half:]]

    monkeypatch.setattr(_mesh, "host_groups", host_groups)


# -- jdp.distributed.initialize ------------------------------------------------


@pytest.fixture
def no_job_env(monkeypatch):
    for name in (
        "JDP_COORDINATOR_ADDRESS",
        "JDP_NUM_PROCESSES",
        "JDP_PROCESS_ID",
        "JDP_FAIL_FAST",
        "JDP_GLOO_LOOP_IDLE",
        "JAX_COORDINATOR_ADDRESS",
        "JDP_STALL_TIMEOUT_S",
    ):
        monkeypatch.delenv(name, raising=False)
    # A cluster's variables (a test run inside a SLURM job or a pod) would make a
    # process that runs alone an error.
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_")) or name in (
            "JOB_COMPLETION_INDEX",
            "REPLICATED_JOB_REPLICAS",
            "GLOBAL_REPLICAS",
        ):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {"cpu_collectives": "nccl"}, r"`cpu_collectives` must be one of"),
        ((), {"timeout_s": 0}, r"`timeout_s` must be an int >= 1 \(seconds\), got 0"),
        ((), {"heartbeat_timeout_s": -1}, r"`heartbeat_timeout_s` must be an int >="),
        (
            ("127.0.0.1:1234", 2, 2),
            {},
            r"`process_id` must be an int in \[0, num_processes=2\), got 2\.",
        ),
        ((), {"process_id": -1}, r"`process_id` must be an int >= 0, got -1\."),
        (("127.0.0.1:1234", 0, 0), {}, r"`num_processes` must be an int >= 1, got 0"),
        (("localhost", 2, 0), {}, r"`coordinator_address` must look like 'host:port'"),
    ],
    ids=[
        "collectives",
        "timeout",
        "heartbeat",
        "process-id",
        "process-id-alone",
        "num",
        "address",
    ],
)
def test_initialize_rejects_bad_arguments(no_job_env, args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jdp.distributed.initialize(*args, **kwargs)
    assert not jdp.distributed.is_initialized()


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (
            ("127.0.0.1:1234", "2", 0),
            {},
            r"`num_processes` must be an int >= 1, got '2' \(a str\)\.",
        ),
        (("127.0.0.1:1234", True, 0), {}, r"`num_processes` .* got True \(a bool\)"),
        (
            ("127.0.0.1:1234", 2, "0"),
            {},
            r"`process_id` must be an int in \[0, num_processes=2\), got '0' "
            r"\(a str\)\.",
        ),
        ((), {"process_id": 0.0}, r"`process_id` must be an int >= 0, got 0\.0"),
        ((1234, 2, 0), {}, r"`coordinator_address` must be a str 'host:port'.*"),
        ((), {"timeout_s": 1.5}, r"`timeout_s` .* got 1\.5 \(a float\)"),
        ((), {"heartbeat_timeout_s": 1.5}, r"`heartbeat_timeout_s` must be an int"),
        (
            (),
            {"fail_fast": 1},
            r"`fail_fast` must be a bool, or None to read \$JDP_FAIL_FAST; got 1 "
            r"\(an int\)\.",
        ),
    ],
    ids=[
        "num-str",
        "num-bool",
        "process-id-str",
        "process-id-alone",
        "address",
        "timeout",
        "heartbeat",
        "fail-fast",
    ],
)
def test_initialize_rejects_arguments_of_the_wrong_type(
    no_job_env, args, kwargs, message
):
    with pytest.raises(TypeError, match=message):
        jdp.distributed.initialize(*args, **kwargs)
    assert not jdp.distributed.is_initialized()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "JDP_NUM_PROCESSES",
            "two",
            r"\$JDP_NUM_PROCESSES must be an integer, got 'two'",
        ),
        (
            "JDP_FAIL_FAST",
            "yes",
            r"\$JDP_FAIL_FAST must be '1' \(fail fast\) or '0', got 'yes'",
        ),
        (
            "JDP_GLOO_LOOP_IDLE",
            "on",
            r"\$JDP_GLOO_LOOP_IDLE must be '1' \(gloo's TCP loop thread at "
            r"SCHED_IDLE\) or '0' \(default priority\), got 'on'\. Unset, it is "
            r"SCHED_IDLE where the process is bound to one core\.",
        ),
    ],
    ids=["num-processes", "fail-fast", "gloo-loop-idle"],
)
def test_initialize_names_a_malformed_environment_variable(
    no_job_env, monkeypatch, name, value, message
):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        jdp.distributed.initialize()


@pytest.mark.parametrize(
    ("env", "cores", "online", "expected"),
    [
        (None, 1, 4, True),  # bound to one core of several: its threads share it
        (None, 2, 4, False),  # several cores: others may use them
        (None, 1, 1, False),  # the machine's one core: other processes share it
        ("0", 1, 2, False),
        ("1", 2, 2, True),
    ],
)
def test_gloo_loop_idle_where_bound_or_asked(env, cores, online, expected):
    environ = {} if env is None else {"JDP_GLOO_LOOP_IDLE": env}
    assert _config._gloo_loop_idle(environ, cores, online) is expected


@pytest.mark.parametrize(
    ("fail_fast", "env", "expected"),
    [
        (None, None, False),
        (None, "0", False),
        (None, "1", True),
        (False, "1", False),
        (True, None, True),
    ],
)
def test_fail_fast_defaults_to_the_environment(
    no_job_env, monkeypatch, fail_fast, env, expected
):
    if env is not None:
        monkeypatch.setenv("JDP_FAIL_FAST", env)
    assert _config._fail_fast(fail_fast) is expected


def test_launcher_asks_its_processes_to_fail_fast():
    env = _setup.process_env(
        {}, process_id=0, num_processes=2, port=1234, devices_per_process=None
    )
    assert env[_config.ENV_FAIL_FAST] == "1"


def test_initialize_after_jax_started_says_to_call_it_first(no_job_env):
    jax.devices()  # this test process started JAX long ago
    with pytest.raises(RuntimeError, match=r"must run before JAX starts its backends"):
        jdp.distributed.initialize("127.0.0.1:1234", 2, 0)
    with pytest.raises(RuntimeError, match=r"must run before JAX starts"):
        jdp.distributed.initialize(process_id=0)  # partly from arguments
    assert not jdp.distributed.is_initialized()


def test_initialize_without_any_configuration_runs_one_process(no_job_env):
    assert jdp.distributed.initialize() is None
    assert not jdp.distributed.is_initialized()
    assert jax.process_count() == 1
    jdp.distributed.shutdown()  # nothing to leave: no error


@pytest.fixture
def held_port():
    """A free port on 127.0.0.1 that this test listens on (so: in use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def run_python(code, *args, timeout=60):
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_initialize_on_a_port_in_use_raises_instead_of_crashing(no_job_env, held_port):
    # JAX's coordinator crashes its process (SIGSEGV) on a port in use.
    proc = run_python(
        "import sys, jdp; jdp.distributed.initialize(sys.argv[1], 2, 0, timeout_s=5)",
        f"127.0.0.1:{held_port}",
    )
    assert proc.returncode == 1, proc.stderr
    assert re.search(
        rf"OSError: \[Errno {errno.EADDRINUSE}\] `jdp\.distributed\.initialize`: "
        rf"process 0 hosts the job's coordinator, but port {held_port} on "
        r"127\.0\.0\.1 is already in use \(another program, or the coordinator of "
        r"another job, listens on it\)\. Pick a free port in the address "
        rf"\(now '127\.0\.0\.1:{held_port}', from `coordinator_address` \(or "
        r"\$JDP_COORDINATOR_ADDRESS\)\), or "
        r"start the job with `python -m jdp\.launch` without `--port`, which picks a "
        r"free one\.",
        proc.stderr,
    ), proc.stderr


def test_listen_error_sees_a_port_in_use_on_every_address(held_port):
    # JAX's default listening address, [::]:port, includes 127.0.0.1:port.
    error = _coordinator.listen_error(f"[::]:{held_port}")
    assert error is not None and error.errno == errno.EADDRINUSE
    assert _coordinator.listen_reason(error, f"[::]:{held_port}") == (
        f"port {held_port} on every address is already in use (another program, "
        "or the coordinator of another job, listens on it)"
    )
    assert _coordinator.listen_error(f"127.0.0.1:{free_port()}") is None


@pytest.mark.parametrize(
    ("address", "bind"),
    [
        ("127.0.0.1:1234", "127.0.0.1:1234"),
        ("127.0.0.2:1234", "127.0.0.2:1234"),
        ("localhost:1234", "127.0.0.1:1234"),
        ("LOCALHOST:1234", "127.0.0.1:1234"),
        ("[::1]:1234", "[::1]:1234"),
        ("10.0.0.1:1234", None),
        ("node-0.cluster:1234", None),
    ],
)
def test_coordinator_binds_loopback_only_for_a_loopback_address(
    no_job_env, address, bind
):
    assert _coordinator.bind_address(address) == bind


def test_coordinator_bind_address_from_the_environment_wins(no_job_env, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "0.0.0.0:4321")
    assert _coordinator.bind_address("127.0.0.1:4321") == "0.0.0.0:4321"


def listening_addresses(port):
    """The addresses that TCP sockets listen on at `port` (Linux's /proc/net)."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
        for row in rows:
            host, port_hex = row[1].split(":")
            if row[3] != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(host)
            if sys.byteorder == "little":  # printed one 32-bit word at a time
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(raw)
            if address.version == 6 and address.ipv4_mapped:
                address = address.ipv4_mapped
            found.append(address)
    return found


LISTEN = """
import sys, time
import jdp
jdp.distributed.initialize(sys.argv[1], 1, 0, timeout_s=30)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp6"), reason="reads Linux's /proc/net/tcp6"
)
def test_coordinator_at_a_loopback_address_listens_on_loopback_only(no_job_env):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTEN, f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = proc.stdout.readline()  # "" if the process ended
        addresses = listening_addresses(port)
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert ready == "ready\n", err
    # JAX's default would be every address: [::] (and so 0.0.0.0).
    assert addresses == [ipaddress.ip_address("127.0.0.1")]


# What `initialize` changes process-wide: by default nothing beyond JAX's own
# set-up. `signal.signal` is wrapped to see every handler jdp sets; SIGTERM's own
# handler (set before `initialize`) shows whether SIGTERM still reaches Python
# afterwards (JAX's preemption service takes the signal over).
HOOKS = """
import atexit, json, os, signal, sys
import jdp

kwargs = json.loads(sys.argv[2])
received = []
signal.signal(signal.SIGTERM, lambda *_: received.append("SIGTERM"))
set_handlers = []
set_handler = signal.signal
signal.signal = lambda sig, handler: set_handlers.append(sig) or set_handler(
    sig, handler
)
excepthook, sigterm = sys.excepthook, signal.getsignal(signal.SIGTERM)
callbacks = atexit._ncallbacks()
jdp.distributed.initialize(sys.argv[1], 1, 0, timeout_s=30, **kwargs)
found = {
    "excepthook": "replaced" if sys.excepthook is not excepthook else "kept",
    "fail_fast_hook": getattr(sys.excepthook, "jdp_fail_fast", False),
    "signal_handlers_set": set_handlers,
    "sigterm_handler": "kept" if signal.getsignal(signal.SIGTERM) is sigterm else "?",
    "atexit_added": atexit._ncallbacks() - callbacks,
}
if kwargs.get("fail_fast") or os.environ.get("JDP_FAIL_FAST") == "1":
    signal.raise_signal(signal.SIGTERM)  # reaches the handler set above again
    found["sigterm_received"] = received
jdp.distributed.shutdown()
print(json.dumps(found), flush=True)
"""


@pytest.mark.parametrize(
    ("kwargs", "env", "fail_fast"),
    [({}, None, False), ({"fail_fast": True}, None, True), ({}, "1", True)],
    ids=["default", "fail-fast", "launcher-env"],
)
def test_initialize_installs_process_hooks_only_when_asked(
    no_job_env, kwargs, env, fail_fast
):
    environ = {k: v for k, v in os.environ.items() if k != "JDP_FAIL_FAST"}
    if env is not None:
        environ["JDP_FAIL_FAST"] = env
    proc = subprocess.run(
        [sys.executable, "-c", HOOKS, f"127.0.0.1:{free_port()}", json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if not fail_fast:
        assert found == {
            "excepthook": "kept",
            "fail_fast_hook": False,
            "signal_handlers_set": [],
            "sigterm_handler": "kept",
            "atexit_added": 0,
        }
    else:
        # The exit hook, SIGTERM's handler put back, the fail-fast excepthook.
        assert found == {
            "excepthook": "replaced",
            "fail_fast_hook": True,
            "signal_handlers_set": [signal.SIGTERM],
            "sigterm_handler": "kept",
            "atexit_added": 1,
            "sigterm_received": ["SIGTERM"],
        }


# -- parallelize(..., axis_name=("host", "device")) -----------------------------


def test_host_mesh_training_matches_single_device(two_hosts):
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0))
    batches = make_batches(10, 32)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, axis_name=HOST_MESH), axis_name=HOST_MESH
    )
    assert dict(step.mesh.shape) == {"host": 2, "device": 4}
    assert step.axis_name == HOST_MESH
    assert step.num_replicas == 8
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    # One copy per replica, over both mesh axes.
    assert state.params["layer0"]["w"].shape == (8, 8, 16)
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    expected, _ = single_device_train(mlp_loss, params, tx, batches)
    assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5)
    jdp.assert_replicas_in_sync(state)


@pytest.mark.parametrize("flatten", [True, False], ids=["flat", "tuple"])
def test_host_mesh_gradients_equal_the_flat_mean(two_hosts, flatten):
    # Leaf sizes 5 and 3 are not multiples of 4 devices per host: padding path.
    def grads_step(state, batch):
        g = {"a": batch.sum() * jnp.arange(5.0), "b": batch[0] * jnp.ones(3)}
        out = jdp.all_reduce_gradients(g, axis_name=HOST_MESH, flatten=flatten)
        return state, {"a": out["a"], "b": out["b"]}

    step = jdp.parallelize(grads_step, axis_name=HOST_MESH)
    x = np.arange(16.0, dtype=np.float32)
    _, metrics = step(step.replicate({}), step.shard(x))
    per_replica = x.reshape(8, 2)
    np.testing.assert_allclose(
        metrics["a"], per_replica.sum(1).mean() * np.arange(5.0), rtol=1e-6
    )
    np.testing.assert_allclose(metrics["b"], per_replica[:, 0].mean() * np.ones(3))


def test_host_mesh_reduces_within_hosts_then_across(two_hosts):
    def grads_step(state, batch):
        g = jdp.all_reduce_gradients(
            {"w": batch.sum() * jnp.ones(12)}, axis_name=HOST_MESH, flatten=True
        )
        return state, {"w": g["w"].sum()}

    step = jdp.parallelize(grads_step, axis_name=HOST_MESH)
    ops = step.collectives(step.replicate({}), step.shard(np.ones(8, np.float32)))
    within = ((0, 1, 2, 3), (4, 5, 6, 7))
    across = ((0, 4), (1, 5), (2, 6), (3, 7))
    kinds = [(c.kind, c.replica_groups, c.result_bytes) for c in ops]
    # 48 bytes scattered within each host, 1/4 of them (12 bytes) sent across.
    assert kinds[:3] == [
        ("reduce-scatter", within, 12),
        ("all-reduce", across, 12),
        ("all-gather", within, 48),
    ]


def zero_training(axis_name, batches, params, tx):
    step = jdp.parallelize(
        jdp.make_train_step(
            mlp_loss, jdp.zero(tx), sync=jdp.local(), axis_name=axis_name
        ),
        axis_name=axis_name,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=jdp.zero(tx)))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return step, state


def test_zero_on_the_host_mesh_equals_the_flat_mesh(two_hosts):
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0))
    batches = make_batches(4, 32)
    flat_step, flat = zero_training("data", batches, params, tx)
    host_step, host = zero_training(HOST_MESH, batches, params, tx)
    got, want = host_step.unreplicate(host), flat_step.unreplicate(flat)
    assert_trees_close(got.params, want.params, rtol=1e-6)
    assert_trees_close(got.opt_state.chunks, want.opt_state.chunks, rtol=1e-6)
    expected, _ = single_device_train(mlp_loss, params, tx, batches)
    assert_trees_close(host_step.unreplicate(host).params, expected, rtol=1e-5)
    # The reduce-scatter and the all-gather run within hosts, then across.
    ops = host_step.collectives(host, host_step.shard(batches[0]))
    within = ((0, 1, 2, 3), (4, 5, 6, 7))
    across = ((0, 4), (1, 5), (2, 6), (3, 7))
    # (The all-reduce left out is the loss metric's mean.)
    assert [(c.kind, c.replica_groups) for c in ops if c.kind != "all-reduce"] == [
        ("reduce-scatter", within),
        ("reduce-scatter", across),
        ("all-gather", across),
        ("all-gather", within),
    ]


def test_export_of_host_mesh_params_gives_one_copy(two_hosts):
    step = jdp.parallelize(lambda s, b: (s, {}), axis_name=HOST_MESH)
    w = jnp.arange(6.0).reshape(3, 2)
    params = step.replicate({"w": w})
    predictor = jdp.load_predictor(
        jdp.export_predictor(lambda p, x: x @ p["w"], params, (jnp.ones((5, 3)),))
    )
    out = predictor(np.ones((5, 3), np.float32))
    assert out.shape == (5, 2)
    np.testing.assert_allclose(out, np.ones((5, 3)) @ np.asarray(w))


def test_host_mesh_on_one_process_is_a_single_row():
    step = jdp.parallelize(lambda s, b: (s, {}), axis_name=HOST_MESH)
    assert dict(step.mesh.shape) == {"host": 1, "device": jax.device_count()}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"axis_name": ("a", "b", "c")}, r"`axis_name` must be one name.*two names"),
        ({"axis_name": ("a", "a")}, r"`axis_name` must be one name"),
        ({"axis_name": ""}, r"`axis_name` must be one name"),
        ({"axis_name": ("a", 1)}, r"got \('a', 1\)"),
        (
            {"axis_name": HOST_MESH, "backend": "pmap"},
            r"needs backend='shard_map' \(pmap maps over one axis only\)",
        ),
    ],
    ids=["three-names", "same-names", "empty", "not-a-name", "pmap"],
)
def test_two_axis_names_reject_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jdp.parallelize(lambda s, b: (s, {}), **kwargs)


def test_axis_name_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"`axis_name` must be a str.*got 3 \(an int\)"):
        jdp.parallelize(lambda s, b: (s, {}), axis_name=3)


def test_parallelize_needs_devices_of_every_process(monkeypatch):
    # Pretend to be one of 2 processes: all 8 devices belong to process 0.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(
        ValueError, match=r"every process must hold the same number.*process 1: 0"
    ):
        jdp.parallelize(lambda s, b: (s, {}))


# An uncaught error after the stall check decided to stop the job (a collective
# failing because another process already left) exits with the stall's status.
STOPPING_THEN_RAISES = """
import sys, types
from jdp.distributed import _exit, _state
sys.excepthook = _exit._exit_on_uncaught(sys.excepthook)
if sys.argv[1] == "stopping":
    _state._this.stall_watch = types.SimpleNamespace(stopping=124)
raise ValueError("Gloo all-reduce failed: connection closed by peer")
"""


@pytest.mark.parametrize("state, code", [("stopping", 124), ("running", 1)])
def test_an_error_after_the_stall_verdict_exits_with_its_status(state, code):
    proc = subprocess.run(
        [sys.executable, "-c", STOPPING_THEN_RAISES, state],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == code, proc.stderr
    assert "Gloo all-reduce failed" in proc.stderr
