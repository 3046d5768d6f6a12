"""`jdp.bmuf`: blockwise model-update filtering (BMUF) as an optax transform.

Caffe2's `Parallelize_GPU_BMUF` as one pure `optax.GradientTransformation`:
every replica trains on its own gradients for a block of steps without
communicating, then the replicas' models are averaged (one all-reduce of the
parameters, inside a `lax.cond` so that it runs on sync steps only) and merged
into a global model with a momentum filter.

One module per part, each importing only those listed before it:

- `_state`: `BMUFState` and the small tree helpers every part uses;
- `_outer`: the classical block filter, its formula written once, as the optax
  transform `block_momentum` (the default `outer`);
- `_options`: the schedule (`Streaming`) and average (`BlockAverage`) values,
  the options' record and their checks;
- `_fragments`: Streaming DiLoCo's fragment plan (pure: shapes in, slices out);
- `_average`: the average across replicas, the seam every option that changes
  what is averaged plugs into (a plain mean, `wire=`);
- `_drop`: the mean of the valid replicas (`on_bad_replica="drop"`);
- `_update`: the update of a sync (block momentum or `outer`), written once;
- `_block`: the block sync; `_streaming`: the fragment syncs;
- `_deferred`: the sync left to a train step that applies the updates itself;
- `_api`: `jdp.bmuf` and `jdp.bmuf_global_params`.
"""

from jdp._bmuf import _fragments, _options
from jdp._bmuf._api import NO_PARAMS_MSG, bmuf, bmuf_global_params
from jdp._bmuf._deferred import MERGES_ARG, merge_updated
from jdp._bmuf._options import BlockAverage, Streaming
from jdp._bmuf._outer import block_momentum
from jdp._bmuf._state import BMUFState, find_states

# The fragment plan and the options' record, by the names the tests use.
_plan = _fragments.plan
_Options = _options.Options

__all__ = [
    "MERGES_ARG",
    "NO_PARAMS_MSG",
    "BMUFState",
    "BlockAverage",
    "Streaming",
    "block_momentum",
    "bmuf",
    "bmuf_global_params",
    "find_states",
    "merge_updated",
]
