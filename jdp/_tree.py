"""Private pytree helpers shared by jdp's modules: paths, leaf kinds, error lists."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any

#: How many offending leaves an error message lists before "and N more".
MAX_LISTED = 5


def keystr(path: Sequence[Any]) -> str:
    """Formats a pytree key path the way users write it, e.g. `['dense']['kernel']`."""
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def repeated_paths(
    tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None
) -> list[tuple[str, str]]:
    """`(first path, later path)` for each leaf that is an object met before.

    With `is_leaf`, only the nodes it accepts are compared (e.g. NNX `Variable`s).
    """
    first: dict[int, str] = {}
    pairs = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        if is_leaf is not None and not is_leaf(x):
            continue
        if id(x) in first:
            pairs.append((first[id(x)], keystr(path)))
        else:
            first[id(x)] = keystr(path)
    return pairs


def is_float(x: Any) -> bool:
    """True for floating and complex leaves: the ones that are averaged."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def is_complex(x: Any) -> bool:
    """True for complex leaves."""
    return jnp.issubdtype(jnp.result_type(x), jnp.complexfloating)


def as_real(x: jax.Array) -> jax.Array:
    """`x` as real numbers: a complex array's (real, imaginary) pairs on a last axis.

    For an exchange in a real format (a wire dtype, a compressed wire), which
    would otherwise drop the imaginary part; `from_real` undoes it.
    """
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1) if is_complex(x) else x


def from_real(v: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """`v` (the values of `as_real` of an array of `shape`, `dtype`) as that array."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        v = v.reshape(*shape, 2).astype(jnp.finfo(dtype).dtype)
        return jax.lax.complex(v[..., 0], v[..., 1])
    return v.reshape(shape).astype(dtype)


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def float_bits(x: jax.Array) -> jax.Array:
    """A real floating-point array's bits, as unsigned integers of its width.

    Compared as bits, -0.0 differs from 0.0, NaNs with their payloads, and
    subnormal numbers that a CPU would read as zero keep their values.
    """
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[jnp.dtype(x.dtype).itemsize])


def float_map(fn, tree, *rest):
    """Applies `fn` to floating leaves; other leaves keep `tree`'s value."""
    return jax.tree.map(lambda x, *r: fn(x, *r) if is_float(x) else x, tree, *rest)


def fill_empty(tree: PyTree, like: PyTree) -> PyTree:
    """`tree` with each empty subtree (no leaves) taken from `like`.

    Such as the parameters a mask (`optax.multi_transform`) left out of an
    optimizer's params-shaped state; `tree` itself if it does not fit `like`.
    """

    def empty(x):
        return not jax.tree.leaves(x)

    try:
        return jax.tree.map(lambda t, x: x if empty(t) else t, tree, like,
                            is_leaf=empty)  # fmt: skip
    except (ValueError, TypeError):  # `tree` is not a prefix of `like`
        return tree


def finite(tree: PyTree) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite (a bool scalar)."""
    ok = jnp.array(True)
    for x in jax.tree.leaves(tree):
        if is_float(x):
            ok &= jnp.all(jnp.isfinite(x))
    return ok


def format_problems(problems: Sequence[str]) -> str:
    """Joins per-leaf problems, listing at most `MAX_LISTED` of them."""
    shown = list(problems[:MAX_LISTED])
    if len(problems) > MAX_LISTED:
        shown.append(f"... and {len(problems) - MAX_LISTED} more.")
    return "\n  ".join([""] + shown)
