"""What a cluster's environment tells `jdp.distributed.initialize`, simulated.

The GPUs of a process that SLURM or Open MPI started, a process that finds itself
alone in a job the environment says has several, and the judgement of the stall
check that runs outside the launcher (its real two-process run is in
tests/multiprocess/test_direct_stall.py).
"""

import inspect
import logging
import os
import re
import subprocess
import sys

import jax
import pytest

import jdp
from jdp.distributed import _cluster, _config, _runtime, _watchdog

CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "JDP_", "JAX_COORDINATOR")
CLUSTER_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
    "REPLICATED_JOB_REPLICAS",
    "GLOBAL_REPLICAS",
    "JOB_INDEX",
    "JOB_GLOBAL_INDEX",
    "JAX_LOCAL_DEVICE_IDS",
)


@pytest.fixture
def no_cluster_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(CLUSTER_PREFIXES) or name in CLUSTER_NAMES:
            monkeypatch.delenv(name)


def clean_environ():
    """This process's environment without any cluster's variables (for a child)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(CLUSTER_PREFIXES) or k in CLUSTER_NAMES)
    }


def slurm(localid, per_node, gpus=None, visible=None, **more):
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node[001-004]",
        "SLURM_NTASKS": str(4 * per_node),
        "SLURM_PROCID": str(localid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NTASKS_PER_NODE": str(per_node),
    }
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env.update(more)
    return env


# -- the GPUs of a process -----------------------------------------------------


def test_one_task_per_node_gets_all_of_the_nodes_gpus():
    plan = _cluster.plan_local_devices(slurm(0, 1, gpus=4, visible="0,1,2,3"))
    assert plan.local_device_ids == [0, 1, 2, 3]
    assert "all 4 GPUs" in plan.reason
    assert "$SLURM_NTASKS_PER_NODE=1" in plan.reason


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_one_task_per_gpu_gets_its_own(rank):
    plan = _cluster.plan_local_devices(slurm(rank, 4, gpus=4, visible="0,1,2,3"))
    assert plan.local_device_ids == [rank]
    assert f"its own GPU, number {rank}" in plan.reason


@pytest.mark.parametrize("rank", [0, 1])
def test_two_tasks_share_four_gpus_equally(rank):
    plan = _cluster.plan_local_devices(slurm(rank, 2, gpus=4, visible="0,1,2,3"))
    assert plan.local_device_ids == [2 * rank, 2 * rank + 1]


@pytest.mark.parametrize(
    ("visible", "gpus", "expected"),
    [("2", 4, [0]), ("4,5", 8, [0, 1]), ("GPU-aa11,GPU-bb22", 8, [0, 1])],
    ids=["one-of-four", "two-of-eight", "uuids"],
)
def test_gpus_bound_per_task_are_renumbered_from_zero(visible, gpus, expected):
    """`--gpus-per-task`: each task sees a subset, which CUDA numbers from 0."""
    plan = _cluster.plan_local_devices(slurm(2, 4, gpus=gpus, visible=visible))
    assert plan.local_device_ids == expected
    assert f"$CUDA_VISIBLE_DEVICES={visible} of {gpus}" in plan.reason
    assert "renumbered from 0" in plan.reason


def test_tasks_per_node_from_slurms_compact_format():
    env = slurm(1, 4, visible="0,1,2,3")
    del env["SLURM_NTASKS_PER_NODE"]
    env["SLURM_STEP_TASKS_PER_NODE"] = "2(x3)"
    assert _cluster.plan_local_devices(env).local_device_ids == [2, 3]
    env["SLURM_STEP_TASKS_PER_NODE"] = "4,2(x2)"
    env["SLURM_NODEID"] = "2"
    assert _cluster.plan_local_devices(env).local_device_ids == [2, 3]
    env["SLURM_NODEID"] = "0"
    assert _cluster.plan_local_devices(env).local_device_ids == [1]


def test_open_mpi_ranks_share_the_node():
    env = {
        "OMPI_COMM_WORLD_LOCAL_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    plan = _cluster.plan_local_devices(env)
    assert plan.local_device_ids == [3]
    assert plan.reason.startswith("Open MPI: task 3 of 4")
    # A wrapper that gives each rank two of the node's eight GPUs.
    env["CUDA_VISIBLE_DEVICES"] = "6,7"
    assert _cluster.plan_local_devices(env, node_gpus=8).local_device_ids == [0, 1]


def test_open_mpi_is_read_before_slurm():
    """`mpirun` inside a SLURM allocation: the MPI ranks are the processes."""
    env = slurm(0, 1, visible="0,1")
    env.update(OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    assert _cluster.plan_local_devices(env).local_device_ids == [1]


def test_gpu_count_unknown():
    """No GPU variable (a CPU cluster, or GPUs unknown): JAX's one device per task."""
    assert _cluster.plan_local_devices(slurm(0, 1)).local_device_ids == []
    plan = _cluster.plan_local_devices(slurm(2, 4))
    assert plan.local_device_ids == [2]
    assert "GPU count unknown" in plan.reason
    assert _cluster.plan_local_devices(slurm(2, 4), node_gpus=4).local_device_ids == [2]


