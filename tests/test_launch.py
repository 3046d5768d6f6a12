"""`python -m jdp.launch` and `jdp.launch.run`: real processes, bounded time.

These jobs do not join JAX's distributed runtime (tests/multiprocess/ does): they
check what the launcher itself does with its processes.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types

import pytest

import jdp
from jdp import _progress
from jdp.launch import __main__ as launch_main
from jdp.launch import _launcher, _restarts, _setup, _stall, _worker

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


# Process 1 stops before its step STUCK_AT (argv[1]); process 0 goes on forever.
# Both start stepping together (files in the directory argv[2]), as after a
# collective: a process still starting is not stuck.
STUCK_PROCESS_1 = """
import os, sys, time
from jdp import _progress
stuck_at, meet = int(sys.argv[1]), sys.argv[2]
print(f"ready {os.getpid()}", flush=True)
open(os.path.join(meet, os.environ["JDP_PROCESS_ID"]), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(meet)) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
for step in range(1, 1_000_000):
    if os.environ["JDP_PROCESS_ID"] == "1" and step == stuck_at:
        time.sleep(300)  # alive, but stuck
    _progress.beat()  # what a jdp step does as it starts
    time.sleep(0.02)
"""
STUCK_LINE = (
    textwrap.dedent(STUCK_PROCESS_1)
    .splitlines()
    .index("        time.sleep(300)  # alive, but stuck")
    + 1
)

INITIALIZE = """
import jdp
jdp.distributed.initialize(timeout_s=10)
print("initialized", flush=True)
"""


def meeting_dir(tmp_path):
    path = tmp_path / "meet"
    path.mkdir()
    return path


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


def test_cli_refuses_a_port_in_use_before_starting_anything(tmp_path):
    # Without the check, JAX's coordinator crashes process 0 (SIGSEGV).
    script = write(tmp_path, "initialize.py", INITIALIZE)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = launcher(["--num-processes", 2, "--port", port, script])
        out, err = finish(proc)
    assert proc.returncode == 2, err
    assert (
        f"jdp.launch: port {port} on 127.0.0.1 is already in use (another program, "
        "or the coordinator of another job, listens on it), so process 0 cannot host "
        "the job's coordinator there. Pick another port with `--port`, or leave "
        "`--port` out to let the launcher pick a free one.\n"
    ) in err
    assert "initialized" not in out


def test_cli_stops_a_job_whose_process_is_stuck(tmp_path):
    script = write(tmp_path, "stuck.py", STUCK_PROCESS_1)
    start = time.monotonic()
    proc = launcher(
        ["--num-processes", 2, "--stall-timeout", 1, script, 3, meeting_dir(tmp_path)]
    )
    out, err = finish(proc)
    assert proc.returncode == 124, err
    assert re.search(
        r"jdp\.launch: process 1 of 2 \(pid \d+\) made no progress for more than "
        r"1 s while the others went on or waited for it: it reported progress 2 "
        r"times, the others up to \d+ times\. Process 1 was "
        rf"last seen at stuck\.py:{STUCK_LINE} in <module>: `time\.sleep\(300\)  "
        r"# alive, but stuck`\. Stopped the job\. If a process may take longer than "
        r"that between two steps \(an evaluation, a checkpoint\), raise the limit "
        r"with `--stall-timeout SECONDS` \(0 turns the check off\)\.",
        err,
    ), err
    assert time.monotonic() - start < PROMPT_S
    pids = [int(p) for p in re.findall(r"^\[\d\] ready (\d+)$", out, re.M)]
    assert len(pids) == 2
    assert wait_dead(pids, 5) == []


def test_stall_timeout_0_or_none_turns_the_check_off(tmp_path):
    for off in (0, None):
        envs = [{}, {}]
        assert _setup._progress_setup(envs, str(tmp_path), off, "x") is None
        assert envs == [{}, {}]  # no progress files: the processes report nothing
    monitor = _setup._progress_setup(envs, str(tmp_path), 2, "x")
    assert [e["JDP_PROGRESS_FILE"] for e in envs] == monitor.paths
    assert monitor.paths == [str(tmp_path / f"progress-{r}.json") for r in (0, 1)]


def test_cli_stall_check_leaves_a_program_that_reports_no_progress(tmp_path):
    script = write(tmp_path, "quiet.py", "import time\ntime.sleep(1.5)\nprint('done')")
    proc = launcher(["--num-processes", 2, "--stall-timeout", 0.5, script])
    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert "[0] done" in out and "[1] done" in out


def test_cli_stall_timeout_defaults_to_300_s(monkeypatch):
    calls = []
    monkeypatch.setattr(
        launch_main, "launch_command", lambda *a, **k: calls.append(k) or 0
    )
    assert launch_main.main(["--num-processes", "2", "x.py"]) == 0
    assert launch_main.main(["--num-processes", "2", "--stall-timeout=7", "x.py"]) == 0
    assert [c["stall_timeout_s"] for c in calls] == [300.0, 7.0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-processes", "0", "x.py"], "expected an integer >= 1, got 0"),
        (["--num-processes", "two", "x.py"], "expected an integer, got 'two'"),
        (["--nprocs", "0", "x.py"], "expected an integer >= 1, got 0"),
        (["x.py"], "the following arguments are required: --num-processes"),
        (["--num-processes", "1", "--timeout", "0", "x.py"], "a number > 0, got 0"),
        (["--num-processes", "1", "--timeout", "soon", "x.py"], "got 'soon'"),
        (
            ["--num-processes", "1", "--stall-timeout", "-1", "x.py"],
            "argument --stall-timeout: expected a number >= 0, got -1",
        ),
        (
            ["--num-processes", "1", "--stall-timeout", "later", "x.py"],
            "argument --stall-timeout: expected a number, got 'later'",
        ),
    ],
    ids=[
        "zero",
        "not-an-int",
        "alias-zero",
        "missing",
        "timeout",
        "timeout-text",
        "stall-timeout",
        "stall-timeout-text",
    ],
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


def exit_quietly():
    sys.exit(0)


def test_run_of_a_function_that_exits_names_it():
    """A `sys.exit(0)` in `fn` raised FileNotFoundError for an internal file."""
    with pytest.raises(
        RuntimeError, match=r"process\(es\) \[0, 1\] exited with status 0 without"
    ):
        jdp.launch.run(exit_quietly, 2, initialize=False, timeout_s=60)


def test_cli_refuses_a_port_above_65535(tmp_path):
    """It started every process, which failed on the address (exit status 1)."""
    script = write(tmp_path, "initialize.py", INITIALIZE)
    proc = launcher(["--num-processes", 2, "--port", 99999, script])
    out, err = finish(proc)
    assert proc.returncode == 2, err
    assert "argument --port: expected an integer <= 65535, got 99999" in err
    assert "initialized" not in out


def sleep_long():
    time.sleep(300)


def stuck_on_process_1(meet):
    open(os.path.join(meet, os.environ["JDP_PROCESS_ID"]), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(meet)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # start together, as after a collective
    for step in range(1, 1_000_000):
        if os.environ["JDP_PROCESS_ID"] == "1" and step == 3:
            time.sleep(300)  # stuck
        _progress.beat()
        time.sleep(0.02)


def test_run_stops_a_job_whose_process_is_stuck(tmp_path):
    with pytest.raises(
        TimeoutError,
        match=r"`jdp.launch.run`: process 1 of 2 \(pid \d+\) made no progress for "
        r"more than 1 s while the others went on or waited for it: it reported "
        r"progress 2 times, .* Process 1 was last seen at test_launch\.py:\d+ in "
        r"stuck_on_process_1: `time\.sleep\(300\)  # stuck`\. Stopped the job\. "
        r".*raise `stall_timeout_s` \(0 or None turns the check off\)\.",
    ):
        jdp.launch.run(
            stuck_on_process_1,
            2,
            args=(str(meeting_dir(tmp_path)),),
            initialize=False,
            stall_timeout_s=1,
            timeout_s=60,
        )


def write_progress(path, beats, where=None):
    path.write_text(json.dumps({"pid": 1, "beats": beats, "where": where}))


def test_a_process_restarted_alone_is_not_taken_to_finish_early():
    """Under `--live` a replacement joins part way and makes fewer step calls: it
    finishing first while the others took a while after their loop was called
    "finished early" and the job was stopped (status 124)."""
    tracker = _progress.Tracker(3, timeout_s=60, finished_grace_s=4)
    tracker.update({0: (40, False), 1: (34, True), 2: (40, False)}, now=0)
    assert tracker.finished_early(now=30) == (1, [0, 2])  # a plain process would
    tracker.rejoined.add(1)
    assert tracker.finished_early(now=30) is None


def test_stall_monitor_judges_from_the_first_report_on(tmp_path):
    paths = [tmp_path / f"progress-{r}.json" for r in range(3)]
    monitor = _stall.StallMonitor(
        [str(p) for p in paths], 5, how_to_change="raise the limit"
    )
    assert monitor.stalled(now=0.0) == []  # no report yet: nothing is judged
    assert monitor.stalled(now=1000.0) == []
    for path in paths:
        write_progress(path, 4, "train.py:9 in main")
    assert monitor.stalled(now=2000.0) == []  # the first report starts the clocks
    write_progress(paths[2], 5)
    assert monitor.stalled(now=2004.0) == []
    assert monitor.stalled(now=2005.5) == [0, 1]  # 2 is ahead: it waits for them
    assert monitor.stalled(now=2006.0, running=[0, 2]) == [0]  # 1 has finished
    assert monitor.message([0, 1], [10, 11]) == (
        "processes 0, 1 of 3 (pids 10, 11) made no progress for more than 5 s while "
        "the others went on or waited for them: each reported progress 4 times, the "
        "others up to 5 times. Process 0 was last seen at train.py:9 in main. "
        "Process 1 was last seen at train.py:9 in main. Stopped the job. If a "
        "process may take longer than that between two steps (an evaluation, a "
        "checkpoint), raise the limit."
    )


def test_stall_monitor_names_a_process_that_never_reported(tmp_path):
    paths = [tmp_path / f"progress-{r}.json" for r in range(2)]
    monitor = _stall.StallMonitor([str(p) for p in paths], 1, how_to_change="x")
    write_progress(paths[0], 3)
    write_progress(paths[1], 0, "load.py:3 in <module>: `input()`")
    assert monitor.stalled(now=10.0) == []
    assert monitor.stalled(now=11.5) == [1]
    assert monitor.message([1], [20, 21]).startswith(
        "process 1 of 2 (pid 21) made no progress for more than 1 s while the "
        "others went on or waited for it: it has reported no progress since it "
        "started, the others up to 3 times. Process 1 was last seen at load.py:3 "
        "in <module>: `input()`. Stopped the job."
    )


def test_stall_monitor_names_a_deadlock_of_every_process(tmp_path):
    paths = [tmp_path / f"progress-{r}.json" for r in range(2)]
    monitor = _stall.StallMonitor([str(p) for p in paths], 2.5, how_to_change="x")
    for path in paths:
        write_progress(path, 1)
    assert monitor.stalled(now=10.0) == []
    assert monitor.stalled(now=13.0) == [0, 1]
    assert monitor.message([0, 1], [10, 11]).startswith(
        "none of the 2 processes made progress for more than 2.5 s (each reported "
        "progress 1 time): the processes wait for each other (a deadlock), or a "
        "step takes longer than that. Stopped the job."
    )


def test_worker_reads_progress_from_the_progress_module():
    assert _worker.PROGRESS_MODULE == _progress.__name__
    before = _progress.count()
    _progress.beat()
    assert _worker._progress_record()["beats"] == before + 1


def test_worker_describes_a_frame_caught_between_two_lines():
    # A frame inside an import can have no line number (f_lineno is None); the
    # progress thread must describe it rather than die (and stop reporting).
    class Frame:
        f_code = test_worker_describes_a_frame_caught_between_two_lines.__code__
        f_lineno = None

    assert _worker._describe_frame(Frame()) == (
        "test_launch.py:? in test_worker_describes_a_frame_caught_between_two_lines"
    )
    Frame.f_lineno = Frame.f_code.co_firstlineno
    assert _worker._describe_frame(Frame()).endswith(
        "`def test_worker_describes_a_frame_caught_between_two_lines():`"
    )


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
        (
            {"num_processes": 1, "stall_timeout_s": -1},
            r"`stall_timeout_s` must be a number of seconds >= 0 \(0 or None turns "
            r"the stall check off\), got -1\.",
        ),
    ],
    ids=["num_processes", "devices_per_process", "timeout_s", "stall_timeout_s"],
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
        (
            {"num_processes": 1, "stall_timeout_s": True},
            r"`stall_timeout_s` must be a number of seconds >= 0 .* got True "
            r"\(a bool\)",
        ),
    ],
    ids=[
        "num_processes-str",
        "num_processes-bool",
        "num_processes-float",
        "devices_per_process",
        "timeout_s",
        "stall_timeout_s",
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
    env = _setup.process_env(
        base, process_id=1, num_processes=3, port=1234, devices_per_process=2
    )
    assert env["JDP_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert env["JDP_NUM_PROCESSES"] == "3"
    assert env["JDP_PROCESS_ID"] == "1"
    assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:1234"
    assert env["JDP_FAIL_FAST"] == "1"  # `initialize()` fails fast
    assert env["XLA_FLAGS"].split() == [
        "--foo=1",
        "--bar",
        "--xla_force_host_platform_device_count=2",
    ]
    assert env["JAX_NUM_CPU_DEVICES"] == "2"
    kept = _setup.process_env(
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


# -- a process that finishes early; the process that ended first -----------------

# Both processes start stepping together (files in the directory argv[2]);
# process 1 makes STEPS_1 (argv[1]) step calls and finishes; process 0 goes on to
# one more, in which it waits for process 1 (as in a collective) forever.
FINISHES_EARLY = """
import os, sys, time
from jdp import _progress
steps_1, meet = int(sys.argv[1]), sys.argv[2]
rank = os.environ["JDP_PROCESS_ID"]
print(f"ready {os.getpid()}", flush=True)
open(os.path.join(meet, rank), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(meet)) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
for step in range(1, steps_1 + 2):
    if rank == "1" and step > steps_1:
        break  # its data ran out
    _progress.beat()  # what a jdp step does as it starts
    if step > steps_1:
        time.sleep(300)  # waits in the step for process 1
    time.sleep(0.02)
