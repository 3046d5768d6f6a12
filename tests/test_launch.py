"""`python -m jdp.launch` and `jdp.launch.run`: real processes, bounded time.

These jobs do not join JAX's distributed runtime (tests/multiprocess/ does): they
check what the launcher itself does with its processes.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import jdp
from jdp.launch import __main__ as launch_main
from jdp.launch import _launcher

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

# The launcher must notice a failure and stop the job within this many seconds.
PROMPT_S = 30

ECHO = """
import os, sys
print(f"hello from {os.environ['JDP_PROCESS_ID']} of "
      f"{os.environ['JDP_NUM_PROCESSES']} args={sys.argv[1:]} name={__name__}")
print(f"to stderr from {os.environ['JDP_PROCESS_ID']}", file=sys.stderr)
"""

EXIT_3_ON_PROCESS_1 = """
import os, sys, time
if os.environ["JDP_PROCESS_ID"] == "1":
    sys.exit(3)
time.sleep(300)
"""

SLEEP = """
import os, time
print(f"ready {os.getpid()}", flush=True)
time.sleep(300)
"""


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def launcher(args, *, cwd=None):
    return subprocess.Popen(
        [sys.executable, "-m", "jdp.launch", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )


def finish(proc, timeout=PROMPT_S + 30):
    """Waits for the launcher; if it hangs, SIGTERM it (it stops its children)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=_launcher.FORWARD_GRACE_S + 10)
        finally:
            proc.kill()
        pytest.fail(f"the launcher did not finish within {timeout} s")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_dead(pids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def read_ready_pids(proc, n):
    pids = []
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, "the launcher's output ended early"
        m = re.match(r"\[\d\] ready (\d+)$", line.strip())
        if m:
            pids.append(int(m.group(1)))
    return pids


# -- the command line --------------------------------------------------------


def test_cli_runs_the_script_in_every_process_with_prefixed_output(tmp_path):
    script = write(tmp_path, "echo.py", ECHO)
    proc = launcher(["--num-processes", 2, script, "a", "--b"])
    out, err = finish(proc)
    assert proc.returncode == 0, err
    for rank in (0, 1):
        assert f"[{rank}] hello from {rank} of 2 args=['a', '--b'] name=__main__" in out
        assert f"[{rank}] to stderr from {rank}" in err


def test_cli_runs_a_module_with_dash_m(tmp_path):
    write(tmp_path, "echo_module.py", ECHO)
    proc = launcher(["--num-processes", 1, "-m", "echo_module", "x"], cwd=tmp_path)
    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert "[0] hello from 0 of 1 args=['x'] name=__main__" in out


def test_cli_failure_stops_the_others_and_returns_the_exit_status(tmp_path):
    script = write(tmp_path, "exit3.py", EXIT_3_ON_PROCESS_1)
    start = time.monotonic()
    proc = launcher(["--num-processes", 2, script])
    _, err = finish(proc)
    assert proc.returncode == 3
    assert re.search(
        r"jdp.launch: process 1 of 2 \(pid \d+\) exited with status 3; "
        r"stopped the other process\.",
        err,
    ), err
    assert time.monotonic() - start < PROMPT_S


def test_cli_forwards_sigterm_to_every_process(tmp_path):
    script = write(tmp_path, "sleep.py", SLEEP)
    proc = launcher(["--num-processes", 2, script])
    try:
        pids = read_ready_pids(proc, 2)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = finish(proc)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "jdp.launch: stopped by SIGTERM." in err
    assert time.monotonic() - start < PROMPT_S
    assert wait_dead(pids, 5) == []


def test_processes_exit_when_the_launcher_is_killed(tmp_path):
    script = write(tmp_path, "sleep.py", SLEEP)
    proc = launcher(["--num-processes", 2, script])
    try:
        pids = read_ready_pids(proc, 2)
        proc.kill()  # SIGKILL: the launcher cannot stop its children itself
        proc.communicate(timeout=10)
        assert wait_dead(pids, 15) == []
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_cli_timeout_stops_the_job(tmp_path):
    script = write(tmp_path, "sleep.py", SLEEP)
    proc = launcher(["--num-processes", 1, "--timeout", 3, script])
    _, err = finish(proc)
    assert proc.returncode == 124
    assert re.search(r"did not finish within 3 s; stopped it", err), err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-processes", "0", "x.py"], "expected an integer >= 1, got 0"),
        (["--num-processes", "two", "x.py"], "expected an integer, got 'two'"),
        (["--nprocs", "0", "x.py"], "expected an integer >= 1, got 0"),
        (["x.py"], "the following arguments are required: --num-processes"),
        (["--num-processes", "1", "--timeout", "0", "x.py"], "a number > 0, got 0"),
        (["--num-processes", "1", "--timeout", "soon", "x.py"], "got 'soon'"),
    ],
    ids=["zero", "not-an-int", "alias-zero", "missing", "timeout", "timeout-text"],
)
def test_cli_rejects_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        launch_main.main(args)  # the code `python -m jdp.launch` runs
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# -- jdp.launch.run -------------------------------------------------------------


def describe_process(tag):
    import jax

    return {
        "tag": tag,
        "pid": os.getpid(),
        "process_id": os.environ["JDP_PROCESS_ID"],
        "num_processes": os.environ["JDP_NUM_PROCESSES"],
        "coordinator": os.environ["JDP_COORDINATOR_ADDRESS"],
        "local_devices": jax.local_device_count(),
    }


