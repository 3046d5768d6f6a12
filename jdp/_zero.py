"""Private: ZeRO-style sharded optimizer state (stages 1 and 2) for `make_train_step`.

With `jdp.make_train_step(loss_fn, tx, sync=jdp.zero())` each replica
keeps only its 1/N slice of the optimizer state instead of a full copy:

1. every parameter leaf is flattened and zero-padded to a multiple of N; replica
   `r` owns elements `[r * c, (r + 1) * c)` of it, with `c = ceil(size / N)`;
2. the gradients are reduce-scattered (`lax.psum_scatter`, bucketed like
   `jdp.all_reduce_gradients`), so each replica receives only the averaged
   gradient of its slices (stage 2: no replica holds the full averaged gradient);
3. the optimizer updates the slices (`tx.update` on a pytree like `params` whose
   leaves are the replica's 1-D slices) and the updated slices are all-gathered
   (`lax.all_gather`) into full, replicated parameters.

This equals plain synchronous training for any optimizer that acts element by
element (SGD, momentum, Adam, AdamW, RMSProp, Lion, Adagrad, with schedules).
Optimizers that look at whole parameters (global-norm clipping, LAMB, Adafactor)
are detected from their jaxpr and refused with a message; global-norm clipping is
available as `jdp.zero(clip_grad_norm=...)`, which computes the norm
across replicas with a `psum`.

Layout. The optimizer state lives in the train state as a `ShardedOptState`: the
optimizer's own state pytree (structure unchanged) whose per-parameter leaves are
slices, plus static metadata (each leaf's full logical shape, or None for leaves
such as step counts that every replica holds whole). Replicated, every leaf still
has the leading replica axis sharded over the mesh, so `jdp.parallelize` treats it
like any state; replica `r`'s row is its slice. `ShardedOptState` is a
`jdp._layout.CustomLayout`: it converts itself between this layout and ONE full
logical copy (unreplicate, checkpoints), so a checkpoint holds the ordinary
optimizer state and restores into any replica count, with or without sharding.
The ZeRO train step declares the layout (`layout_fn`), and `step.replicate`
follows it.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", SC 2020, https://arxiv.org/abs/1910.02054.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax

from jdp import _collectives, _jax_compat
from jdp._layout import CustomLayout, abstract
from jdp._tree import format_problems, keystr

PyTree = Any

API = "jdp.zero"
PLACING = "Placing a ZeRO optimizer state (`step.replicate`, a checkpoint restore): "

#: Leading sizes of the probe parameters used to tell per-element state leaves
#: from others; far from any real shape, and never allocated (`jax.eval_shape`).
_SENTINEL = 1_000_003_000

ELEMENTWISE_HINT = (
    "With `sync=jdp.zero()` each replica updates only its slice of "
    "every parameter (seen by the optimizer as a 1-D vector), so the optimizer "
    "must act element by element, as SGD, momentum, Adam, AdamW, RMSProp, Lion and "
    "Adagrad do (with any schedule)."
)

NOT_LAID_OUT_MSG = (
    f"`{API}`: the state's `opt_state` is a full optimizer state, not the sharded "
    "layout this step needs. Place the state with `step.replicate(state)` of the "
    "`jdp.parallelize` that runs this train step. If you wrap the train step in "
    "your own function, give `jdp.parallelize` an object that keeps its "
    "`state_layout` attribute (`functools.wraps` copies it), so that "
    "`step.replicate` finds it."
)


def _is_none(x: Any) -> bool:
    return x is None


class ShardedOptState(struct.PyTreeNode, CustomLayout):
    """An optimizer state sharded across replicas (one slice of it per replica).

    Attributes:
      chunks: The optimizer's state pytree (same structure as `tx.init(params)`);
        each per-parameter leaf holds the replica's 1-D slice of the flattened,
        zero-padded logical leaf; other leaves (counts) are held whole.
      shapes: Static, one entry per leaf of `chunks` in flattening order: the
        logical leaf's full shape, or None for a leaf every replica holds whole.
    """

    chunks: PyTree
    shapes: tuple[tuple[int, ...] | None, ...] = struct.field(pytree_node=False)

    def logical(self) -> PyTree:
        """One full logical copy of the optimizer state (see `logical`)."""
        return logical(self)

    def place(self, host_value: PyTree, place_leaf) -> ShardedOptState:
        """Splits one full logical optimizer state into this layout (see `place`)."""
        return place(host_value, self, place_leaf)

    def agreed(self) -> ShardedOptState:
        """This node with its slices (which differ between replicas) set to None."""
        leaves, treedef = jax.tree.flatten(self.chunks, is_leaf=_is_none)
        kept = [
            v if s is None else None for v, s in zip(leaves, self.shapes, strict=True)
        ]
        return self.replace(chunks=jax.tree.unflatten(treedef, kept))

    def with_agreed(self, agreed: ShardedOptState) -> ShardedOptState:
        """This node with its whole leaves taken from `agreed`."""
        new = iter(jax.tree.leaves(agreed.chunks))
        leaves, treedef = jax.tree.flatten(self.chunks)
        merged = [
            old if s is not None else next(new)
            for old, s in zip(leaves, self.shapes, strict=True)
        ]
        return self.replace(chunks=jax.tree.unflatten(treedef, merged))


def is_sharded(x: Any) -> bool:
    """Whether `x` is a `ShardedOptState` node (an `is_leaf` for tree maps)."""
    return isinstance(x, ShardedOptState)


def chunk_size(size: int, num_shards: int) -> int:
    """Elements per replica of a leaf of `size` elements: `ceil(size / num_shards)`."""
    return -(-size // num_shards)


# -- layout: full logical state <-> sharded per-replica state -----------------------


def _refuse(what: str, fix: str) -> ValueError:
    return ValueError(f"`{API}`: the optimizer {what}. {ELEMENTWISE_HINT} Fix: {fix}")


_FIX_GENERIC = "use an element-wise optimizer, or `sync=jdp.all_reduce()`."


def _check_params(params: PyTree) -> list[tuple[Any, jax.ShapeDtypeStruct]]:
    flat = [
        (p, abstract(x)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    bad = [
        f"{keystr(p)}: {x.dtype}"
        for p, x in flat
        if not jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if bad:
        raise ValueError(
            f"`{API}` shards floating-point parameters only; these leaves are not:"
            f"{format_problems(bad)}\nFix: keep integer state outside `params` "
            "(e.g. in `batch_stats`), or use `sync=jdp.all_reduce()`."
        )
    return flat


def opt_state_layout(
    opt_state: PyTree,
    params: PyTree,
    tx: optax.GradientTransformation,
    num_shards: int,
) -> ShardedOptState:
    """The per-replica abstract layout of a full optimizer state.

    Args:
      opt_state: The full (logical) optimizer state, arrays or ShapeDtypeStructs.
      params: The parameters it belongs to (their shapes and dtypes).
      tx: The optimizer that made it.
      num_shards: Number of replicas it is split across.

    Returns:
      A `ShardedOptState` of per-replica `jax.ShapeDtypeStruct`s (no replica axis).

    Raises:
      ValueError: If the optimizer state is not one value per parameter element,
        or does not match `tx.init(params)`.
    """
    flat_params = _check_params(params)
    treedef = jax.tree.structure(params)
    probe_params = jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct((_SENTINEL + i,), x.dtype)
            for i, (_, x) in enumerate(flat_params)
        ],
    )
    probe = jax.eval_shape(tx.init, probe_params)
    full, state_def = jax.tree_util.tree_flatten_with_path(opt_state)
    probe_leaves, probe_def = jax.tree.flatten(probe)
    if probe_def != state_def:
        raise _refuse(
            "state's structure depends on the parameters' shapes (for example a "
            "mask chosen by `ndim`), or `opt_state` was not made by this `tx` "
            f"(`tx.init` on 1-D slices gives {probe_def.num_leaves} leaves, the "
            f"state has {state_def.num_leaves})",
            "choose masks by parameter path, not shape; or use "
            "`sync=jdp.all_reduce()`.",
        )
    chunks, shapes = [], []
    for (path, leaf), ref in zip(full, probe_leaves, strict=True):
        leaf = abstract(leaf)
        owner = ref.shape[0] - _SENTINEL if len(ref.shape) == 1 else -1
        if 0 <= owner < len(flat_params):
            ppath, pshape = flat_params[owner][0], flat_params[owner][1].shape
            if leaf.shape != pshape:
                raise ValueError(
                    f"`{API}`: optimizer state leaf {keystr(path)} has shape "
                    f"{leaf.shape}, but its parameter "
                    f"{keystr(ppath)} has shape {pshape}. Pass "
                    "the state made by `jdp.TrainState.create(params=..., tx=...)`."
                )
            size = math.prod(pshape)
            chunks.append(
                jax.ShapeDtypeStruct((chunk_size(size, num_shards),), leaf.dtype)
            )
            shapes.append(tuple(leaf.shape))
        elif any(d >= _SENTINEL for d in ref.shape) or ref.shape != leaf.shape:
            raise _refuse(
                f"keeps state leaf {keystr(path)} of shape {leaf.shape}, which is "
                "not one value per parameter element (e.g. factored statistics)",
                _FIX_GENERIC,
            )
        else:
            chunks.append(leaf)
            shapes.append(None)
    return ShardedOptState(
        chunks=jax.tree.unflatten(state_def, chunks), shapes=tuple(shapes)
    )


def layout_fn(tx: optax.GradientTransformation | None):
    """The state layout of a ZeRO train step (for `TrainStep.state_layout`)."""
    return functools.partial(state_layout, tx=tx)


def state_layout(
    state: PyTree, num_replicas: int, *, tx: optax.GradientTransformation | None
) -> PyTree:
    """A train state's abstract layout with its optimizer state sharded.

    Trees without `opt_state`/`params` (e.g. bare parameters) are returned as
    they are.
    """
    if not (hasattr(state, "opt_state") and hasattr(state, "params")):
        return state
    if is_sharded(state.opt_state):
        return state
    optimizer = tx if tx is not None else getattr(state, "tx", None)
    if optimizer is None:
        raise ValueError(
            f"`{API}` got no optimizer: pass `tx` or use a state that carries one "
            "(`jdp.TrainState.create(params=..., tx=...)`)."
        )
    layout = opt_state_layout(state.opt_state, state.params, optimizer, num_replicas)
    return state.replace(opt_state=layout)


def place(
    host_opt_state: PyTree,
    like: ShardedOptState,
    place_whole: Callable[[Any, Any], jax.Array],
) -> ShardedOptState:
    """Splits a full logical optimizer state into the layout of `like`.

    Args:
      host_opt_state: The full optimizer state (e.g. from `tx.init(params)` or a
        checkpoint).
      like: A `ShardedOptState` of replicated `jax.Array`s or
        `jax.ShapeDtypeStruct`s with the replica axis and a sharding.
      place_whole: Places a leaf every replica holds whole (as `step.replicate`
        does).

    Returns:
      The `ShardedOptState` with replica `r`'s row holding slice `r`.
    """
    if is_sharded(host_opt_state):
        raise ValueError(
            f"{PLACING}expected one full logical copy of the optimizer state, "
            "got an already sharded one; pass `step.unreplicate(state)` (or the "
            "state a checkpoint saved)."
        )
    refs, treedef = jax.tree.flatten(like.chunks)
    try:
        values = treedef.flatten_up_to(host_opt_state)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{PLACING}it does not match the layout it is "
            f"placed into ({e}). Restore a state saved for the same model and "
            "optimizer."
        ) from e
    out = []
    for x, ref, shape in zip(values, refs, like.shapes, strict=True):
        if shape is None:
            out.append(place_whole(x, ref))
            continue
        x = np.asarray(jax.device_get(x)).astype(ref.dtype, copy=False)
        if x.shape != tuple(shape):
            raise ValueError(
                f"{PLACING}a leaf has shape {x.shape}, expected {tuple(shape)}."
            )
        num, size = ref.shape[0], ref.shape[1]
        rows = np.zeros(num * size, ref.dtype)
        rows[: x.size] = x.reshape(-1)
        rows = rows.reshape(num, size)
        out.append(
            jax.make_array_from_callback(ref.shape, ref.sharding, rows.__getitem__)
        )
    return like.replace(chunks=jax.tree.unflatten(treedef, out))


def _gather_rows(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def logical(node: ShardedOptState) -> PyTree:
    """One full logical copy of a replicated `ShardedOptState` (the optimizer state).

    Sliced leaves are gathered from every replica, trimmed of padding and reshaped;
    whole leaves come from the first replica. `jax.ShapeDtypeStruct` leaves give
    the logical `jax.ShapeDtypeStruct`. Every process must call it when the state
    spans several processes.
    """
    leaves, treedef = jax.tree.flatten(node.chunks)
    out = []
    for x, shape in zip(leaves, node.shapes, strict=True):
        if isinstance(x, jax.ShapeDtypeStruct):
            logical_shape = shape if shape is not None else x.shape[1:]
            out.append(jax.ShapeDtypeStruct(tuple(logical_shape), x.dtype))
        elif not isinstance(x, jax.Array):
            out.append(x)
        elif shape is None:
            data = x.addressable_shards[0].data
            out.append(data.reshape(data.shape[1:]))
        else:
            full = _gather_rows(x).reshape(-1)[: math.prod(shape)].reshape(shape)
            out.append(jax.device_put(full, x.addressable_shards[0].device))
    return jax.tree.unflatten(treedef, out)


# -- the refusal check: is the optimizer element-wise? -------------------------------

# JAX's primitive names, kept with jdp's other assumptions about JAX.
_REDUCTIONS = _jax_compat.REDUCTION_PRIMITIVES
_COLLECTIVES = _jax_compat.COLLECTIVE_PRIMITIVES
#: Primitives whose presence depends only on ranks, ignored when comparing the
#: update on full parameters with the update on 1-D slices.
_SHAPE_ONLY = _jax_compat.SHAPE_ONLY_PRIMITIVES


def _update_eqns(tx, grads, opt_state, params) -> list:
    closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(
        grads, opt_state, params
    )
    return _jax_compat.equations(closed)


def check_elementwise(
    tx: optax.GradientTransformation,
    slices: PyTree,
    opt_slices: PyTree,
    params: PyTree,
    opt_state: PyTree,
) -> None:
    """Refuses optimizers whose update is not element-wise (traces, runs nothing).

    Traces `tx.update` on the replica's slices and looks for reductions over
    non-scalar values (global norms, per-leaf norms, factored moments) and for
    collectives; then compares it with the update on the full parameters, which
    must issue the same operations (a mask chosen by shape would not).

    Raises:
      ValueError: Naming what was found and how to fix it.
    """
    slices, opt_slices, params, opt_state = jax.tree.map(
        abstract, (slices, opt_slices, params, opt_state)
    )
    eqns = _update_eqns(tx, slices, opt_slices, slices)
    for eqn in eqns:
        name = eqn.primitive.name
        shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
        if name in _COLLECTIVES:
            raise _refuse(
                f"communicates across replicas itself (`{name}` in its update), as "
                "`jdp.sync_gradients` or `jdp.bmuf` do",
                "drop it from `tx`: this step already averages the gradients "
                "(reduce-scatter).",
            )
        if name in _REDUCTIONS and any(len(s) >= 1 for s in shapes):
            raise _refuse(
                f"reduces over whole parameters (`{name}` of a "
                f"{max(shapes, key=len)} operand in its update), as global-norm "
                "clipping, `optax.apply_if_finite`, LAMB or Adafactor do; on a slice "
                "that would see only part of each parameter",
                "for global-norm clipping remove `optax.clip_by_global_norm` from "
                "`tx` and pass `sync=jdp.zero(clip_grad_norm=max_norm)`, "
                "which computes the global norm across replicas; otherwise use "
                "`sync=jdp.all_reduce()`.",
            )
    full = _update_eqns(tx, params, opt_state, params)
    names = [e.primitive.name for e in eqns if e.primitive.name not in _SHAPE_ONLY]
    full_names = [e.primitive.name for e in full if e.primitive.name not in _SHAPE_ONLY]
    if names != full_names:
        raise _refuse(
            "does not do the same on a 1-D slice of a parameter as on the whole "
            f"parameter ({len(full_names)} operations on full parameters, "
            f"{len(names)} on slices), typically a weight-decay or other mask chosen "
            "by `ndim` or shape",
            "choose masks by parameter path, e.g. `mask=lambda p: "
            "jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key != 'b', "
            "p)`; or use `sync=jdp.all_reduce()`.",
        )


# -- the per-replica update ---------------------------------------------------------


def _padded_rows(x: jax.Array, num: int, size: int) -> jax.Array:
    """`x` flattened, zero-padded to `num * size` elements, as `(num, size)` rows."""
    flat = jnp.ravel(x)
    pad = num * size - flat.shape[0]
    if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    return flat.reshape(num, size)


def _reduce_scatter(grads, sizes, *, num, axis_name, bucket_bytes, dtype):
    """This replica's slices of the mean of `grads` (bucketed reduce-scatters)."""
    if dtype is None:
        rows = [_padded_rows(g, num, s) for g, s in zip(grads, sizes, strict=True)]
    else:  # divide first, so that a narrow wire type cannot overflow
        rows = [
            _padded_rows(g / num, num, s).astype(dtype)
            for g, s in zip(grads, sizes, strict=True)
        ]
    mine = _collectives.bucketed(
        "psum_scatter", rows, axis_name=axis_name, bucket_bytes=bucket_bytes
    )
    return [
        (m[0] if dtype is not None else m[0] / num).astype(g.dtype)
        for m, g in zip(mine, grads, strict=True)
    ]