def test_no_scheduler_no_plan():
    assert _cluster.plan_local_devices({"CUDA_VISIBLE_DEVICES": "0,1"}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            slurm(0, 3, gpus=4, visible="0,1,2,3"),
            r"SLURM put 3 tasks on this node \(\$SLURM_LOCALID=0, "
            r"\$SLURM_NTASKS_PER_NODE=3\), but 4 GPUs \(\$CUDA_VISIBLE_DEVICES="
            r"0,1,2,3\) do not split evenly between 3 tasks.*--ntasks-per-node=1",
        ),
        (
            slurm(5, 8, gpus=4, visible="0,1,2,3"),
            r"SLURM put 8 tasks on this node .*but only 4 GPUs "
            r"\(\$CUDA_VISIBLE_DEVICES=0,1,2,3\) for 8 tasks.*`local_device_ids=`",
        ),
        (
            slurm(4, 4, gpus=4, visible="0,1,2,3"),
            r"the SLURM variables contradict each other \(\$SLURM_LOCALID=4, "
            r"\$SLURM_NTASKS_PER_NODE=4\): the local rank must be below",
        ),
        (
            {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1"},
            r"Open MPI started this process as local task 1 .*does not say how many "
            r"tasks share the node's 2 GPUs",
        ),
    ],
    ids=["uneven", "too-few-gpus", "contradictory", "no-task-count"],
)
def test_uneven_or_contradictory_variables_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        _cluster.plan_local_devices(env)


def test_an_explicit_local_device_ids_wins(caplog):
    with caplog.at_level(logging.INFO, logger="jdp.distributed"):
        assert _config.local_devices([5], slurm(0, 1, visible="0,1")) == [5]
        assert _config.local_devices(None, {"JAX_LOCAL_DEVICE_IDS": "1"}) is None
    assert "local_device_ids=[5] (given)." in caplog.text
    assert "$JAX_LOCAL_DEVICE_IDS=1" in caplog.text


def test_the_plan_reaches_jax_distributed_initialize(caplog):
    """The arguments jdp passes to `jax.distributed.initialize`, and its log."""
    requested = dict(coordinator_address=None, num_processes=None, process_id=None)
    with caplog.at_level(logging.INFO, logger="jdp.distributed"):
        args = _runtime.jax_initialize_args(
            requested,
            local_device_ids=None,
            timeout_s=30,
            heartbeat_timeout_s=100,
            bind=None,
            environ=slurm(0, 1, gpus=4, visible="0,1,2,3"),
        )
    assert args["local_device_ids"] == [0, 1, 2, 3]
    assert set(args) <= set(inspect.signature(jax.distributed.initialize).parameters)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert caplog.records[0].name == "jdp.distributed"
    assert caplog.text.count("local_device_ids=[0, 1, 2, 3] (SLURM: task 0 of 1") == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jdp.distributed"):
        args = _runtime.jax_initialize_args(
            requested,
            local_device_ids=None,
            timeout_s=30,
            heartbeat_timeout_s=100,
            bind=None,
            environ=slurm(0, 1),
        )
    # Not None: JAX would then give the process one device.
    assert args["local_device_ids"] == []
    assert "local_device_ids=every device it sees (SLURM: the only task" in caplog.text


# -- a process alone in a job of several ----------------------------------------


