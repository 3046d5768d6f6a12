"""The block sync deferred to a train step that applies the updates itself."""

from __future__ import annotations

from collections.abc import Callable

from jdp._bmuf._state import find_states, replace_states
from jdp._tree import PyTree

#: The optimizer's extra argument (optax's `**extra_args`, which `optax.chain`
#: and `optax.MultiSteps` forward): a list into which `jdp.bmuf`'s update puts
#: its block sync instead of running it, for `merge_updated`.
MERGES_ARG = "jdp_bmuf_merges"


def merge_updated(
    params: PyTree, old_opt_state: PyTree, opt_state: PyTree, merges: list[Callable]
) -> tuple[PyTree, PyTree]:
    """`(params, opt_state)` after the block sync `jdp.bmuf` left in `merges`.

    `params` are the updated params; inside the optimizer (a hand-written step)
    the same sync would need them computed there, a larger temporary buffer.
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
