"""`jdp.zero`, ZeRO stages 1 and 2 (Rajbhandari et al., SC 2020) as an optimizer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax

from jdp import _collectives, _jax_compat, _validate
from jdp._layout import CustomLayout, abstract, logical_copy
from jdp._tree import PyTree, as_real, format_problems, from_real, keystr

API = "jdp.zero"
PLACING = "Placing a ZeRO optimizer state (`step.replicate`, a checkpoint restore): "

#: Leading sizes of the probe parameters that tell per-element state leaves from
#: others; far from any real shape, never allocated (`jax.eval_shape`).
_SENTINEL = 1_000_003_000

ELEMENTWISE_HINT = (
    "Under `jdp.zero` each replica updates only its slice of every parameter "
    "(seen by the optimizer as a 1-D vector), so the optimizer must act element "
    "by element, as SGD, momentum, Adam, AdamW, RMSProp, Lion and Adagrad do "
    "(with any schedule)."
)

NOT_LAID_OUT_MSG = (
    f"`{API}`: the optimizer state is one full logical copy, not the sharded "
    "layout of {num} replicas that this step needs. Place the state with "
    "`step.replicate(state)` of the `jdp.parallelize` that runs the step (a "
    "sharded state for another replica count: `step.replicate(other_step."
    "unreplicate(state))`)."
)


class ZeroState(struct.PyTreeNode, CustomLayout):
    """`jdp.zero`'s state: the wrapped optimizer's, whole or one slice per replica.

    `chunks` has the structure of `tx.init(params)`; `grad_norm` is the last
    global norm before clipping (None without `clip_grad_norm`); static
    `shapes` gives each chunk leaf's full shape (None: held whole) and
    `num_shards` the replica count it is sliced for (None while whole); static
    `fills` gives each sliced leaf's initial value (None: it depends on the
    parameters), with which a slice that died with its process restarts.
    """

    chunks: PyTree
    grad_norm: jax.Array | None
    shapes: tuple[tuple[int, ...] | None, ...] = struct.field(pytree_node=False)
    num_shards: int | None = struct.field(pytree_node=False, default=None)
    fills: tuple[Any, ...] = struct.field(pytree_node=False, default=())

    #: It averages the gradients itself: the step's piece must not.
    syncs_gradients = True

    def _map(self, fn, is_leaf=None) -> PyTree:
        """`chunks` with each leaf `x` replaced by `fn(x, its full shape or None)`."""
        leaves, treedef = jax.tree.flatten(self.chunks, is_leaf=is_leaf)
        new = [fn(x, shape) for x, shape in zip(leaves, self.shapes, strict=True)]
        return jax.tree.unflatten(treedef, new)

    def layout(self, num_replicas: int) -> ZeroState:
        """The abstract per-replica layout of this (whole, abstract) state."""

        def sliced(x, shape):
            if shape is None:
                return x
            size = chunk_size(math.prod(shape), num_replicas)
            return jax.ShapeDtypeStruct((size,), x.dtype)

        return self.replace(chunks=self._map(sliced), num_shards=num_replicas)

    def logical(self) -> ZeroState:
        """One whole copy of the replicated state; abstract leaves give abstract."""
        norm = None if self.grad_norm is None else _whole(self.grad_norm, None)
        return self.replace(chunks=self._map(_whole), grad_norm=norm, num_shards=None)

    def place(self, host_value: PyTree, place_leaf) -> ZeroState:
        """Splits one whole state (`host_value`) into this layout."""
        return place(host_value, self, place_leaf)

    def agreed(self) -> ZeroState:
        """This node with its slices (which differ between replicas) set to None."""
        if len(jax.tree.leaves(self.chunks)) != len(self.shapes):
            return self  # agreed already: its slices are None
        # Not None-aware: a None leaf of the state (a None parameter's) has no shape.
        return self.replace(chunks=self._map(lambda v, s: v if s is None else None))

    def with_agreed(self, agreed: ZeroState) -> ZeroState:
        """This node with its whole leaves taken from `agreed`."""
        new = iter(jax.tree.leaves(agreed.chunks))
        merged = self._map(lambda old, s: old if s is not None else next(new))
        return self.replace(chunks=merged, grad_norm=agreed.grad_norm)

    def relayout(self, rewrap, sharding, holds: bool, total) -> ZeroState:
        """Sliced anew for `sharding`'s replicas from the slices the live ones hold.

        `total` (a sum over the new replicas) gathers every leaf whole, each
        element from the replica that holds it, bit for bit; the elements of a
        slice no live replica holds restart from the optimizer's initial value.
        """
        mesh, me = sharding.mesh, jax.process_index()
        mine = [d for d in mesh.devices.flat if d.process_index == me]
        leaves, treedef = jax.tree.flatten(self.chunks)
        sliced = [i for i, shape in enumerate(self.shapes) if shape is not None]
        parts = [
            _held(leaves[i], self.shapes[i], mine, sharding, holds) for i in sliced
        ]
        gathered = total(parts) if parts else []
        out = [rewrap(x) for x in leaves]
        for i, (bits, owned) in zip(sliced, gathered, strict=True):
            fill = self.fills[i] if self.fills else None
            out[i] = _new_slices(bits, owned, leaves[i].dtype, self.shapes[i], fill,
                                 mine, sharding)  # fmt: skip
        norm = None if self.grad_norm is None else rewrap(self.grad_norm)
        chunks = jax.tree.unflatten(treedef, out)
        return self.replace(chunks=chunks, grad_norm=norm, num_shards=mesh.size)


def _words(dtype) -> np.dtype:
    """The unsigned type a leaf's bits are summed as (at most 32 bits wide)."""
    return np.dtype(f"uint{8 * min(np.dtype(dtype).itemsize, 4)}")


