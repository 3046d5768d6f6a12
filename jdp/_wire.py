"""Compressed all-reduce: wire formats, error feedback, and the exchange.

The exchange (`mean`) is described step by step in docs/guides/compression.md.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _buckets, _replica_parts, _validate
from jdp._tree import PyTree, as_real, from_real, is_complex, is_float


class Wire(NamedTuple):
    """A wire format for `jdp.all_reduce(wire=...)`: made by `jdp.wire.*`.

    Attributes:
      name: `"bf16"`, `"int8"` or `"fp8"`.
      dtype: The element type sent.
      block_size: Values per float32 scale; 1 means no scales (bfloat16).
      qmax: The largest magnitude of the format a block's largest value is
        scaled to (127 for int8, 448 for fp8 e4m3), or None (bfloat16).
    """

    name: str
    dtype: Any
    block_size: int
    qmax: float | None

    def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """Quantises a float32 vector (length a multiple of `block_size`).

        Returns the payload (`dtype`) and the float32 scales (one per block),
        or None for a format without scales.
        """
        if self.qmax is None:
            return x.astype(self.dtype), None
        blocks = x.reshape(-1, self.block_size)
        amax = _block_amax(blocks)
        # An all-zero block keeps scale 1; a non-finite block decodes non-finite.
        inverse = np.float32(1.0 / self.qmax)
        scale = jnp.where(amax == 0, 1.0, amax * inverse).astype(jnp.float32)
        # CPUs flush a scale below float32's smallest normal number to zero.
        scale = jnp.maximum(scale, np.finfo(np.float32).tiny)
        scaled = blocks / scale[:, None]
        if jnp.issubdtype(self.dtype, jnp.integer):
            scaled = jnp.clip(jnp.round(scaled), -self.qmax, self.qmax)
        return scaled.astype(self.dtype).reshape(x.shape), scale

    def decode(self, payload: jax.Array, scale: jax.Array | None) -> jax.Array:
        """The float32 values of a payload and its scales (`encode`'s inverse)."""
        values = payload.astype(jnp.float32)
        if scale is None:
            return values
        blocks = values.reshape(-1, self.block_size) * scale[:, None]
        return blocks.reshape(payload.shape)

    @property
    def bytes_per_value(self) -> float:
        """Wire bytes per value, scales included."""
        scale = 0.0 if self.qmax is None else 4.0 / self.block_size
        return float(np.dtype(self.dtype).itemsize) + scale


def _abs_max(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.abs(a), jnp.abs(b))


def _max_abs(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.maximum(a, jnp.abs(b))


def _block_amax(blocks: jax.Array) -> jax.Array:
    """`jnp.max(jnp.abs(blocks), axis=1)` (NaN rows give NaN), fused with its input.

    XLA:CPU hands `max(abs(.))` to a library call (YNNPACK) that writes the
    magnitudes to a buffer first; reducers XLA does not recognise stay in its own
    loop, which reads the values where they are made. Over more than 32 values XLA
    windows the reduction (reading a written-out input), so rows reduce over
    `gcd(block, 32)` values, then the rest, with two reducers XLA does not merge.
    """
    mags = jnp.abs(blocks)  # the reducers take magnitudes too: no library call
    block = blocks.shape[1]
    outer = math.gcd(block, 32)
    if block <= 32 or outer == 1:
        return lax.reduce(mags, np.float32(0), _abs_max, (1,))
    part = mags.reshape(-1, outer, block // outer)
    part = lax.reduce(part, np.float32(0), _abs_max, (1,))
    return lax.reduce(part, np.float32(0), _max_abs, (1,))


def bf16() -> Wire:
    """bfloat16 on the wire: half the bytes of float32, no scales.

    Returns:
      A wire format for `jdp.all_reduce(wire=...)` or
      `jdp.bmuf(average=jdp.BlockAverage(wire=...))`.

    Example:
      >>> import jdp
      >>> jdp.wire.bf16().bytes_per_value
      2.0
    """
    return Wire("bf16", jnp.bfloat16, 1, None)


def int8(block_size: int = 256) -> Wire:
    """int8 on the wire, one float32 scale per block: about a quarter of the bytes.

    Each block's largest magnitude maps to 127 (the compression guide's step 1).

    Args:
      block_size: Values per scale (256: scales add 1.6% to the bytes). Smaller
        blocks follow the values more closely and cost more.

    Returns:
      A wire format.

    Raises:
      ValueError: If `block_size` is not a positive int.

    Example:
      >>> import jdp
      >>> jdp.wire.int8(block_size=256).bytes_per_value
      1.015625
    """
    _validate.positive_int("block_size", block_size, note="values per scale")
    return Wire("int8", jnp.int8, block_size, 127.0)


def fp8(block_size: int = 256) -> Wire:
    """8-bit floats (e4m3) on the wire, one float32 scale per block.

    As `int8`, with each block's largest magnitude mapped to 448.

    Args:
      block_size: Values per scale (256 by default), as for `int8`.

    Returns:
      A wire format for `jdp.all_reduce(wire=...)`.

    Raises:
      ValueError: If `block_size` is not a positive int.

    Example:
      >>> import jdp
      >>> jdp.wire.fp8().dtype
      <class 'jax.numpy.float8_e4m3fn'>
    """
    _validate.positive_int("block_size", block_size, note="values per scale")
    return Wire("fp8", jnp.float8_e4m3fn, block_size, 448.0)


def check_wire(wire: Any, api: str) -> None:
    """A clear error unless `wire` is None or a `Wire`."""
    if wire is not None and not isinstance(wire, Wire):
        raise TypeError(
            f"`{api}`: `wire` must be a wire format made by `jdp.wire.bf16()`, "
            f"`jdp.wire.int8()` or `jdp.wire.fp8()`, or None; got "
            f"{type(wire).__name__} {wire!r}."
        )


def check_options(wire: Any, error_feedback: Any, reduce_dtype: Any, api: str) -> None:
    """Clear errors for `wire`, `error_feedback` and `reduce_dtype` together."""
    check_wire(wire, api)
    _validate.boolean("error_feedback", error_feedback)
    if error_feedback and wire is None:
        raise ValueError(
            f"`{api}(error_feedback=True)` feeds back what a compressed exchange "
            "drops, and no `wire` format is given: pass e.g. "
            "`wire=jdp.wire.int8()`, or leave `error_feedback=False`."
        )
    if wire is not None and reduce_dtype is not None:
        raise ValueError(
            f"`{api}` got both `wire=jdp.wire.{wire.name}()` and `reduce_dtype="
            f"{reduce_dtype}`: `wire` says what the exchange sends; drop "
            "`reduce_dtype`."
        )


@_replica_parts.declare(local=("worker", "server"), required=("worker", "server"))
class WireState(NamedTuple):
    """The error-feedback buffers of a compressed all-reduce; differ per replica.

    Attributes:
      worker: What this replica's quantisation dropped last step: one float32
        vector per float gradient leaf, padded with zeros to whole blocks.
      server: What its re-quantisation of the chunk it owns dropped: the chunk
        first, zeros after (as long as all worker buffers, whatever the
        replica count; zero with two replicas, whose exchange quantises once).
    """

    worker: tuple[jax.Array, ...]
    server: jax.Array

    #: The checkpoint's warning when `restart_local` zeroed the buffers.
    RESTART_NOTE = (
        "Error-feedback buffers (of `jdp.all_reduce(wire=...)`, `jdp.powersgd`) "
        "start again from zero on every replica."
    )

    def restart_local(self) -> WireState:
        """Zero buffers, for a checkpoint restored into another replica count."""
        return jax.tree.map(np.zeros_like, self)


def _real_size(x) -> int:
    """How many real numbers `x` holds (two per complex element)."""
    return int(np.prod(np.shape(x))) * (2 if is_complex(x) else 1)


def _padded(size: int, block: int) -> int:
    return -(-size // block) * block


def init_state(params: PyTree, wire: Wire) -> WireState:
    """Zero error buffers for gradients shaped like `params`."""
    floats = [x for x in jax.tree.leaves(params) if is_float(x)]
    sizes = [_padded(_real_size(x), wire.block_size) for x in floats]
    worker = tuple(jnp.zeros((n,), jnp.float32) for n in sizes)
    return WireState(worker, server=jnp.zeros((sum(sizes),), jnp.float32))


def mean(grads: PyTree, *, wire: Wire, axis_name: Any, error: WireState | None = None,
         api: str = "jdp.all_reduce") -> tuple[PyTree, WireState | None]:  # fmt: skip
    """Averages `grads` over replicas sending `wire`'s format: `(grads, new error)`.

    The exchange of the compression guide, for a resolved `axis_name`; `error`:
    the buffers of `init_state`, or None.
    """
    outer, *inner = (axis_name,) if isinstance(axis_name, str) else axis_name
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    if not (idx := [i for i, x in enumerate(leaves) if is_float(x)]):
        return grads, error
    block = wire.block_size
    sizes = [_real_size(leaves[i]) for i in idx]
    padded = [_padded(n, block) for n in sizes]
    if error is not None:
        _check_error(error, padded, api)
    # A complex leaf travels as its real and imaginary parts.
    values = [as_real(leaves[i]).astype(jnp.float32).reshape(-1) for i in idx]
    if inner:
        values = lax.pmean(values, tuple(inner))
    num = lax.axis_size(outer)
    if num == 1:
        return grads if not inner else _unflatten(leaves, treedef, idx, values), error
    server = None if error is None else error.server

    def gather(x):
        return lax.all_gather(x, outer).reshape(num, -1)

    def scatter(x):
        return lax.all_to_all(x, outer, 0, 0, tiled=False).reshape(x.shape)

    if num == 2:
        # Each replica sends its whole quantised vector once either way: gathering
        # it leaves out the owners' decode, average and second rounding.
        workers, payload, scale = _quantise(values, sizes, padded, wire, error, 1)
        got, got_scale = _sent(payload[None], _row(scale), wire, gather)
        values = _decoded(got, got_scale, wire, sizes, padded, np.float32(num))
    else:
        workers, payload, scale = _quantise(values, sizes, padded, wire, error, num)
        # Chunk j to replica j: row i of what arrives is replica i's chunk.
        rows = payload.reshape(num, -1)
        scales = None if scale is None else scale.reshape(num, -1)
        got, got_scale = _sent(rows, scales, wire, scatter)
        own_q, own_scale, server = _average(got, got_scale, wire, server)
        # Every owner's average to every replica, decoded leaf by leaf.
        got, got_scale = _sent(own_q[None], _row(own_scale), wire, gather)
        got = got.reshape(1, -1)
        got_scale = None if got_scale is None else got_scale.reshape(1, -1)
        values = _decoded(got, got_scale, wire, sizes, padded, None)
    new_error = None if error is None else WireState(tuple(workers), server)
    return _unflatten(leaves, treedef, idx, values), new_error


def _sent(payload, scale, wire: Wire, move):
    """`move` (a collective of rows) of the payload's rows, then of the scales'.

    The payload travels as integers (XLA:CPU widens bf16 and fp8). The scales'
    collective reads the payload's result, so that every process runs the two in
    the same order; apart, XLA writes the payload where it is sent (one buffer of
    both copied it).
    """
    kind = jnp.uint16 if scale is None else jnp.int8
    bits = payload if payload.dtype == kind else lax.bitcast_convert_type(payload, kind)
    got = lax.bitcast_convert_type(move(bits), wire.dtype)
    if scale is None:
        return got, None
    (scale,) = _buckets.after([scale], [got])
    return got, move(scale)


def _row(scale):
    """Scales as one row, or None."""
    return None if scale is None else scale[None]


def _decoded(rows, scales, wire: Wire, sizes, padded, divisor):
    """Each leaf's values: the sum of the rows' decoded values, over `divisor`.

    `rows`: payloads (each the leaves padded to whole blocks, side by side);
    `scales`: their scales' rows, or None.
    """
    out, offset, block = [], 0, wire.block_size
    for n, p in zip(sizes, padded, strict=True):
        total = None
        for i in range(rows.shape[0]):
            sc = None if scales is None else scales[i, offset // block :][: p // block]
            value = wire.decode(rows[i, offset : offset + p], sc)[:n]
            total = value if total is None else total + value
        out.append(total if divisor is None else total / divisor)
        offset += p
    return out


def _quantise(values, sizes, padded, wire: Wire, error, num: int):
    """`(worker errors, payload, scales)`: the leaves plus errors in `num` chunks."""
    payloads, scales, workers = [], [], []
    for k, (v, n, p) in enumerate(zip(values, sizes, padded, strict=True)):
        x = jnp.pad(v, (0, p - n))
        if error is not None:
            x = x + error.worker[k]
        q, sc = wire.encode(x)
        payloads.append(q)
        scales.append(sc)
        if error is not None:
            workers.append(x - wire.decode(q, sc))
    total = sum(padded)
    extra = _padded(-(-total // num), wire.block_size) * num - total
    # On the last leaf: XLA:CPU runs a pad after the concatenation scalar (5x slower).
    payloads[-1] = jnp.pad(payloads[-1], (0, extra))
    scale = None
    if wire.qmax is not None:
        scales[-1] = jnp.pad(scales[-1], (0, extra // wire.block_size))
        scale = jnp.concatenate(scales)
    return workers, jnp.concatenate(payloads), scale


def _average(got, got_scale, wire: Wire, server):
    """The owner's float32 average of its chunk, quantised again.

    `got`: the chunk from every replica (one payload row each, with its scales);
    `server`: its error buffer or None. Returns the payload, scales, new `server`.
    """
    num, chunk = got.shape
    own = sum(
        wire.decode(got[i], None if got_scale is None else got_scale[i])
        for i in range(num)
    ) / np.float32(num)
    if server is not None:
        own = own + server[:chunk]
    own_q, own_scale = wire.encode(own)
    if server is not None:
        dropped = own - wire.decode(own_q, own_scale)
        server = lax.dynamic_update_slice(server, dropped, (0,))
    return own_q, own_scale, server


def _unflatten(leaves, treedef, idx, values):
    out = list(leaves)
    for i, v in zip(idx, values, strict=True):
        out[i] = from_real(v, leaves[i].shape, leaves[i].dtype)
    return jax.tree_util.tree_unflatten(treedef, out)


def _check_error(error: WireState, padded: list[int], api: str) -> None:
    got = [tuple(np.shape(w)) for w in error.worker]
    want = [(p,) for p in padded]
    if got != want or tuple(np.shape(error.server)) != (sum(padded),):
        raise ValueError(
            f"`{api}`: the error-feedback buffers were made for other params: "
            f"they hold {len(got)} worker buffers of sizes {[g[0] for g in got]}, "
            f"and the gradients have {len(want)} float leaves needing "
            f"{[w[0] for w in want]} (padded to whole blocks). Create the state "
            "again with `jdp.TrainState.create(params=..., tx=..., sync=sync)` "
            "for these params and this sync piece."
        )
