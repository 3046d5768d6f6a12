"""Reading one saved step into the layout of `like`, or as one copy.

The saved structure, shapes and dtypes are checked against `like` before any
array is read, and every array read against its record.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.sharding import SingleDeviceSharding

from jdp._layout import (
    abstract,
    is_custom,
    is_key,
    is_replicated,
    logical_like,
    place_like,
)
from jdp._tree import PyTree, format_problems, keystr
from jdp.checkpoint import _format, _per_replica
from jdp.checkpoint._common import check_step_number, error_text, short_list
from jdp.checkpoint._damage import DAMAGED_SUFFIX, corrupt, reading
from jdp.checkpoint._extra import decode_extra
from jdp.checkpoint._format import STATE_ITEM, as_key_data, dtype_name, key_impl_name
from jdp.checkpoint._integrity import check_leaves
from jdp.checkpoint._store import NO_CHECKPOINT_MSG, StepStore

MISMATCH_MSG = (
    "`CheckpointManager.restore`: the checkpoint of step {step} in {directory} does "
    "not match `like` ({count} leaves differ; shapes are per replica, without the "
    "replica axis):{probs}\nFix: build `like` from the same model and optimizer "
    "as the saved state, e.g. `step.replicate(init_state)` or its "
    "`jax.ShapeDtypeStruct`s."
)

ONE_COPY_HINT = (
    "\n`like` is read as one copy (no leaf laid out by `step.replicate`), whose "
    "shapes must match the saved leaves exactly. To restore into every "
    "replica instead, pass a state replicated by the `jdp.Parallel` that will run "
    "it: `manager.restore(step.replicate(init_state))`."
)

MIXED_LIKE_MSG = (
    "`CheckpointManager.restore`: `like` mixes one-copy leaves (shaped as saved in "
    "step {step}, e.g. {one}) and leaves with a replica axis (e.g. {rep}), so it "
    "is neither one copy nor a replicated state.\nFix: pass one copy (e.g. "
    "`init_state`) to get one copy back, or `step.replicate(init_state)` to "
    "restore into every replica."
)

NEWER_INCOMPLETE_MSG = (
    "`CheckpointManager.restore`: step {step} in {directory} is incomplete or "
    "damaged ({detail}); restoring step {older}, the newest complete step, "
    "instead. If no save is still writing step {step}, the next `save` of step "
    "{step} or an earlier step moves it aside to {directory}/{step}"
    + DAMAGED_SUFFIX
    + "<n> (nothing is deleted)."
)


def resolve_step(store: StepStore, step: Any) -> int:
    """A complete step to read: `step`, or the newest for None (else raises)."""
    steps = store.complete_steps()
    ignored = sorted(set(store.steps_on_disk()) - set(steps))
    note = (
        f" Step(s) {ignored} exist but are incomplete or damaged (a save that "
        "was interrupted or is still running, or corrupted files) and are "
        "ignored; the next `save` of one of these step numbers or an earlier "
        "one moves them aside."
        if ignored
        else ""
    )
    if step is None:
        if not steps:
            why = "" if store.directory.exists() else " (the directory does not exist)"
            raise FileNotFoundError(
                NO_CHECKPOINT_MSG.format(directory=store.directory, why=why) + note
            )
        return steps[-1]
    step = check_step_number(step, "step")
    if step not in steps:
        raise FileNotFoundError(
            f"`CheckpointManager.restore`: no complete checkpoint for step {step} "
            f"in {store.directory}; the complete steps are {steps}. Pass one of "
            "them, or `step=None` for the latest." + note
        )
    return step


def warn_newer_incomplete(store: StepStore, newest: int) -> None:
    """Warns about each step on disk after `newest` (called by `restore` itself)."""
    for s in store.steps_on_disk():
        if s > newest:
            warnings.warn(NEWER_INCOMPLETE_MSG.format(
                step=s, directory=store.directory, detail=store.incomplete(s),
                older=newest,
            ), RuntimeWarning, stacklevel=3)  # fmt: skip


def restore_step(store: StepStore, step: int, like: PyTree) -> PyTree:
    """Reads a complete step into `like`'s layout, or as one copy (for `restore`)."""
    meta = store.metadata(step)
    flat_like = jax.tree_util.tree_flatten_with_path(like)[0]
    if _is_one_copy(step, meta, flat_like):
        return _restore_one_copy(store, step, meta, like, flat_like)
    return _restore_replicated(store, step, meta, like, flat_like)


