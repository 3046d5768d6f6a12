"""Collectives for use inside a parallel step: gradients, computed state, broadcast."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _buckets, _validate
from jdp._tree import PyTree, as_real, from_real, is_float

AxisName = str | tuple[str, ...]

DEFAULT_BUCKET_BYTES = 25 * 2**20

#: With flat buffers, a leaf of at least this size travels as its own array (see
#: the performance guide; `benchmarks/multihost.py`).
ALONE_BYTES = 8 * 2**20

UNBOUND_AXIS_MSG = (
    "`{api}` needs the replica axis {axis!r}, which is not bound here. Call it inside "
    "a step run by `jdp.parallelize(step, axis_name={axis!r})` (or inside a "
    "`shard_map`/`pmap` that binds that axis), or pass the `axis_name` your step "
    "uses."
)


class _Traced(NamedTuple):
    """What `jdp.parallelize` binds while it traces a step."""

    axis_name: AxisName
    # `id(mean) -> (mean, total)` of `record_total` (holding them keeps ids unique).
    totals: dict[int, tuple[Any, Any]]
    devices: tuple[Any, ...] | None  # the step's devices, in the mesh's order


_BOUND_AXIS: contextvars.ContextVar[_Traced | None] = contextvars.ContextVar(
    "jdp_replica_axis", default=None
)


@contextlib.contextmanager
def bound_axis(axis_name: AxisName, devices: tuple | None = None) -> Iterator[dict]:
    """While tracing a step on `devices`, `axis_name=None` means this axis."""
    token = _BOUND_AXIS.set(_Traced(axis_name, {}, devices))
    try:
        yield _BOUND_AXIS.get().totals
    finally:
        _BOUND_AXIS.reset(token)


def traced_devices() -> tuple[Any, ...] | None:
    """The devices of the step `jdp.parallelize` is tracing, or None outside one."""
    return getattr(_BOUND_AXIS.get(), "devices", None)


def record_total(mean: Any, total: Any) -> None:
    """Notes that the metric `mean` averages `total`'s microbatch parts.

    A `jdp.metrics.sum` put on `mean` then sums `total` (`_metrics.reduce_metrics`).
    """
    if (bound := _BOUND_AXIS.get()) is not None:
        bound.totals[id(mean)] = (mean, total)


def last(metrics: PyTree, state: PyTree) -> PyTree:
    """`metrics`, bit for bit, each computed once every array of `state` is.

    Their all-reduces then come after every other collective of the step. The
    CPU collectives give every all-reduce one tag: a process that leaves one
    early (its peer died) keeps a receive posted there, and a larger message of
    a later all-reduce from another peer would abort it. The small metrics last,
    whatever arrives then fits. A total noted for a metric (`record_total`) is
    its new value's.
    """
    done = [x for x in jax.tree.leaves(state) if _orders(x)]
    bound = _BOUND_AXIS.get()

    def order(m):
        if not done or not _orders(m):
            return m
        new = _buckets.after([m], done)[0]
        if bound is not None and id(m) in bound.totals:
            bound.totals[id(new)] = (new, bound.totals[id(m)][1])
        return new

    return jax.tree.map(order, metrics)


def _orders(x) -> bool:
    numeric = isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.number)
    return numeric and x.size > 0


#: The optax `**extra_args` key that, set to False, tells jdp's transforms to issue
#: no collective (an update every replica discards: `optax.MultiSteps`' micro-steps).
COLLECTIVES_ARG = "jdp_collectives"


def resolve_axis(axis_name: AxisName | None) -> AxisName:
    """`axis_name`, or the replica axis of the enclosing step (else `"data"`)."""
    if axis_name is not None:
        return axis_name
    return getattr(_BOUND_AXIS.get(), "axis_name", "data")


def check_bucket_bytes(bucket_bytes: int | None) -> None:
    """A clear error unless `bucket_bytes` is None or a positive int."""
    _validate.positive_int(
        "bucket_bytes", bucket_bytes, allow_none=True, note="bytes, or None"
    )


def check_reduce_dtype(reduce_dtype: Any) -> None:
    """A clear error unless `reduce_dtype` is None or a real floating-point dtype."""
    if reduce_dtype is None:
        return
    try:
        dtype = jnp.dtype(reduce_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            "`reduce_dtype` is the floating-point type the gradients travel in, "
            f"e.g. `jnp.bfloat16`, or None; got {reduce_dtype!r}. (A complex "
            "leaf travels as its real and imaginary parts in that type.)"
        )


def axis_size(axis_name: AxisName | None, api: str) -> int:
    """Number of replicas along `axis_name`; a clear `RuntimeError` if it is unbound."""
    axis_name = resolve_axis(axis_name)
    try:
        return lax.axis_size(axis_name)
    except NameError as e:
        raise RuntimeError(UNBOUND_AXIS_MSG.format(api=api, axis=axis_name)) from e


def all_reduce_gradients(
    grads: PyTree,
    *,
    axis_name: AxisName | None = None,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    reverse: bool = True,
    reduce_dtype: Any = None,
    flatten: bool | None = None,
) -> PyTree:
    """Averages a gradient pytree over replicas using a few large collectives.

    Floating leaves are packed, per dtype and last leaf first, into buckets of at
    most `bucket_bytes`, one all-reduce each: `jax.lax.pmean(grads, axis_name)`
    up to float rounding. Integer and boolean leaves are returned unchanged. See
    the performance guide (docs/guides/performance.md).

    Args:
      grads: Per-replica gradients, any pytree of arrays.
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize` (`"data"` outside one).
      bucket_bytes: Largest bucket size in bytes (25 MiB); `None`: one bucket
        per dtype. A larger leaf travels alone.
      reverse: Pack leaves last-first (default) rather than in pytree order.
      reduce_dtype: Optional wire dtype, e.g. `jnp.bfloat16`; results keep each
        leaf's dtype (the division by the replica count comes first). A complex
        leaf travels as its real and imaginary parts.
      flatten: Send a bucket's leaves under 8 MiB as one flat buffer (True) or
        as a tuple for XLA's combiner (False); None (default): flat across CPU
        processes only.

    Returns:
      A pytree like `grads` holding the mean over replicas of every floating leaf.

    Raises:
      RuntimeError: If `axis_name` is not bound (called outside `jdp.parallelize`).
      ValueError: If `bucket_bytes` is not positive, or `reduce_dtype` is not a
        real floating-point type.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> def step_fn(state, batch):
      ...     g = jdp.all_reduce_gradients({"w": batch.sum()})
      ...     return state, {"g": g["w"]}
      >>> step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
      >>> _, metrics = step(step.replicate({}), step.shard(jnp.arange(4.0)))
      >>> float(metrics["g"])  # mean of (0 + 1) and (2 + 3)
      3.0
    """
    return all_reduce(
        grads, axis_name=axis_name, bucket_bytes=bucket_bytes, reverse=reverse,
        reduce_dtype=reduce_dtype, flatten=flatten, api="jdp.all_reduce_gradients",
    )  # fmt: skip


def all_reduce(grads, *, axis_name, api, bucket_bytes=DEFAULT_BUCKET_BYTES,
               reduce_dtype=None, reverse=True, flatten=None):  # fmt: skip
    """`jdp.all_reduce_gradients` under the public name `api` (for its errors)."""
    check_bucket_bytes(bucket_bytes)
    check_reduce_dtype(reduce_dtype)
    axis_name = resolve_axis(axis_name)
    num = axis_size(axis_name, api)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    leaves = [jnp.asarray(x) for x in leaves]
    floats = [i for i, x in enumerate(leaves) if is_float(x)]
    if flatten is None:  # flat buffers where each array costs a latency: gloo
        flatten = jax.process_count() > 1 and jax.default_backend() == "cpu"
    # Divide first where the sum could overflow: a narrow wire type, or float16
    # leaves (8 replicas of 12000 sum past float16's 65504).
    first = [reduce_dtype is not None or leaves[i].dtype == jnp.float16 for i in floats]
    wire = [  # a complex leaf in a real wire type: its real and imaginary parts
        as_real(leaves[i] / num).astype(reduce_dtype or leaves[i].dtype)
        if d
        else leaves[i]
        for i, d in zip(floats, first, strict=True)
    ]
    summed = bucketed(
        "psum", wire, axis_name=axis_name, bucket_bytes=bucket_bytes, reverse=reverse,
        flatten=flatten, chain=True,
    )  # fmt: skip
    out = list(leaves)
    for i, total, divided in zip(floats, summed, first, strict=True):
        if divided:
            out[i] = from_real(total, leaves[i].shape, leaves[i].dtype)
        else:
            out[i] = total.reshape(leaves[i].shape).astype(leaves[i].dtype) / num
    return jax.tree_util.tree_unflatten(treedef, out)


BucketedOp = Literal["psum", "psum_scatter", "all_gather"]


def bucketed(op: BucketedOp, arrays: list[jax.Array], *, axis_name: AxisName,
             bucket_bytes: int | None, reverse: bool = True, flatten: bool = True,
             chain: bool = False) -> list[jax.Array]:  # fmt: skip
    """Runs one collective per bucket of `arrays`: every bucketed collective of jdp.

    `"psum"` sums each array into a `(1, size)` row; `"psum_scatter"` takes `(num,
    n)` rows and returns this replica's row of the sum, `(1, n)`; `"all_gather"`
    takes this replica's `(n,)` or `(1, n)` row and returns all, `(num, n)`. With
    `flatten`, a bucket is packed into ONE collective (an array of at least
    `ALONE_BYTES` alone). On a 2-D host mesh each runs within hosts first.

    With `chain`, a bucket's collectives wait (`_buckets.after`) for the previous
    bucket's: XLA then cannot merge the buckets into one collective that would wait
    for every array, and each may run while the rest is still being computed.
    """
    axis_name = resolve_axis(axis_name)
    num = lax.axis_size(axis_name)
    rows_in = num if op == "psum_scatter" else 1
    rows_out = num if op == "all_gather" else 1
    widths = [x.size // rows_in for x in arrays]
    out = [
        jnp.zeros((rows_out, w), x.dtype) for x, w in zip(arrays, widths, strict=True)
    ]
    plan = _buckets.plan_buckets(
        [(max(rows_in, rows_out), w) for w in widths],
        [np.dtype(x.dtype) for x in arrays], bucket_bytes=bucket_bytes,
        reverse=reverse, alone_bytes=ALONE_BYTES if flatten else None,
    )  # fmt: skip
    sent = []  # per bucket: its indices, widths and collectives' results
    for bucket in plan:
        sizes = [widths[i] for i in bucket.indices]
        inputs = [arrays[i] for i in bucket.indices]
        if chain and sent:
            # Packed: one collective, one array to hold back. Else one collective
            # per array, which XLA would merge with any independent one.
            inputs = _buckets.after(inputs, sent[-1][2], packed=flatten)
        blocks = [x.reshape(rows_in, w) for x, w in zip(inputs, sizes, strict=True)]
        if flatten:
            results = [_COLLECTIVE[op](_buckets.pack(blocks), axis_name)]
        elif op == "psum":
            results = _hierarchical_psum(inputs, axis_name)
        else:
            results = [_COLLECTIVE[op](block, axis_name) for block in blocks]
        sent.append((bucket.indices, sizes, results))
    for k, (indices, sizes, results) in enumerate(sent):
        if chain and k < len(sent) - 1:
            # Used only once the last bucket is sent, after the backward pass: an
            # update in place of the parameters it reads would need copies.
            results = _buckets.after(results, sent[-1][2])
        if flatten:
            results = _buckets.unpack(results[0], sizes)
        for i, result in zip(indices, results, strict=True):
            out[i] = result.reshape(out[i].shape)
    return out


def _split_axes(axis_name: AxisName):
    """`(outer, inner)` of a host-mesh axis tuple, or None for a single axis."""
    if isinstance(axis_name, str) or len(axis_name) < 2:
        return None
    *outer, inner = axis_name
    return (outer[0] if len(outer) == 1 else tuple(outer)), inner


def _hierarchical_psum(x, axis_name: AxisName):
    """`lax.psum` of a flat buffer (or a list of arrays), host by host.

    On `(outer..., inner)` a buffer is reduce-scattered within `inner`, summed
    across, then all-gathered; a list is summed within, then across.
    """
    if (axes := _split_axes(axis_name)) is None:
        return lax.psum(x, axis_name)
    outer, inner = axes
    size = lax.axis_size(inner)
    if isinstance(x, list) or size == 1:
        return lax.psum(lax.psum(x, inner), outer)
    n = x.shape[0]
    x = jnp.pad(x, (0, -n % size))
    x = lax.psum_scatter(x, inner, scatter_dimension=0, tiled=True)
    x = lax.psum(x, outer)
    return lax.all_gather(x, inner, axis=0, tiled=True)[:n]


def _scatter_rows(m, axis_name: AxisName):
    """Row r of the sum of `(num, n)` rows, on replica r (within hosts first)."""
    if (axes := _split_axes(axis_name)) is not None:
        outer, inner = axes
        # Rows (host, device) -> (device, host): the scatter within a host hands
        # device d every host's row d; the one across hosts hands host h its own.
        m = m.reshape(-1, lax.axis_size(inner), m.shape[1]).transpose(1, 0, 2)
        m = lax.psum_scatter(m.reshape(-1), inner, scatter_dimension=0, tiled=True)
        axis_name = outer
    x = lax.psum_scatter(m.reshape(-1), axis_name, scatter_dimension=0, tiled=True)
    return x[None]


def _gather_rows(m, axis_name: AxisName):
    """Every replica's row, `(num, n)`, from each replica's `(1, n)` row."""
    n = m.shape[-1]
    if (axes := _split_axes(axis_name)) is None:
        x = lax.all_gather(m.reshape(-1), axis_name, axis=0, tiled=True)
        return x.reshape(-1, n)
    outer, inner = axes
    x = lax.all_gather(m.reshape(-1), outer, axis=0, tiled=True)  # rows by host
    x = lax.all_gather(x, inner, axis=0, tiled=True)  # then by device
    return x.reshape(lax.axis_size(inner), -1, n).transpose(1, 0, 2).reshape(-1, n)


_COLLECTIVE = {
    "psum": lambda m, axis: _hierarchical_psum(m.reshape(-1), axis).reshape(m.shape),
    "psum_scatter": _scatter_rows,
    "all_gather": _gather_rows,
}


def broadcast(
    tree: PyTree, *, root: int = 0, axis_name: AxisName | None = None
) -> PyTree:
    """Gives every replica replica `root`'s value of `tree` (inside a parallel step).

    Works for every dtype, typed PRNG keys included. Outside a step use
    `step.broadcast(tree)`.

    Args:
      tree: Per-replica pytree of arrays.
      root: Index of the replica whose value wins (0 by default); may be a
        traced integer.
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.

    Returns:
      `tree` with every leaf equal, on every replica, to replica `root`'s leaf.

    Raises:
      RuntimeError: If `axis_name` is not bound.
      ValueError: If `root` is not a replica index.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> def step_fn(state, batch):
      ...     return jdp.broadcast(state, root=1), {}
      >>> step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
      >>> state = step.broadcast(step.replicate(jnp.zeros(())))  # already equal
      >>> state, _ = step(state, step.shard(jnp.zeros(2)))
      >>> jdp.replicas_in_sync(state)
      True
    """
    axis_name = resolve_axis(axis_name)
    num = axis_size(axis_name, "jdp.broadcast")
    if not isinstance(root, jax.Array):  # a traced root is the caller's to check
        _validate.index("root", root, num, size_name="num_replicas")
    is_root = lax.axis_index(axis_name) == root

    def one(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys: their data
            data = one(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        if x.size == 0:
            return x
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            return lax.complex(one(x.real), one(x.imag))
        if jnp.issubdtype(x.dtype, jnp.floating):  # as bits: -0.0 stays -0.0
            bits = lax.bitcast_convert_type(x, f"uint{8 * x.dtype.itemsize}")
            sent = one(bits.astype(jnp.promote_types(bits.dtype, jnp.uint32)))
            return lax.bitcast_convert_type(sent.astype(bits.dtype), x.dtype)
        wire = jnp.int32 if x.dtype == jnp.bool_ else x.dtype
        masked = jnp.where(is_root, x.astype(wire), jnp.zeros_like(x, dtype=wire))
        return lax.psum(masked, axis_name).astype(x.dtype)

    return jax.tree.map(one, tree)


def sync_batch_stats(
    tree: PyTree,
    *,
    mode: Literal["mean", "broadcast"] = "mean",
    axis_name: AxisName | None = None,
) -> PyTree:
    """Synchronises computed, non-trained state such as BatchNorm running statistics.

    `mode="mean"` averages the floating leaves across replicas and leaves integer
    ones (counters) unchanged; `mode="broadcast"` copies replica 0's value.

    Args:
      tree: Per-replica pytree (e.g. flax `batch_stats`).
      mode: `"mean"` (default) or `"broadcast"`.
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.

    Returns:
      The synchronised pytree, equal on every replica.

    Raises:
      ValueError: If `mode` is not one of the two modes.
      RuntimeError: If `axis_name` is not bound.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> def step_fn(state, batch):
      ...     return jdp.sync_batch_stats({"mean": batch.mean()}), {}
      >>> step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
      >>> state, _ = step(step.replicate({"mean": 0.0}), step.shard(jnp.arange(4.0)))
      >>> step.unreplicate(state)["mean"].item()
      1.5
    """
    if mode == "broadcast":
        return broadcast(tree, root=0, axis_name=axis_name)
    if mode != "mean":
        raise ValueError(f"`mode` must be one of 'mean', 'broadcast'; got {mode!r}.")
    axis_name = resolve_axis(axis_name)
    axis_size(axis_name, "jdp.sync_batch_stats")
    return jax.tree.map(lambda x: lax.pmean(x, axis_name) if is_float(x) else x, tree)


def replica_key(key: jax.Array, *, axis_name: AxisName | None = None) -> jax.Array:
    """A PRNG key that differs on every replica (dropout, augmentation).

    `jax.random.fold_in(key, replica index)`: the same on every run and backend
    for the same replica count.

    Args:
      key: A key equal on every replica (e.g. from the state), typed or raw.
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.

    Returns:
      This replica's key.

    Raises:
      RuntimeError: If `axis_name` is not bound (called outside a step).

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> def step_fn(state, batch):
      ...     key = jdp.replica_key(state["key"])
      ...     return state, {"u": jdp.metrics.gather(jax.random.uniform(key))}
      >>> step = jdp.parallelize(step_fn, devices=jax.devices()[:4])
      >>> state = step.replicate({"key": jax.random.key(0)})
      >>> u = step(state, step.shard(jnp.zeros(4)))[1]["u"]
      >>> len(set(u.tolist()))  # four different draws
      4
    """
    axis_name = resolve_axis(axis_name)
    axis_size(axis_name, "jdp.replica_key")
    return jax.random.fold_in(key, lax.axis_index(axis_name))
