"""The on-disk format of a checkpoint step, and the checks of its integrity.

A step directory holds orbax items: `state`, one logical copy of the state (NumPy
arrays, written by tensorstore); `jdp_metadata`, a JSON record of the jdp version,
the replica count, the backend and every leaf's path, shape, dtype and CRC-32;
and, when the replicas of some leaves differed, `jdp_replicas`, those leaves with
every replica (`_per_replica`). This module writes the record, checks the arrays
read back against it, and moves damaged steps aside. It reads with tensorstore
and JSON only: nothing is ever unpickled.

The arrays of an item are read one by one, by name (`read_arrays`), not through
orbax's PyTree restore: orbax sorts the saved key paths to rebuild a tree, which
fails for trees whose nodes mix integer and string keys (flax NNX's
`nnx.Sequential` and `nnx.List`, whose layers are keyed by position next to
attributes), though the files are intact.

Only a real integrity failure (a checksum that differs, a file missing,
truncated or undecodable) is a `CheckpointCorruptedError`; anything else that
fails while reading a step (`is_damage` tells them apart) is raised as a
`RuntimeError` that says the files are not judged damaged, and nothing is
moved aside for it.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import json
import sys
import warnings
import zlib
from collections.abc import Coroutine, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jdp._layout import is_key, key_impl
from jdp._tree import keystr
from jdp._version import __version__
from jdp.checkpoint._common import same_kind_of_error

PyTree = Any

#: Orbax item names inside one step directory.
STATE_ITEM = "state"
METADATA_ITEM = "jdp_metadata"
#: Leaves whose replicas differed when saved, with every replica.
REPLICAS_ITEM = "jdp_replicas"
#: Marks a step's JSON as written by this module (and its layout version).
FORMAT = "jdp.checkpoint/1"
#: What a damaged step is renamed to: `<step>.damaged-<n>`.
DAMAGED_SUFFIX = ".damaged-"

CORRUPT_MSG = (
    "`CheckpointManager.restore`: the checkpoint of step {step} in {directory} is "
    "corrupted or truncated: {detail} Restore an older step "
    "(`manager.restore(like, step=...)`; `manager.all_steps()` lists the complete "
    "ones), or save again: the next `save` of step {step} or an earlier step moves "
    "the damaged files aside to {directory}/{step}" + DAMAGED_SUFFIX + "<n> "
    "(nothing is deleted)."
)

SET_ASIDE_MSG = (
    "`CheckpointManager.save`: step {step} in {directory} was incomplete or "
    "damaged ({detail}); moved it to {target} so that step {step} can be saved "
    "again. Nothing was deleted: inspect or delete {target} yourself."
)


NOT_DAMAGE_MSG = (
    "`CheckpointManager.{caller}`: reading step {step} in {directory} failed "
    "({error}). This is not a sign of damaged files (a checksum that differs, or "
    "a file that is missing, truncated or undecodable, raises "
    "`jdp.checkpoint.CheckpointCorruptedError`), so step {step} was left as it "
    "is: nothing was moved aside.\nFix: check that the installed "
    "orbax-checkpoint and tensorstore are versions jdp supports; if they are, "
    "please report this error with its traceback."
)


class CheckpointCorruptedError(ValueError):
    """A checkpoint step whose files are damaged (not a `like` that does not match).

    Raised by `CheckpointManager.restore` when a step's files fail an integrity
    check: an array whose CRC-32 differs from the one recorded at save, or a
    file that is missing, truncated or cannot be decoded. A subclass of
    `ValueError`, which `restore` raised for damaged files before this class
    existed. Any other failure while reading a step is not reported as damage.

    The next `save` of that step number (or an earlier one) moves the damaged
    step aside to `<directory>/<step>.damaged-<n>` (nothing is deleted).

    Args:
      message: The whole error message.
      directory: The checkpoint directory.
      step: The damaged step.
      detail: What is wrong with the step, one sentence.

    Attributes:
      directory: The checkpoint directory (a string), or None.
      step: The damaged step number, or None.
      detail: What is wrong with the step, or None.

    Example:
      >>> import jdp
      >>> issubclass(jdp.checkpoint.CheckpointCorruptedError, ValueError)
      True
    """

    def __init__(
        self,
        message: str,
        *,
        directory: Any = None,
        step: int | None = None,
        detail: str | None = None,
    ):
        super().__init__(message)
        self.directory = None if directory is None else str(directory)
        self.step = step
        self.detail = detail

    def __reduce__(self):
        kwargs = {"directory": self.directory, "step": self.step, "detail": self.detail}
        return _rebuild_corrupted, (str(self), kwargs)


def _rebuild_corrupted(
    message: str, kwargs: dict[str, Any]
) -> CheckpointCorruptedError:
    """Unpickles a `CheckpointCorruptedError` with its attributes."""
    return CheckpointCorruptedError(message, **kwargs)


def corrupt(directory: epath.Path, step: int, detail: str) -> CheckpointCorruptedError:
    """The error for a damaged checkpoint of `step`.

    Args:
      directory: The checkpoint directory.
      step: The damaged step.
      detail: What is wrong with it.

    Returns:
      The error, naming the step and what to do.
    """
    return CheckpointCorruptedError(
        CORRUPT_MSG.format(step=step, directory=directory, detail=detail),
        directory=directory,
        step=step,
        detail=detail,
    )


def is_damage(error: BaseException) -> bool:
    """Whether an error raised while reading a step's files means they are damaged.

    Tensorstore raises a `ValueError` for data it cannot find or decode, the file
    system an `OSError`, JSON a `ValueError`, orbax a `KeyError` for a missing
    item: these are damage. Anything else (a `TypeError` inside orbax, say) is a
    failure of the reader, not of the files.

    Args:
      error: What reading raised.

    Returns:
      True for damage.

    Example:
      >>> from jdp.checkpoint._format import is_damage
      >>> is_damage(ValueError("DATA_LOSS: ...")), is_damage(TypeError("'<'"))
      (True, False)
    """
    return isinstance(error, OSError | ValueError | KeyError | EOFError | zlib.error)


def not_damage(
    directory: epath.Path,
    step: int,
    error: BaseException,
    *,
    caller: str = "restore",
) -> RuntimeError:
    """The error for a failure to read a step that is not damage (`is_damage`).

    Args:
      directory: The checkpoint directory.
      step: The step being read.
      error: What reading raised.
      caller: The `CheckpointManager` method, for the message.

    Returns:
      A `RuntimeError` to raise `from error`.
    """
    return RuntimeError(
        NOT_DAMAGE_MSG.format(
            caller=caller,
            step=step,
            directory=directory,
            error=f"{type(error).__name__}: {error}",
        )
    )


# -- leaves as saved --------------------------------------------------------------


def dtype_name(dtype: Any) -> str:
    """The name a record gives a dtype, e.g. `"float32"`."""
    return np.dtype(dtype).name


def crc32(x: np.ndarray) -> int:
    """The CRC-32 of an array's bytes in C order."""
    return zlib.crc32(memoryview(np.ascontiguousarray(x)).cast("B"))


