"""Private: what a cluster's environment variables say about this process.

Which of the node's GPUs are its own (`plan_local_devices`), and whether the job
has several processes (`expected_processes`).
"""

from __future__ import annotations

import glob
import importlib.util
import math
import re
from collections.abc import Mapping
from typing import NamedTuple

#: Open MPI up to version 4 (JAX's detection needs it; Open MPI 5 does not set it).
OMPI_URI = "OMPI_MCA_orte_hnp_uri"
#: All needed for JAX to detect SLURM (set inside an `srun` step).
SLURM_REQUIRED = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                  "SLURM_PROCID", "SLURM_LOCALID")  # fmt: skip
#: SLURM's counts of tasks per node, in order of preference.
TASKS_PER_NODE = ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
                  "SLURM_TASKS_PER_NODE")  # fmt: skip
#: The GPUs a process sees (NVIDIA, then AMD's), which it numbers from 0.
VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                   "HIP_VISIBLE_DEVICES")  # fmt: skip
K8S_HOST = "KUBERNETES_SERVICE_HOST"
#: An indexed Kubernetes Job's pod index (JAX's process id on Kubernetes).
K8S_INDEX = "JOB_COMPLETION_INDEX"
#: A JobSet's counts and indices of jobs.
JOBSET_REPLICAS = ("REPLICATED_JOB_REPLICAS", "GLOBAL_REPLICAS")
JOBSET_INDEX = ("JOB_INDEX", "JOB_GLOBAL_INDEX")

_K8S_JOB_FIX = (
    "JAX's Kubernetes detection counts the pods of this pod's own Job (its "
    "`parallelism`) and takes $JOB_COMPLETION_INDEX as the process id: run "
    "the processes as the pods of ONE Indexed Job (`completionMode: Indexed`, "
    "`completions` = `parallelism` = the number of processes; in a JobSet, one "
    "replicated job with `replicas: 1`), with a headless service for the "
    "coordinator (see the clusters guide)"
)

_K8S_NO_PACKAGE_FIX = (
    "JAX's Kubernetes detection needs the `kubernetes` package, which is not "
    "installed: install `jdp[k8s]` (or `jax[k8s]`) in the image, and give the pods' "
    "service account permission to read pods and jobs (see the clusters guide)"
)


def env_int(environ: Mapping[str, str], name: str) -> int | None:
    """`environ[name]` as an int; None if unset or empty; raises if malformed."""
    if not (value := environ.get(name, "").strip()):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"jdp.distributed: the environment variable ${name} must be an integer, "
            f"got {environ[name]!r}. The scheduler (or launcher) sets it to a number: "
            "fix the job script or the environment that sets it, or unset it."
        ) from None


