"""jdp: data-parallel training for JAX.

Write the training step for ONE replica; `jdp.parallelize` runs it on every device
(and host), with replicated state, a sharded batch and averaged gradients. A
JAX-native, purely functional take on Caffe2's `data_parallel_model`.

Everything public is listed in `__all__` (and in the public subpackages'
`__init__`); modules whose names start with `_` are private and may change.
"""

from jdp import distributed as distributed
from jdp import launch as launch
from jdp import metrics as metrics
from jdp import sparse as sparse
from jdp import wire as wire
from jdp._bmuf import (
    BlockAverage,
    BMUFState,
    Streaming,
    block_momentum,
    bmuf,
    bmuf_global_params,
)
from jdp._checks import assert_replicas_in_sync, replicas_in_sync
from jdp._collectives import (
    all_reduce_gradients,
    broadcast,
    replica_key,
    sync_batch_stats,
)
from jdp._divergence import ReplicaDivergenceError
from jdp._equivalence import check_equivalence
from jdp._export import export_predictor, load_predictor, save_predictor
from jdp._hlo import Collective, MemoryAnalysis
from jdp._metrics import weighted
from jdp._parallel import Parallel, parallelize
from jdp._partition import partition
from jdp._powersgd import PowerSGDState, powersgd
from jdp._replica_parts import declare_per_replica
from jdp._sync import Sync, all_reduce, local, sync_gradients
from jdp._train_state import TrainState
from jdp._train_step import make_train_step
from jdp._version import __version__ as __version__
from jdp._zero import zero


def __getattr__(name: str):
    # `jdp.checkpoint` brings in orbax: imported on first use, not by `import jdp`
    # (a process of a launched job that saves nothing starts ~0.3 s sooner).
    if name == "checkpoint":
        import jdp.checkpoint

        return jdp.checkpoint
    raise AttributeError(f"module 'jdp' has no attribute {name!r}")


__all__ = [
    "BMUFState", "BlockAverage", "Collective", "MemoryAnalysis", "Parallel",
    "PowerSGDState", "ReplicaDivergenceError", "Streaming", "Sync", "TrainState",
    "all_reduce", "all_reduce_gradients", "assert_replicas_in_sync",
    "block_momentum", "bmuf", "bmuf_global_params", "broadcast",
    "check_equivalence", "declare_per_replica", "export_predictor",
    "load_predictor", "local", "make_train_step", "parallelize", "partition",
    "powersgd", "replica_key", "replicas_in_sync", "save_predictor",
    "sync_batch_stats", "sync_gradients", "weighted", "zero",
]  # fmt: skip