def _is_one_copy(
    step: int, meta: dict[str, Any], flat_like: Sequence[tuple[Any, Any]]
) -> bool:
    """Whether `like` is one copy (True) or replicated; raises if it mixes."""
    saved = {r["path"]: tuple(r["shape"]) for r in meta.get("leaves", [])}
    one, rep = [], []
    for path, x in flat_like:
        name, shape = keystr(path), _data_shape(x)
        if name not in saved or shape is None:
            continue
        # The layout decides where it tells: a ZeRO slice can have the saved
        # shape, and an array on one device is never replicated.
        if is_replicated(x):
            rep.append(f"{name} {shape}")
        elif isinstance(getattr(x, "sharding", None), SingleDeviceSharding):
            one.append(f"{name} {shape}")
        elif shape == saved[name]:
            one.append(f"{name} {shape}")
        elif len(shape) >= 1 and shape[1:] == saved[name]:
            rep.append(f"{name} {shape}")
    if one and rep:
        raise ValueError(
            MIXED_LIKE_MSG.format(step=step, one=short_list(one), rep=short_list(rep))
        )
    return bool(one)


def _restore_replicated(
    store: StepStore, step: int, meta: dict[str, Any], like: PyTree, flat_like
) -> PyTree:
    """Every replica of `like`'s layout gets the saved copy (or its own value)."""
    _check_like(flat_like)
    # One logical copy of `like` is what was saved (ZeRO's slices whole).
    flat, treedef = jax.tree_util.tree_flatten_with_path(logical_like(like))
    flat_logical = [(path, as_key_data(x), key_impl_name(x)) for path, x in flat]
    host = treedef.unflatten(_read_state(store, step, meta, flat_logical))
    if not (per := _per_replica.records_of(meta["leaves"])):
        return place_like(host, like)
    like_by_path = _per_replica.leaves_by_path(like)
    refs = [like_by_path.get(r["path"]) for r in per.values()]
    counts = {None if x is None or is_custom(x) else x.shape[0] for x in refs}
    # The same count on another mesh (a 4 x 2 host mesh for 2 x 4) groups the
    # replicas otherwise: each one's own values no longer belong where they go.
    meshes = {tuple(m) for x in refs if x is not None and (m := _format.mesh_grid(x))}
    saved_mesh = meta.get("mesh_grid")  # None: written before it was recorded
    same_mesh = saved_mesh is None or meshes <= {tuple(saved_mesh)}
    if counts == {meta["num_replicas"]} and same_mesh:
        own = _per_replica.read_replicas(
            store.open(create=False), store.directory, step, meta, per, like_by_path
        )
        return _per_replica.place_with(host, like, own)
    count = next(iter(counts)) if len(counts) == 1 else None
    if count == meta["num_replicas"] and not same_mesh:
        shape = " x ".join(map(str, next(iter(meshes))))
        saved = " x ".join(map(str, saved_mesh))
        why = f"`like` is laid out on a {shape} mesh, not {saved}"
    else:
        why = f"`like` has {count} replicas" if count else "`like` lays them out"
    host = _per_replica.one_copy_of_differing(
        store.directory, step, meta, host, per, why
    )
    return place_like(host, like)