def env_seconds(
    environ: Mapping[str, str], name: str, meaning: str, *, zero_is_unset: bool = False
) -> float | None:
    """`environ[name]` as seconds > 0; None if unset or empty (or "0" if allowed).

    A malformed value raises a `ValueError` saying what the variable does.
    """
    text = environ.get(name, "").strip()
    if not text or (zero_is_unset and text == "0"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(
            f"${name}={text!r}: the environment variable must be a number of "
            f"seconds above 0 ({meaning}). Set such a number, or unset it."
        )
    return value


#: The variables read as integers here or by JAX's cluster detection.
INTEGER_VARIABLES = (
    "SLURM_JOB_ID SLURM_NTASKS SLURM_NPROCS SLURM_PROCID SLURM_LOCALID "
    "SLURM_NODEID SLURM_GPUS_ON_NODE OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_RANK "
    "OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE PMI_SIZE PMI_RANK "
    "JAX_COORDINATOR_PORT JOB_COMPLETION_INDEX"
).split() + [*JOBSET_REPLICAS, *JOBSET_INDEX]


def check_integers(environ: Mapping[str, str]) -> None:
    """Raises `ValueError` for a cluster variable that is set but not an integer."""
    for name in INTEGER_VARIABLES:
        env_int(environ, name)


def slurm_source(environ: Mapping[str, str]) -> str:
    """Where JAX takes a SLURM job's coordinator address from, for messages."""
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return _show(environ, "JAX_COORDINATOR_ADDRESS")
    port = f"a port derived from {_show(environ, 'SLURM_JOB_ID')}"
    if environ.get("JAX_COORDINATOR_PORT"):
        port = _show(environ, "JAX_COORDINATOR_PORT")
    return (
        f"JAX's SLURM detection: the first host of "
        f"{_show(environ, 'SLURM_STEP_NODELIST')}, {port}"
    )


def _show(environ: Mapping[str, str], *names: str) -> str:
    """`$A=1, $B=2` for the variables among `names` that are set."""
    return ", ".join(f"${n}={environ[n]}" for n in names if n in environ)


# -- which GPUs are this process's -------------------------------------------


class DevicePlan(NamedTuple):
    """What `initialize` passes as `local_device_ids`, and why (for the log)."""

    #: [] for every device the process sees; None to leave the choice to JAX.
    local_device_ids: list[int] | None
    #: Why, naming the variables read.
    reason: str


def _tasks_per_node(value: str, node: int | None) -> int | None:
    """The tasks on node `node` from SLURM's `2(x3),1` format (None if unknown)."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if counts and len(set(counts)) == 1:
        return counts[0]
    if node is not None and 0 <= node < len(counts):
        return counts[node]
    return None


def _local_rank_and_size(
    environ: Mapping[str, str],
) -> tuple[str, int, int | None, str] | None:
    """(scheduler, local rank, tasks on this node, the variables read), or None."""
    if "OMPI_COMM_WORLD_LOCAL_RANK" in environ:  # JAX checks Open MPI first too
        names = ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
        rank, size = (env_int(environ, n) for n in names)
        if rank is not None:
            return "Open MPI", rank, size, _show(environ, *names)
    if "SLURM_LOCALID" in environ:
        if (rank := env_int(environ, "SLURM_LOCALID")) is None:
            return None
        for name in TASKS_PER_NODE:
            if name in environ:
                size = _tasks_per_node(environ[name], env_int(environ, "SLURM_NODEID"))
                if size is not None:
                    return "SLURM", rank, size, _show(environ, "SLURM_LOCALID", name)
        return "SLURM", rank, None, _show(environ, "SLURM_LOCALID")
    return None


def _visible_gpus(
    environ: Mapping[str, str], node_gpus: int | None
) -> tuple[int | None, str, bool]:
    """(GPUs this process sees, the variable that says so, whether only it has them)."""
    node_count = env_int(environ, "SLURM_GPUS_ON_NODE")
    node_said = _show(environ, "SLURM_GPUS_ON_NODE")
    if node_count is None:
        node_count, node_said = node_gpus, "the node's /dev/nvidia* devices"
    visible = next((n for n in VISIBLE_DEVICES if n in environ), None)
    if visible is not None:
        listed = [d for d in environ[visible].split(",") if d.strip()]
        if listed == ["-1"] or listed == ["NoDevFiles"]:
            listed = []
        said = _show(environ, visible)
        if own := node_count is not None and len(listed) < node_count:
            said += f" of {node_count} ({node_said}), renumbered from 0"
        return len(listed), said, own
    return node_count, (node_said if node_count is not None else ""), False


def node_gpus() -> int | None:
    """How many NVIDIA GPUs this node has (`/dev/nvidia0`, ...); None if none."""
    return len(glob.glob("/dev/nvidia[0-9]*")) or None


def plan_local_devices(
    environ: Mapping[str, str], *, node_gpus: int | None = None
) -> DevicePlan | None:
    """The local devices of a process that SLURM or Open MPI started, or None.

    One task per node: all of the node's GPUs; several: an equal share each, by
    local rank; GPUs bound per task: all it sees. Raises a `ValueError` if the
    variables contradict each other or the GPUs cannot be shared evenly.
    """
    if (found := _local_rank_and_size(environ)) is None:
        return None
    scheduler, rank, size, tasks = found
    gpus, visible, own = _visible_gpus(environ, node_gpus)
    fix = (
        "Start one task per node (`srun --ntasks-per-node=1`: it gets all of "
        "the node's GPUs), or one per GPU (`--ntasks-per-node` = GPUs per node, "
        "or `--gpus-per-task=1`), or pass `local_device_ids=` to "
        "`jdp.distributed.initialize` yourself."
    )
    if size is not None and not 0 <= rank < size:
        raise ValueError(
            f"jdp.distributed: the {scheduler} variables contradict each other "
            f"({tasks}): the local rank must be below the number of tasks on "
            "the node. Check the job script's task counts. " + fix
        )
    if gpus is None:
        if size == 1:
            only = f"the only task on its node ({tasks}): every device it sees"
            return DevicePlan([], f"{scheduler}: {only}")
        return DevicePlan(
            [rank],
            f"{scheduler}: task {rank} of {size or 'several'} on its node "
            f"({tasks}), the node's GPU count unknown (no $CUDA_VISIBLE_DEVICES "
            "or $SLURM_GPUS_ON_NODE): one device per task, its local rank",
        )
    if gpus == 0:
        return DevicePlan([], f"{scheduler}: no GPU visible ({visible})")
    if own:
        return DevicePlan(
            list(range(gpus)),
            f"{scheduler}: task {rank} on its node ({tasks}) has GPUs of its own "
            f"({visible}): all {gpus} of them",
        )
    if gpus == 1 and size != 1:
        return DevicePlan([0], f"{scheduler}: one GPU visible ({visible})")
    if size is None:
        raise ValueError(
            f"jdp.distributed: {scheduler} started this process as local task "
            f"{rank} ({tasks}) but does not say how many tasks share the node's "
            f"{gpus} GPUs ({visible}; set $SLURM_NTASKS_PER_NODE, e.g. with "
            "`--ntasks-per-node`). " + fix
        )
    if gpus % size:
        which = f"{gpus} GPUs ({visible}) do not split evenly between {size} tasks"
        if gpus < size:
            which = f"only {gpus} GPUs ({visible}) for {size} tasks"
        raise ValueError(
            f"jdp.distributed: {scheduler} put {size} tasks on this node "
            f"({tasks}), but {which}: the processes' device counts would "
            "differ, or they would share GPUs. " + fix
        )
    per = gpus // size
    ids = list(range(rank * per, (rank + 1) * per))
    if size == 1:
        share = f"all {gpus} GPUs"
    elif per == 1:
        share = f"its own GPU, number {ids[0]}"
    else:
        share = f"its {per} GPUs, numbers {ids[0]}-{ids[-1]}"
    return DevicePlan(
        ids,
        f"{scheduler}: task {rank} of {size} on its node ({tasks}) sharing "
        f"{gpus} GPUs ({visible}): {share}",
    )


# -- how many processes the environment expects ------------------------------


class Expected(NamedTuple):
    """The environment's word that a job has several processes."""

    #: How many at least (2 when a variable only says "several").
    count: int
    #: The variables that said so, e.g. "$SLURM_NTASKS=4".
    said: str
    #: Why this process is alone, and what to do.
    fix: str
    #: False where the variables only hint at it: a warning, not an error.
    certain: bool = True
    #: Whether `count` is the job's size, not a lower bound.
    exact: bool = True


def kubernetes_installed() -> bool:
    """Whether the `kubernetes` package (JAX's Kubernetes detection) is installed."""
    return importlib.util.find_spec("kubernetes") is not None


def _explicit_fix(rank_var: str, size_var: str) -> str:
    return (
        "pass the configuration yourself: `jdp.distributed.initialize("
        f"coordinator_address='<host of rank 0>:<port>', num_processes="
        f"int(os.environ['{size_var}']), process_id=int(os.environ['{rank_var}']))`, "
        "or set $JDP_COORDINATOR_ADDRESS, $JDP_NUM_PROCESSES and $JDP_PROCESS_ID"
    )


def expected_processes(
    environ: Mapping[str, str], *, kubernetes: bool
) -> Expected | None:
    """Whether the environment (SLURM, MPI, Kubernetes) says the job has several."""
    size = env_int(environ, "OMPI_COMM_WORLD_SIZE")
    if size is not None and size > 1:
        why = (
            f"JAX detects Open MPI through ${OMPI_URI}, which is not set (Open "
            "MPI 5's `mpirun` no longer sets it)"
            if OMPI_URI not in environ
            else "JAX's Open MPI detection did not join it"
        )
        fix = f"{why}: {_explicit_fix('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE')}."
        return Expected(size, _show(environ, "OMPI_COMM_WORLD_SIZE"), fix)
    for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
        size = env_int(environ, name)
        if size is not None and size > 1:
            missing = [v for v in SLURM_REQUIRED if v not in environ]
            why = (
                "JAX detects a SLURM job inside a job step, from "
                + ", ".join(f"${v}" for v in SLURM_REQUIRED)
                + f"; missing here: {', '.join(f'${v}' for v in missing)}"
                if missing
                else "JAX's SLURM detection did not join it"
            )
            fix = (
                f"{why}. Start every process with `srun` (in an sbatch script: "
                "`srun python train.py`, not `python train.py`, which runs one "
                "process), or run one process on purpose with `--ntasks=1`."
            )
            return Expected(size, _show(environ, name), fix)
    size = env_int(environ, "PMI_SIZE")
    if size is not None and size > 1:
        fix = (
            "JAX does not detect MPICH or Intel MPI: "
            f"{_explicit_fix('PMI_RANK', 'PMI_SIZE')}."
        )
        return Expected(size, _show(environ, "PMI_SIZE"), fix)
    return _expected_on_kubernetes(environ, kubernetes=kubernetes)


def _expected_on_kubernetes(
    environ: Mapping[str, str], *, kubernetes: bool
) -> Expected | None:
    if K8S_HOST not in environ and K8S_INDEX not in environ:
        return None
    index = env_int(environ, K8S_INDEX)
    replicas = {n: env_int(environ, n) for n in JOBSET_REPLICAS + JOBSET_INDEX}
    several = [n for n in JOBSET_REPLICAS if (replicas[n] or 0) > 1]
    several += [n for n in JOBSET_INDEX if (replicas[n] or 0) > 0]
    if index is not None and index > 0:
        several.insert(0, K8S_INDEX)
    fix = _K8S_JOB_FIX if kubernetes else _K8S_NO_PACKAGE_FIX
    if several:
        count = max(
            [index + 1 if index is not None else 2]
            + [replicas[n] for n in JOBSET_REPLICAS if replicas[n]]
            + [replicas[n] + 1 for n in JOBSET_INDEX if replicas[n]]
        )
        return Expected(max(count, 2), _show(environ, *several), fix + ".", exact=False)
    if index is not None and not kubernetes:
        # An Indexed Job at index 0 may have one pod.
        note = f"{fix}. If this Indexed Job has one pod, ignore this warning."
        return Expected(2, _show(environ, K8S_INDEX), note, certain=False, exact=False)
    return None


def one_process_message(expected: Expected, *, found: str) -> str:
    """The message for a process that is alone in a job of several."""
    size = f"{expected.count} processes" if expected.exact else "several processes"
    return (
        f"jdp.distributed.initialize: {expected.said} says that this job has {size}, "
        f"but {found}: each process would train a model of its own. {expected.fix}"
    )
