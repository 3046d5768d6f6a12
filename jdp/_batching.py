"""Private: `step.shard`, which checks, pads and places a batch in a backend's layout.

`jdp.distributed` plugs in the processes' agreement (`use_process_agreement`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import weakref
from collections.abc import Callable
from queue import Full, Queue
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jdp import _validate
from jdp._layout import host_value, misplaced
from jdp._tree import PyTree, format_problems, keystr

NOT_SHARDED_MSG = (
    "`step`: the batch passed in was not placed by this step's `step.shard`. "
    "Offending leaves:{probs}\nFix: `step(state, step.shard(global_batch))`, "
    "or iterate over `step.prefetch(batches)` (instead of flax's "
    "`prefetch_to_device`).{hint}"
)
FLAX_SHARD_HINT = (
    " Every leaf listed has a leading axis of {n}, the number of local devices: "
    "if the batch went through flax's `common_utils.shard`, leave that out and "
    "give `step.shard` the global batch, (examples, ...)."
)

#: Batch leaves placed by `step.shard`, by id: the backend whose layout they have.
_LAYOUT_OF: dict[int, tuple[weakref.ref, str]] = {}

OTHER_LAYOUT_MSG = (
    "`step`: the batch was laid out by the `step.shard` of a {other!r} step, "
    "but this step runs on {mine!r} ({why}). Offending leaves:{probs}\nFix: "
    "place the batch with this step's own `step.shard(global_batch)`."
)
_WHY = {
    "pmap": "a pmap batch is (num_replicas, examples per replica, ...); this step "
    "would see an extra axis",
    "shard_map": "a shard_map batch is (examples, ...); this step needs the "
    "replica axis first",
}


def remember_layout(arrays: list[jax.Array], backend: str) -> None:
    """Records that `arrays` were placed in `backend`'s batch layout."""
    for x in arrays:
        key = id(x)
        ref = weakref.ref(x, lambda _, key=key: _LAYOUT_OF.pop(key, None))
        _LAYOUT_OF[key] = (ref, backend)


def check_placed(batch: PyTree, backend) -> None:
    """Refuses a batch not placed for `backend` (a `_backends.Backend`)."""
    if probs := misplaced(batch, backend.sharding, leading=None):
        n = len(backend.mesh.local_devices)
        shapes = [
            np.shape(x)
            for x in jax.tree.leaves(batch)
            if not (isinstance(x, jax.Array) and x.sharding == backend.sharding)
        ]
        flax_like = n > 1 and all(len(s) >= 2 and s[0] == n for s in shapes)
        hint = FLAX_SHARD_HINT.format(n=n) if flax_like else ""
        raise ValueError(
            NOT_SHARDED_MSG.format(probs=format_problems(probs), hint=hint)
        )
    check_layout(batch, backend.name)
    if probs := backend.batch_problems(batch):
        raise ValueError(NOT_SHARDED_MSG.format(probs=format_problems(probs), hint=""))


def check_layout(batch: PyTree, backend: str) -> None:
    """Refuses a batch that `step.shard` laid out for the other backend."""
    if not _LAYOUT_OF:
        return
    other = []
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        entry = _LAYOUT_OF.get(id(x))
        if entry is not None and entry[0]() is x and entry[1] != backend:
            other.append((keystr(path), entry[1]))
    if other:
        kind, probs = other[0][1], format_problems([p for p, _ in other])
        why = _WHY[kind]
        raise ValueError(
            OTHER_LAYOUT_MSG.format(other=kind, mine=backend, why=why, probs=probs)
        )


class ProcessAgreement(Protocol):
    """How `shard` checks that the processes' batches agree (`jdp.distributed`)."""

    def agree(
        self, host: list, *, pad: bool, pad_to: int | None, num_local: int
    ) -> int | None:
        """Compares this process's `(path, array)` leaves: ValueError if they differ.

        Returns the padded per-process size, with `pad` and no `pad_to` (else
        None); RuntimeError where the batches cannot be compared.
        """

    def count_only(self) -> None:
        """Counts a call that failed its own checks, so the processes' counts agree."""


