"""Private planning, (un)packing and ordering of buckets (no collectives)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


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


def after(arrays: list[jax.Array], previous: list[jax.Array], *,
          packed: bool = False) -> list[jax.Array]:  # fmt: skip
    """`arrays`, bit for bit, but each computed only once every one of `previous` is.

    Adds to the first element of each array a zero that XLA cannot fold, made
    from the bits of the first element of every array of `previous`: `-0.0` for
    floats (`x + -0.0` is `x` for every float, NaN, inf and `-0.0` included; to
    both parts of a complex), `0` for integers. A collective of `arrays` then
    comes after those that made `previous`: XLA's combiners only merge
    independent collectives, so they stay apart, and none waits for computation
    it does not need. (`lax.optimization_barrier` would not do: XLA:CPU removes it
    before it combines collectives.) The element is read and written at an index
    made the same way, so XLA updates the buffer in place, as long as the update
    has the shape the collective takes: with `packed` (the arrays travel as one
    flat buffer) only the smallest array is held back, as a vector.
    """
    zero = jnp.uint32(0)
    for p in previous:
        bits = lax.bitcast_convert_type(
            p.reshape(-1)[0].real.astype(jnp.float32), jnp.uint32
        )
        zero = zero | lax.shift_right_logical(lax.clz(bits), jnp.uint32(6))  # clz <= 32
    index = zero.astype(jnp.int32)
    minus_zero = lax.bitcast_convert_type(zero | jnp.uint32(0x80000000), jnp.float32)

    def held(x):
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            add = lax.complex(minus_zero, minus_zero)
        elif jnp.issubdtype(x.dtype, jnp.floating):
            add = minus_zero
        else:
            add = zero
        view = x.reshape(-1) if packed else x
        at = (index,) * view.ndim
        head = lax.dynamic_slice(view, at, (1,) * view.ndim) + add.astype(x.dtype)
        return lax.dynamic_update_slice(view, head, at).reshape(x.shape)

    if packed:
        smallest = min(range(len(arrays)), key=lambda i: arrays[i].size)
        return [held(x) if i == smallest else x for i, x in enumerate(arrays)]
    return [held(x) for x in arrays]
