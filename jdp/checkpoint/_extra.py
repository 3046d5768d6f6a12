"""The resume extras of a checkpoint (`save`'s `extra`) to JSON and back.

JSON values are kept as they are, NumPy and JAX arrays (typed PRNG keys too) as
base64 under a reserved key; a value that cannot be saved is named by its key.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jdp._layout import is_key, key_impl
from jdp.checkpoint._format import dtype_name

#: The key of an encoded array in an extra's JSON (user dicts may not use it).
ARRAY_TAG = "__jdp_array__"

BAD_EXTRA_MSG = (
    "`CheckpointManager.save`: {where} {what}, which cannot be saved in `extra`. "
    "Extras are JSON values (None, bool, int, float, str, lists, tuples and "
    "dicts with string keys) and NumPy or JAX arrays (typed PRNG keys "
    "included).\nFix: {fix}"
)


def _bad_extra(path: Sequence[Any], what: str, fix: str) -> TypeError:
    """The error for the value at `path`, named like `extra['data'][0]`."""
    where = "extra" + "".join(f"[{k!r}]" for k in path)
    return TypeError(BAD_EXTRA_MSG.format(where=where, what=what, fix=fix))


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
    record = {"dtype": dtype_name(a.dtype), "shape": list(a.shape),
              "data": base64.b64encode(a.tobytes()).decode("ascii")}  # fmt: skip
    if impl is not None:
        record["key_impl"] = impl
    return {ARRAY_TAG: record}


def _encode_extra_value(path: tuple[Any, ...], x: Any, encode: bool) -> Any:
    if x is None or isinstance(x, bool | int | float | str):
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
    """The JSON form of `save`'s `extra`, checked (`encode=False`: only checked).

    Raises a `TypeError` naming the key (e.g. `extra['data']['loader']`) of a value
    that cannot be saved, or for an `extra` that is not a dict.
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
    if not isinstance(x, dict):
        return x
    if set(x) != {ARRAY_TAG}:
        return {k: _decode_extra_value(v) for k, v in x.items()}
    r = x[ARRAY_TAG]
    data = base64.b64decode(r["data"].encode("ascii"), validate=True)
    a = np.frombuffer(data, dtype=np.dtype(r["dtype"])).reshape(r["shape"]).copy()
    if r.get("key_impl") is not None:
        return jax.random.wrap_key_data(a, impl=r["key_impl"])
    return a


def decode_extra(encoded: Any) -> dict[str, Any]:
    """The extras from `encode_extra`'s JSON ({} for None); tuples become lists."""
    if encoded is None:
        return {}
    if not isinstance(encoded, dict):
        raise ValueError(f"the saved extras are a {type(encoded).__name__}")
    return _decode_extra_value(encoded)