print("done", flush=True)
"""
WAITS_LINE = (
    textwrap.dedent(FINISHES_EARLY)
    .splitlines()
    .index("        time.sleep(300)  # waits in the step for process 1")
    + 1
)

# Both processes make 3 step calls; process 0 then works for LINGER_S (argv[1])
# seconds more (an evaluation, a checkpoint) while process 1 has finished.
FINISH_APART = """
import os, sys, time
from jdp import _progress
linger_s = float(sys.argv[1])
for step in range(3):
    _progress.beat()
    time.sleep(0.1)
if os.environ["JDP_PROCESS_ID"] == "0":
    time.sleep(linger_s)
print("done", flush=True)
"""


def finished_progress(path, beats):
    path.write_text(json.dumps({"pid": 1, "beats": beats, "finished": True}))


def test_stall_monitor_finds_processes_waiting_for_one_that_finished(tmp_path):
    paths = [tmp_path / f"progress-{r}.json" for r in range(3)]
    monitor = _stall.StallMonitor(
        [str(p) for p in paths], 300, how_to_change="x", finished_grace_s=2
    )
    for path in paths:
        write_progress(path, 4)
    assert monitor.finished_early(now=10.0) is None
    finished_progress(paths[1], 4)  # waits at shutdown
    write_progress(paths[0], 5, "train.py:9 in main")
    write_progress(paths[2], 5, "train.py:9 in main")
    assert monitor.finished_early(now=11.0) is None  # within the grace period
    assert monitor.stalled(now=100.0) == []  # not a stall: see finished_early
    found = monitor.finished_early(now=13.5)
    assert found == (1, [0, 2])
    assert monitor.finished_message(found, [10, 11, 12]) == (
        "process 1 of 3 (pid 11) finished its program (it waits at shutdown for "
        "the others) after 4 step calls while processes 0, 2 (pids 10, 12) are "
        "still running (at step call 5) and have stopped making progress (none "
        "for 2 s): they wait in a step that process 1 will never join. "
        + _stall.UNEVEN_STEPS_HINT
        + " Process 0 was last seen at train.py:9 in main. Process 2 was last "
        "seen at train.py:9 in main. Stopped the job."
    )
    # Once it has exited (status 0), with process 2 gone too.
    found = monitor.finished_early(now=14.0, running=[0], exited={1: 12.0})
    assert found == (1, [0])
    assert monitor.finished_message(found, [10, 11, 12], {1: 12.0}).startswith(
        "process 1 of 3 (pid 11) finished (exit 0) after 4 step calls while "
        "process 0 (pid 10) is still running (at step call 5) and has stopped "
        "making progress (none for 2 s): it waits in a step that process 1 will "
        "never join. Every process must make the same number of step calls"
    )


def test_stall_monitor_leaves_processes_that_finish_together(tmp_path):
    paths = [tmp_path / f"progress-{r}.json" for r in range(2)]
    monitor = _stall.StallMonitor(
        [str(p) for p in paths], 5, how_to_change="x", finished_grace_s=1
    )
    write_progress(paths[0], 4)
    finished_progress(paths[1], 4)
    # Process 0 finishes its work after its last step (no step beyond 4).
    assert monitor.finished_early(now=10.0) is None
    assert monitor.finished_early(now=14.0) is None
    assert monitor.stalled(now=14.0) == []  # a finished process is not stuck
    assert monitor.stalled(now=15.5) == [0]  # the stall limit still holds
    # Ahead of it, but still making progress (steps on its own devices).
    for now, beats in ((16.0, 5), (16.8, 6), (17.6, 7)):
        write_progress(paths[0], beats)
        assert monitor.finished_early(now=now) is None
    assert monitor.finished_early(now=18.7) == (1, [0])


def test_stall_message_names_a_process_that_exited_after_fewer_steps(tmp_path):
    # It left with `os._exit(0)`: no last record, so its count may lag behind
    # and the others are stopped at the stall limit only; the message says why.
    paths = [tmp_path / f"progress-{r}.json" for r in range(2)]
    monitor = _stall.StallMonitor([str(p) for p in paths], 1, how_to_change="x")
    write_progress(paths[0], 4, "train.py:9 in main")
    write_progress(paths[1], 3)
    assert monitor.finished_early(now=10.0, running=[0], exited={1: 10.0}) is None
    assert monitor.stalled(now=11.5, running=[0]) == [0]
    assert monitor.message([0], [10, 11], {1: 10.0}) == (
        "process 0 (pid 10), the only one of 2 still running, made no progress "
        "for more than 1 s (each reported progress 4 times): the processes wait "
        "for each other (a deadlock), or a step takes longer than that. Process 0 "
        "was last seen at train.py:9 in main. Process 1 finished (exit 0) "
        "earlier, after at least 3 step calls: the others may wait in a step that "
        "it never joined. "
        + _stall.UNEVEN_STEPS_HINT
        + " Stopped the job. If a process may take longer than that between two "
        "steps (an evaluation, a checkpoint), x."
    )


def test_the_grace_period_is_at_most_the_stall_limit(tmp_path):
    monitor = _stall.StallMonitor([str(tmp_path / "p")], 3, how_to_change="x")
    assert monitor.finished_grace_s == 3
    monitor = _stall.StallMonitor([str(tmp_path / "p")], 300, how_to_change="x")
    assert monitor.finished_grace_s == _stall.FINISHED_GRACE_S == 15


def test_cli_stops_a_job_whose_process_waits_for_one_that_finished(tmp_path):
    script = write(tmp_path, "early.py", FINISHES_EARLY)
    start = time.monotonic()
    proc = launcher(
        ["--num-processes", 2, "--stall-timeout", 2, script, 3, meeting_dir(tmp_path)]
    )
    out, err = finish(proc)
    assert proc.returncode == 124, err
    assert re.search(
        r"jdp\.launch: process 1 of 2 \(pid \d+\) finished \(exit 0\) after 3 step "
        r"calls while process 0 \(pid \d+\) is still running \(at step call 4\) "
        r"and has stopped making progress \(none for 2 s\): it waits in a step "
        r"that process 1 will never join\. Every process must make the same "
        r"number of step calls .*a data set that ends at different steps on "
        r"different processes .* Process 0 was last seen at "
        rf"early\.py:{WAITS_LINE} in <module>: `time\.sleep\(300\)  # waits in the "
        r"step for process 1`\. Stopped the job\.\n",
        err,
    ), err
    assert "[1] done" in out and "[0] done" not in out
    assert time.monotonic() - start < PROMPT_S
    pids = [int(p) for p in re.findall(r"^\[\d\] ready (\d+)$", out, re.M)]
    assert len(pids) == 2
    assert wait_dead(pids, 5) == []


def test_cli_lets_processes_finish_a_little_apart(tmp_path):
    script = write(tmp_path, "apart.py", FINISH_APART)
    proc = launcher(["--num-processes", 2, "--stall-timeout", 3, script, 1.5])
    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert "[0] done" in out and "[1] done" in out


# Process 1 dies (status 3) once process 0 is connected to it; process 0 fails
# (status 1) 0.15 s after it notices, as a peer in a collective does (20 ms was
# within the launcher threads' wake-up delay on a busy machine, once). With
# argv[2] == "slow", process 1 closes its files (its connection, its output)
# 0.3 s before it exits, as a large process does whose memory takes a while to
# free: process 0 then exits first, but process 1 ended first.
DIES_FIRST = """
import os, socket, sys, time
port, how, rank = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rank == "0":
    server = socket.create_server(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.recv(1)  # returns once process 1 has closed the connection
    # "slow": process 1's output closed first, which a thread of the launcher
    # must see before this exit is recorded; 0.5 s leaves that thread time on a
    # busy machine (20 ms did not, once).
    time.sleep(0.15 if how == "quick" else 0.5)
    os._exit(1)
deadline = time.monotonic() + 30
while True:
    try:
        conn = socket.create_connection(("127.0.0.1", port))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.01)
