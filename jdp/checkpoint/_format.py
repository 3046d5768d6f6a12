"""The on-disk format of a checkpoint step: its items, its record, reading them back.

Items: `state` (one logical copy, by tensorstore), `jdp_metadata` (the JSON
record) and `jdp_replicas` (leaves whose replicas differed, every replica).
Reading uses tensorstore and JSON only: nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import sys
import zlib
from collections.abc import Coroutine, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jdp._layout import is_key, key_impl
from jdp._tree import PyTree, keystr
from jdp._version import __version__
from jdp.checkpoint._damage import corrupt, reading

#: Orbax item names inside one step directory.
STATE_ITEM = "state"
METADATA_ITEM = "jdp_metadata"
#: Leaves whose replicas differed when saved, with every replica.
REPLICAS_ITEM = "jdp_replicas"
#: Marks a step's JSON as written by this module (and its layout version).
FORMAT = "jdp.checkpoint/1"


def dtype_name(dtype: Any) -> str:
    """The name a record gives a dtype, e.g. `"float32"`."""
    return np.dtype(dtype).name


def crc32(x: np.ndarray) -> int:
    """The CRC-32 of an array's bytes in C order."""
    # As bytes: a memoryview refuses bfloat16, float8 and int4 (not buffer
    # formats) and a view with a zero in its shape.
    return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


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
    """A leaf of the logical copy as written: a fresh NumPy array (key data for keys).

    A copy survives the next step donating the state; a leaf spread over hosts
    stays a `jax.Array`.
    """
    x = as_key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x
    return np.array(x, copy=True)


def is_empty(shape: Sequence[int]) -> bool:
    """Whether a leaf of this shape holds no values (orbax writes none of those)."""
    return math.prod(shape) == 0


def written(host: PyTree) -> PyTree:
    """What orbax writes of `host`: its zero-size leaves (which it refuses) as None.

    Their shape and dtype are in the step's record; restoring makes them anew.
    """
    return jax.tree.map(lambda x: None if is_empty(np.shape(x)) else x, host)


def make_metadata(
    step: int, state: PyTree, logical: PyTree, host: PyTree, replicas: dict[str, Any],
    parallel: Any,
) -> dict[str, Any]:  # fmt: skip
    """The JSON record of a step (`host`: what is written of `logical`)."""
    leaves, paths = [], jax.tree_util.tree_flatten_with_path(host)[0]
    for (path, x), one in zip(paths, jax.tree.leaves(logical), strict=True):
        record = {
            "path": keystr(path), "shape": list(x.shape), "dtype": dtype_name(x.dtype),
            "crc32": (
                crc32(x) if isinstance(x, np.ndarray) and not is_empty(x.shape)
                else None
            ),
        }  # fmt: skip
        if is_key(one):  # saved as its key data
            record["key_impl"] = key_impl(one)
        if (every := replicas.get(record["path"])) is not None:
            crc = crc32(every) if isinstance(every, np.ndarray) else None
            record["per_replica"] = {"crc32": crc}
        leaves.append(record)
    first = jax.tree.leaves(state)[0]
    num_replicas = int(first.shape[0]) if parallel is None else parallel.num_replicas
    cls = type(state)
    return {
        "format": FORMAT, "step": step, "jdp_version": __version__,
        "jax_version": jax.__version__, "python_version": sys.version.split()[0],
        "num_replicas": num_replicas, "backend": getattr(parallel, "backend", None),
        "axis_name": getattr(parallel, "axis_name", None),
        "process_count": jax.process_count(), "mesh_grid": mesh_grid(first),
        "state_type": f"{cls.__module__}.{cls.__qualname__}", "leaves": leaves,
    }  # fmt: skip


def mesh_grid(x: Any) -> list[int] | None:
    """The shape of the device mesh a replicated leaf is laid out on, or None.

    E.g. `[2, 4]` for a host mesh of 2 hosts of 4 devices, `[8]` for a flat one.
    """
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None else [int(n) for n in mesh.devices.shape]


def read_metadata(
    manager: ocp.CheckpointManager, directory: epath.Path, step: int
) -> dict[str, Any]:
    """The step's JSON record; a `CheckpointCorruptedError` if it is damaged."""
    with reading(directory, step, "its metadata could not be read"):
        meta = manager.restore(
            step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()})
        )[METADATA_ITEM]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise corrupt(directory, step, f"its metadata is not a {FORMAT!r} record.")
    return meta


def param_name(path: Sequence[Any]) -> str:
    """Orbax's name of a leaf in an item, e.g. `"0.layers.2.kernel"`."""
    tu = jax.tree_util
    parts = []
    for key in path:
        if isinstance(key, tu.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, tu.DictKey | tu.FlattenedIndexKey):
            parts.append(str(key.key))
        elif isinstance(key, tu.GetAttrKey):
            parts.append(key.name)
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
    """The names of the arrays orbax wrote into an item (empty nodes left out)."""
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


def read_arrays(directory: epath.Path, step: int, item: str, names: Sequence[str],
                dtypes: Sequence[Any] | None = None) -> list[np.ndarray]:  # fmt: skip
    """Reads arrays of an orbax PyTree item by name (`param_name`), as NumPy arrays.

    Not through orbax's PyTree restore, which fails for nodes mixing integer and
    string keys (flax NNX's `nnx.Sequential` and `nnx.List`).
    """
    th = ocp.type_handlers
    parent = directory / str(step) / item
    tree = _item_tree(directory, step, item)
    if not names:
        return []
    use_ocdbt = tree.get("use_ocdbt")
    use_ocdbt = th.is_ocdbt_checkpoint(parent) if use_ocdbt is None else use_ocdbt
    context = th.get_ts_context(use_ocdbt=bool(use_ocdbt))
    infos = [
        th.ParamInfo(name=name, parent_dir=parent, is_ocdbt_checkpoint=bool(use_ocdbt),
                     use_zarr3=bool(tree.get("use_zarr3")), ts_context=context)
        for name in names
    ]  # fmt: skip
    dtypes = [None] * len(names) if dtypes is None else map(np.dtype, dtypes)
    args = [th.RestoreArgs(restore_type=np.ndarray, dtype=d) for d in dtypes]
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
