"""Private: `step.shard`, splitting a global batch across replicas.

With several processes each process passes its own share of the global batch;
the processes' sizes, structures, dtypes and padding are compared through JAX's
coordination service, because a mismatch would otherwise train on misaligned
data without an error. A process waits for that comparison only when its batch's
shapes change (or it pads to the largest batch); in a steady loop each call only
counts itself, in one round trip to the service (see `_ProcessCheck`).
"""

from __future__ import annotations

import collections
import math
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from queue import Full, Queue
from typing import Any

import jax
import numpy as np

from jdp import _coordination, _validate
from jdp._layout import host_value, misplaced
from jdp._tree import format_problems, keystr

PyTree = Any

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


def placed_for_other(batch: PyTree, backend: str) -> list[tuple[str, str]]:
    """`(path, backend)` of leaves `step.shard` laid out for another backend."""
    found = []
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        entry = _LAYOUT_OF.get(id(x))
        if entry is not None and entry[0]() is x and entry[1] != backend:
            found.append((keystr(path), entry[1]))
    return found


def check_placed(batch: PyTree, backend) -> None:
    """Refuses a batch not placed for `backend` (a `_backends.Backend`)."""
    probs = misplaced(batch, backend.sharding, leading=None)
    if probs:
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
    probs = backend.batch_problems(batch)
    if probs:
        raise ValueError(NOT_SHARDED_MSG.format(probs=format_problems(probs), hint=""))


def check_layout(batch: PyTree, backend: str) -> None:
    """Refuses a batch that `step.shard` laid out for the other backend."""
    if not _LAYOUT_OF:
        return
    other = placed_for_other(batch, backend)
    if other:
        raise ValueError(
            OTHER_LAYOUT_MSG.format(
                other=other[0][1],
                mine=backend,
                why=_WHY[other[0][1]],
                probs=format_problems([p for p, _ in other]),
            )
        )


def padded_size(size: int, num_local: int) -> int:
    """`size` rounded up to a multiple of `num_local` (at least `num_local`)."""
    return max(num_local, math.ceil(size / num_local) * num_local)