def _held(x, shape, mine, sharding, holds) -> tuple[jax.Array, jax.Array]:
    """`(bits, owned)` per replica: the leaf's bits where it holds a slice, else 0."""
    size, words = math.prod(shape), _words(x.dtype)
    per = np.dtype(x.dtype).itemsize // words.itemsize
    order = list(x.sharding.mesh.devices.flat)
    held = {s.device: s.data for s in x.addressable_shards} if holds else {}
    bits, owned = [], []
    for d in mine:
        b, o = np.zeros(size * per, words), np.zeros(size, np.int32)
        if d in held:
            row = np.asarray(held[d]).reshape(-1)
            lo = order.index(d) * row.size
            hi = min(lo + row.size, size)
            b[lo * per : hi * per] = row[: hi - lo].view(words)
            o[lo:hi] = 1
        bits.append(jax.device_put(b[None], d))
        owned.append(jax.device_put(o[None], d))
    n = sharding.mesh.size
    return tuple(
        jax.make_array_from_single_device_arrays((n, *a[0].shape[1:]), sharding, a)
        for a in (bits, owned)
    )


def _new_slices(bits, owned, dtype, shape, fill, mine, sharding) -> jax.Array:
    """This process's slices, for `sharding`'s replicas, of a leaf gathered whole."""
    n = sharding.mesh.size
    size, rows = math.prod(shape), chunk_size(math.prod(shape), n)
    whole = np.asarray(bits.addressable_shards[0].data)[0].view(dtype)
    lost = np.asarray(owned.addressable_shards[0].data)[0] == 0
    if lost.any():
        if fill is None:
            raise ValueError(
                f"`{API}` under `jdp.distributed.live`: {int(lost.sum())} "
                f"elements of an optimizer state leaf of shape {shape} died with "
                "their process, and they cannot restart: the optimizer's initial "
                "value of that leaf depends on the parameters. Use an optimizer "
                "whose state starts from a constant (SGD, momentum, Adam, ...)."
            )
        whole = np.where(lost, np.asarray(fill, dtype), whole)
    padded = np.pad(whole, (0, rows * n - size)).reshape(n, rows)
    index = {d: i for i, d in enumerate(sharding.mesh.devices.flat)}
    shards = [jax.device_put(padded[index[d]][None], d) for d in mine]
    return jax.make_array_from_single_device_arrays((n, rows), sharding, shards)