time.sleep(0.05)
if how == "slow":
    conn.close()
    os.close(1)
    os.close(2)
    time.sleep(1.0)  # reaped well after process 0
os._exit(3)
"""


def failed_job(commands):
    """A `Job` of `commands` (one per process), run until it failed."""
    commands = list(commands)
    job = _launcher.Job(commands, [os.environ] * len(commands), echo=False)
    job.start()
    try:
        assert job.wait(timeout_s=30) is False
    finally:
        job.kill(grace_s=0)
    return job


@pytest.mark.parametrize("how", ["quick", "slow"])
def test_job_reports_the_process_that_ended_first(how):
    # The exits fall a few of the launcher's looks apart (every `POLL_S`), and
    # the "slow" one is reaped last; the process that died first is named all
    # the same, every time.
    source = textwrap.dedent(DIES_FIRST)
    for _ in range(8):
        port = _setup.free_port()
        job = failed_job(
            [sys.executable, "-c", source, str(port), how, str(rank)]
            for rank in range(2)
        )
        assert job.failure == (1, 3), job.failure_message()
        assert re.fullmatch(
            r"process 1 of 2 \(pid \d+\) exited with status 3(; then process 0 "
            r"exited with status 1|; stopped the other process)\.",
            job.failure_message(with_tail=False),
        )


def failed_pair_at(source, gap):
    """A 2-process `failed_job` of `source`, given its rank, a wall time 1 s
    ahead at which to act, and `gap` (argv[1:4])."""
    at = str(time.time() + 1.0)
    return failed_job(
        [sys.executable, "-c", source, str(rank), at, str(gap)] for rank in range(2)
    )


# Process 0 kills itself at the time argv[2]; process 1 exits with status 1
# argv[3] seconds later (as a peer whose connection closed does), or earlier.
KILLED_AND_A_PEER_FAILED = """
import os, signal, sys, time
rank, at, gap = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
time.sleep(max(0.0, at - time.time() + (gap if rank == "1" else 0.0)))
if rank == "1":
    sys.exit(1)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("gap", [0.002, -0.1])