def key_impl_name(x: Any) -> str | None:
    """The PRNG implementation of a typed-key leaf (array or struct), else None."""
    return key_impl(x) if is_key(x) else None


def as_key_data(x: Any) -> Any:
    """Typed PRNG keys as their raw key data (an array or a struct), else `x`."""
    if not is_key(x):
        return x
    if isinstance(x, jax.Array):
        return jax.random.key_data(x)
    return jax.eval_shape(jax.random.key_data, x)


def host_copy(x: Any) -> Any:
    """A leaf of the logical copy as a fresh NumPy array this process owns.

    Copying (rather than viewing device memory) keeps an async save correct when
    the next step donates the state's buffers. A leaf that is not fully
    addressable (one logical copy spread over several hosts) stays a `jax.Array`:
    orbax writes each host's part. Typed PRNG keys are saved as their key data.

    Args:
      x: A leaf of one logical copy of the state.

    Returns:
      What orbax writes for it.
    """
    x = as_key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x
    return np.array(x, copy=True)


# -- the record -------------------------------------------------------------------


def make_metadata(
    step: int,
    state: PyTree,
    logical: PyTree,
    host: PyTree,
    replicas: dict[str, Any],
    parallel: Any,
) -> dict[str, Any]:
    """The JSON record of a step (see `CheckpointManager.metadata`).

    Args:
      step: The step number.
      state: The replicated state being saved.
      logical: One logical copy of `state` (typed keys still keys).
      host: What is written of `logical` (`host_copy` of each leaf).
      replicas: The leaves saved with every replica, by path (`host_copy`s).
      parallel: The `jdp.Parallel` given to `save`, or None.

    Returns:
      The record, ready for `json.dumps`.
    """
    leaves = []
    for (path, x), one in zip(
        jax.tree_util.tree_flatten_with_path(host)[0],
        jax.tree.leaves(logical),
        strict=True,
    ):
        record = {
            "path": keystr(path),
            "shape": list(x.shape),
            "dtype": dtype_name(x.dtype),
            "crc32": crc32(x) if isinstance(x, np.ndarray) else None,
        }
        if is_key(one):  # saved as its key data
            record["key_impl"] = key_impl_name(one)
        every = replicas.get(record["path"])
        if every is not None:
            record["per_replica"] = {
                "crc32": crc32(every) if isinstance(every, np.ndarray) else None
            }
        leaves.append(record)
    flat = jax.tree.leaves(state)
    num_replicas = (
        parallel.num_replicas if parallel is not None else int(flat[0].shape[0])
    )
    cls = type(state)
    return {
        "format": FORMAT,
        "step": step,
        "jdp_version": __version__,
        "jax_version": jax.__version__,
        "python_version": sys.version.split()[0],
        "num_replicas": num_replicas,
        "backend": getattr(parallel, "backend", None),
        "axis_name": getattr(parallel, "axis_name", None),
        "process_count": jax.process_count(),
        "state_type": f"{cls.__module__}.{cls.__qualname__}",
        "leaves": leaves,
    }