def chunk_size(size: int, num_shards: int) -> int:
    """Elements per replica of a leaf of `size` elements: `ceil(size / num_shards)`."""
    return -(-size // num_shards)


def _whole(x: Any, shape: tuple[int, ...] | None) -> Any:
    """One whole leaf of a replicated one (slices gathered and trimmed)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        whole = x.shape[1:] if shape is None else shape
        return jax.ShapeDtypeStruct(tuple(whole), x.dtype)
    if not isinstance(x, jax.Array):
        return x
    if shape is None:
        return logical_copy(x)
    if x.is_fully_addressable:
        rows = np.asarray(jax.device_get(x))
    else:
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    full = rows.reshape(-1)[: math.prod(shape)].reshape(shape)
    return jax.device_put(full, x.addressable_shards[0].device)


def place(
    host: PyTree, like: ZeroState, place_whole: Callable[[Any, Any], jax.Array]
) -> ZeroState:
    """Splits a whole `ZeroState` into the layout of `like` (replica `r`: slice `r`)."""
    if not isinstance(host, ZeroState) or host.num_shards is not None:
        got = "a sharded one" if isinstance(host, ZeroState) else type(host).__name__
        raise ValueError(
            f"{PLACING}expected one whole `jdp.zero` state, got {got}; pass "
            "`step.unreplicate(state)` (or the state a checkpoint saved)."
        )
    refs, treedef = jax.tree.flatten(like.chunks)
    try:
        values = treedef.flatten_up_to(host.chunks)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{PLACING}it does not match the layout it is placed into ({e}). "
            "Restore a state saved for the same model and optimizer."
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
        rows = np.pad(x.ravel(), (0, math.prod(ref.shape) - x.size)).reshape(ref.shape)
        out.append(
            jax.make_array_from_callback(ref.shape, ref.sharding, rows.__getitem__)
        )
    if (norm := like.grad_norm) is not None:
        norm = place_whole(host.grad_norm, norm)
    return like.replace(chunks=jax.tree.unflatten(treedef, out), grad_norm=norm)


def _refuse(what: str, fix: str) -> ValueError:
    return ValueError(f"`{API}`: the optimizer {what}. {ELEMENTWISE_HINT} Fix: {fix}")


def _check_params(params: PyTree) -> list[tuple[Any, jax.ShapeDtypeStruct]]:
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(abstract, params))[0]
    if bad := [
        f"{keystr(p)}: {x.dtype}"
        for p, x in flat
        if not jnp.issubdtype(x.dtype, jnp.inexact)
    ]:
        raise ValueError(
            f"`{API}` shards floating-point parameters only; these leaves are not:"
            f"{format_problems(bad)}\nFix: keep integer state outside `params` "
            "(e.g. in `batch_stats`), or do without `jdp.zero`."
        )
    return flat


def _leaf_shapes(tx, opt_state: PyTree, params: PyTree) -> tuple:
    """Per leaf of `opt_state`: its parameter's shape, or None (from probe shapes)."""
    flat_params = _check_params(params)
    sentinels = enumerate(x for _, x in flat_params)
    probes = [jax.ShapeDtypeStruct((_SENTINEL + i,), x.dtype) for i, x in sentinels]
    probe_params = jax.tree.unflatten(jax.tree.structure(params), probes)
    probe_leaves, probe_def = jax.tree.flatten(jax.eval_shape(tx.init, probe_params))
    full, state_def = jax.tree_util.tree_flatten_with_path(opt_state)
    if probe_def != state_def:
        raise _refuse(
            "state's structure depends on the parameters' shapes (for example a "
            f"mask chosen by `ndim`): `tx.init` on 1-D slices gives "
            f"{probe_def.num_leaves} leaves, on the parameters "
            f"{state_def.num_leaves}",
            "choose masks by parameter path, not shape; or do without `jdp.zero`.",
        )
    shapes = []
    for (path, leaf), ref in zip(full, probe_leaves, strict=True):
        owner = ref.shape[0] - _SENTINEL if len(ref.shape) == 1 else -1
        if 0 <= owner < len(flat_params):
            shapes.append(tuple(flat_params[owner][1].shape))
        elif any(d >= _SENTINEL for d in ref.shape) or ref.shape != leaf.shape:
            raise _refuse(
                f"keeps state leaf {keystr(path)} of shape {leaf.shape}, which is "
                "not one value per parameter element (e.g. factored statistics)",
                "use an element-wise optimizer, or no `jdp.zero`.",
            )
        else:
            shapes.append(None)
    return tuple(shapes)


def _fills(tx, params: PyTree, shapes: tuple) -> tuple:
    """Per state leaf: the initial value of a sliced one if it is a constant."""
    probes = []
    with jax.ensure_compile_time_eval():  # concrete even where `init` is traced
        for v in (0, 1):
            one = jax.tree.map(lambda p, v=v: jnp.full(1, v, abstract(p).dtype), params)
            probes.append([np.asarray(x) for x in jax.tree.leaves(tx.init(one))])
    return tuple(
        a.reshape(-1)[0].item() if shape is not None and np.array_equal(a, b) else None
        for a, b, shape in zip(*probes, shapes, strict=True)
    )


def _update_eqns(tx, grads, opt_state, params) -> list:
    trace = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))
    return _jax_compat.equations(trace(grads, opt_state, params))


