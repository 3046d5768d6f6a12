"""Collectives for use inside a parallel step: gradients, computed state, broadcast.

Every function here runs inside a step given to `jdp.parallelize` (or any
`shard_map`/`pmap` that binds `axis_name`); called outside one it raises a
`RuntimeError` that says so.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _buckets
from jdp._tree import is_float

PyTree = Any
AxisName = str | tuple[str, ...]

DEFAULT_BUCKET_BYTES = 25 * 2**20

UNBOUND_AXIS_MSG = (
    "`{api}` needs the replica axis {axis!r}, which is not bound here. Call it inside "
    "a step run by `jdp.parallelize(step, axis_name={axis!r})` (or inside a "
    "`shard_map`/`pmap` that binds that axis), or pass the `axis_name` your step "
    "uses."
)


def check_bucket_bytes(bucket_bytes: int | None) -> None:
    """A clear `ValueError` unless `bucket_bytes` is None or positive."""
    if bucket_bytes is not None and bucket_bytes <= 0:
        raise ValueError(
            f"`bucket_bytes` must be a positive number of bytes or None, got "
            f"{bucket_bytes}."
        )


def axis_size(axis_name: AxisName, api: str) -> int:
    """Number of replicas along `axis_name`; a clear `RuntimeError` if it is unbound."""
    try:
        return lax.axis_size(axis_name)
    except NameError as e:
        raise RuntimeError(UNBOUND_AXIS_MSG.format(api=api, axis=axis_name)) from e


def all_reduce_gradients(
    grads: PyTree,
    *,
    axis_name: AxisName = "data",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    reverse: bool = True,
    dtype: Any = None,
    flatten: bool | None = None,
) -> PyTree:
    """Averages a gradient pytree over replicas using a few large collectives.

    Floating leaves are taken in reverse pytree order when `reverse` (the order the
    backward pass produces them: Caffe2's `_GetReverseOrderedGrads`, PyTorch DDP's
    buckets) and packed, per dtype, into buckets of at most `bucket_bytes`; each
    bucket is one `psum` (one all-reduce in the program), divided by the number of
    replicas and unpacked. The result equals `jax.lax.pmean(grads, axis_name)` up to
    float rounding.

    A bucket travels either as one flat buffer (its leaves concatenated, one `psum`,
    as Caffe2 and DDP do) or as the `psum`s of its leaves issued back to back, which
    XLA's all-reduce combiner merges when it compiles (on CPU into one all-reduce
    per step; on GPU up to its combine threshold). Flat buffers cost a copy in and
    out; they pay off where every array of a collective has a fixed cost, as with
    JAX's gloo collectives between processes (a flat buffer ran twice as fast as the
    gradient tree there). `flatten=None` picks flat buffers exactly when several
    processes share the CPU backend, and otherwise leaves the merging to XLA, which
    costs no copy.

    Integer and boolean leaves are NOT averaged (a mean of integers is not an
    integer, and integer "gradients" are `float0`/counters, never learned): they are
    returned unchanged, as each replica holds them. Empty leaves are returned as they
    are and communicate nothing.

    Args:
      grads: Per-replica gradients, any pytree of arrays.
      axis_name: Replica axis bound by `jdp.parallelize` (`"data"` by default).
      bucket_bytes: Largest bucket size in bytes, 25 MiB by default (PyTorch DDP's
        `bucket_cap_mb`). `None` packs all leaves of a dtype into one bucket. A leaf
        larger than the limit travels alone.
      reverse: Pack leaves last-first (default) rather than in pytree order.
      dtype: Optional wire dtype, e.g. `jnp.bfloat16` to halve the bytes sent
        (gradient compression); results keep each leaf's original dtype. The
        gradients are divided by the replica count before the cast, so the sum
        cannot overflow a narrow type.
      flatten: Send each bucket as one flat buffer (True), as a tuple of its
        leaves (False), or decide from the runtime (None, the default: flat
        across CPU processes, tuples otherwise).

    Returns:
      A pytree like `grads` holding the mean over replicas of every floating leaf.

    Raises:
      RuntimeError: If `axis_name` is not bound (called outside `jdp.parallelize`).
      ValueError: If `bucket_bytes` is not positive.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> def step_fn(state, batch):
      ...     g = jdp.all_reduce_gradients({"w": batch.sum()})
      ...     return state, {"g": g["w"]}
      >>> step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
      >>> _, metrics = step(step.replicate({}), step.shard(jnp.arange(4.0)))
      >>> float(metrics["g"])  # mean of (0 + 1) and (2 + 3)
      3.0

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
      Training", VLDB 2020, https://arxiv.org/abs/2006.15704.
    """
    return _all_reduce(
        grads,
        axis_name=axis_name,
        bucket_bytes=bucket_bytes,
        reverse=reverse,
        dtype=dtype,
        flatten=flatten,
        api="jdp.all_reduce_gradients",
    )


def _all_reduce(grads, *, axis_name, bucket_bytes, reverse, dtype, flatten, api):
    num = axis_size(axis_name, api)
    check_bucket_bytes(bucket_bytes)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    leaves = [jnp.asarray(x) for x in leaves]
    float_idx = [i for i, x in enumerate(leaves) if is_float(x)]
    wire = [
        np.dtype(dtype) if dtype is not None else np.dtype(leaves[i].dtype)
        for i in float_idx
    ]
    plan = _buckets.plan_buckets(
        [leaves[i].shape for i in float_idx],
        wire,
        bucket_bytes=bucket_bytes,
        reverse=reverse,
    )
    sub = [leaves[i] for i in float_idx]
    if flatten is None:
        # Flat buffers pay a concatenate and a split; they win where each array of
        # a collective costs a fixed latency (gloo between processes). Elsewhere
        # one tuple all-reduce per bucket moves the same bytes with no copies.
        flatten = jax.process_count() > 1 and jax.default_backend() == "cpu"
    out = list(leaves)
    for bucket in plan:
        if dtype is not None:
            parts = [(sub[i] / num).astype(bucket.dtype) for i in bucket.indices]
        else:
            parts = [sub[i] for i in bucket.indices]
        if flatten:
            flat = _hierarchical_psum(
                _buckets.pack(parts, bucket, cast=False), axis_name
            )
            parts = _buckets.split(flat, bucket)
        else:
            parts = _hierarchical_psum(parts, axis_name)
        for i, part in zip(bucket.indices, parts, strict=True):
            ref = sub[i]
            value = part.reshape(ref.shape).astype(ref.dtype)
            out[float_idx[i]] = value if dtype is not None else value / num
    return jax.tree_util.tree_unflatten(treedef, out)


def _hierarchical_psum(x, axis_name: AxisName):
    """`lax.psum` of a flat buffer (or a list of arrays), host by host.

    For a tuple of mesh axes `(outer..., inner)`, e.g. `("host", "device")` from
    `jdp.parallelize(..., mesh_shape=...)`, it sums within `inner` first. A flat
    buffer is reduce-scattered within `inner`, all-reduced across the outer axes
    (every device sends 1/size(inner) of the buffer: the cross-host bytes of one
    device per host, like Caffe2's reduce-to-master, all-reduce, broadcast), then
    all-gathered within `inner`. A list of arrays is summed within, then across.
    A single axis name is a plain `psum`.
    """
    if isinstance(axis_name, str) or len(axis_name) < 2:
        return lax.psum(x, axis_name)
    *outer, inner = axis_name
    outer = tuple(outer)
    size = lax.axis_size(inner)
    if isinstance(x, list) or size == 1:
        return lax.psum(lax.psum(x, inner), outer)
    n = x.shape[0]
    x = jnp.pad(x, (0, -n % size))
    x = lax.psum_scatter(x, inner, scatter_dimension=0, tiled=True)
    x = lax.psum(x, outer)
    return lax.all_gather(x, inner, axis=0, tiled=True)[:n]


def broadcast(tree: PyTree, *, root: int = 0, axis_name: AxisName = "data") -> PyTree:
    """Gives every replica replica `root`'s value of `tree` (inside a parallel step).

    This is the checkpoint-sync primitive (Caffe2's `FinalizeAfterCheckpoint`,
    Horovod's `broadcast_parameters`): a masked all-reduce in which every replica
    but `root` contributes zeros. Every dtype is supported; booleans travel as
    integers. Outside a step use `step.broadcast(tree)`.

    Args:
      tree: Per-replica pytree of arrays.
      root: Index of the replica whose value wins (0 by default).
      axis_name: Replica axis bound by `jdp.parallelize`.

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
    num = axis_size(axis_name, "jdp.broadcast")
    if not 0 <= root < num:
        raise ValueError(
            f"`root` must be a replica index in [0, {num}), got {root} "
            f"(num_replicas={num})."
        )
    is_root = lax.axis_index(axis_name) == root

    def one(x):
        x = jnp.asarray(x)
        if x.size == 0:
            return x
        wire = jnp.int32 if x.dtype == jnp.bool_ else x.dtype
        masked = jnp.where(is_root, x.astype(wire), jnp.zeros_like(x, dtype=wire))
        return lax.psum(masked, axis_name).astype(x.dtype)

    return jax.tree.map(one, tree)


def sync_batch_stats(
    tree: PyTree,
    *,
    mode: Literal["mean", "broadcast"] = "mean",
    axis_name: AxisName = "data",
) -> PyTree:
    """Synchronises computed, non-trained state such as BatchNorm running statistics.

    Caffe2 calls these "computed params" and copies the master device's copy to the
    others every iteration (`broadcast_computed_params`). `mode="mean"` averages the
    floating leaves across replicas instead (each replica's statistics saw a
    different slice of the batch, so the mean uses all of it); integer leaves such
    as counters are left unchanged. `mode="broadcast"` copies replica 0's value of
    every leaf, as Caffe2 does.

    Args:
      tree: Per-replica pytree (e.g. flax `batch_stats`).
      mode: `"mean"` (default) or `"broadcast"`.
      axis_name: Replica axis bound by `jdp.parallelize`.

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
    axis_size(axis_name, "jdp.sync_batch_stats")
    return jax.tree.map(lambda x: lax.pmean(x, axis_name) if is_float(x) else x, tree)
