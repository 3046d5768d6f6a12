"""Predictor export: a single-device inference function serialised with `jax.export`.

The counterpart of Caffe2's `ExtractPredictorNet`: Caffe2 stripped the `gpu_0/`
prefix from the training net and returned a one-device inference net plus the blobs
it needs. Here the inference function is traced with one logical copy of the
parameters baked in as constants, lowered to StableHLO by `jax.export` (optionally
for several platforms, with a symbolic batch dimension), and wrapped in a small
container so that a damaged file is reported as such:

    offset  size  field
    0       8     magic b"JDPPRED" + one zero byte
    8       4     format version (little-endian uint32)
    12      4     metadata length M (uint32)
    16      8     payload length P (uint64)
    24      32    SHA-256 of metadata + payload
    56      M     metadata: UTF-8 JSON (jdp/jax versions, inputs, platforms)
    56+M    P     payload: `jax.export.Exported.serialize()`
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import export as jax_export

from jdp._layout import is_replicated, logical_copy
from jdp._tree import format_problems, keystr
from jdp._version import __version__

PyTree = Any

MAGIC = b"JDPPRED\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ32s")
_KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_BATCH = "batch"


# -- parameters ------------------------------------------------------------------


def _one_copy(params: PyTree, replicated: bool | None) -> PyTree:
    """Host (NumPy) copy of `params`, replica 0's when they are replicated."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    arrays = [(p, x) for p, x in flat if isinstance(x, (jax.Array, np.ndarray))]
    if replicated is None:
        marks = [is_replicated(x) for _, x in arrays]
        if any(marks) and not all(marks):
            probs = [
                f"{keystr(p)}: shape {np.shape(x)}"
                for (p, x), m in zip(arrays, marks, strict=True)
                if not m
            ]
            raise ValueError(
                "`jdp.export_predictor`: some parameter leaves are replicated by "
                "`step.replicate` (a leading replica axis sharded over the mesh) "
                "and others are not:"
                f"{format_problems(probs)}\nPass one logical copy "
                "(`step.unreplicate(state.params)`) or the replicated state as it "
                "came out of the step; or force the reading with `replicated=True` "
                "or `replicated=False`."
            )
        replicated = bool(marks) and all(marks)
    if replicated:
        probs = [
            f"{keystr(p)}: {x!r}"
            for p, x in flat
            if not (isinstance(x, jax.Array) and x.ndim >= 1)
        ]
        if probs:
            raise ValueError(
                "`jdp.export_predictor(replicated=True)`: every leaf of a replicated "
                "pytree must be a jax.Array with a leading replica axis; these are "
                f"not:{format_problems(probs)}"
            )
        params = logical_copy(params)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)


# -- inputs ----------------------------------------------------------------------