# -- reading ----------------------------------------------------------------------


def restore_item(
    manager: ocp.CheckpointManager, step: int, name: str, item: PyTree, restore_args
) -> PyTree:
    """Reads one orbax PyTree item of a step into `item`'s structure.

    Args:
      manager: The orbax manager of the directory.
      step: The step to read.
      name: The item's name (`STATE_ITEM` or `REPLICAS_ITEM`).
      item: The tree to read into (`jax.ShapeDtypeStruct` leaves).
      restore_args: Orbax's restore arguments, a tree like `item`.

    Returns:
      The item, shaped like `item`.
    """
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
    return manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]


def read_metadata(
    manager: ocp.CheckpointManager, directory: epath.Path, step: int
) -> dict[str, Any]:
    """The step's JSON record.

    Args:
      manager: The orbax manager of `directory`.
      directory: The checkpoint directory.
      step: The step to read.

    Returns:
      The record as a dict.

    Raises:
      CheckpointCorruptedError: If it is missing, unreadable or not a `FORMAT`
        record.
      RuntimeError: If reading it fails for another reason (`is_damage`).
    """
    try:
        meta = manager.restore(
            step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()})
        )[METADATA_ITEM]
    except Exception as e:  # orbax/json raise many types for a damaged file
        if not is_damage(e):
            raise not_damage(directory, step, e) from e
        detail = f"its metadata could not be read ({type(e).__name__}: {e})."
        raise corrupt(directory, step, detail) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise corrupt(directory, step, f"its metadata is not a {FORMAT!r} record.")
    return meta


def check_leaves(
    directory: epath.Path,
    step: int,
    records: Sequence[dict[str, Any]],
    leaves: Sequence[Any],
) -> None:
    """Checks the leaves read back against their records: shape, dtype, CRC-32.

    Args:
      directory: The checkpoint directory.
      step: The step the leaves were read from.
      records: The step's leaf records, in the order of `leaves`.
      leaves: The arrays read back.

    Raises:
      CheckpointCorruptedError: Naming the first leaf that differs from its
        record.
    """
    for record, x in zip(records, leaves, strict=True):
        x = np.asarray(x)
        detail = None
        if x.shape != tuple(record["shape"]) or dtype_name(x.dtype) != record["dtype"]:
            detail = (
                f"leaf {record['path']} was read back with shape {x.shape} "
                f"{dtype_name(x.dtype)}, but was saved with shape "
                f"{tuple(record['shape'])} {record['dtype']}."
            )
        elif record.get("crc32") is not None and crc32(x) != record["crc32"]:
            detail = (
                f"leaf {record['path']} does not match the CRC-32 recorded when "
                "it was saved."
            )
        if detail:
            raise corrupt(directory, step, detail)