def test_job_names_a_sigkilled_process_before_a_peer_that_failed_with_it(gap):
    # A peer of a SIGKILLed process fails within milliseconds (a closed
    # connection), closer than the launcher's threads can order on a busy
    # machine; the SIGKILL is the cause, and it is named first every time, even
    # when the launcher saw the peer end 0.1 s before it (it waits `SETTLE_S`).
    for _ in range(4):
        job = failed_pair_at(KILLED_AND_A_PEER_FAILED, gap)
        assert job.failure == (0, -signal.SIGKILL), job.failure_message()
        assert re.fullmatch(
            r"process 0 of 2 \(pid \d+\) was killed by SIGKILL(; then process 1 "
            r"exited with status 1|; stopped the other process)\.",
            job.failure_message(with_tail=False),
        )


# Process 1 finishes (exit 0) at the time argv[2]; process 0 exits with status 1
# argv[3] seconds later: a peer whose collective fails once process 1 has left.
FINISHED_AND_A_PEER_FAILED = """
import os, sys, time
rank, at, gap = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
time.sleep(max(0.0, at - time.time() + (gap if rank == "0" else 0.0)))
os._exit(1 if rank == "0" else 0)
"""


@pytest.mark.parametrize("gap", [0.02, -0.05])
def test_job_names_a_process_that_finished_as_its_peer_failed(gap):
    # The peer fails within milliseconds of the process that finished, and the
    # launcher may see the failure first (-0.05: it even comes first); a
    # program does not complete because a peer failed, so the finished process
    # is named as the likely cause every time.
    for _ in range(3):
        job = failed_pair_at(FINISHED_AND_A_PEER_FAILED, gap)
        assert job.failure == (0, 1), job.failure_message()
        assert re.match(
            r"process 1 of 2 \(pid \d+\) finished \(exit 0\) while process 0 was "
            r"still running; (\S+ s later|as it left) process 0 exited with status "
            r"1, most likely in a step that process 1 never joined",
            job.failure_message(with_tail=False),
        ), job.failure_message(with_tail=False)


