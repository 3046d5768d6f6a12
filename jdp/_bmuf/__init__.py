"""`jdp.bmuf`: blockwise model-update filtering (BMUF) as an optax transform.

Each replica trains on its own gradients for a block of steps; then the
replicas' params are averaged (one all-reduce, in a `lax.cond` that runs on
sync steps only) and merged into a global model by a momentum filter.

One module per part, each importing only those listed before it: `_state`
(`BMUFState`, tree helpers), `_outer` (the block filter, `block_momentum`),
`_options` (`Streaming`, `BlockAverage`, their checks), `_fragments`
(Streaming DiLoCo's fragment plan), `_average` (the mean across replicas),
`_drop` (the valid replicas' mean), `_update` (the update of a sync), `_block`
(the block sync), `_streaming` (the fragment syncs), `_deferred` (the sync left
to the train step) and `_api` (`jdp.bmuf`, `jdp.bmuf_global_params`).
"""

from jdp._bmuf import _fragments, _options
from jdp._bmuf._api import bmuf, bmuf_global_params
from jdp._bmuf._deferred import MERGES_ARG, merge_updated
from jdp._bmuf._options import BlockAverage, Streaming
from jdp._bmuf._outer import block_momentum
from jdp._bmuf._state import BMUFState

# The fragment plan and the options' record, by the names the tests use.
_plan = _fragments.plan
_Options = _options.Options

__all__ = [
    "MERGES_ARG", "BMUFState", "BlockAverage", "Streaming", "block_momentum", "bmuf",
    "bmuf_global_params", "merge_updated",
]  # fmt: skip