def _restore_one_copy(
    store: StepStore, step: int, meta: dict[str, Any], like: PyTree, flat_like
) -> PyTree:
    """One logical copy, shaped like `like` (which has no replica axis)."""
    flat_logical = []
    for path, x in flat_like:
        ref = x if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else abstract(x)
        flat_logical.append((path, as_key_data(ref), key_impl_name(ref)))
    host_leaves = _read_state(store, step, meta, flat_logical, ONE_COPY_HINT)
    treedef = jax.tree.structure(like)
    if per := _per_replica.records_of(meta["leaves"]):
        host = jax.tree_util.tree_unflatten(treedef, host_leaves)
        host = _per_replica.one_copy_of_differing(
            store.directory, step, meta, host, per, "`like` is one copy"
        )
        host_leaves = jax.tree.leaves(host)
    out = [
        _place_one(x, ref, r.get("key_impl"))
        for x, (_, ref), r in zip(host_leaves, flat_like, meta["leaves"], strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def _read_state(
    store: StepStore, step: int, meta: dict[str, Any], flat_logical, hint: str = ""
) -> list[np.ndarray]:
    """`_check_matches`, then the saved copy's leaves as NumPy arrays (checked)."""
    _check_matches(store.directory, step, meta, flat_logical, hint=hint)
    records = meta["leaves"]
    # Zero-size leaves were not written: their record gives shape and dtype.
    full = [not _format.is_empty(r["shape"]) for r in records]
    with reading(store.directory, step, "reading its arrays failed"):
        paths = [path for path, _, _ in flat_logical]
        names = [_format.param_name(p) for p, f in zip(paths, full, strict=True) if f]
        dtypes = [r["dtype"] for r, f in zip(records, full, strict=True) if f]
        read = iter(
            _format.read_arrays(store.directory, step, STATE_ITEM, names, dtypes)
        )
        leaves = [
            next(read) if f else np.zeros(r["shape"], np.dtype(r["dtype"]))
            for r, f in zip(records, full, strict=True)
        ]
    check_leaves(store.directory, step, records, leaves)
    return leaves


def read_extra(store: StepStore, step: int) -> dict[str, Any]:
    """The extras saved with a complete step ({} if none were)."""
    try:
        return decode_extra(store.metadata(step).get("extra"))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        detail = f"its extras could not be decoded ({error_text(e)})."
        raise corrupt(store.directory, step, detail) from e


def _check_like(flat_like: Sequence[tuple[Any, Any]]) -> None:
    """Checks that every leaf of a replicated `like` can be placed."""
    for path, ref in flat_like:
        if getattr(ref, "sharding", None) is None or not hasattr(ref, "dtype"):
            raise TypeError(
                f"`CheckpointManager.restore`: leaf {keystr(path)} of `like` is "
                f"a {type(ref).__name__} without a sharding, not a "
                "replicated `jax.Array` or a `jax.ShapeDtypeStruct` with a "
                "sharding. Pass `step.replicate(init_state)`, or "
                "`jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, "
                "sharding=x.sharding), replicated_state)`; or one copy whose "
                "shapes are the saved ones to get one copy back."
            )
        if len(ref.shape) == 0:
            raise ValueError(
                f"`CheckpointManager.restore`: leaf {keystr(path)} of `like` has "
                "shape (), so it has no replica axis. Pass a state replicated by "
                "the `jdp.Parallel` that will run it: "
                "`manager.restore(step.replicate(init_state))`."
            )


def _check_matches(directory: epath.Path, step: int, meta: dict[str, Any],
                   flat_logical: Sequence[tuple[Any, Any, Any]], *,
                   hint: str = "") -> None:  # fmt: skip
    """Raises a `ValueError` listing where the saved leaves and `like`'s differ."""
    saved = {
        r["path"]: (tuple(r["shape"]), _describe_dtype(r["dtype"], r.get("key_impl")))
        for r in meta.get("leaves", [])
    }
    wanted = {
        keystr(path): (tuple(ref.shape), _describe_dtype(dtype_name(ref.dtype), impl))
        for path, ref, impl in flat_logical
    }
    if probs := _differences(saved, wanted):
        raise ValueError(MISMATCH_MSG.format(
            step=step, directory=directory, count=len(probs),
            probs=format_problems(probs),
        ) + hint)  # fmt: skip


def _describe_dtype(dtype: str, key_impl: str | None) -> str:
    """A saved dtype for messages; typed keys: `uint32 (threefry2x32 key data)`."""
    return dtype if key_impl is None else f"{dtype} ({key_impl} key data)"


def _differences(
    saved: dict[str, tuple[Any, str]], wanted: dict[str, tuple[Any, str]]
) -> list[str]:
    """Where two `{path: (shape, dtype)}` maps differ, first difference first."""
    found = []  # (position in pytree order, checkpoint side first, message)
    for i, (path, (shape, dtype)) in enumerate(saved.items()):
        if path not in wanted:
            text = f"in the checkpoint with shape {shape} {dtype}, not in `like`"
            found.append((i, 0, f"{path}: {text}"))
    for i, (path, (shape, dtype)) in enumerate(wanted.items()):
        if path not in saved:
            text = f"not in the checkpoint; `like` has shape {shape} {dtype}"
            found.append((i, 1, f"{path}: {text}"))
        elif saved[path] != (shape, dtype):
            s_shape, s_dtype = saved[path]
            text = f"the checkpoint has shape {s_shape} {s_dtype}, `like` has shape"
            found.append((i, 1, f"{path}: {text} {shape} {dtype}"))
    probs = [text for _, _, text in sorted(found)]
    if not probs and list(saved) != list(wanted):
        probs.append("the leaves are the same but in a different pytree order")
    return probs


def _data_shape(x: Any) -> tuple[int, ...] | None:
    """A `like` leaf's shape as saved (key data for typed keys); None if shapeless."""
    if is_key(x):
        return tuple(as_key_data(x).shape)
    try:
        return tuple(np.shape(x))
    except Exception:  # an object NumPy cannot size
        return None


def _place_one(x: np.ndarray, ref: Any, impl: str | None) -> Any:
    """One restored leaf of a one-copy `like`: NumPy, or placed like `ref`."""
    sharding = getattr(ref, "sharding", None)
    if isinstance(ref, jax.Array | jax.ShapeDtypeStruct) and sharding is not None:
        x = jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])
    elif impl is not None:
        x = jax.numpy.asarray(x)
    if impl is not None:
        x = jax.random.wrap_key_data(x, impl=impl)
    return x
