"""Multi-process training on JAX's distributed runtime (`jax.distributed`).

Public, stable names:

- `initialize`: join a multi-process job (call first, in every process).
- `shutdown`: leave it (also done at interpreter exit).
- `is_initialized`: whether this process has joined one.
- `live`: a train step that keeps going when a process dies (`LiveStep`).

Once initialized, `jdp.parallelize` spans the devices of every process. Start the
processes with `python -m jdp.launch` on one machine, or with SLURM / Open MPI /
Kubernetes on a cluster.
"""

from jdp import _batching
from jdp.distributed import _batch_agreement
from jdp.distributed._live import LiveStep, live
from jdp.distributed._runtime import initialize, is_initialized, shutdown

# `step.shard` compares the processes' batches through this package.
_batching.use_process_agreement(_batch_agreement._PROCESS_CHECK)

__all__ = ["LiveStep", "initialize", "is_initialized", "live", "shutdown"]