def _as_tuple(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs
    return (example_inputs,)


def _input_specs(inputs: tuple, batch_polymorphic: bool) -> tuple:
    flat, treedef = jax.tree_util.tree_flatten_with_path(inputs)
    if not flat:
        raise ValueError(
            "`jdp.export_predictor`: `example_inputs` has no arrays; pass a tuple "
            "of example arrays, e.g. `(x,)`."
        )
    shapes = [
        (
            p,
            np.shape(x),
            jax.dtypes.canonicalize_dtype(
                getattr(x, "dtype", None) or np.result_type(x)
            ),
        )
        for p, x in flat
    ]
    if not batch_polymorphic:
        specs = [jax.ShapeDtypeStruct(s, d) for _, s, d in shapes]
        return jax.tree_util.tree_unflatten(treedef, specs)
    scalars = [f"args{keystr(p)}" for p, s, _ in shapes if len(s) == 0]
    if scalars:
        raise ValueError(
            "`jdp.export_predictor(batch_polymorphic=True)` makes the leading axis of "
            f"every input the batch axis, but these inputs are scalars: "
            f"{', '.join(scalars)}. Give them a batch axis or pass "
            "`batch_polymorphic=False`."
        )
    sizes = {s[0] for _, s, _ in shapes}
    if len(sizes) != 1:
        listed = ", ".join(f"args{keystr(p)}: {s}" for p, s, _ in shapes)
        raise ValueError(
            "`jdp.export_predictor(batch_polymorphic=True)`: every input's leading "
            f"axis is the batch axis, so they must agree; got shapes {listed}. Pass "
            "`batch_polymorphic=False` to export fixed shapes."
        )
    (batch,) = jax_export.symbolic_shape(_BATCH)
    specs = [jax.ShapeDtypeStruct((batch,) + s[1:], d) for _, s, d in shapes]
    return jax.tree_util.tree_unflatten(treedef, specs)


def _platforms(platforms: Sequence[str]) -> tuple[str, ...]:
    if isinstance(platforms, str):
        platforms = (platforms,)
    out = []
    for p in platforms:
        p = {"gpu": "cuda"}.get(str(p).lower(), str(p).lower())
        if p not in _KNOWN_PLATFORMS:
            raise ValueError(
                f"`platforms`: unknown platform {p!r}; choose from {_KNOWN_PLATFORMS}."
            )
        if p not in out:
            out.append(p)
    if not out:
        raise ValueError("`platforms` is empty; pass e.g. ('cpu', 'cuda').")
    return tuple(out)


def _format_aval(aval: Any) -> str:
    dims = ", ".join(str(d) for d in aval.shape)
    return f"{aval.dtype}[{dims}]"


# -- export ----------------------------------------------------------------------


def export_predictor(
    apply_fn: Callable[..., Any],
    params: PyTree,
    example_inputs: Any,
    *,
    platforms: Sequence[str] = ("cpu", "cuda"),
    batch_polymorphic: bool = True,
    replicated: bool | None = None,
) -> bytes:
    """Serialises `apply_fn(params, *inputs)` as a standalone inference function.

    One logical copy of `params` is baked into the function as constants and the
    function is lowered to StableHLO with `jax.export`; the result runs on one
    device, without a mesh, without the training code and without the model's
    Python classes (`jdp.load_predictor`). This is Caffe2's `ExtractPredictorNet`.

    Params straight out of a `jdp.parallelize` step carry a replica axis; they are
    recognised by their layout (every array leaf a `jax.Array` whose leading axis is
    sharded over every axis of a mesh of that size, as `step.replicate` places them
    on a 1-D or a 2-D host mesh) and
    replica 0's copy is exported. Force the reading with `replicated=True` or
    `False` when the layout is ambiguous (e.g. your own `NamedSharding(mesh,
    P("data"))` params that are not replicas).

    Args:
      apply_fn: Inference function `apply_fn(params, *inputs) -> outputs` (any
        pytree of arrays); e.g. `lambda v, x: model.apply(v, x, train=False)`.
      params: Parameters (and other model state such as BatchNorm statistics):
        one plain copy, or replicated by `step.replicate` / returned by a step.
      example_inputs: Tuple of example inputs (arrays or pytrees of arrays); a
        single array is taken as one input. Only shapes and dtypes are used.
      platforms: Platforms to lower for (`"cpu"`, `"cuda"`, `"rocm"`, `"tpu"`);
        the loaded predictor runs on whichever of them the loading process uses.
      batch_polymorphic: Make the leading axis of every input a symbolic batch
        size, so one predictor serves any batch (every input must then have a
        leading axis, of the same size in `example_inputs`). False exports the
        example shapes exactly.
      replicated: Whether `params` is replicated; None (default) decides from the
        layout as described above.

    Returns:
      The serialised predictor (bytes) for `jdp.load_predictor` or a file.

    Raises:
      ValueError: If `platforms` names an unknown platform, the inputs do not
        fit `batch_polymorphic`, or `params` mixes replicated and plain leaves.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jdp
      >>> def apply_fn(params, x):
      ...     return x @ params["w"] + params["b"]
      >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
      >>> blob = jdp.export_predictor(apply_fn, params, (np.zeros((4, 3), np.float32),))
      >>> predict = jdp.load_predictor(blob)
      >>> predict(np.ones((5, 3), np.float32)).shape
      (5, 2)
    """
    platforms = _platforms(platforms)
    inputs = _as_tuple(example_inputs)
    specs = _input_specs(inputs, batch_polymorphic)
    consts = _one_copy(params, replicated)

    def predictor(*args):
        return apply_fn(consts, *args)

    predictor.__name__ = getattr(apply_fn, "__name__", "predictor")
    try:
        exported = jax_export.export(jax.jit(predictor), platforms=platforms)(*specs)
    except Exception as e:  # add what jdp knows; keep JAX's own error type
        if batch_polymorphic and "symbolic" in str(e).lower():
            e.add_note(
                "jdp: the batch axis was exported as the symbolic dimension "
                f"{_BATCH!r}; if the model needs a concrete batch size, pass "
                "`batch_polymorphic=False`."
            )
        raise
    meta = {
        "jdp_format": FORMAT_VERSION,
        "jdp": __version__,
        "jax": jax.__version__,
        "fun_name": exported.fun_name,
        "platforms": list(exported.platforms),
        "inputs": [_format_aval(a) for a in exported.in_avals],
        "outputs": [_format_aval(a) for a in exported.out_avals],
    }
    return _pack(json.dumps(meta).encode(), bytes(exported.serialize()))


def save_predictor(
    path: str | os.PathLike,
    apply_fn: Callable[..., Any],
    params: PyTree,
    example_inputs: Any,
    **kwargs: Any,
) -> None:
    """Writes the bytes of `jdp.export_predictor(...)` to the file `path`.

    The file is written to a temporary name in the same directory and renamed, so
    a crash never leaves a half-written predictor under `path`.

    Args:
      path: Destination file.
      apply_fn: See `jdp.export_predictor`.
      params: See `jdp.export_predictor`.
      example_inputs: See `jdp.export_predictor`.
      **kwargs: `platforms`, `batch_polymorphic`, `replicated`.
    """
    data = export_predictor(apply_fn, params, example_inputs, **kwargs)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".jdp-predictor-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# -- container -------------------------------------------------------------------


def _pack(meta: bytes, payload: bytes) -> bytes:
    digest = hashlib.sha256(meta + payload).digest()
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(meta), len(payload), digest)
    return header + meta + payload