_agreement: ProcessAgreement | None = None


def use_process_agreement(agreement: ProcessAgreement) -> None:
    """Makes `shard` compare the processes' batches through `agreement`."""
    global _agreement
    _agreement = agreement


def padded_size(size: int, num_local: int) -> int:
    """`size` rounded up to a multiple of `num_local` (at least `num_local`)."""
    return max(num_local, math.ceil(size / num_local) * num_local)


def shard(batch: PyTree, *, pad: bool, pad_to: int | None, backend):
    """`Parallel.shard` on `backend` (a `_backends.Backend`)."""
    num_local, num_replicas = len(backend.mesh.local_devices), backend.mesh.size
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    several = jax.process_count() > 1
    try:
        if not flat:
            raise ValueError("`step.shard`: the batch has no array leaves.")
        host = [(path, _host_leaf(path, x, num_replicas)) for path, x in flat]
        if pad_to is not None:
            per_process = _local_pad_to(pad_to, pad, num_replicas)
    except (TypeError, ValueError):
        # The call still counts, so that the processes' counts agree.
        if several and _agreement is not None:
            _agreement.count_only()
        raise
    padded = None
    if several:
        if _agreement is None:
            raise RuntimeError(
                "`step.shard` across processes compares the processes' batches "
                "through `jdp.distributed`, which was not imported: import "
                "`jdp.distributed` and call `jdp.distributed.initialize()` first."
            )
        padded = _agreement.agree(host, pad=pad, pad_to=pad_to, num_local=num_local)
    if pad_to is not None:
        padded = per_process
    if pad:
        host, mask = _pad(host, padded, num_local)
        host.append(("mask", mask))
    else:
        _check_divisible(host, num_local, num_replicas)
    leaves = [backend.place_batch_leaf(x) for _, x in host]
    remember_layout(leaves, backend.name)
    placed = jax.tree_util.tree_unflatten(treedef, leaves[: len(flat)])
    return (placed, leaves[-1]) if pad else placed


def _host_leaf(path, x, num_replicas: int) -> np.ndarray:
    """A batch leaf as the NumPy array JAX would place; no strings, no wrap-around."""
    raw = x if isinstance(x, jax.Array) else np.asarray(x)
    if jnp.issubdtype(raw.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"`step.shard`: batch leaf {keystr(path)} holds PRNG keys, which are "
            "not split over replicas as values. Pass their bits, "
            "`jax.random.key_data(keys)`, and rebuild them in the step with "
            "`jax.random.wrap_key_data(bits)`; or draw per-replica keys in the "
            "step with `jdp.replica_key`."
        )
    # bfloat16 and the float8 types are kind "V" (NumPy's structured kind) too.
    kind = raw.dtype.kind
    if kind in "USO" or (kind == "V" and not jnp.issubdtype(raw.dtype, jnp.number)):
        raise TypeError(
            f"`step.shard`: batch leaf {keystr(path)} holds {raw.dtype} values "
            "(strings or Python objects); only numeric arrays can be placed on "
            "devices. Turn them into numbers first (e.g. token ids), or keep them "
            "on the host beside the batch."
        )
    value = host_value(x)
    if raw.dtype.kind in "iu" and value.dtype != raw.dtype and raw.size:
        info = np.iinfo(value.dtype)
        low, high = raw.min(), raw.max()
        if low < info.min or high > info.max:
            bad = high if high > info.max else low
            raise ValueError(
                f"`step.shard`: batch leaf {keystr(path)} holds {raw.dtype} values "
                f"such as {bad}, which do not fit {value.dtype} (JAX's integer "
                "type without `jax_enable_x64`) and would wrap around. Map them "
                f"into [{info.min}, {info.max}] (e.g. hash ids into the table), or "
                "enable 64-bit types with `jax.config.update('jax_enable_x64', "
                "True)`."
            )
    if value.ndim == 0:
        raise ValueError(
            f"`step.shard`: leaf {keystr(path)} is a scalar; every batch leaf "
            "needs a leading example axis to split across "
            f"num_replicas={num_replicas}."
        )
    return value