def param_name(path: Sequence[Any]) -> str:
    """The name orbax gives a leaf's arrays inside an item: its keys joined by ".".

    Args:
      path: The leaf's key path in the saved tree.

    Returns:
      E.g. `"0.layers.2.kernel.value"` for `[0].layers[2].kernel.value`.

    Raises:
      TypeError: For a key that is not a sequence, dict, attribute or flattened
        index key (orbax cannot save those).

    Example:
      >>> import jax
      >>> from jdp.checkpoint._format import param_name
      >>> path = jax.tree_util.tree_flatten_with_path({"a": [0, {1: 2}]})[0][1][0]
      >>> param_name(path)
      'a.1.1'
    """
    tu = jax.tree_util
    parts = []
    for key in path:
        if isinstance(key, tu.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, tu.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, tu.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, tu.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            raise TypeError(
                f"key {key!r} of leaf {keystr(path)} is a {type(key).__name__}: "
                "expected a sequence, dict, attribute or flattened-index key."
            )
    return ".".join(parts)


def _item_tree(directory: epath.Path, step: int, item: str) -> dict[str, Any]:
    """Orbax's JSON record of a PyTree item (`<step>/<item>/_METADATA`)."""
    tree = json.loads((directory / str(step) / item / "_METADATA").read_text())
    if not isinstance(tree, dict):
        raise ValueError(f"the `{item}` item's _METADATA is not a JSON object")
    return tree


def item_array_names(directory: epath.Path, step: int, item: str) -> list[str]:
    """The names of the arrays orbax wrote into an item (empty nodes left out).

    Args:
      directory: The checkpoint directory.
      step: The step.
      item: The item's name.

    Returns:
      The names, as `read_arrays` takes them.

    Raises:
      OSError, ValueError: If orbax's record of the item is missing or damaged.
    """
    entries = _item_tree(directory, step, item).get("tree_metadata")
    if not isinstance(entries, dict):
        raise ValueError(f"the `{item}` item's _METADATA lists no tree")
    names = []
    for entry in entries.values():
        try:
            if entry["value_metadata"].get("skip_deserialize"):
                continue  # an empty node (None, an empty tuple or state)
            names.append(".".join(str(k["key"]) for k in entry["key_metadata"]))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"the `{item}` item's _METADATA has a malformed entry ({e!r})"
            ) from e
    return names


def read_arrays(
    directory: epath.Path,
    step: int,
    item: str,
    names: Sequence[str],
    dtypes: Sequence[Any] | None = None,
) -> list[np.ndarray]:
    """Reads arrays of an orbax PyTree item by name, as NumPy arrays.

    Uses orbax's array reader (`NumpyHandler`, tensorstore underneath) but not
    its PyTree restore, which rebuilds the saved tree first and fails for trees
    whose nodes mix integer and string keys (see the module docstring).

    Args:
      directory: The checkpoint directory.
      step: The step.
      item: The item's name (`STATE_ITEM` or `REPLICAS_ITEM`).
      names: The arrays' names (`param_name` of their paths).
      dtypes: The dtype to read each array as; None for the saved dtypes.

    Returns:
      The arrays, in the order of `names`.

    Raises:
      OSError, ValueError: If a file is missing or cannot be decoded (damage).
    """
    th = ocp.type_handlers
    parent = directory / str(step) / item
    tree = _item_tree(directory, step, item)
    use_ocdbt = tree.get("use_ocdbt")
    if use_ocdbt is None:
        use_ocdbt = th.is_ocdbt_checkpoint(parent)
    context = th.get_ts_context(use_ocdbt=bool(use_ocdbt))
    infos = [
        th.ParamInfo(
            name=name,
            parent_dir=parent,
            is_ocdbt_checkpoint=bool(use_ocdbt),
            use_zarr3=bool(tree.get("use_zarr3")),
            ts_context=context,
        )
        for name in names
    ]
    args = [
        th.RestoreArgs(
            restore_type=np.ndarray,
            dtype=None if dtypes is None else np.dtype(dtypes[i]),
        )
        for i in range(len(names))
    ]
    if not infos:
        return []
    return list(_run(th.NumpyHandler().deserialize(infos, args)))