@pytest.mark.parametrize("late", ["before-reaping", "after-reaping"])
def test_job_names_a_finished_process_whose_reaping_thread_is_late(monkeypatch, late):
    # On a loaded machine a thread of the launcher may run seconds late: the
    # job asks the kernel which processes exited before it names the cause, and
    # waits for a returncode that a thread has reaped but not yet recorded.
    reap = _launcher.Job._reap

    def late_for_process_1(self, rank, proc):
        if rank == 1 and late == "before-reaping":
            time.sleep(2 * _launcher.ENDING_WAIT_S)
        elif rank == 1:
            proc.wait()
            time.sleep(2 * _launcher.ENDING_WAIT_S)
        reap(self, rank, proc)

    monkeypatch.setattr(_launcher.Job, "_reap", late_for_process_1)
    job = failed_pair_at(FINISHED_AND_A_PEER_FAILED, 0.05)
    assert job.failure == (0, 1), job.failure_message()
    assert job.failure_message(with_tail=False).startswith(
        "process 1 of 2 (pid "
    ) and ") finished (exit 0) while process 0 was still running; " in (
        job.failure_message(with_tail=False)
    ), job.failure_message(with_tail=False)


def test_worker_reports_no_progress_from_a_progress_module_being_imported(
    monkeypatch,
):
    # Caught mid-import, the module has no `count` yet: the reporter thread
    # must go on (it used to die, and the process never reported again).
    monkeypatch.setitem(sys.modules, _worker.PROGRESS_MODULE, types.ModuleType("p"))
    assert _worker._progress_record()["beats"] == 0