def test_a_slurm_task_count_outside_a_job_step():
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NNODES": "4"}
    expected = _cluster.expected_processes(env, kubernetes=False)
    assert (expected.count, expected.said, expected.certain) == (
        4,
        "$SLURM_NTASKS=4",
        True,
    )
    assert "missing here: $SLURM_STEP_NODELIST, $SLURM_PROCID" in expected.fix
    assert "`srun python train.py`" in expected.fix
    env = {"SLURM_NPROCS": "2"}
    assert _cluster.expected_processes(env, kubernetes=False).said == "$SLURM_NPROCS=2"
    assert _cluster.expected_processes({"SLURM_NTASKS": "1"}, kubernetes=False) is None


def test_open_mpi_5_is_not_detected_by_jax():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}
    expected = _cluster.expected_processes(env, kubernetes=False)
    assert expected.said == "$OMPI_COMM_WORLD_SIZE=4"
    assert "$OMPI_MCA_orte_hnp_uri, which is not set" in expected.fix
    assert "process_id=int(os.environ['OMPI_COMM_WORLD_RANK'])" in expected.fix


def test_mpich_is_not_detected_by_jax():
    expected = _cluster.expected_processes({"PMI_SIZE": "8"}, kubernetes=False)
    assert expected.count == 8
    assert "JAX does not detect MPICH or Intel MPI" in expected.fix


@pytest.mark.parametrize(
    ("env", "kubernetes", "said", "fix", "certain"),
    [
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "2"},
            False,
            "$JOB_COMPLETION_INDEX=2",
            "install `jdp[k8s]`",
            True,
        ),
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"},
            False,
            "$JOB_COMPLETION_INDEX=0",
            "If this Indexed Job has one pod, ignore this warning.",
            False,
        ),
        (
            {
                "KUBERNETES_SERVICE_HOST": "10.0.0.1",
                "JOB_COMPLETION_INDEX": "0",
                "REPLICATED_JOB_REPLICAS": "4",
            },
            True,
            "$REPLICATED_JOB_REPLICAS=4",
            "the pods of ONE Indexed Job",
            True,
        ),
    ],
    ids=["no-package", "index-0-no-package", "jobset-of-one-pod-jobs"],
)
def test_kubernetes_jobs(env, kubernetes, said, fix, certain):
    expected = _cluster.expected_processes(env, kubernetes=kubernetes)
    assert expected.said == said
    assert fix in expected.fix
    assert expected.certain is certain
    message = _cluster.one_process_message(expected, found="it runs alone")
    assert message.startswith(
        f"jdp.distributed.initialize: {said} says that this job has several "
        "processes, but it runs alone"
    )


def test_a_plain_pod_or_machine_expects_nothing():
    assert _cluster.expected_processes({}, kubernetes=False) is None
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "notebook-0"}
    assert _cluster.expected_processes(env, kubernetes=False) is None


def test_initialize_alone_in_a_slurm_job_raises(no_cluster_env, monkeypatch):
    """This test process started JAX long ago: it would run alone."""
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(
        RuntimeError,
        match=r"\$SLURM_NTASKS=4 says that this job has 4 processes, but JAX's "
        r"backends started before `jdp\.distributed\.initialize`.*Start every "
        r"process with `srun`",
    ):
        jdp.distributed.initialize()
    assert not jdp.distributed.is_initialized()


def test_initialize_at_index_0_without_the_package_warns(
    no_cluster_env, monkeypatch, caplog
):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    monkeypatch.setattr(_cluster, "kubernetes_installed", lambda: False)
    with caplog.at_level(logging.WARNING, logger="jdp.distributed"):
        assert jdp.distributed.initialize() is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "$JOB_COMPLETION_INDEX=0 says that this job has several" in caplog.text
    assert "install `jdp[k8s]`" in caplog.text


