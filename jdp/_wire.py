"""Compressed all-reduce: wire formats, error feedback, and the exchange.

A `Wire` says what an all-reduce sends: bfloat16, or int8 / fp8 with one float32
scale per block of `block_size` values (the scales travel too). `mean` averages
a gradient pytree over replicas sending that format, in the shape DeepSpeed's
compressed all-reduce and torchft's quantised outer gradients use:

1. every replica flattens its float leaves into one float32 vector (plus its
   worker error, with error feedback) and quantises it;
2. an all-to-all sends chunk `j` of the quantised vector (and its scales) to
   replica `j`, the chunk's owner;
3. each owner dequantises the N copies of its chunk and averages them in
   float32 (plus its server error, with error feedback), then quantises the
   average again;
4. an all-gather hands every replica every owner's quantised average, which it
   dequantises: the same numbers on every replica.

Both exchanges move the narrow type, so the bytes on the wire are those of the
format (a plain `psum` in bfloat16 would not do: XLA on CPU computes it in
float32). With error feedback, what quantisation dropped is added back the next
step: the worker error (each replica's own, `x - dequantise(quantise(x))` of
step 1) and the server error (each owner's, of step 3), both per replica.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _replica_parts, _validate
from jdp._tree import is_float

PyTree = Any


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
        amax = jnp.max(jnp.abs(blocks), axis=1)
        # An all-zero block keeps scale 1; a block holding a NaN or an infinity
        # gets a non-finite scale, so that it decodes non-finite (a skipped step
        # sees it) rather than quantising to garbage.
        inverse = np.float32(1.0 / self.qmax)
        scale = jnp.where(amax == 0, 1.0, amax * inverse).astype(jnp.float32)
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


def bf16() -> Wire:
    """bfloat16 on the wire: half the bytes of float32, no scales.

    Returns:
      A wire format for `jdp.all_reduce(wire=...)`, `jdp.sync_gradients(wire=
      ...)` or `jdp.bmuf(wire=...)`.

    Example:
      >>> import jdp
      >>> jdp.wire.bf16().bytes_per_value
      2.0
    """
    return Wire("bf16", jnp.bfloat16, 1, None)


def int8(block_size: int = 256) -> Wire:
    """int8 on the wire, one float32 scale per block: about a quarter of the bytes.

    Each block of `block_size` consecutive gradient values is scaled so that its
    largest magnitude maps to 127, rounded to the nearest integer (ties to even)
    and sent with its scale.

    Args:
      block_size: Values per scale (256 by default: scales add 1.6% to the
        bytes). Smaller blocks follow the values more closely and cost more.

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

    As `int8`, with each block scaled so that its largest magnitude maps to 448
    (e4m3's largest finite value) and rounded to the nearest e4m3 value: a
    relative error per value rather than an absolute one per block, so small
    values in a block with a large one survive better. XLA sends the bytes
    (on CPU as on GPU); the arithmetic is float32.

    Args:
      block_size: Values per scale (256 by default).

    Returns:
      A wire format.

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


# -- error-feedback state -------------------------------------------------------------


@_replica_parts.declare(local=("worker", "server"), required=("worker", "server"))
class WireState(NamedTuple):
    """The error-feedback buffers of a compressed all-reduce.

    Both are float32 vectors as long as the gradients' float values together
    (flattened in pytree order), and differ between replicas.

    Attributes:
      worker: What this replica's quantisation dropped last step.
      server: What this replica's re-quantisation of the chunks it owns
        dropped last step (zero outside those chunks).
    """

    worker: jax.Array
    server: jax.Array

    def restart_local(self) -> WireState:
        """Zero buffers: a checkpoint restored into another replica count.

        The buffers belong to one replica and (the server error) to the chunks
        it owned, which another replica count splits differently; at most one
        step's quantisation error is lost.
        """
        return WireState(np.zeros_like(self.worker), np.zeros_like(self.server))


def init_state(params: PyTree) -> WireState:
    """Zero error buffers for gradients shaped like `params`."""
    size = sum(int(np.prod(np.shape(x))) for x in _float_leaves(params))
    zeros = jnp.zeros((size,), jnp.float32)
    return WireState(worker=zeros, server=zeros)


def _float_leaves(tree: PyTree) -> list[Any]:
    return [x for x in jax.tree.leaves(tree) if is_float(x)]


# -- the exchange ---------------------------------------------------------------------


def _split_outer(axis_name):
    """`(compressed axis, inner axes)`: on a host mesh only the outer one compresses."""
    if isinstance(axis_name, str) or len(axis_name) == 1:
        return (axis_name if isinstance(axis_name, str) else axis_name[0]), ()
    return axis_name[0], tuple(axis_name[1:])


def mean(
    grads: PyTree,
    *,
    wire: Wire,
    axis_name: Any,
    error: WireState | None = None,
    api: str = "jdp.all_reduce",
) -> tuple[PyTree, WireState | None]:
    """Averages `grads` over replicas, sending `wire`'s format.

    Args:
      grads: One replica's gradients (float leaves are averaged; others pass
        through).
      wire: The wire format.
      axis_name: The replica axis (resolved: bound in the enclosing step), or
        a host mesh's `(host, device)` axes: the devices of a host average in
        float32 first, and only the hosts' exchange is compressed.
      error: The error-feedback buffers (`init_state`), or None for none.
      api: The public name, for errors.

    Returns:
      `(averaged grads, new error buffers or None)`.
    """
    outer, inner = _split_outer(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    idx = [i for i, x in enumerate(leaves) if is_float(x)]
    if not idx:
        return grads, error
    sizes = [int(np.prod(leaves[i].shape)) for i in idx]
    total = sum(sizes)
    if error is not None and (
        error.worker.shape != (total,) or error.server.shape != (total,)
    ):
        raise ValueError(
            f"`{api}`: the error-feedback buffers hold {error.worker.shape} and "
            f"{error.server.shape} values, but the gradients have {total} float "
            "values: the state was made for other params. Create it again with "
            "`jdp.TrainState.create(params=..., tx=..., sync=sync)` for these params."
        )
    flat = jnp.concatenate([leaves[i].astype(jnp.float32).reshape(-1) for i in idx])
    if inner:
        flat = lax.pmean(flat, inner)
    num = lax.axis_size(outer)
    if num == 1:
        averaged, new_error = flat, error
    else:
        averaged, new_error = _exchange(flat, wire, outer, num, error)
    out = list(leaves)
    offset = 0
    for i, size in zip(idx, sizes, strict=True):
        ref = leaves[i]
        out[i] = averaged[offset : offset + size].reshape(ref.shape).astype(ref.dtype)
        offset += size
    return jax.tree_util.tree_unflatten(treedef, out), new_error


def _exchange(flat, wire: Wire, axis, num: int, error: WireState | None):
    """Steps 1-4 of the module docstring on one float32 vector."""
    total = flat.shape[0]
    chunk = -(-total // (num * wire.block_size)) * wire.block_size
    padded = chunk * num

    def pad(x):
        return jnp.pad(x, (0, padded - total))

    x = pad(flat)
    if error is not None:
        x = x + pad(error.worker)
    payload, scale = wire.encode(x)
    if error is not None:
        worker = (x - wire.decode(payload, scale))[:total]
    # 2. chunk j to replica j: row i of what arrives is replica i's chunk j.
    payload = _all_to_all(payload.reshape(num, chunk), axis)
    if scale is not None:
        scale = lax.all_to_all(scale.reshape(num, -1), axis, 0, 0, tiled=False).reshape(
            num, -1
        )
    # 3. the owner's float32 average, quantised again.
    values = jnp.stack(
        [
            wire.decode(payload[i], None if scale is None else scale[i])
            for i in range(num)
        ]
    )
    own = jnp.sum(values, axis=0) / num
    me = lax.axis_index(axis)
    if error is not None:
        own = own + lax.dynamic_slice(pad(error.server), (me * chunk,), (chunk,))
    own_payload, own_scale = wire.encode(own)
    if error is not None:
        dropped = own - wire.decode(own_payload, own_scale)
        server = lax.dynamic_update_slice(
            jnp.zeros((padded,), jnp.float32), dropped, (me * chunk,)
        )[:total]
    # 4. every owner's average to every replica.
    gathered = _all_gather(own_payload, axis).reshape(num, chunk)
    if own_scale is not None:
        own_scale = lax.all_gather(own_scale, axis).reshape(num, -1)
    averaged = jnp.concatenate(
        [
            wire.decode(gathered[i], None if own_scale is None else own_scale[i])
            for i in range(num)
        ]
    )[:total]
    new_error = None if error is None else WireState(worker=worker, server=server)
    return averaged, new_error


_UINT = {1: jnp.uint8, 2: jnp.uint16}


def _as_bytes(x):
    """Narrow floats travel as unsigned ints of their width.

    XLA on CPU computes a bfloat16 all-to-all in float32 (twice the bytes), and
    collectives of float8 need not exist; their bits as integers travel as they
    are everywhere.
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize in _UINT:
        return lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]), x.dtype
    return x, None


def _all_to_all(x, axis):
    raw, dtype = _as_bytes(x)
    out = lax.all_to_all(raw, axis, 0, 0, tiled=False).reshape(raw.shape)
    return out if dtype is None else lax.bitcast_convert_type(out, dtype)


def _all_gather(x, axis):
    raw, dtype = _as_bytes(x)
    out = lax.all_gather(raw, axis)
    return out if dtype is None else lax.bitcast_convert_type(out, dtype)