def _all_gather(slices, like, *, axis_name, bucket_bytes):
    """Full parameters from every replica's new slices (bucketed all-gathers)."""
    rows = _collectives.bucketed(
        "all_gather", slices, axis_name=axis_name, bucket_bytes=bucket_bytes
    )
    return [
        r.reshape(-1)[: ref.size].reshape(ref.shape).astype(ref.dtype)
        for r, ref in zip(rows, like, strict=True)
    ]


def update_fn(*, bucket_bytes, reduce_dtype, clip_grad_norm):
    """The ZeRO update of a train step: `apply(grads, state, tx, axis_name)`."""

    def apply(grads, state, tx, axis_name):
        params, opt_state, grad_norm = sharded_update(
            grads,
            state.opt_state,
            state.params,
            tx,
            axis_name=axis_name,
            bucket_bytes=bucket_bytes,
            reduce_dtype=reduce_dtype,
            clip_grad_norm=clip_grad_norm,
        )
        return params, opt_state, {} if grad_norm is None else {"grad_norm": grad_norm}

    return apply


def sharded_update(
    grads: PyTree,
    opt_state: ShardedOptState,
    params: PyTree,
    tx: optax.GradientTransformation,
    *,
    axis_name: str,
    bucket_bytes: int | None,
    reduce_dtype: Any,
    clip_grad_norm: float | None,
) -> tuple[PyTree, ShardedOptState, jax.Array | None]:
    """One ZeRO update inside the step: reduce-scatter, slice update, all-gather.

    Args:
      grads: This replica's gradients (not yet averaged).
      opt_state: This replica's `ShardedOptState` (its slices).
      params: The full parameters (equal on every replica).
      tx: The optimizer (element-wise).
      axis_name: The replica axis.
      bucket_bytes: Largest bucket per collective (None: one per dtype).
      reduce_dtype: Optional wire dtype of the reduce-scatter.
      clip_grad_norm: If set, clip the averaged gradients to this global norm.

    Returns:
      `(new_params, new_opt_state, grad_norm)`; `grad_norm` is the global norm of
      the averaged gradients before clipping, or None without clipping.
    """
    axis_name = _collectives.resolve_axis(axis_name)
    num = _collectives.axis_size(axis_name, API)
    if not is_sharded(opt_state):
        raise ValueError(NOT_LAID_OUT_MSG)
    _collectives.check_bucket_bytes(bucket_bytes)
    _check_params(params)
    p_leaves, p_def = jax.tree.flatten(params)
    p_leaves = [jnp.asarray(x) for x in p_leaves]
    g_leaves = [jnp.asarray(g) for g in p_def.flatten_up_to(grads)]
    sizes = [chunk_size(x.size, num) for x in p_leaves]
    for x, shape in zip(
        jax.tree.leaves(opt_state.chunks), opt_state.shapes, strict=True
    ):
        if shape is not None and x.shape != (chunk_size(math.prod(shape), num),):
            raise ValueError(
                f"`{API}`: the sharded optimizer state was laid out for another "
                f"number of replicas (a slice of {x.shape[0]} elements for a leaf of "
                f"shape {shape}; num_replicas={num} needs "
                f"{chunk_size(math.prod(shape), num)}). Use `step.replicate` of "
                "this step, e.g. `step.replicate(other_step.unreplicate(state))`."
            )
    index = lax.axis_index(axis_name)
    grad_slices = _reduce_scatter(
        g_leaves,
        sizes,
        num=num,
        axis_name=axis_name,
        bucket_bytes=bucket_bytes,
        dtype=reduce_dtype,
    )
    param_slices = [
        lax.dynamic_index_in_dim(_padded_rows(x, num, s), index, keepdims=False)
        for x, s in zip(p_leaves, sizes, strict=True)
    ]
    grad_norm = None
    if clip_grad_norm is not None:
        local = sum(
            (jnp.sum(jnp.real(g * jnp.conj(g))) for g in grad_slices),
            start=jnp.zeros((), jnp.float32),
        )
        grad_norm = jnp.sqrt(lax.psum(local, axis_name))
        grad_slices = [clip_to_norm(g, grad_norm, clip_grad_norm) for g in grad_slices]
    g_tree = jax.tree.unflatten(p_def, grad_slices)
    p_tree = jax.tree.unflatten(p_def, param_slices)
    check_elementwise(
        tx, g_tree, opt_state.chunks, params, logical_abstract(opt_state, num)
    )
    updates, chunks = tx.update(g_tree, opt_state.chunks, p_tree)
    new_slices = jax.tree.leaves(optax.apply_updates(p_tree, updates))
    new_params = _all_gather(
        new_slices, p_leaves, axis_name=axis_name, bucket_bytes=bucket_bytes
    )
    return (
        jax.tree.unflatten(p_def, new_params),
        opt_state.replace(chunks=chunks),
        grad_norm,
    )


def logical_abstract(node: ShardedOptState, num: int) -> PyTree:
    """The full optimizer state's shapes, from a per-replica `ShardedOptState`."""
    leaves, treedef = jax.tree.flatten(node.chunks)
    return jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(s if s is not None else x.shape, x.dtype)
            for x, s in zip(leaves, node.shapes, strict=True)
        ],
    )


def clip_to_norm(g: jax.Array, norm: jax.Array, max_norm: float) -> jax.Array:
    """`optax.clip_by_global_norm`'s rule for one leaf, given the global norm."""
    return lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)