# -- restarts -----------------------------------------------------------------------

# Records each attempt (restart count, process count) in argv[1]; process 1 exits
# with status 5 in the first `argv[2]` attempts, or whenever 2 processes run if
# argv[2] is "slot".
FAIL_EARLY_ATTEMPTS = """
import os, sys
attempt = int(os.environ["JDP_RESTART_COUNT"])
n = int(os.environ["JDP_NUM_PROCESSES"])
rank = os.environ["JDP_PROCESS_ID"]
with open(os.path.join(sys.argv[1], f"{attempt}-{rank}"), "w") as f:
    f.write(f"{n} {os.environ['JDP_MAX_RESTARTS']} "
            f"{os.environ['JDP_COORDINATOR_ADDRESS']}")
bad = n == 2 if sys.argv[2] == "slot" else attempt < int(sys.argv[2])
if rank == "1" and bad:
    sys.exit(5)
"""


def attempts(directory):
    """`{(attempt, rank): (processes, max restarts, coordinator)}` written."""
    out = {}
    for p in directory.iterdir():
        a, r = p.name.split("-")
        n, k, address = p.read_text().split()
        out[int(a), int(r)] = (int(n), int(k), address)
    return out


def test_cli_restarts_a_failed_job_up_to_max_restarts(tmp_path):
    script = write(tmp_path, "flaky.py", FAIL_EARLY_ATTEMPTS)
    seen = meeting_dir(tmp_path)
    proc = launcher(["--num-processes", 2, "--max-restarts", 3, script, seen, 2])
    out, err = finish(proc)
    assert proc.returncode == 0, out + err
    got = attempts(seen)
    assert sorted(got) == [(a, r) for a in range(3) for r in range(2)]
    assert {(n, k) for n, k, _ in got.values()} == {(2, 3)}
    # A fresh coordinator port for each attempt; one per attempt for all.
    assert len({got[a, 0][2] for a in range(3)}) == 3
    assert all(got[a, 0][2] == got[a, 1][2] for a in range(3))
    lines = re.findall(r"^jdp\.launch: .*$", err, re.M)
    assert len(lines) == 2, err
    for i, line in enumerate(lines, 1):
        assert re.fullmatch(
            r"jdp\.launch: process 1 of 2 \(pid \d+\) exited with status 5.*\. "
            rf"Restarting the job \(restart {i}/3\) with 2 processes\.",
            line,
        ), line