def shard(
    batch: PyTree,
    *,
    pad: bool,
    pad_to: int | None = None,
    num_local: int,
    num_replicas: int,
    place_leaf: Callable[[np.ndarray], jax.Array],
    backend: str,
):
    """Places a (process-local) batch for a step; see `Parallel.shard`.

    Args:
      batch: Pytree of arrays whose leading axis is the example axis.
      pad: Pad to a multiple of the local replica count and return a mask.
      pad_to: With `pad`, the global batch size to pad to (split evenly
        between processes).
      num_local: Replicas on this process.
      num_replicas: Replicas in all.
      place_leaf: Places one host leaf (the backend's batch layout).
      backend: The backend's name, remembered with the placed leaves.

    Returns:
      The placed batch, or `(batch, mask)` when `pad`.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    several = jax.process_count() > 1
    try:
        host = _host_leaves(flat, num_replicas)
        if pad_to is not None:
            per_process = _local_pad_to(pad_to, pad, num_replicas)
    except (TypeError, ValueError):
        if several:  # the call still counts, so that the processes' counts agree
            _PROCESS_CHECK.count_only()
        raise
    padded_everywhere = None
    if several:
        padded_everywhere = _check_process_batches(
            host, pad=pad, pad_to=pad_to, num_local=num_local
        )
    if pad_to is not None:
        padded_everywhere = per_process
    mask = None
    if pad:
        host, mask = _pad(host, padded_everywhere, num_local)
    else:
        _check_sizes(host)
        _check_divisible(host, num_local, num_replicas)
    leaves = [place_leaf(x) for _, x in host]
    remember_layout(leaves, backend)
    placed = jax.tree_util.tree_unflatten(treedef, leaves)
    if pad:
        placed_mask = place_leaf(mask)
        remember_layout([placed_mask], backend)
        return placed, placed_mask
    return placed


def _host_leaves(flat, num_replicas: int) -> list:
    """`(path, NumPy array)` of every batch leaf, checked (see `_host_leaf`)."""
    if not flat:
        raise ValueError("`step.shard`: the batch has no array leaves.")
    host = [(path, _host_leaf(path, x)) for path, x in flat]
    for path, x in host:
        if x.ndim == 0:
            raise ValueError(
                f"`step.shard`: leaf {keystr(path)} is a scalar; every batch leaf "
                "needs a leading example axis to split across "
                f"num_replicas={num_replicas}."
            )
    return host


def _host_leaf(path, x) -> np.ndarray:
    """A batch leaf as the NumPy array JAX would place, checked for what JAX cannot.

    Strings and objects cannot be placed; integers wider than JAX's default types
    (without `jax_enable_x64`) would wrap around silently.
    """
    raw = x if isinstance(x, jax.Array) else np.asarray(x)
    if raw.dtype.kind in "USOV":
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
    return value


def _check_sizes(host) -> None:
    """Every leaf must hold the same number of examples, and at least one."""
    sizes = {x.shape[0] for _, x in host}
    if len(sizes) > 1:
        listed = ", ".join(f"{keystr(p)}: {x.shape[0]}" for p, x in host[:5])
        raise ValueError(
            "`step.shard`: the batch leaves hold different numbers of examples "
            f"(leading sizes {listed}); each replica would pair the wrong rows. "
            "Give every leaf the same leading (example) size."
        )
    if sizes == {0}:
        raise ValueError(_empty_message(host))


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
    sizes = {x.shape[0] for _, x in host}
    if len(sizes) != 1:
        listed = ", ".join(f"{keystr(p)}: {x.shape[0]}" for p, x in host[:5])
        raise ValueError(
            "`step.shard(pad=True)`: all leaves must share one leading batch "
            f"size to be padded; got {listed}."
        )
    size = sizes.pop()
    padded = padded_everywhere or padded_size(size, num_local)
    if padded < size:
        raise ValueError(
            f"`step.shard`: the batch holds {size} examples on this process, more "
            f"than `pad_to` allows ({padded} per process). Split it, or raise "
            "`pad_to` to the largest global batch."
        )
    extra = padded - size
    if extra:
        if size == 0:
            raise ValueError(_empty_message(host))
        host = [(p, np.concatenate([x, _padding(x, extra)])) for p, x in host]
    return host, np.arange(padded) < size


def _padding(x: np.ndarray, extra: int) -> np.ndarray:
    """The rows `pad=True` appends: zeros for integers, else copies of the last.

    Integer leaves are ids (tokens, labels), whose 0 is padding by convention:
    a padded row then counts for nothing in a loss or metric weighted by
    `inputs > 0`. Other leaves repeat the last real row, a valid input for any
    model (zeros could divide by zero, and a NaN in a padded row would spoil a
    masked sum).
    """
    if x.dtype.kind in "iub":
        return np.zeros((extra,) + x.shape[1:], x.dtype)
    return np.repeat(x[-1:], extra, axis=0)


def _empty_message(host) -> str:
    listed = ", ".join(f"{keystr(p)}: shape {x.shape}" for p, x in host[:5])
    return (
        f"`step.shard`: the batch is empty ({listed}): a step on it would average "
        "over no examples. Skip empty batches (e.g. the last one of a data set "
        "whose size is a multiple of the batch size)."
    )


def _check_divisible(host, num_local: int, num_replicas: int) -> None:
    for path, x in host:
        if x.shape[0] % num_local:
            where = (
                f"num_replicas={num_local}"
                if num_local == num_replicas
                else f"this process's {num_local} replicas "
                f"(num_replicas={num_replicas} over "
                f"{jax.process_count()} processes)"
            )
            raise ValueError(
                f"`step.shard`: leaf {keystr(path)} has leading size "
                f"{x.shape[0]}, which is not divisible by {where}. Use a batch "
                f"that is a multiple of {num_local}, or call "
                "`step.shard(batch, pad=True)` to pad it and get a mask."
            )


#: Keys in JAX's coordination service (see `_ProcessCheck`): per process, the
#: counter of its calls and its last compared rows; per call, every process's
#: row where they disagreed.
_CALLS_KEY = "jdp/step.shard/calls/"
_ROWS_KEY = "jdp/step.shard/rows/"
_ERROR_KEY = "jdp/step.shard/error/"
#: The store's counters are 32-bit: a process's counter holds its calls modulo
#: `_FLAG`, plus `_FLAG` for each disagreement reported to it and not yet taken
#: off (which it does at its next call).
_FLAG = 1 << 22
#: Every process compares at the calls that are multiples of this, which keeps
#: any two processes within this many calls of each other: counts modulo
#: `_FLAG` then still tell whether a process has reached a call.
_REFRESH = 1 << 20
#: Compared rows each process keeps published (2 would do: see `_ProcessCheck`).
_KEEP_ROWS = 4
#: Longest pause between two reads while waiting for the other processes.
_POLL_S = 0.02


def _encode(entries) -> str:
    """`[(call, row)]` as text for the store (rows are tuples of ints)."""
    return " ".join(f"{c}:" + ",".join(map(str, row)) for c, row in entries)


def _decode(value: str) -> list:
    entries = []
    for item in value.split():
        call, _, row = item.partition(":")
        entries.append((int(call), tuple(int(v) for v in row.split(","))))
    return entries


def _by_number(pairs) -> dict:
    """`{n: value}` from a directory read of the store (keys ending in `/n`)."""
    found = {}
    for key, value in pairs:
        tail = key.rstrip("/").rpartition("/")[2]
        if tail.isdigit():
            found[int(tail)] = value
    return found


def reached(counter: int, call: int) -> bool:
    """Whether a process whose counter reads `counter` has made call `call`.

    Example:
      >>> from jdp._batching import reached, _FLAG
      >>> reached(5, 4), reached(5, 5), reached(3 * _FLAG + 5, 4)
      (True, False, True)
      >>> reached(1, _FLAG), reached(_FLAG - 1, _FLAG)  # counts wrap around
      (True, False)
    """
    return (counter - (call + 1)) % _FLAG < _FLAG // 2


def row_at(entries, call: int):
    """The row in force at `call`, from a process's `(call, row)` entries.

    Example:
      >>> from jdp._batching import row_at
      >>> row_at([(0, (8,)), (5, (6,))], 4), row_at([(0, (8,)), (5, (6,))], 5)
      ((8,), (6,))
    """
    found = None
    for c, row in entries:
        if c > call:
            break
        found = row
    return found


def mismatch(rows) -> str | None:
    """What the processes' rows disagree on: "layout", "pad", "pad_to", "sizes".

    A row is `(fewest examples, most examples, layout checksum, pad, local
    replicas, pad_to or 0)`. Sizes may differ when the processes pad.

    Args:
      rows: One row per process.

    Returns:
      The first field that differs, or None if the rows agree.

    Example:
      >>> from jdp._batching import mismatch
      >>> mismatch([(8, 8, 7, 1, 1, 0), (5, 5, 7, 1, 1, 0)]) is None
      True
      >>> mismatch([(8, 8, 7, 0, 1, 0), (5, 5, 7, 0, 1, 0)])
      'sizes'
    """
    for name, column in (("layout", 2), ("pad", 3), ("pad_to", 5)):
        if len({row[column] for row in rows}) > 1:
            return name
    if not rows[0][3] and len({n for row in rows for n in row[:2]}) > 1:
        return "sizes"
    return None


class _ProcessCheck:
    """The cross-process batch check, made by the calling thread (no thread).

    It reads and writes the key-value store of JAX's coordination service (which
    `jdp.distributed.initialize` set up), not the devices.

    Every process makes the same `shard` calls in the same order, so a call has
    the same index `n` on every process. In the store, process `p` keeps a
    counter `calls/p` (its calls, plus `_FLAG` for each disagreement reported to
    it) and `rows/p`, its last few compared `(call, row)`; `error/n` holds every
    process's row at a call `n` where they disagreed. At its call `n`, `p`:

    1. compares if its row changed (its first call, a call after an error, new
       shapes, ...), if it pads to the largest batch (`pad=True` without
       `pad_to`), or if `n` is a multiple of `_REFRESH`: it then appends
       `(n, row)` to `rows/p` (one write);
    2. always adds 1 to `calls/p` (less the flags it saw at its last call), one
       round trip that answers the counter's value: a steady loop costs this
       alone, and never waits;
    3. when it compares: waits until every counter shows call `n` made, reads
       every `rows/q` (the row of `q` at `n` is its last entry at or before `n`)
       and raises if they disagree. The first process that compared then writes
       `error/n` and adds `_FLAG` to the counter of each process that did not
       compare (unless that process has not counted a call since its last flag
       from this process, which keeps the counters small);
    4. when the counter it read in step 2 holds a flag, raises the earliest
       disagreement in `error/` that it has not raised yet.

    Every disagreement is found: at the first call at which the rows differ,
    some process's row changed (or it is call 0), and that process compares;
    the processes that did not compare raise at their next call; each process
    that raised compares again at its next call. Nothing deadlocks: a process
    waits only for the others to make the call it is at, and each of them gets
    there without waiting for it (a process waits at an earlier call only for
    processes that made that call, and a device collective that follows call
    `n` in the program comes after call `n` on every process). The row of `q` at
    `n` is still in `rows/q` when `p` reads it: `q` compares at most once past
    `n` while `p` waits at `n` (it then waits there for `p`).
    """

    def __init__(self, *, client=None, process: tuple[int, int] | None = None):
        """A check for this process.

        Args:
          client: A key-value store to use instead of the coordination
            service's client (for tests).
          process: `(index, count)` to use instead of JAX's process index and
            count (for tests).
        """
        self._given_client = client
        self._process = process
        self._reset(None)

    def _index(self) -> int:
        return jax.process_index() if self._process is None else self._process[0]

    def _count(self) -> int:
        return jax.process_count() if self._process is None else self._process[1]

    def _reset(self, client) -> None:
        self.client = client
        self.calls = 0  # `shard` calls so far (in multi-process mode)
        self.last = None  # this process's last row
        self.entries: list = []  # its last compared (call, row), as published
        self.held = 0  # flags in its counter, seen and not yet taken off
        self.flagged: dict = {}  # process -> its count when last flagged by this one
        self.reported = -1  # the last call whose disagreement it has raised
        self.pending = None  # (call, rows) reported by another process, to raise
        self.waits = 0  # calls that waited for the other processes

    def _client(self):
        client = self._given_client or _coordination.client()
        if client is None:
            raise RuntimeError(
                "`step.shard` across processes compares the processes' batches "
                "through JAX's coordination service, which is not running: call "
                "`jdp.distributed.initialize()` first."
            )
        if client is not self.client:
            self._reset(client)
        return client

    def check(self, row: tuple, *, need_sizes: bool):
        """Counts this call, with `row`; compares it when it must (see the class).

        Args:
          row: This process's row at this call.
          need_sizes: Compare even if the row did not change (to agree on the
            largest size).

        Returns:
          `(call, rows)`: every process's row at this call when this process
          compared, or at an earlier call (`call` < this call) at which another
          process found a disagreement; None otherwise.
        """
        client = self._client()
        call = self.calls
        self.calls += 1
        compare = need_sizes or row != self.last or call % _REFRESH == 0
        self.last = row
        if compare:
            self.entries = [*self.entries, (call, row)][-_KEEP_ROWS:]
            client.key_value_set(
                f"{_ROWS_KEY}{self._index()}",
                _encode(self.entries),
                allow_overwrite=True,
            )
        self._arrive(client)
        now = None
        if compare:
            self.waits += 1
            now = (call, self._rows_at(client, call))
            if mismatch(now[1]) is not None:
                self.pending = None  # this call raises already
                return now
        late, self.pending = self.pending, None
        return late or now

    def count_only(self) -> None:
        """Counts a call that failed its own checks (the next call compares)."""
        try:
            client = self._client()
        except RuntimeError:  # no service: the caller's own error says enough
            return
        self.calls += 1
        self.last = None
        self._arrive(client)

    def forget_last(self) -> None:
        """Makes the next call compare (after a disagreement)."""
        self.last = None

    @property
    def late(self):
        """A disagreement another process reported and this one has not raised.

        Reads this process's counter (one round trip) unless one is known.
        """
        if self.pending is None and self.client is not None and self.calls:
            key = f"{_CALLS_KEY}{self._index()}"
            self._note_flags(self.client, int(self.client.key_value_try_get(key)))
        return self.pending

    def _arrive(self, client) -> None:
        """Counts this call in the store; takes off the flags seen, notes new ones."""
        one = 1 if self.calls % _FLAG else 1 - _FLAG  # the count wraps around
        key = f"{_CALLS_KEY}{self._index()}"
        counter = client.key_value_increment(key, one - _FLAG * self.held)
        self.held = 0
        self._note_flags(client, counter)

    def _note_flags(self, client, counter: int) -> None:
        flags = counter // _FLAG
        if flags > self.held:  # a new one: read what was reported
            records = _by_number(client.key_value_dir_get(_ERROR_KEY))
            found = {
                call: [tuple(int(v) for v in r.split(",")) for r in value.split()]
                for call, value in records.items()
                if call > self.reported
            }
            if found and self.pending is None:
                self.pending = (min(found), found[min(found)])
            self.reported = max([self.reported, *found])
        self.held = flags

    def _rows_at(self, client, call: int) -> list:
        """Waits until every process has made `call`; their rows there.

        Reports a disagreement to the processes that did not compare at `call`.
        """
        num = self._count()
        pause = 0.0005
        while True:
            read = _by_number(client.key_value_dir_get(_CALLS_KEY))
            counters = {p: int(v) for p, v in read.items()}
            if all(p in counters and reached(counters[p], call) for p in range(num)):
                break
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S)
        found = _by_number(client.key_value_dir_get(_ROWS_KEY))
        every = [_decode(found.get(p, "")) for p in range(num)]
        rows = [row_at(entries, call) for entries in every]
        if any(row is None for row in rows):  # pragma: no cover - see the class
            raise RuntimeError(
                f"`step.shard`: lost track of the processes' batches at call {call}."
            )
        compared = [p for p, e in enumerate(every) if any(c == call for c, _ in e)]
        if mismatch(rows) is not None and compared[0] == self._index():
            client.key_value_set(
                f"{_ERROR_KEY}{call}",
                " ".join(",".join(map(str, row)) for row in rows),
                allow_overwrite=True,
            )
            for p in set(range(num)) - set(compared):
                if self.flagged.get(p) != counters[p] % _FLAG:
                    counter = client.key_value_increment(f"{_CALLS_KEY}{p}", _FLAG)
                    self.flagged[p] = counter % _FLAG
        if mismatch(rows) is not None:
            self.reported = max(self.reported, call)
        return rows


_PROCESS_CHECK = _ProcessCheck()


def _check_process_batches(
    host, *, pad: bool, pad_to: int | None, num_local: int
) -> int | None:
    """Compares this process's batch with the other processes' batches.

    With `pad`, the processes' sizes may differ; without `pad_to` (padding to the
    largest process's batch) this process compares on every call and returns the
    padded per-process size every process uses; otherwise None.
    """
    rows = [x.shape[0] for _, x in host]
    layout = "|".join(f"{keystr(p)}:{x.shape[1:]}:{x.dtype}" for p, x in host)
    mine = (
        min(rows),
        max(rows),
        zlib.crc32(layout.encode()) & 0x7FFFFFFF,
        int(pad),
        num_local,
        pad_to or 0,
    )
    check = _PROCESS_CHECK
    need_sizes = pad and pad_to is None
    answer = check.check(mine, need_sizes=need_sizes)
    if answer is None:
        return None
    call, every = answer
    late = call < check.calls - 1  # reported by another process
    try:
        padded = _compare_processes(
            every, host, num_local=num_local, late=call if late else None
        )
    except ValueError:
        check.forget_last()  # the next call compares again, at once
        raise
    return padded if need_sizes and not late else None


def _compare_processes(every, host, *, num_local: int, late: int | None):
    """Raises unless every process's row agrees; the padded size when padding.

    `late`: the earlier call (counted from 0 over this process's `step.shard`
    calls) at which another process found the disagreement.
    """
    when = (
        f"at an earlier call (call {late} of `step.shard` on this process), "
        if late is not None
        else ""
    )
    what = mismatch(every)
    if what == "layout":
        odd = [p for p in range(len(every)) if every[p][2] != every[0][2]]
        raise ValueError(
            f"`step.shard`: {when}the processes passed batches of different "
            "structure, "
            f"trailing shapes or dtypes (process {odd[0]} differs from process "
            f"0; this is process {jax.process_index()}, whose leaves are: "
            + ", ".join(f"{keystr(p)} {x.shape} {x.dtype}" for p, x in host[:5])
            + "). Every process must pass the same leaves with the same shapes "
            "(except the leading size) and dtypes."
        )
    if what == "pad":
        listed = ", ".join(
            f"process {p}: pad={bool(row[3])}" for p, row in enumerate(every)
        )
        raise ValueError(
            f"`step.shard`: {when}the processes called `step.shard` with different "
            f"`pad` ({listed}); every process must pad, or none."
        )
    if what == "pad_to":
        listed = ", ".join(
            f"process {p}: pad_to={row[5] or None}" for p, row in enumerate(every)
        )
        raise ValueError(
            f"`step.shard`: {when}the processes called `step.shard` with different "
            f"`pad_to` ({listed}); every process must pass the same `pad_to` (the "
            "global batch size to pad to), or none."
        )
    if what == "sizes":
        listed = ", ".join(
            f"process {p}: {row[0]}" + (f"-{row[1]}" if row[1] != row[0] else "")
            for p, row in enumerate(every)
        )
        raise ValueError(
            f"`step.shard`: {when}the processes passed local batches of "
            "different sizes; with several "
            "processes every process must pass a local batch of the same size "
            f"(its share of the global batch); got {listed} examples. Give every "
            "process the same number of examples (e.g. drop the smaller last "
            "batch of an epoch), or call `step.shard(batch, pad=True)`, which "
            "pads every process to the largest local batch and returns a mask."
        )
    if every[0][3]:
        return max(padded_size(row[1], num_local) for row in every)
    return None


_DONE = object()


def prefetch(iterable, *, size: int, place: Callable[[Any], Any]):
    """Yields `place(batch)` for each batch, placing up to `size` batches ahead.

    In one process a background thread loads and places the next batches while
    the caller's steps run (even when the caller reads each step's results);
    with several processes the batches are placed on the calling thread, ahead
    of use (placing counts and compares the batches across processes, in the
    same order on every process), and JAX's asynchronous dispatch overlaps the
    transfers with the running step.
    """
    _validate.positive_int("size", size)
    if jax.process_count() > 1:
        yield from _prefetch_inline(iter(iterable), size, place)
        return
    queue: Queue = Queue(maxsize=size)
    stop = threading.Event()

    def put(item) -> bool:
        """Puts `item` once there is room; False if the consumer stopped first."""
        while not stop.is_set():
            try:
                queue.put(item, timeout=0.1)
                return True
            except Full:
                continue
        return False

    def fill():
        try:
            for batch in iterable:
                if not put((place(batch), None)):
                    return
            item = (_DONE, None)
        except BaseException as e:  # handed to the consumer, raised there
            item = (_DONE, e)
        put(item)

    thread = threading.Thread(target=fill, name="jdp-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            placed, error = queue.get()
            if placed is _DONE:
                if error is not None:
                    raise error
                return
            yield placed
    finally:
        stop.set()


def _prefetch_inline(it, size: int, place):
    ahead = collections.deque()
    for batch in it:
        ahead.append(place(batch))
        if len(ahead) > size:
            yield ahead.popleft()
    while ahead:
        yield ahead.popleft()
