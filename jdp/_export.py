"""Predictor export: a single-device inference function serialised with `jax.export`.

The container (header, JSON metadata, `Exported.serialize()` payload, SHA-256 of
both) is described in the export guide (docs/guides/export.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import export as jax_export
from jax.sharding import NamedSharding

from jdp import _jax_compat
from jdp._layout import is_replicated, logical_copy
from jdp._tree import PyTree, format_problems, keystr
from jdp._version import __version__

MAGIC = b"JDPPRED\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ32s")
_KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_BATCH = "batch"
#: Keys every predictor's JSON header has, and the types of their values.
_METADATA_KEYS = {
    "jdp_format": int, "jdp": str, "jax": str, "platforms": list, "inputs": list,
    "outputs": list,
}  # fmt: skip
_JSON_NAMES = {
    bool: "boolean", int: "number", float: "number", str: "string", list: "array",
    dict: "object", type(None): "null",
}  # fmt: skip
_HEX = frozenset("0123456789abcdef")


def _kind(x: Any) -> str:
    """What a value is, for error messages: "a str", "a numpy.ndarray"."""
    if isinstance(x, jax.Array):
        return "a jax.Array"
    module, name = type(x).__module__.split(".")[0], type(x).__qualname__
    return f"a {name}" if module == "builtins" else f"a {module}.{name}"


def _placement(x: Any) -> str:
    """A leaf's dtype, shape and placement, for error messages."""
    if not isinstance(x, jax.Array):
        return f"{_kind(x)} of shape {np.shape(x)} (not a jax.Array)"
    sharding = x.sharding
    where = type(sharding).__name__
    if isinstance(sharding, NamedSharding):
        where += f"(mesh {dict(sharding.mesh.shape)}, {sharding.spec})"
    return f"{_format_aval(x)} placed by {where}"


def _one_copy(params: PyTree, replicated: bool | None) -> PyTree:
    """Host (NumPy) copy of `params`, replica 0's when they are replicated."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]

    def others(leaves) -> str:
        bad = [(p, x) for p, x in leaves if not is_replicated(x)]
        return format_problems([f"{keystr(p)}: {_placement(x)}" for p, x in bad])

    if replicated is None:
        arrays = [(p, x) for p, x in flat if isinstance(x, (jax.Array, np.ndarray))]
        marks = [is_replicated(x) for _, x in arrays]
        if any(marks) and not all(marks):
            raise ValueError(
                "`jdp.export_predictor`: some parameter leaves are replicated by "
                f"`step.replicate` and others are not:{others(arrays)}\nPass one "
                "copy (`step.unreplicate(state.params)`) or the state as the step "
                "returned it; or `replicated=False` if the sharded leaves are not "
                "replicas (their leading axis is then kept)."
            )
        replicated = bool(marks) and all(marks)
    # Python and NumPy scalars beside the arrays are the same on every replica.
    arrays = [(p, x) for p, x in flat if np.ndim(x) > 0 or isinstance(x, jax.Array)]
    if replicated and not all(is_replicated(x) for _, x in arrays):
        raise ValueError(
            "`jdp.export_predictor(replicated=True)`: every array leaf must be laid "
            f"out by `step.replicate`; these are not:{others(arrays)}\nPass "
            "`replicated=False` for one plain copy (e.g. "
            "`step.unreplicate(state.params)`), or the replicated state as the step "
            "returned it."
        )
    params = logical_copy(params) if replicated else params
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)


def _input_specs(inputs: tuple, batch_polymorphic: bool) -> tuple:
    """The `jax.ShapeDtypeStruct`s to export for, a symbolic leading axis if asked."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(inputs)
    if not flat:
        raise ValueError(
            "`jdp.export_predictor`: `example_inputs` has no arrays; pass a tuple "
            "of example arrays, e.g. `(x,)`."
        )
    shapes = [(p, np.shape(x), _dtype(x)) for p, x in flat]
    if not batch_polymorphic:
        specs = [jax.ShapeDtypeStruct(s, d) for _, s, d in shapes]
        return jax.tree_util.tree_unflatten(treedef, specs)
    if scalars := [f"args{keystr(p)}" for p, s, _ in shapes if len(s) == 0]:
        raise ValueError(
            "`jdp.export_predictor(batch_polymorphic=True)` makes every input's "
            f"leading axis the batch axis; these are scalars: {', '.join(scalars)}. "
            "Give them a batch axis or pass `batch_polymorphic=False`."
        )
    if len({s[0] for _, s, _ in shapes}) != 1:
        listed = ", ".join(f"args{keystr(p)}: {s}" for p, s, _ in shapes)
        raise ValueError(
            "`jdp.export_predictor(batch_polymorphic=True)`: every input's leading "
            f"axis is the batch axis, so they must agree; got shapes {listed}. Pass "
            "`batch_polymorphic=False` to export fixed shapes."
        )
    (batch,) = jax_export.symbolic_shape(_BATCH)
    specs = [jax.ShapeDtypeStruct((batch,) + s[1:], d) for _, s, d in shapes]
    return jax.tree_util.tree_unflatten(treedef, specs)


