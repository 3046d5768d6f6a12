"""Start a multi-process job on this machine: the JAX counterpart of `torchrun`.

`run(fn, num_processes, ...)` runs a function in N new processes. From the
command line,

    python -m jdp.launch --num-processes 2 [--devices-per-process 2] script.py args...

runs a script as N processes of one job (`python -m jdp.launch --help` lists
the options). Either stops the job as soon as a process fails or stalls, and
can start it again (`--max-restarts`). See the Many hosts guide
(docs/guides/multihost.md) and the Restarts guide (docs/guides/restarts.md).
"""

from jdp.launch._run import run

__all__ = ["run"]