def _unpack(data: bytes, source: str) -> tuple[dict, bytes]:
    prefix = f"`jdp.load_predictor`: {source}"
    if len(data) < _HEADER.size:
        if not MAGIC.startswith(bytes(data[: len(MAGIC)])):
            raise ValueError(f"{prefix} is not a jdp predictor (no {MAGIC!r} header).")
        raise ValueError(
            f"{prefix} is truncated: {len(data)} bytes, shorter than the "
            f"{_HEADER.size}-byte header."
        )
    magic, version, meta_len, payload_len, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(
            f"{prefix} is not a jdp predictor: it starts with {bytes(data[:8])!r}, "
            f"expected {MAGIC!r}. Write predictors with `jdp.save_predictor`."
        )
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{prefix} uses predictor format version {version}; this jdp reads "
            f"version {FORMAT_VERSION}. Load it with the jdp version that wrote it."
        )
    expected = _HEADER.size + meta_len + payload_len
    if len(data) < expected:
        raise ValueError(
            f"{prefix} is truncated: {len(data)} bytes, the header promises "
            f"{expected}. Copy or write the file again."
        )
    if len(data) > expected:
        raise ValueError(
            f"{prefix} has {len(data) - expected} unexpected trailing bytes after "
            f"the {expected} the header promises: it is damaged."
        )
    body = bytes(data[_HEADER.size :])
    if hashlib.sha256(body).digest() != digest:
        raise ValueError(
            f"{prefix} is corrupted: its SHA-256 checksum does not match the "
            "contents. Copy or write the file again."
        )
    meta = json.loads(body[:meta_len].decode())
    return meta, body[meta_len:]


# -- loading ---------------------------------------------------------------------