def check_elementwise(tx, slices, opt_slices, params, opt_state) -> None:
    """Refuses an optimizer whose update is not element-wise (traced only).

    No collectives, no reductions of non-scalars, and the same operations on
    slices as on whole parameters (a mask chosen by shape would differ).
    """
    slices, opt_slices, params, opt_state = jax.tree.map(
        abstract, (slices, opt_slices, params, opt_state)
    )
    eqns = _update_eqns(tx, slices, opt_slices, slices)
    for eqn in eqns:
        name = eqn.primitive.name
        shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
        if name in _jax_compat.COLLECTIVE_PRIMITIVES:
            raise _refuse(
                f"communicates across replicas itself (`{name}` in its update), as "
                "`jdp.sync_gradients` or `jdp.bmuf` do",
                "drop that from the optimizer `jdp.zero` wraps: `jdp.zero` "
                "averages the gradients itself (reduce-scatter).",
            )
        if name in _jax_compat.REDUCTION_PRIMITIVES and any(len(s) for s in shapes):
            raise _refuse(
                f"reduces over whole parameters (`{name}` of a "
                f"{max(shapes, key=len)} operand in its update), as global-norm "
                "clipping, `optax.apply_if_finite`, LAMB or Adafactor do; on a slice "
                "that would see only part of each parameter",
                "for global-norm clipping remove `optax.clip_by_global_norm` from "
                "the wrapped optimizer and pass `jdp.zero(tx, clip_grad_norm="
                "max_norm)`, which computes the global norm across replicas; "
                "otherwise do without `jdp.zero`.",
            )
    ignored = _jax_compat.SHAPE_ONLY_PRIMITIVES
    names = [e.primitive.name for e in eqns if e.primitive.name not in ignored]
    full = _update_eqns(tx, params, opt_state, params)
    full_names = [e.primitive.name for e in full if e.primitive.name not in ignored]
    if names != full_names:
        raise _refuse(
            "does not do the same on a 1-D slice of a parameter as on the whole "
            f"parameter ({len(full_names)} operations on full parameters, "
            f"{len(names)} on slices), typically a weight-decay or other mask chosen "
            "by `ndim` or shape",
            "choose masks by parameter path, e.g. `mask=lambda p: "
            "jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key != 'b', "
            "p)`; or do without `jdp.zero`.",
        )


def _padded_rows(x: jax.Array, num: int, size: int) -> jax.Array:
    """`x` flattened, zero-padded to `num * size` elements, as `(num, size)` rows."""
    flat = jnp.ravel(x)
    if pad := num * size - flat.shape[0]:
        flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    return flat.reshape(num, size)


def _reduce_scatter(grads, sizes, num, axis_name, bucket_bytes, dtype):
    """This replica's slices of the mean of `grads` (bucketed reduce-scatters)."""
    if dtype is None:
        rows = [_padded_rows(g, num, s) for g, s in zip(grads, sizes, strict=True)]
        mine = _collectives.bucketed(
            "psum_scatter", rows, axis_name=axis_name, bucket_bytes=bucket_bytes
        )
        return [(m[0] / num).astype(g.dtype) for m, g in zip(mine, grads, strict=True)]
    # A wire dtype divides first, so that a narrow type cannot overflow; a complex
    # leaf travels as its real and imaginary parts.
    rows = [
        as_real(_padded_rows(g / num, num, s)).reshape(num, -1).astype(dtype)
        for g, s in zip(grads, sizes, strict=True)
    ]
    mine = _collectives.bucketed(
        "psum_scatter", rows, axis_name=axis_name, bucket_bytes=bucket_bytes
    )
    return [
        from_real(m[0], (s,), g.dtype)
        for m, g, s in zip(mine, grads, sizes, strict=True)
    ]