ALONE = "import jdp; jdp.distributed.initialize()"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
            r"RuntimeError: jdp\.distributed\.initialize: \$SLURM_NTASKS=2 says that "
            r"this job has 2 processes, but JAX's cluster detection found no job "
            r"to join: each process would train a model of its own\. JAX detects "
            r"a SLURM job inside a job step",
        ),
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "1"},
            r"RuntimeError: jdp\.distributed\.initialize: \$JOB_COMPLETION_INDEX=1 "
            r"says that this job has several processes, but JAX's cluster "
            r"detection found no job to join.*install `jdp\[k8s\]`",
        ),
    ],
    ids=["slurm-batch-step", "k8s-without-package"],
)
def test_a_real_initialize_that_finds_no_job_raises(env, message):
    """JAX's own detection, in a fresh process, finds no cluster."""
    if _cluster.kubernetes_installed() and "KUBERNETES_SERVICE_HOST" in env:
        pytest.skip("the kubernetes package is installed: JAX would query the API")
    clean = clean_environ()
    proc = subprocess.run(
        [sys.executable, "-c", ALONE],
        env={**clean, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert re.search(message, proc.stderr), proc.stderr


# -- the stall check outside the launcher --------------------------------------


@pytest.mark.parametrize(
    ("value", "environ", "expected"),
    [
        (None, {}, None),
        (None, {"JDP_STALL_TIMEOUT_S": ""}, None),
        (None, {"JDP_STALL_TIMEOUT_S": "0"}, None),
        (None, {"JDP_STALL_TIMEOUT_S": "90"}, 90.0),
        (30, {"JDP_STALL_TIMEOUT_S": "90"}, 30.0),
        (0.5, {}, 0.5),
    ],
)
def test_stall_timeout_defaults_to_the_environment(value, environ, expected):
    assert _watchdog.timeout_from(value, environ) == expected


@pytest.mark.parametrize(
    ("value", "environ", "error", "message"),
    [
        (
            None,
            {"JDP_STALL_TIMEOUT_S": "ten"},
            ValueError,
            r"\$JDP_STALL_TIMEOUT_S='ten': the environment variable must be a "
            r"number of seconds above 0 \(.*0 or unset: no stall check\)",
        ),
        (
            None,
            {"JDP_STALL_TIMEOUT_S": "-3"},
            ValueError,
            r"\$JDP_STALL_TIMEOUT_S='-3': the environment variable must be ",
        ),
        (0, {}, ValueError, r"`stall_timeout_s` must be a number of seconds > 0, "),
        (
            "60",
            {},
            TypeError,
            r"`stall_timeout_s` must be a number of seconds > 0, or None .*got '60' "
            r"\(a str\)",
        ),
        (True, {}, TypeError, r"`stall_timeout_s` .*got True \(a bool\)"),
    ],
    ids=["env-word", "env-negative", "zero", "str", "bool"],
)
def test_bad_stall_timeouts_are_named(value, environ, error, message):
    with pytest.raises(error, match=message):
        _watchdog.timeout_from(value, environ)


def test_initialize_checks_stall_timeout_s(no_cluster_env):
    with pytest.raises(ValueError, match=r"`stall_timeout_s` must be a number"):
        jdp.distributed.initialize(stall_timeout_s=-1)


def test_nothing_is_judged_before_the_first_progress():
    tracker = _watchdog.Tracker(2, timeout_s=5)
    tracker.update({0: (0, False), 1: (0, False)}, now=0)
    assert tracker.verdict(now=100) is None


def test_the_process_behind_is_found_after_the_timeout():
    tracker = _watchdog.Tracker(3, timeout_s=5)
    tracker.update({0: (1, False), 1: (1, False), 2: (1, False)}, now=0)
    tracker.update({0: (2, False), 1: (2, False)}, now=1)
    assert tracker.verdict(now=5) is None  # process 2: 5 s, not more
    verdict = tracker.verdict(now=5.5)
    assert verdict == _watchdog.Verdict("stall", [2], {0: 2, 1: 2, 2: 1})
    text = _watchdog.describe(verdict, 5, 5, {2: "node3, pid 42"})
    assert text == (
        "process 2 of 3 (node3, pid 42) stopped making progress first: none for "
        "more than 5 s (its last step call was number 1), while the others "
        "reached step call 2 and wait for it."
    )
    # Progress restarts the clock.
    tracker.update({2: (2, False)}, now=6)
    assert tracker.verdict(now=10) is None


def test_all_stuck_together_is_a_deadlock():
    tracker = _watchdog.Tracker(2, timeout_s=2)
    tracker.update({0: (3, False), 1: (3, False)}, now=0)
    verdict = tracker.verdict(now=2.5)
    assert verdict.behind == [0, 1]
    assert "none of the 2 processes made progress for more than 2 s, all at step " in (
        _watchdog.describe(verdict, 2, 2, {})
    )


def test_a_finished_process_is_not_stuck_but_may_be_waited_for():
    both = _watchdog.Tracker(2, timeout_s=60)
    both.update({0: (5, True), 1: (5, True)}, now=0)
    assert both.verdict(now=1000) is None  # both finished: nothing to judge
    tracker = _watchdog.Tracker(2, timeout_s=60, finished_grace_s=4)
    tracker.update({0: (5, True), 1: (5, False)}, now=0)
    assert tracker.verdict(now=30) is None
    # Process 1 is in a step that process 0 never started.
    tracker.update({1: (6, False)}, now=31)
    assert tracker.verdict(now=35) is None
    verdict = tracker.verdict(now=35.5)
    assert verdict == _watchdog.Verdict("finished", [1], {0: 5, 1: 6}, 0)
    text = _watchdog.describe(verdict, 60, 4, {})
    assert text.startswith(
        "process 0 of 2 finished its program after 5 step calls while process 1 "
        "is still running (at step call 6) and made no progress for 4 s: it waits "
        "in a step that process 0 will never join."
    )


def test_a_verdict_travels_as_json():
    verdict = _watchdog.Verdict("stall", [1], {0: 4, 1: 3})
    assert _watchdog.Verdict.from_json(verdict.to_json()) == verdict


def test_a_job_of_one_where_the_environment_says_several_raises():
    """JAX's detection joins a job of one process (here a one-task SLURM step)
    while a JobSet's variables say there are four one-pod jobs: the process
    leaves the job and raises instead of training alone."""
    from jdp.launch._setup import free_port

    clean = clean_environ()
    env = {
        **clean,
        "JAX_PLATFORMS": "cpu",
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "JDP_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "JOB_COMPLETION_INDEX": "0",
        "REPLICATED_JOB_REPLICAS": "4",
    }
    code = ALONE + "\nprint('not reached')"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "not reached" not in proc.stdout
    assert re.search(
        r"RuntimeError: jdp\.distributed\.initialize: \$REPLICATED_JOB_REPLICAS=4 "
        r"says that this job has several processes, but JAX's cluster detection "
        r"made a job of one process",
        proc.stderr,
    ), proc.stderr


def test_a_malformed_task_count_is_named(no_cluster_env, monkeypatch):
    with pytest.raises(
        ValueError, match=r"\$SLURM_NTASKS must be an integer, got 'abc'"
    ):
        _cluster.expected_processes({"SLURM_NTASKS": "abc"}, kubernetes=False)
    monkeypatch.setenv("SLURM_NTASKS", "abc")
    with pytest.raises(
        ValueError,
        match=r"environment variable \$SLURM_NTASKS must be an integer, got "
        r"'abc'\. The scheduler .* sets it to a number",
    ):
        jdp.distributed.initialize()
    assert not jdp.distributed.is_initialized()


def test_a_slurm_task_whose_coordinator_never_comes_up_says_so_and_exits():
    """Task 1 of 2 started, task 0 never: warnings while waiting, then a
    `TimeoutError` and exit status 1 (JAX alone aborts with SIGABRT)."""
    from jdp.launch._setup import free_port

    port = free_port()
    clean = clean_environ()
    env = {
        **clean,
        "JAX_PLATFORMS": "cpu",
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS_PER_NODE": "1",
        "JAX_COORDINATOR_PORT": str(port),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", "import jdp; jdp.distributed.initialize(timeout_s=2)"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 1, err
    where = (
        r"JAX's SLURM detection: the first host of \$SLURM_STEP_NODELIST=127\.0\.0\.1, "
        rf"\$JAX_COORDINATOR_PORT={port}"
    )
    assert re.search(
        rf"process 1 of 2 is waiting for the coordinator at 127\.0\.0\.1:{port} "
        rf"\(address from {where}, which `coordinator_address` or "
        r"\$JAX_COORDINATOR_PORT override\) to accept a connection: [\d.]+ s so "
        r"far, giving up after 2 s",
        err,
    ), err
    assert re.search(
        rf"TimeoutError: `jdp\.distributed\.initialize`: the coordinator at "
        rf"127\.0\.0\.1:{port} did not accept a connection within 2 s \(this is "
        rf"process 1 of 2\)\. .*from {where}",
        err,
    ), err
    assert "DEADLINE_EXCEEDED" not in err


def test_amd_gpus_bound_per_task():
    env = slurm(1, 4, gpus=4)
    env["ROCR_VISIBLE_DEVICES"] = "1"
    plan = _cluster.plan_local_devices(env)
    assert plan.local_device_ids == [0]
    assert "$ROCR_VISIBLE_DEVICES=1 of 4" in plan.reason
