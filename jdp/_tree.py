"""Private pytree helpers shared by jdp's modules: paths, leaf kinds, error lists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

#: How many offending leaves an error message lists before "and N more".
MAX_LISTED = 5


def keystr(path: Sequence[Any]) -> str:
    """Formats a pytree key path the way users write it, e.g. `['dense']['kernel']`."""
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def leaves_with_paths(tree: PyTree) -> tuple[list[tuple[Any, Any]], Any]:
    """Returns `([(path, leaf), ...], treedef)` in the pytree's canonical order."""
    return jax.tree_util.tree_flatten_with_path(tree)


def is_float(x: Any) -> bool:
    """True for floating and complex leaves: the ones that are averaged."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def format_problems(problems: Sequence[str]) -> str:
    """Joins per-leaf problems, listing at most `MAX_LISTED` of them."""
    shown = list(problems[:MAX_LISTED])
    if len(problems) > MAX_LISTED:
        shown.append(f"... and {len(problems) - MAX_LISTED} more.")
    return "\n  ".join([""] + shown)


def nbytes(x: Any) -> int:
    """Bytes held by an array-like leaf (0 for non-arrays)."""
    shape = np.shape(x)
    return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(jnp.result_type(x)).itemsize
