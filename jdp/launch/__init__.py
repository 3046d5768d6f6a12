"""Start a multi-process job on this machine: the JAX counterpart of `torchrun`.

Public, stable names:

- `run(fn, num_processes, ...)`: run a function in N new processes (Python, tests).

From the command line:

    python -m jdp.launch --num-processes 2 [--devices-per-process 2] script.py args...

starts N processes on 127.0.0.1 with a free coordinator port, sets
`JDP_COORDINATOR_ADDRESS`, `JDP_NUM_PROCESSES` and `JDP_PROCESS_ID` (read by
`jdp.distributed.initialize()`) and `JDP_FAIL_FAST=1` (its `fail_fast`: a failing
process exits at once), prefixes every output line with its process index,
forwards Ctrl-C / SIGTERM to every process, and, as soon as one process fails,
stops the others and exits non-zero, naming the process that ended first. A
process that is alive but stuck is found from the progress reported at each jdp
step: after `--stall-timeout` seconds (300 by default) the job is stopped,
naming it. Processes that wait in a step for one that has finished (it made
fewer step calls: its data ran out first) are stopped after 15 s without
progress (or the stall limit, if shorter), naming the finished process.

With `--max-restarts K` (`run(..., max_restarts=K)`), a failed or stalled job is
started again on a fresh port, up to K times, with a line per restart; every
process sees `JDP_RESTART_COUNT` (the restarts so far) and `JDP_MAX_RESTARTS`,
and resumes from its latest checkpoint (`CheckpointManager.restore(like,
default=like, with_extra=True)`). With `--min-processes M`, a process index that
fails first in two attempts in a row makes the next attempt run with one
process fewer, down to M (`JDP_NUM_PROCESSES` says how many run).
"""

from jdp.launch._run import run

__all__ = ["run"]