def test_run_returns_each_process_result_in_order():
    results = jdp.launch.run(
        describe_process,
        2,
        args=("t",),
        devices_per_process=3,
        initialize=False,
        timeout_s=60,
    )
    assert [r["process_id"] for r in results] == ["0", "1"]
    assert {r["num_processes"] for r in results} == {"2"}
    assert {r["tag"] for r in results} == {"t"}
    assert len({r["coordinator"] for r in results}) == 1
    assert re.fullmatch(r"127\.0\.0\.1:\d+", results[0]["coordinator"])
    assert [r["local_devices"] for r in results] == [3, 3]
    assert os.getpid() not in {r["pid"] for r in results}
    assert wait_dead([r["pid"] for r in results], 5) == []


def fail_on_process_1():
    if os.environ["JDP_PROCESS_ID"] == "1":
        raise KeyError("no such key on purpose")
    time.sleep(300)


def test_run_raises_with_the_failing_process_traceback():
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"(?s)process 1 of 2 \(pid \d+\) exited with status 1; stopped the "
        r"other process\..*Last output of process 1:.*KeyError: 'no such key on "
        r"purpose'",
    ):
        jdp.launch.run(fail_on_process_1, 2, initialize=False, timeout_s=60)
    assert time.monotonic() - start < PROMPT_S


def sleep_long():
    time.sleep(300)


def test_run_timeout_stops_every_process():
    with pytest.raises(TimeoutError, match=r"did not finish within 2 s; stopped it"):
        jdp.launch.run(sleep_long, 2, initialize=False, timeout_s=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_processes": 0}, r"`num_processes` must be an int >= 1, got 0\."),
        (
            {"num_processes": 2, "devices_per_process": 0},
            r"`devices_per_process` must be an int >= 1 \(or None to keep the "
            r"environment's device count\), got 0\.",
        ),
        ({"num_processes": 1, "timeout_s": 0}, r"`timeout_s` must be a number of"),
    ],
    ids=["num_processes", "devices_per_process", "timeout_s"],
)
def test_run_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jdp.launch.run(sleep_long, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_processes": "2"},
            r"`num_processes` must be an int >= 1, got '2' \(a str\)\.",
        ),
        ({"num_processes": True}, r"`num_processes` .* got True \(a bool\)"),
        ({"num_processes": 2.0}, r"`num_processes` .* got 2\.0 \(a float\)"),
        (
            {"num_processes": 2, "devices_per_process": "2"},
            r"`devices_per_process` must be an int >= 1 .* got '2' \(a str\)",
        ),
        (
            {"num_processes": 1, "timeout_s": "60"},
            r"`timeout_s` must be a number of seconds > 0 .* got '60' \(a str\)",
        ),
    ],
    ids=[
        "num_processes-str",
        "num_processes-bool",
        "num_processes-float",
        "devices_per_process",
        "timeout_s",
    ],
)
def test_run_rejects_bad_types(kwargs, message):
    with pytest.raises(TypeError, match=message):
        jdp.launch.run(sleep_long, **kwargs)


def test_run_no_longer_takes_nprocs():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'nprocs'"):
        jdp.launch.run(sleep_long, nprocs=2)


@pytest.mark.parametrize("flag", ["--num-processes", "--nprocs"])
@pytest.mark.parametrize("joined", [False, True], ids=["separate", "joined"])
def test_cli_accepts_nprocs_as_an_alias_of_num_processes(flag, joined):
    argv = [f"{flag}=3"] if joined else [flag, "3"]
    ns = launch_main._parser().parse_args([*argv, "x.py", "a"])
    assert ns.num_processes == 3
    assert (ns.target, ns.args) == ("x.py", ["a"])
    assert not hasattr(ns, "nprocs")


def test_cli_passes_num_processes_to_the_launcher(monkeypatch):
    calls = []
    monkeypatch.setattr(
        launch_main, "launch_command", lambda *a, **k: calls.append((a, k)) or 0
    )
    assert launch_main.main(["--nprocs", "2", "x.py"]) == 0
    assert launch_main.main(["--num-processes", "2", "x.py"]) == 0
    assert calls[0] == calls[1]
    assert calls[0][1]["num_processes"] == 2


def test_process_env_sets_the_job_and_replaces_the_device_count():
    base = {"XLA_FLAGS": "--foo=1 --xla_force_host_platform_device_count=8 --bar"}
    env = _launcher.process_env(
        base, process_id=1, num_processes=3, port=1234, devices_per_process=2
    )
    assert env["JDP_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert env["JDP_NUM_PROCESSES"] == "3"
    assert env["JDP_PROCESS_ID"] == "1"
    assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:1234"
    assert env["XLA_FLAGS"].split() == [
        "--foo=1",
        "--bar",
        "--xla_force_host_platform_device_count=2",
    ]
    assert env["JAX_NUM_CPU_DEVICES"] == "2"
    kept = _launcher.process_env(
        base, process_id=0, num_processes=1, port=1, devices_per_process=None
    )
    assert kept["XLA_FLAGS"] == base["XLA_FLAGS"]
    assert "JAX_NUM_CPU_DEVICES" not in kept


RUN_FROM_A_SCRIPT = """
import os
import jdp.launch

def where_am_i(x):
    return (int(os.environ["JDP_PROCESS_ID"]), x, __name__)

if __name__ == "__main__":
    print(jdp.launch.run(where_am_i, 2, args=(7,), initialize=False, quiet=True))
"""


def test_run_accepts_a_function_of_the_launching_script(tmp_path):
    script = write(tmp_path, "spawn.py", RUN_FROM_A_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=PROMPT_S + 30,
    )
    assert proc.returncode == 0, proc.stderr
    # The script is imported again in each process, not run as __main__.
    assert proc.stdout.strip() == "[(0, 7, '__mp_main__'), (1, 7, '__mp_main__')]"


def test_run_rejects_an_unpicklable_function():
    with pytest.raises(TypeError, match=r"`fn` is pickled by reference.*lambda"):
        jdp.launch.run(lambda: 0, 1, initialize=False)
