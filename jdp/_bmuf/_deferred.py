"""The block sync deferred to a train step that applies the updates itself.

A step that runs the optimizer through `_transforms.update` (`jdp.local()`)
passes it the extra argument `MERGES_ARG`; `jdp.bmuf`'s update then applies
`inner` alone and leaves its block sync in that list, which `merge_updated`
runs on the updated params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jdp._bmuf._state import find_states, replace_states

PyTree = Any


#: The optimizer's extra argument (optax's `**extra_args`) through which a train
#: step that applies the updates itself asks `jdp.bmuf` to leave its block sync to
#: it: a list into which the update puts the sync (see `merge_updated`).
MERGES_ARG = "jdp_bmuf_merges"


def merge_updated(
    params: PyTree, old_opt_state: PyTree, opt_state: PyTree, merges: list[Callable]
) -> tuple[PyTree, PyTree]:
    """The block sync of `jdp.bmuf` on updated params, after a deferred update.

    A train step that applies the optimizer itself passes an empty list as the
    optimizer's extra argument `MERGES_ARG` (optax's extra-args protocol, which
    `optax.chain` and `optax.MultiSteps` forward): `jdp.bmuf`'s update then
    applies `inner` alone and puts its block sync into the list, and the step
    calls this on the params it updated. Inside the optimizer (a hand-written
    step) the same sync runs on params the update has to compute first: a
    larger temporary buffer on every step.

    Args:
      params: The params after `optax.apply_updates`.
      old_opt_state: The optimizer state before the update.
      opt_state: The optimizer state the update returned.
      merges: The list given to the optimizer.

    Returns:
      `(params, opt_state)`: on a step that ends a block, every replica's params
      are exactly the next block's start and the state holds the new global model
      and velocity; otherwise both as given.

    Raises:
      ValueError: If the optimizer holds more than one `jdp.bmuf`.
    """
    if not merges:
        return params, opt_state
    old, new = find_states(old_opt_state), find_states(opt_state)
    if len(new) != 1 or len(old) != 1:
        raise ValueError(
            f"The optimizer contains {len(new)} `jdp.bmuf` states; use one "
            "`jdp.bmuf`, as the last transform of the chain."
        )
    params, merged = merges[-1](params, old[0], new[0])
    return params, replace_states(opt_state, merged)