def _run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Runs a coroutine to completion, also where an event loop already runs."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # none (a script): run it here
        return asyncio.run(coroutine)
    # In a running loop (a notebook's): in a thread of its own.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def verify_arrays(directory: epath.Path, step: int, meta: dict[str, Any]) -> str | None:
    """Reads every array of a step and checks its CRC-32.

    Needs no `like`: the arrays are matched to the records by shape, dtype and
    checksum. Reading a whole step is slow: only for a step that would block a
    save.

    Args:
      directory: The checkpoint directory.
      step: The step to read.
      meta: The step's record.

    Returns:
      What is wrong with the step, or None if every array matches its record.

    Raises:
      RuntimeError: If reading fails for a reason that is not damage
        (`is_damage`): the step is then neither damaged nor known intact.
    """
    want = collections.Counter()
    for r in meta["leaves"]:
        if r.get("crc32") is not None:
            want[(tuple(r["shape"]), r["dtype"], r["crc32"])] += 1
        per = r.get("per_replica") or {}
        if per.get("crc32") is not None:
            shape = (meta["num_replicas"], *r["shape"])
            want[(shape, r["dtype"], per["crc32"])] += 1
    have = collections.Counter()
    items = [STATE_ITEM]
    if any(r.get("per_replica") for r in meta["leaves"]):
        items.append(REPLICAS_ITEM)
    try:
        for item in items:
            names = item_array_names(directory, step, item)
            for x in read_arrays(directory, step, item, names):
                x = np.asarray(x)
                have[(x.shape, dtype_name(x.dtype), crc32(x))] += 1
    except Exception as e:  # tensorstore raises many types for bad files
        if not is_damage(e):
            raise not_damage(directory, step, e, caller="save") from e
        return f"reading its arrays failed ({type(e).__name__}: {e})"
    bad = sum((want - have).values())
    if bad:
        return f"{bad} of its arrays do not match the CRC-32 recorded at save"
    return None


# -- damaged steps ----------------------------------------------------------------


def set_aside(directory: epath.Path, damaged: dict[int, str]) -> None:
    """Renames damaged steps to `<step>.damaged-<n>` (process 0), with warnings.

    Called by `CheckpointManager.save` itself: the warnings name its caller.
    Every process of a job calls it; process 0 renames, the others wait for it.

    Args:
      directory: The checkpoint directory.
      damaged: What is wrong with each step to move aside, by step.

    Raises:
      OSError: If a step cannot be renamed (naming it and what to do).
    """
    if not damaged:
        return
    if jax.process_index() == 0:
        for step, detail in sorted(damaged.items()):
            n = 1
            while (directory / f"{step}{DAMAGED_SUFFIX}{n}").exists():
                n += 1
            target = directory / f"{step}{DAMAGED_SUFFIX}{n}"
            try:
                (directory / str(step)).rename(target)
            except OSError as e:
                raise same_kind_of_error(
                    e,
                    f"`CheckpointManager.save`: step {step} in {directory} "
                    f"is incomplete or damaged ({detail}), and moving it aside "
                    f"to {target} failed ({type(e).__name__}: {e}). Nothing was "
                    f"saved.\nFix: move or delete {directory / str(step)} "
                    "yourself, then save again.",
                ) from e
            warnings.warn(
                SET_ASIDE_MSG.format(
                    step=step, directory=directory, detail=detail, target=target
                ),
                RuntimeWarning,
                stacklevel=3,
            )
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jdp_checkpoint_set_aside")


# -- extras: what a resume needs besides the state ------------------------------

#: The key of an encoded array in an extra's JSON (user dicts may not use it).
ARRAY_TAG = "__jdp_array__"

BAD_EXTRA_MSG = (
    "`CheckpointManager.save`: {where} {what}, which cannot be saved in `extra`. "
    "Extras are JSON values (None, bool, int, float, str, lists, tuples and "
    "dicts with string keys) and NumPy or JAX arrays (typed PRNG keys "
    "included).\nFix: {fix}"
)


def _extra_where(path: Sequence[Any]) -> str:
    """`extra['data'][0]`: where a value sits in the extras."""
    return "extra" + "".join(f"[{k!r}]" for k in path)


def _bad_extra(path: Sequence[Any], what: str, fix: str) -> TypeError:
    return TypeError(BAD_EXTRA_MSG.format(where=_extra_where(path), what=what, fix=fix))


