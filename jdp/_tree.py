"""Private pytree helpers shared by jdp's modules: paths, leaf kinds, error lists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any

#: How many offending leaves an error message lists before "and N more".
MAX_LISTED = 5


def keystr(path: Sequence[Any]) -> str:
    """Formats a pytree key path the way users write it, e.g. `['dense']['kernel']`."""
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def is_float(x: Any) -> bool:
    """True for floating and complex leaves: the ones that are averaged."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def format_problems(problems: Sequence[str]) -> str:
    """Joins per-leaf problems, listing at most `MAX_LISTED` of them."""
    shown = list(problems[:MAX_LISTED])
    if len(problems) > MAX_LISTED:
        shown.append(f"... and {len(problems) - MAX_LISTED} more.")
    return "\n  ".join([""] + shown)