def test_cli_returns_the_last_failure_when_no_restart_is_left(tmp_path):
    script = write(tmp_path, "flaky.py", FAIL_EARLY_ATTEMPTS)
    seen = meeting_dir(tmp_path)
    proc = launcher(["--num-processes", 2, "--max-restarts", 1, script, seen, 5])
    out, err = finish(proc)
    assert proc.returncode == 5, out + err
    assert sorted(attempts(seen)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "(restart 1/1)" in err
    assert re.search(
        r"^jdp\.launch: process 1 of 2 \(pid \d+\) exited with status 5.*\.$",
        err.splitlines()[-1],
    ), err


def test_cli_min_processes_drops_a_slot_that_keeps_failing(tmp_path):
    script = write(tmp_path, "slot.py", FAIL_EARLY_ATTEMPTS)
    seen = meeting_dir(tmp_path)
    proc = launcher(
        [
            "--num-processes",
            2,
            "--max-restarts",
            3,
            "--min-processes",
            1,
            script,
            seen,
            "slot",
        ]
    )
    out, err = finish(proc)
    assert proc.returncode == 0, out + err
    got = attempts(seen)
    # Twice with 2 processes (process 1 failed both times), then 1 process.
    assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert got[2, 0][0] == 1
    assert "(restart 1/3) with 2 processes." in err
    assert (
        "(restart 2/3) with 1 process, one fewer: process 1 failed first in two "
        "attempts in a row (--min-processes 1)." in err
    )


def test_restart_policy_shrinks_only_on_the_same_process_twice_in_a_row():
    policy = _restarts.Restarts(4, 10, 2)
    decisions = []
    for failed in [1, 2, 2, 3, 3, 3, None, 0, 0, 0]:
        line = policy.next_attempt(failed, "x.")
        decisions.append(policy.num_processes)
        assert line.startswith(f"x. Restarting the job (restart {policy.restarts}/10)")
    assert decisions == [4, 4, 3, 3, 2, 2, 2, 2, 2, 2]
    assert policy.next_attempt(0, "x.") is None  # 11 restarts > 10
    assert _restarts.Restarts(2, 0, None).next_attempt(1, "x.") is None


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(max_restarts=-1), ValueError, r"`max_restarts` must be an int >= 0"),
        (dict(max_restarts=1.5), TypeError, r"`max_restarts` must be an int >= 0"),
        (dict(min_processes=0), ValueError, r"`min_processes` must be an int >= 1"),
        (dict(min_processes=3), ValueError, r"`min_processes` \(3\) must be at most"),
        (
            dict(min_processes=1),
            ValueError,
            r"`min_processes=1` needs `max_restarts` of 2 or more \(got 1\)",
        ),
    ],
    ids=["negative", "float", "zero-min", "min-above", "min-without-restarts"],
)
def test_restart_arguments_are_checked(kwargs, error, message):
    args = dict(max_restarts=1, min_processes=None) | kwargs
    with pytest.raises(error, match=message):
        _restarts.Restarts(2, args["max_restarts"], args["min_processes"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-restarts", "-1"], "argument --max-restarts: expected an integer >= 0"),
        (["--max-restarts", "x"], "argument --max-restarts: expected an integer, got"),
        (["--min-processes", "3"], "argument --min-processes: 3 is more than"),
        (
            ["--min-processes", "1"],
            "argument --min-processes: 1 needs --max-restarts 2 or more (now 0)",
        ),
        (
            ["--max-restarts", "1", "--min-processes", "1"],
            "argument --min-processes: 1 needs --max-restarts 2 or more (now 1): a "
            "job shrinks only when the same process fails first in two attempts",
        ),
    ],
    ids=["negative", "text", "above", "no-restarts", "one-restart"],
)
def test_cli_rejects_bad_restart_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        launch_main.main(["--num-processes", "2", *args, "x.py"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_passes_restart_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(
        launch_main, "launch_command", lambda *a, **k: calls.append(k) or 0
    )
    launch_main.main(["--num-processes", "3", "x.py"])
    launch_main.main(
        ["--num-processes", "3", "--max-restarts", "4", "--min-processes", "2", "x.py"]
    )
    assert [(c["max_restarts"], c["min_processes"]) for c in calls] == [
        (0, None),
        (4, 2),
    ]


def fail_on_process_1_in_the_first_attempt():
    if os.environ["JDP_PROCESS_ID"] == "1" and os.environ["JDP_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return int(os.environ["JDP_RESTART_COUNT"])


def test_run_restarts_with_max_restarts(capfd):
    results = jdp.launch.run(
        fail_on_process_1_in_the_first_attempt,
        2,
        initialize=False,
        timeout_s=60,
        max_restarts=1,
    )
    assert results == [1, 1]
    err = capfd.readouterr().err
    assert re.search(
        r"jdp\.launch\.run: process 1 of 2 \(pid \d+\) was killed by SIGKILL.*\. "
        r"Restarting the job \(restart 1/1\) with 2 processes\.",
        err,
    ), err
    with pytest.raises(RuntimeError, match="was killed by SIGKILL"):
        jdp.launch.run(
            fail_on_process_1_in_the_first_attempt, 2, initialize=False, timeout_s=60
        )


def test_cli_restarts_a_stalled_job(tmp_path):
    # Process 1 is stuck at its third step in the first attempt only.
    source = STUCK_PROCESS_1.replace(
        'if os.environ["JDP_PROCESS_ID"] == "1" and step == stuck_at:',
        'if os.environ["JDP_PROCESS_ID"] == "1" and step == stuck_at and '
        'os.environ["JDP_RESTART_COUNT"] == "0":',
    ).replace("for step in range(1, 1_000_000):", "for step in range(1, 30):")
    assert "JDP_RESTART_COUNT" in source and "range(1, 30)" in source
    script = write(tmp_path, "stuck_once.py", source)
    meet = meeting_dir(tmp_path)
    proc = launcher(
        [
            "--num-processes",
            2,
            "--stall-timeout",
            1,
            "--max-restarts",
            1,
            script,
            3,
            meet,
        ]
    )
    out, err = finish(proc)
    assert proc.returncode == 0, out + err
    assert re.search(r"process 1 of 2 \(pid \d+\) made no progress", err), err
    assert re.search(
        r"^jdp\.launch: The job stalled \(see above\)\. Restarting the job "
        r"\(restart 1/1\) with 2 processes\.$",
        err,
        re.M,
    ), err
