"""Multi-process training on JAX's distributed runtime (`jax.distributed`).

`initialize` joins a job (call it first, in every process), `shutdown` leaves it
(also done at exit), `is_initialized` tells whether this process joined one, and
`live` makes a train step that keeps going when a process dies. Start the
processes with `python -m jdp.launch`, or with SLURM / Open MPI / Kubernetes.
"""

from jdp import _batching
from jdp.distributed import _batch_agreement
from jdp.distributed._live import LiveStep, live
from jdp.distributed._runtime import initialize, is_initialized, shutdown

# `step.shard` compares the processes' batches through this package.
_batching.use_process_agreement(_batch_agreement._PROCESS_CHECK)

__all__ = ["LiveStep", "initialize", "is_initialized", "live", "shutdown"]