def _encode_array(path: Sequence[Any], x: Any, encode: bool) -> Any:
    """One array of the extras as JSON (with `encode`), else only checked."""
    impl = None
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            raise _bad_extra(
                path,
                f"is a jax.Array of shape {x.shape} spread over several processes",
                "save one process's part, e.g. `np.asarray(x.addressable_data(0))`, "
                "or put the array in the state.",
            )
        if is_key(x):
            impl = key_impl(x)
            x = jax.random.key_data(x) if encode else x
    if isinstance(x, np.ndarray | np.generic) and x.dtype.kind == "O":
        raise _bad_extra(
            path,
            "is a NumPy array of Python objects",
            "save a numeric array, or a list of JSON values.",
        )
    if not encode:
        return None
    a = np.array(x, order="C", copy=True)
    record = {
        "dtype": dtype_name(a.dtype),
        "shape": list(a.shape),
        "data": base64.b64encode(a.tobytes()).decode("ascii"),
    }
    if impl is not None:
        record["key_impl"] = impl
    return {ARRAY_TAG: record}


def _encode_extra_value(path: tuple[Any, ...], x: Any, encode: bool) -> Any:
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return x
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        return _encode_array(path, x, encode)
    if isinstance(x, list | tuple):
        return [_encode_extra_value((*path, i), v, encode) for i, v in enumerate(x)]
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise _bad_extra(
                    (*path, k),
                    f"has a key of type {type(k).__name__} (JSON keys are strings)",
                    f"use the key {str(k)!r} instead.",
                )
            if k == ARRAY_TAG:
                raise _bad_extra(
                    (*path, k),
                    "uses a key reserved for the arrays of extras",
                    "rename the key.",
                )
            out[k] = _encode_extra_value((*path, k), v, encode)
        return out
    raise _bad_extra(
        path,
        f"is a {type(x).__module__}.{type(x).__qualname__}",
        "save the values it is made of (e.g. a data loader's position as "
        "integers), or put arrays in the state.",
    )


def encode_extra(extra: Any, *, encode: bool = True) -> dict[str, Any] | None:
    """The JSON form of `save`'s `extra` (arrays as base64), checking every value.

    Args:
      extra: A dict with string keys of JSON values and arrays, or None.
      encode: False only checks the values (cheap: no array is copied).

    Returns:
      The JSON-able dict (None for None, or with `encode=False`).

    Raises:
      TypeError: If `extra` is not a dict, or a value cannot be saved (naming
        its key, e.g. `extra['data']['loader']`).

    Example:
      >>> import numpy as np
      >>> from jdp.checkpoint._format import encode_extra, decode_extra
      >>> decode_extra(encode_extra({"epoch": 2, "perm": np.arange(3)}))
      {'epoch': 2, 'perm': array([0, 1, 2])}
    """
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise TypeError(
            "`CheckpointManager.save`: `extra` must be a dict with string keys, "
            f"got a {type(extra).__name__}. Fix: "
            "`manager.save(step, state, extra={'epoch': epoch, 'batch': i})`."
        )
    out = _encode_extra_value((), extra, encode)
    return out if encode else None


def _decode_extra_value(x: Any) -> Any:
    if isinstance(x, list):
        return [_decode_extra_value(v) for v in x]
    if isinstance(x, dict):
        if set(x) == {ARRAY_TAG}:
            r = x[ARRAY_TAG]
            data = base64.b64decode(r["data"].encode("ascii"), validate=True)
            a = np.frombuffer(data, dtype=np.dtype(r["dtype"]))
            a = a.reshape(tuple(r["shape"])).copy()
            if r.get("key_impl") is not None:
                return jax.random.wrap_key_data(a, impl=r["key_impl"])
            return a
        return {k: _decode_extra_value(v) for k, v in x.items()}
    return x


def decode_extra(encoded: Any) -> dict[str, Any]:
    """The extras of `encode_extra`'s JSON form: arrays as NumPy arrays.

    Typed PRNG keys come back as typed keys; tuples come back as lists.

    Args:
      encoded: What `encode_extra` returned (after a round trip through JSON).

    Returns:
      The extras (an empty dict for None).

    Raises:
      ValueError, KeyError, TypeError: If `encoded` is malformed (damage).
    """
    if encoded is None:
        return {}
    if not isinstance(encoded, dict):
        raise ValueError(f"the saved extras are a {type(encoded).__name__}")
    return _decode_extra_value(encoded)