def zero(
    tx: optax.GradientTransformation | None = None,
    *,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
    clip_grad_norm: float | None = None,
    axis_name: _collectives.AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    """ZeRO stages 1 and 2: `tx` with its state sharded over the replicas.

    An optimizer that communicates itself (use `sync=jdp.local()`), to the numbers
    of `jdp.all_reduce()` with `tx`; the Memory guide (docs/guides/memory.md) says
    how.

    Args:
      tx: The element-wise optimizer to shard.
      bucket_bytes: Largest bucket of the reduce-scatters and all-gathers.
      reduce_dtype: Wire dtype of the reduce-scatter.
      clip_grad_norm: If set, clip the averaged gradients to this global L2
        norm across the slices; the norm is kept as the state's `grad_norm`.
      axis_name: The replica axis; None uses the step's.

    Returns:
      An optax transform whose `update` needs `params`.

    Raises:
      ValueError: If `tx` is missing or an option is out of range; at `init`,
        if the parameters are not floating point; at trace time, if `tx` is not
        element-wise or the state was not placed by `step.replicate`.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> tx = jdp.zero(optax.adam(1e-3))
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=jdp.local()))
      >>> params = {"w": jnp.zeros((800, 1))}
      >>> state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
      >>> state.opt_state.chunks[0].mu["w"].shape  # 8 replicas, 100 values each
      (8, 100)
    """
    if tx is None or not callable(getattr(tx, "update", None)):
        raise ValueError(
            f"`{API}` wraps the optimizer (it shards the optimizer's state): "
            "`jdp.make_train_step(loss_fn, jdp.zero(tx), sync=jdp.local())`; got "
            f"{'no optimizer' if tx is None else type(tx).__name__}. (Before 0.4 "
            "it was the piece `sync=jdp.zero()`.)"
        )
    _collectives.check_bucket_bytes(bucket_bytes)
    _collectives.check_reduce_dtype(reduce_dtype)
    if clip_grad_norm is not None:
        _validate.finite_number(
            "clip_grad_norm", clip_grad_norm, above=0, note="a global norm, or None"
        )

    def init(params):
        inner = tx.init(params)
        norm = None if clip_grad_norm is None else jnp.zeros((), jnp.float32)
        shapes = _leaf_shapes(tx, inner, params)
        return ZeroState(inner, norm, shapes, fills=_fills(tx, params, shapes))

    def update(grads, state, params=None, **extra):
        del extra
        if params is None:
            raise ValueError(
                f"`{API}` needs the parameters: `tx.update(grads, state, params)`."
            )
        axis = _collectives.resolve_axis(axis_name)
        num = _collectives.axis_size(axis, API)
        if not isinstance(state, ZeroState) or state.num_shards != num:
            raise ValueError(NOT_LAID_OUT_MSG.format(num=num))
        p_leaves, p_def = jax.tree.flatten(params)
        p_leaves = [jnp.asarray(x) for x in p_leaves]
        g_leaves = [jnp.asarray(g) for g in p_def.flatten_up_to(grads)]
        sizes = [chunk_size(x.size, num) for x in p_leaves]
        grad_slices = _reduce_scatter(
            g_leaves, sizes, num, axis, bucket_bytes, reduce_dtype
        )
        index = lax.axis_index(axis)
        param_slices = [
            lax.dynamic_index_in_dim(_padded_rows(x, num, s), index, keepdims=False)
            for x, s in zip(p_leaves, sizes, strict=True)
        ]
        norm = None
        if clip_grad_norm is not None:
            local = sum(
                (jnp.sum(jnp.real(g * jnp.conj(g))) for g in grad_slices),
                start=jnp.zeros((), jnp.float32),
            )
            norm = jnp.sqrt(lax.psum(local, axis))
            grad_slices = [  # `optax.clip_by_global_norm`'s rule
                lax.select(
                    norm < clip_grad_norm, g, g / norm.astype(g.dtype) * clip_grad_norm
                )
                for g in grad_slices
            ]
        g_tree = jax.tree.unflatten(p_def, grad_slices)
        p_tree = jax.tree.unflatten(p_def, param_slices)
        whole = state._map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape if s is None else s, x.dtype)
        )
        check_elementwise(tx, g_tree, state.chunks, params, whole)
        updates, chunks = tx.update(g_tree, state.chunks, p_tree)
        updates = jax.tree.leaves(updates)
        rows = _collectives.bucketed(
            "all_gather", updates, axis_name=axis, bucket_bytes=bucket_bytes
        )
        full = [
            r.reshape(-1)[: p.size].reshape(p.shape)
            for r, p in zip(rows, p_leaves, strict=True)
        ]
        new_state = state.replace(chunks=chunks, grad_norm=norm)
        return jax.tree.unflatten(p_def, full), new_state

    return optax.GradientTransformationExtraArgs(init, update)