def _dtype(x: Any) -> np.dtype:
    """The dtype JAX gives an example input."""
    return jax.dtypes.canonicalize_dtype(getattr(x, "dtype", None) or np.result_type(x))


def _platforms(platforms: Sequence[str]) -> tuple[str, ...]:
    """`platforms` checked, without repeats, with "gpu" read as "cuda"."""
    platforms = (platforms,) if isinstance(platforms, str) else platforms
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
    """E.g. `float32[batch, 3]`."""
    return f"{aval.dtype}[{', '.join(map(str, aval.shape))}]"


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

    One logical copy of `params` (replica 0's, if a step replicated them) is baked
    in and lowered with `jax.export`, to run on one device without the model's
    code (`jdp.load_predictor`). See the Export guide (docs/guides/export.md).

    Args:
      apply_fn: Inference function `apply_fn(params, *inputs) -> outputs` (any
        pytree of arrays); e.g. `lambda v, x: model.apply(v, x, train=False)`.
      params: Parameters (and other model state such as BatchNorm statistics):
        one plain copy, or replicated by `step.replicate` / returned by a step.
      example_inputs: Tuple of example inputs (arrays or pytrees of arrays); a
        single array is taken as one input. Only shapes and dtypes are used.
      platforms: Platforms to lower for (`"cpu"`, `"cuda"`, `"rocm"`, `"tpu"`).
      batch_polymorphic: Make the leading axis of every input a symbolic batch
        size (every input must then have one, of the same size); False exports
        the example shapes exactly.
      replicated: Whether `params` is replicated; None (default) decides from
        the layout, True requires the replicated layout of every leaf, False
        takes `params` as they are.

    Returns:
      The serialised predictor (bytes), for `jdp.load_predictor` or a file.

    Raises:
      ValueError: If `platforms` names an unknown platform, the inputs do not
        fit `batch_polymorphic`, `params` mixes replicated and plain leaves, or
        `replicated=True` and a leaf is not laid out by `step.replicate`.

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
    single = not isinstance(example_inputs, list | tuple)
    inputs = (example_inputs,) if single else tuple(example_inputs)
    specs = _input_specs(inputs, batch_polymorphic)
    consts = _one_copy(params, replicated)

    def predictor(*args):
        return apply_fn(consts, *args)

    predictor.__name__ = getattr(apply_fn, "__name__", "predictor")
    try:
        exported = jax_export.export(jax.jit(predictor), platforms=platforms)(*specs)
    except Exception as e:  # add what jdp knows; keep JAX's own error type
        if batch_polymorphic and _jax_compat.is_symbolic_dimension_error(e):
            e.add_note(
                "`jdp.export_predictor`: the batch axis was exported as the "
                f"symbolic dimension {_BATCH!r}; if the model needs a concrete "
                "batch size, pass `batch_polymorphic=False`."
            )
        raise
    meta = {
        "jdp_format": FORMAT_VERSION, "jdp": __version__, "jax": jax.__version__,
        "fun_name": exported.fun_name, "platforms": list(exported.platforms),
        "inputs": [_format_aval(a) for a in exported.in_avals],
        "outputs": [_format_aval(a) for a in exported.out_avals],
    }  # fmt: skip
    return _pack(json.dumps(meta).encode(), bytes(exported.serialize()))


def save_predictor(
    path: str | os.PathLike,
    apply_fn: Callable[..., Any],
    params: PyTree,
    example_inputs: Any,
    **kwargs: Any,
) -> None:
    """Writes `jdp.export_predictor(...)`'s bytes to `path`, atomically (by rename).

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
        # mkstemp's file is private (0600): give it a new file's mode, as `open`.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask (read by setting it, then set back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _pack(meta: bytes, payload: bytes) -> bytes:
    """The container: header, JSON metadata, payload (see the export guide)."""
    digest = hashlib.sha256(meta + payload).digest()
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(meta), len(payload), digest)
    return header + meta + payload


def _unpack(data: bytes, source: str) -> tuple[dict, bytes]:
    """The metadata and payload of a container, after checking every field."""
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
    return _parse_metadata(body[:meta_len], prefix), body[meta_len:]


def _parse_metadata(raw: bytes, prefix: str) -> dict:
    """The container's JSON header, checked to be an object with the known keys."""
    where = f"{prefix} has a valid checksum but a bad JSON header"
    fix = "Export the predictor again with `jdp.export_predictor`."
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: {type(e).__name__}: {e}. {fix}") from e
    if not isinstance(meta, dict):
        raise ValueError(
            f"{where}: expected a JSON object, got a JSON {_JSON_NAMES[type(meta)]}. "
            f"{fix}"
        )
    if probs := [
        f"{key!r}: missing"
        if key not in meta
        else f"{key!r}: expected a JSON {_JSON_NAMES[kind]}, got a JSON "
        f"{_JSON_NAMES[type(meta[key])]}"
        for key, kind in _METADATA_KEYS.items()
        if not isinstance(meta.get(key), kind)
    ]:
        raise ValueError(f"{where}:{format_problems(probs)}\n{fix}")
    return meta


def _fits(dtype: np.dtype, shape: tuple, aval: Any, bound: dict) -> bool:
    """Whether `dtype` and `shape` fit `aval`; a symbolic size binds at first use."""
    if dtype != aval.dtype or len(shape) != len(aval.shape):
        return False
    ok = True
    for got, want in zip(shape, aval.shape, strict=True):
        if isinstance(want, int):
            ok &= got == want
        else:
            ok &= got >= 1 and bound.setdefault(str(want), got) == got
    return ok


class Predictor:
    """A loaded predictor: call it with the inputs, as `apply_fn` without `params`.

    Made by `jdp.load_predictor`. Inputs are checked against the exported shapes
    and dtypes before the call; the first call for each batch size compiles.

    Attributes:
      exported: The `jax.export.Exported` function.
      input_specs: The expected inputs, e.g. `("float32[batch, 28, 28, 1]",)`;
        `batch` is the symbolic batch size.
      platforms: The platforms it was exported for.
      metadata: The container's metadata (jdp and jax versions, inputs, outputs).
      sha256: SHA-256 of the bytes it was loaded from, as 64 hex digits, to
        publish for `jdp.load_predictor(..., expected_sha256=...)`; or None.
    """

    def __init__(self, exported: jax_export.Exported, metadata: dict, *, sha256=None):
        self.exported, self.metadata, self.sha256 = exported, metadata, sha256
        self.platforms = tuple(exported.platforms)
        self.input_specs = tuple(_format_aval(a) for a in exported.in_avals)
        self._args_tree = exported.in_tree.children()[0]
        self._call = jax.jit(exported.call)

    def _expected(self) -> str:
        """The sentence listing the expected inputs, for error messages."""
        numbered = self._args_tree.unflatten(range(self._args_tree.num_leaves))
        flat = jax.tree_util.tree_flatten_with_path(numbered)[0]
        listed = ", ".join(f"args{keystr(p)}: {self.input_specs[i]}" for p, i in flat)
        fixed = all(isinstance(d, int) for a in self.exported.in_avals for d in a.shape)
        note = (
            f" ({_BATCH!r} is the batch size: any size >= 1, the same for every input)"
        )
        return f"Expected inputs: {listed}{'' if fixed else note}."

    def _check(self, inputs: tuple) -> list:
        """`inputs` checked against the exported ones and cast to their dtypes."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(inputs)
        tree = self._args_tree
        if treedef != tree:
            num = len(tree.children())
            what = f"inputs structured as {treedef}; it was exported for {tree}"
            if len(inputs) != num:
                what = f"{len(inputs)} input(s); it was exported for {num}"
            raise ValueError(f"Predictor called with {what}. {self._expected()}")
        arrays = [x if isinstance(x, jax.Array) else np.asarray(x) for _, x in flat]
        avals = self.exported.in_avals
        probs = [
            f"args{keystr(path)}: got {_kind(x)} of dtype {a.dtype} and shape "
            f"{a.shape}, expected {_format_aval(aval)}"
            for (path, x), a, aval in zip(flat, arrays, avals, strict=True)
            if a.dtype != aval.dtype
            and not jax.numpy.issubdtype(a.dtype, np.number)
            and not jax.numpy.issubdtype(a.dtype, np.bool_)
        ]
        if probs:
            raise TypeError(
                "Predictor inputs must be numeric (or boolean) arrays; these are "
                f"not:{format_problems(probs)}\n{self._expected()} Turn text into "
                "numbers (e.g. token ids) first."
            )
        leaves, bound = [], {}
        for (path, _), x, aval in zip(flat, arrays, avals, strict=True):
            dtype, shape = jax.dtypes.canonicalize_dtype(x.dtype), tuple(x.shape)
            if not _fits(dtype, shape, aval, bound):
                probs.append(
                    f"args{keystr(path)}: got {dtype}{list(shape)}, expected "
                    f"{_format_aval(aval)}"
                )
            elif x.dtype != aval.dtype:
                x = x.astype(aval.dtype)
            leaves.append(x)
        if probs:
            raise ValueError(
                "Predictor inputs do not match the exported shapes/dtypes:"
                f"{format_problems(probs)}\n{self._expected()}"
            )
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def __call__(self, *inputs: Any) -> Any:
        """Runs the predictor on `inputs` (arrays, as given to `apply_fn`).

        Raises:
          TypeError: If an input is not numeric or boolean (e.g. a str or an
            array of strings); the message names it and the expected inputs.
          ValueError: If the inputs' number, structure, shapes or dtypes differ
            from the exported ones; the message lists the expected inputs.
        """
        return self._call(*self._check(inputs))

    def __repr__(self) -> str:
        return (
            f"Predictor({self.exported.fun_name}, inputs={list(self.input_specs)}, "
            f"platforms={self.platforms})"
        )


def _check_sha256(expected_sha256: Any) -> str | None:
    """`expected_sha256` as 64 lower-case hex digits (or None), checked."""
    if expected_sha256 is None:
        return None
    if not isinstance(expected_sha256, str):
        raise TypeError(
            "`jdp.load_predictor`: `expected_sha256` must be a str of 64 hex digits "
            f"(`hashlib.sha256(data).hexdigest()`), got a "
            f"{type(expected_sha256).__name__}: {expected_sha256!r:.80}."
        )
    digest = expected_sha256.strip().lower()
    if len(digest) != 64 or not set(digest) <= _HEX:
        raise ValueError(
            "`jdp.load_predictor`: `expected_sha256` must be 64 hex digits (a "
            f"SHA-256 `hexdigest()`), got {expected_sha256!r:.80} "
            f"({len(expected_sha256)} characters)."
        )
    return digest


def load_predictor(
    path_or_bytes: str | os.PathLike | bytes, *, expected_sha256: str | None = None
) -> Predictor:
    """Loads a predictor written by `jdp.save_predictor` / `jdp.export_predictor`.

    Loading runs the code inside: load only files you trust. The header's
    SHA-256 is a checksum against damage, not a signature: to detect tampering,
    pass `expected_sha256`, got through a channel you trust.

    Args:
      path_or_bytes: A file path, or the bytes `jdp.export_predictor` returned.
      expected_sha256: Optional SHA-256 of the whole file, as 64 hex digits
        (`hashlib.sha256(data).hexdigest()`; upper case is accepted), checked
        before anything in the file is read.

    Returns:
      A `Predictor`: `predict(*inputs) -> outputs`.

    Raises:
      TypeError: If `expected_sha256` is not a str.
      ValueError: If `expected_sha256` is not 64 hex digits or the data does not
        hash to it; or if the data is not a jdp predictor, is truncated or
        corrupted, has a bad JSON header, is of another format version, or was
        not exported for this process's platform.
      FileNotFoundError: If the path does not exist.

    Example:
      >>> import hashlib, numpy as np, jdp
      >>> x = np.ones(3, np.float32)
      >>> blob = jdp.export_predictor(lambda p, x: x * p, 2.0, (x,))
      >>> digest = hashlib.sha256(blob).hexdigest()  # publish it with the file
      >>> predict = jdp.load_predictor(blob, expected_sha256=digest)
      >>> predict(np.arange(3, dtype=np.float32))
      Array([0., 2., 4.], dtype=float32)
      >>> predict.sha256 == digest
      True
      >>> jdp.load_predictor(blob + b"x", expected_sha256=digest)
      Traceback (most recent call last):
      ...
      ValueError: `jdp.load_predictor`: the data given has SHA-256 ..., expected ...
    """
    expected = _check_sha256(expected_sha256)
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data, source = bytes(path_or_bytes), "the data given"
    else:
        path = os.fspath(path_or_bytes)
        with open(path, "rb") as f:
            data = f.read()
        source = f"file {path!r}"
    sha256 = hashlib.sha256(data).hexdigest()
    if expected is not None and not hmac.compare_digest(sha256, expected):
        raise ValueError(
            f"`jdp.load_predictor`: {source} has SHA-256 {sha256}, expected "
            f"{expected}: it was changed or damaged. Nothing in it was read; get the "
            "file again from a source you trust."
        )
    meta, payload = _unpack(data, source)
    try:
        exported = jax_export.deserialize(bytearray(payload))
    except Exception as e:
        raise ValueError(
            f"`jdp.load_predictor`: {source} passed its checksum but jax "
            f"{jax.__version__} could not deserialize it (written with jax "
            f"{meta.get('jax')}): {type(e).__name__}: {e}"
        ) from e
    if (here := jax_export.default_export_platform()) not in exported.platforms:
        raise ValueError(
            f"`jdp.load_predictor`: {source} was exported for platforms "
            f"{tuple(exported.platforms)}, but this process runs on {here!r}. "
            f"Export with `platforms=(..., {here!r})`."
        )
    return Predictor(exported, meta, sha256=sha256)
