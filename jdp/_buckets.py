"""Private, pure planning and (un)packing of communication buckets (no collectives)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat buffer: its leaves' indices and sizes, in packing order, and dtype."""

    indices: tuple[int, ...]
    dtype: np.dtype
    sizes: tuple[int, ...]


def plan_buckets(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype], *,
                 bucket_bytes: int | None, reverse: bool = True,
                 alone_bytes: int | None = None) -> list[Bucket]:  # fmt: skip
    """Groups leaves into buckets, in issue order (a bucket is issued when full).

    Args:
      shapes: Shape of each leaf, in pytree order; empty leaves are left out.
      dtypes: Wire dtype of each leaf (leaves of different dtypes never share a bucket).
      bucket_bytes: Largest bucket size in bytes; `None` puts every leaf of a dtype in
        one bucket. A larger leaf gets a bucket of its own.
      reverse: Take leaves last-first.
      alone_bytes: A leaf of at least this many bytes gets a bucket of its own when
        it is reached, leaving the open bucket open. None: no such leaf.
    """
    order = range(len(shapes) - 1, -1, -1) if reverse else range(len(shapes))
    open_buckets: dict[np.dtype, tuple[list[int], list[int]]] = {}
    done: list[Bucket] = []

    def close(dtype):
        idx, sizes = open_buckets.pop(dtype)
        done.append(Bucket(tuple(idx), dtype, tuple(sizes)))

    for i in order:
        size = int(np.prod(shapes[i], dtype=np.int64))
        if size == 0:
            continue
        dtype = np.dtype(dtypes[i])
        if alone_bytes is not None and size * dtype.itemsize >= alone_bytes:
            done.append(Bucket((i,), dtype, (size,)))
            continue
        if dtype in open_buckets and bucket_bytes is not None:
            if (sum(open_buckets[dtype][1]) + size) * dtype.itemsize > bucket_bytes:
                close(dtype)
        idx, sizes = open_buckets.setdefault(dtype, ([], []))
        idx.append(i)
        sizes.append(size)
    for dtype in list(open_buckets):
        close(dtype)
    return done


def pack(parts: Sequence[jnp.ndarray]) -> jnp.ndarray:
    """Concatenates 2-D blocks of equal height along their columns (one buffer)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def unpack(packed: jnp.ndarray, widths: Sequence[int]) -> list[jnp.ndarray]:
    """Splits a packed buffer back into its blocks of `widths` columns, in order."""
    if len(widths) == 1:
        return [packed]
    offsets = np.cumsum((0,) + tuple(widths))
    return [packed[:, a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