class Predictor:
    """A loaded predictor: call it with the inputs, as `apply_fn` without `params`.

    Made by `jdp.load_predictor`. Inputs are checked against the exported shapes
    and dtypes before the call (a clear `ValueError` instead of an XLA error); the
    first call for each batch size compiles.

    Attributes:
      exported: The `jax.export.Exported` function.
      input_specs: The expected inputs, e.g. `("float32[batch, 28, 28, 1]",)`;
        `batch` is the symbolic batch size.
      platforms: The platforms it was exported for.
      metadata: The container's metadata (jdp and jax versions, inputs, outputs).
    """

    def __init__(self, exported: jax_export.Exported, metadata: dict):
        self.exported = exported
        self.metadata = metadata
        self.platforms = tuple(exported.platforms)
        self.input_specs = tuple(_format_aval(a) for a in exported.in_avals)
        self._args_tree = exported.in_tree.children()[0]
        self._call = jax.jit(exported.call)

    def _expected(self) -> str:
        paths = [
            f"args{keystr(p)}"
            for p, _ in jax.tree_util.tree_flatten_with_path(
                jax.tree_util.tree_unflatten(
                    self._args_tree, list(range(self._args_tree.num_leaves))
                )
            )[0]
        ]
        listed = ", ".join(
            f"{p}: {s}" for p, s in zip(paths, self.input_specs, strict=True)
        )
        poly = any(
            not isinstance(d, int) for a in self.exported.in_avals for d in a.shape
        )
        note = (
            f" ({_BATCH!r} is the batch size: any size >= 1, the same for every input)"
            if poly
            else ""
        )
        return f"Expected inputs: {listed}{note}."

    def _check(self, inputs: tuple) -> list:
        flat, treedef = jax.tree_util.tree_flatten_with_path(inputs)
        if treedef != self._args_tree:
            num = len(self._args_tree.children())
            if len(inputs) != num:
                what = f"{len(inputs)} input(s); it was exported for {num}"
            else:
                what = (
                    f"inputs structured as {treedef}; it was exported for "
                    f"{self._args_tree}"
                )
            raise ValueError(f"Predictor called with {what}. {self._expected()}")
        leaves, probs, bound = [], [], {}
        for (path, x), aval in zip(flat, self.exported.in_avals, strict=True):
            x = x if isinstance(x, jax.Array) else np.asarray(x)
            dtype = jax.dtypes.canonicalize_dtype(x.dtype)
            shape = tuple(x.shape)
            ok = dtype == aval.dtype and len(shape) == len(aval.shape)
            if ok:
                for got, want in zip(shape, aval.shape, strict=True):
                    if isinstance(want, int):
                        ok &= got == want
                    else:
                        ok &= got >= 1 and bound.setdefault(str(want), got) == got
            if not ok:
                probs.append(
                    f"args{keystr(path)}: got {dtype}{list(shape)}, expected "
                    f"{_format_aval(aval)}"
                )
            leaves.append(x.astype(aval.dtype) if x.dtype != aval.dtype else x)
        if probs:
            raise ValueError(
                "Predictor inputs do not match the exported shapes/dtypes:"
                f"{format_problems(probs)}\n{self._expected()}"
            )
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def __call__(self, *inputs: Any) -> Any:
        """Runs the predictor on `inputs` (arrays, as given to `apply_fn`).

        Raises:
          ValueError: If the inputs' number, structure, shapes or dtypes differ
            from the exported ones; the message lists the expected inputs.
        """
        return self._call(*self._check(inputs))

    def __repr__(self) -> str:
        return (
            f"Predictor({self.exported.fun_name}, inputs={list(self.input_specs)}, "
            f"platforms={self.platforms})"
        )


def load_predictor(path_or_bytes: str | os.PathLike | bytes) -> Predictor:
    """Loads a predictor written by `jdp.save_predictor` / `jdp.export_predictor`.

    Needs neither the model code nor the training code: only jax (and jdp).

    Args:
      path_or_bytes: A file path, or the bytes `jdp.export_predictor` returned.

    Returns:
      A callable `predict(*inputs) -> outputs` (a `Predictor`, which also tells
      its `input_specs` and `platforms`).

    Raises:
      ValueError: If the data is not a jdp predictor, is truncated or corrupted
        (checksum mismatch), was written in another format version, or was not
        exported for the platform this process runs on.
      FileNotFoundError: If the path does not exist.

    Example:
      >>> import numpy as np, jdp
      >>> x = np.ones(3, np.float32)
      >>> blob = jdp.export_predictor(lambda p, x: x * p, 2.0, (x,))
      >>> jdp.load_predictor(blob)(np.arange(3, dtype=np.float32))
      Array([0., 2., 4.], dtype=float32)
    """
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data, source = bytes(path_or_bytes), "the data given"
    else:
        path = os.fspath(path_or_bytes)
        with open(path, "rb") as f:
            data = f.read()
        source = f"file {path!r}"
    meta, payload = _unpack(data, source)
    try:
        exported = jax_export.deserialize(bytearray(payload))
    except Exception as e:
        raise ValueError(
            f"`jdp.load_predictor`: {source} passed its checksum but jax "
            f"{jax.__version__} could not deserialize it (written with jax "
            f"{meta.get('jax')}): {type(e).__name__}: {e}"
        ) from e
    here = jax_export.default_export_platform()
    if here not in exported.platforms:
        raise ValueError(
            f"`jdp.load_predictor`: {source} was exported for platforms "
            f"{tuple(exported.platforms)}, but this process runs on {here!r}. "
            f"Export with `platforms=(..., {here!r})`."
        )
    return Predictor(exported, meta)