def _batch_size(host) -> int:
    """The number of examples every leaf holds (at least one)."""
    sizes = {x.shape[0] for _, x in host}
    if len(sizes) > 1:
        listed = ", ".join(f"{keystr(p)}: {x.shape[0]}" for p, x in host[:5])
        raise ValueError(
            "`step.shard`: the batch leaves hold different numbers of examples "
            f"(leading sizes {listed}); each replica would pair the wrong rows. "
            "Give every leaf one leading batch size (examples)."
        )
    if sizes == {0}:
        listed = ", ".join(f"{keystr(p)}: shape {x.shape}" for p, x in host[:5])
        raise ValueError(
            f"`step.shard`: the batch is empty ({listed}): a step on it would "
            "average over no examples. Skip empty batches (e.g. the last one of a "
            "data set whose size is a multiple of the batch size)."
        )
    return sizes.pop()


def _local_pad_to(pad_to: int, pad: bool, num_replicas: int) -> int:
    """This process's share of `pad_to`, checked."""
    _validate.positive_int("pad_to", pad_to, allow_none=True)
    if not pad:
        raise ValueError(
            "`step.shard(pad_to=...)` pads, so it needs `pad=True` (which also "
            "returns the mask of real examples)."
        )
    if pad_to % num_replicas:
        raise ValueError(
            f"`step.shard`: `pad_to={pad_to}` must be a multiple of "
            f"num_replicas={num_replicas}, so that every replica gets as many "
            "examples."
        )
    return pad_to // jax.process_count()


def _pad(host, padded_everywhere: int | None, num_local: int):
    size = _batch_size(host)
    padded = padded_everywhere or padded_size(size, num_local)
    if padded < size:
        raise ValueError(
            f"`step.shard`: the batch holds {size} examples on this process, more "
            f"than `pad_to` allows ({padded} per process). Split it, or raise "
            "`pad_to` to the largest global batch."
        )
    if padded > size:
        host = [(p, np.concatenate([x, _padding(x, padded - size)])) for p, x in host]
    return host, np.arange(padded) < size


def _padding(x: np.ndarray, extra: int) -> np.ndarray:
    """The rows `pad=True` appends: zeros for integers, else copies of the last row."""
    if x.dtype.kind in "iub":
        return np.zeros((extra,) + x.shape[1:], x.dtype)
    return np.repeat(x[-1:], extra, axis=0)


def _check_divisible(host, num_local: int, num_replicas: int) -> None:
    size = _batch_size(host)
    if size % num_local:
        where = f"num_replicas={num_local}"
        if num_local != num_replicas:
            where = (
                f"this process's {num_local} replicas (num_replicas={num_replicas} "
                f"over {jax.process_count()} processes)"
            )
        raise ValueError(
            f"`step.shard`: leaf {keystr(host[0][0])} has leading size "
            f"{size}, which is not divisible by {where}. Use a batch "
            f"that is a multiple of {num_local}, or call "
            "`step.shard(batch, pad=True)` to pad it and get a mask."
        )


_DONE = object()


def prefetch(iterable, *, size: int, place: Callable[[Any], Any]):
    """Yields `place(batch)` for each batch, placing up to `size` batches ahead.

    With several processes on the calling thread (see the multi-host guide).
    """
    _validate.positive_int("size", size)
    if jax.process_count() > 1:
        ahead = collections.deque()
        for batch in iterable:
            ahead.append(place(batch))
            if len(ahead) > size:
                yield ahead.popleft()
        yield from ahead
        return
    queue: Queue = Queue(maxsize=size)
    stop = threading.Event()

    def put(item) -> bool:
        """Puts `item` once there is room; False if the consumer stopped first."""
        while not stop.is_set():
            with contextlib.suppress(Full):
                queue.put(item, timeout=0.1)
                return True
        return False

    def fill():
        try:
            for batch in iterable:
                if not put(place(batch)):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, raised there
            put(e)

    threading.Thread(target=fill, name="jdp-prefetch", daemon=True).start()
    try:
        while (item := queue.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
