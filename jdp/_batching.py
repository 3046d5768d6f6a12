"""Private: `step.shard`, splitting a global batch across replicas.

With several processes each process passes its own share of the global batch;
the processes' sizes, structures and dtypes are compared through JAX's
coordination service, because a mismatch would otherwise train on misaligned
data without an error. A process waits for that comparison only when its batch's
shapes change; a steady loop is checked in the background (see `_ProcessCheck`).
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
    padded_everywhere = None
    if jax.process_count() > 1:
        padded_everywhere = _check_process_batches(
            host, pad=pad, num_local=num_local, need_sizes=pad and pad_to is None
        )
    mask = None
    if pad_to is not None:
        padded_everywhere = _local_pad_to(pad_to, pad, num_replicas)
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
        raise ValueError(
            "`step.shard`: the batch is empty (leading size 0); a step on it "
            "would average over no examples. Skip empty batches."
        )


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
            raise ValueError("`step.shard(pad=True)`: the batch is empty.")
        host = [
            (p, np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])) for p, x in host
        ]
    return host, np.arange(padded) < size


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


#: Keys, in JAX's coordination service: each process's published signatures, and
#: the requests that ask a process to publish how far it has got.
_KEY = "jdp/step.shard/process/"
_REQUEST_KEY = "jdp/step.shard/request/"
#: Signature changes each process keeps published (the older ones are verified).
_KEEP_CHANGES = 64
#: Longest pause between two reads while waiting for the other processes.
_POLL_S = 0.02
#: How long the background thread's blocking read waits before it reads again.
_LISTEN_MS = 10_000


def _encode(reached: int, answered: int, changes) -> str:
    rows = " ".join(f"{c}:" + ",".join(map(str, row)) for c, row in changes)
    return f"{reached};{answered};{rows}"


def _decode(value: str):
    reached, answered, rows = value.split(";")
    changes = []
    for item in rows.split():
        call, _, row = item.partition(":")
        changes.append((int(call), tuple(int(v) for v in row.split(","))))
    return int(reached), int(answered), changes


def row_at(changes, call: int):
    """The signature in force at `call`, from a list of `(call, signature)` changes.

    Example:
      >>> from jdp._batching import row_at
      >>> row_at([(0, (8,)), (5, (6,))], 4), row_at([(0, (8,)), (5, (6,))], 5)
      ((8,), (6,))
    """
    found = None
    for c, row in changes:
        if c > call:
            break
        found = row
    return found


def rows_agree(rows) -> bool:
    """Whether the processes' signature rows agree (sizes may differ when padding).

    A row is `(fewest examples, most examples, layout checksum, pad, local
    replicas)`.

    Example:
      >>> from jdp._batching import rows_agree
      >>> rows_agree([(8, 8, 7, 1, 1), (5, 5, 7, 1, 1)])
      True
      >>> rows_agree([(8, 8, 7, 0, 1), (5, 5, 7, 0, 1)])
      False
    """
    if len({row[2:4] for row in rows}) > 1:
        return False
    return bool(rows[0][3]) or len({row[:2] for row in rows}) == 1


def first_disagreement(
    every_changes, start: int, through: int, skip=(), agree=rows_agree
):
    """The first call in `(start, through]` at which the processes' signatures differ.

    Each process's signature only changes at its listed calls, so checking the
    calls where any process changed covers every call in between.

    Args:
      every_changes: Per process, its `(call, signature)` changes.
      start: The last call already verified.
      through: The last call every process has reached.
      skip: Calls not to check (this process compared them itself).
      agree: Whether a list of rows (one per process) agrees.

    Returns:
      `(call, rows)` (the rows of every process at that call), or None.

    Example:
      >>> from jdp._batching import first_disagreement
      >>> a, b = [(0, (8,))], [(0, (8,)), (3, (6,))]
      >>> same = lambda rows: len(set(rows)) == 1
      >>> first_disagreement([a, b], -1, 2, agree=same)
      >>> first_disagreement([a, b], -1, 4, agree=same)
      (3, [(8,), (6,)])
    """
    calls = sorted(
        {c for changes in every_changes for c, _ in changes if start < c <= through}
        - set(skip)
    )
    for call in calls:
        rows = [row_at(changes, call) for changes in every_changes]
        if not agree(rows):
            return call, rows
    return None


class _ProcessCheck:
    """The cross-process batch check, through JAX's coordination service.

    Each process publishes, in the coordination service's key-value store (which
    `jdp.distributed.initialize` set up; not a collective on the devices), the
    calls at which its batch signature (sizes, structure, trailing shapes,
    dtypes, padding) changed and how many `shard` calls it had made then. A
    process whose signature changes (its first call, a short last batch, ...)
    publishes, waits until every process has reached the same call, compares,
    and raises at once if they disagree; with `pad=True` and no `pad_to` it does
    so on every call, for the largest size. A process whose signature did not
    change does nothing but count: a background thread, blocked in a read of the
    store, wakes only when another process asks how far this one has got, then
    publishes, checks the asker's changes, and a disagreement it finds is raised
    at this process's next call. A steady loop therefore costs no message at all.
    """

    def __init__(self):
        self._lock = threading.Lock()  # guards the fields below
        self._publishing = threading.Lock()  # keeps publications in order
        self._reset(None)

    def _reset(self, client) -> None:
        self.client = client
        self.calls = 0  # `shard` calls so far (in multi-process mode)
        self.last = None  # this process's last signature row
        self.changes: list = []  # [(call, row)] where it changed
        self.reached = -1  # the last call this process made
        self.answered = 0  # requests to publish answered so far
        self.published = None  # (reached, answered) last published
        self.verified = -1  # disagreements up to here were looked for
        self.waits = 0  # calls that waited for the other processes
        self.late = None  # (call, rows) of a disagreement found in the background
        self.moved = threading.Event()  # set on every call
        self.thread = None

    def check(self, row: tuple, *, need_sizes: bool):
        """Records this call's `row`; every process's rows when it must wait.

        Returns:
          `(call, rows)`: the rows of every process at this call when this
          process waited, or a disagreement found earlier (`call` < this call);
          None otherwise.
        """
        client = _coordination.client()
        if client is None:
            raise RuntimeError(
                "`step.shard` across processes compares the processes' batches "
                "through JAX's coordination service, which is not running: call "
                "`jdp.distributed.initialize()` first."
            )
        with self._lock:
            if client is not self.client:
                self._reset(client)
            call = self.calls
            self.calls += 1
            self.reached = call
            wait = need_sizes or row != self.last
            if wait:
                self.changes.append((call, row))
                del self.changes[:-_KEEP_CHANGES]
                self.last = row
            late, self.late = self.late, None
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._listen, name="jdp-shard-check", daemon=True
                )
                self.thread.start()
        self.moved.set()
        if late is None and not wait:
            return None
        self._publish()  # before raising too: the others may wait for this call
        if late is not None:
            return late
        self.waits += 1
        every = self._wait_for(call)
        with self._lock:
            self.verified = max(self.verified, call)
        return call, [row_at(changes, call) for changes in every]

    def forget_last(self) -> None:
        """Makes the next call count as a change (after a disagreement)."""
        with self._lock:
            self.last = None

    def _publish(self) -> None:
        with self._publishing:
            with self._lock:
                now = (self.reached, self.answered)
                value = _encode(*now, self.changes)
            if now != self.published:
                self.client.key_value_set(
                    f"{_KEY}{jax.process_index()}", value, allow_overwrite=True
                )
                self.published = now

    def _read(self):
        """Every process's `(reached, answered, changes)`, in process order."""
        found = [None] * jax.process_count()
        for key, value in self.client.key_value_dir_get(_KEY):
            tail = key.rstrip("/").rpartition("/")[2]
            if tail.isdigit() and int(tail) < len(found):
                found[int(tail)] = _decode(value)
        return found

    def _wait_for(self, call: int):
        """Waits until every process has reached `call`; their change lists.

        A process that has not published that far is asked to (it may be in a
        steady loop, which publishes nothing unasked).
        """
        asked = set()
        pause = 0.0005
        while True:
            found = self._read()
            if all(f is not None and f[0] >= call for f in found):
                return [f[2] for f in found]
            for process, f in enumerate(found):
                if f is not None and f[0] < call and (process, f[1]) not in asked:
                    self.client.key_value_set(
                        f"{_REQUEST_KEY}{process}/{f[1]}",
                        str(call),
                        allow_overwrite=True,
                    )
                    asked.add((process, f[1]))
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S)

    def _listen(self) -> None:
        """The background thread: answers the other processes' requests."""
        client = self.client
        me = jax.process_index()
        while self.client is client:
            key = f"{_REQUEST_KEY}{me}/{self.answered}"
            try:
                wanted = int(client.blocking_key_value_get(key, _LISTEN_MS))
            except Exception as e:
                if "DEADLINE_EXCEEDED" in str(e):
                    continue  # nobody asked: listen again
                return  # the service is gone (shutdown): stop
            while self.client is client and self.reached < wanted:
                self.moved.wait(_POLL_S)  # until this process gets that far
                self.moved.clear()
            with self._lock:
                if self.client is not client:
                    return
                self.answered += 1
            try:
                self._publish()
                client.key_value_delete(key)
                found = self._read()
            except Exception:
                return
            self._verify(client, found)

    def _verify(self, client, found) -> None:
        """Looks for a disagreement at the other processes' changes."""
        if any(f is None for f in found):
            return
        through = min(f[0] for f in found)
        with self._lock:
            if self.client is not client or through <= self.verified:
                return
            own = {c for c, _ in self.changes}  # this process compared those
            bad = first_disagreement(
                [f[2] for f in found], self.verified, through, skip=own
            )
            self.verified = through if bad is None else bad[0]
            if bad is not None and self.late is None:
                self.late = bad


_PROCESS_CHECK = _ProcessCheck()


def _check_process_batches(
    host, *, pad: bool, num_local: int, need_sizes: bool
) -> int | None:
    """Compares this process's batch with the other processes' batches.

    With `pad`, the processes' sizes may differ. With `need_sizes` (padding to the
    largest process's batch) this process waits on every call and returns the
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
    )
    check = _PROCESS_CHECK
    answer = check.check(mine, need_sizes=need_sizes)
    if answer is None:
        return None
    call, every = answer
    late = call < check.reached  # found by the background check
    try:
        padded = _compare_processes(
            np.array(every),
            host,
            # This process's own flag at that call (a late answer's may differ).
            pad=bool(every[jax.process_index()][3]),
            num_local=num_local,
            late=call if late else None,
        )
    except ValueError:
        check.forget_last()  # the next call compares again, at once
        raise
    return padded if need_sizes and not late else None


def _compare_processes(every, host, *, pad: bool, num_local: int, late: int | None):
    """Raises unless every process's row agrees; the padded size when `pad`.

    `late`: the earlier call (counted from 0 over this process's `step.shard`
    calls) at which the background check found the disagreement.
    """
    when = (
        f"at an earlier call (call {late} of `step.shard` on this process), "
        if late is not None
        else ""
    )
    if len(set(every[:, 2].tolist())) > 1:
        odd = [p for p in range(len(every)) if every[p, 2] != every[0, 2]]
        raise ValueError(
            f"`step.shard`: {when}the processes passed batches of different "
            "structure, "
            f"trailing shapes or dtypes (process {odd[0]} differs from process "
            f"0; this is process {jax.process_index()}, whose leaves are: "
            + ", ".join(f"{keystr(p)} {x.shape} {x.dtype}" for p, x in host[:5])
            + "). Every process must pass the same leaves with the same shapes "
            "(except the leading size) and dtypes."
        )
    if len(set(every[:, 3].tolist())) > 1:
        listed = ", ".join(
            f"process {p}: pad={bool(v)}" for p, v in enumerate(every[:, 3].tolist())
        )
        raise ValueError(
            f"`step.shard`: {when}the processes called `step.shard` with different "
            f"`pad` ({listed}); every process must pad, or none."
        )
    if pad:
        return max(padded_size(int(n), num_local) for n in every[:, 1])
    if every[:, :2].min() != every[:, :2].max():
        listed = ", ".join(
            f"process {p}: {lo}" + (f"-{hi}" if hi != lo else "")
            for p, (lo, hi) in enumerate(every[:, :2].tolist())
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
    return None


_DONE = object()


def prefetch(iterable, *, size: int, place: Callable[[Any], Any]):
    """Yields `place(batch)` for each batch, placing up to `size` batches ahead.

    In one process a background thread loads and places the next batches while
    the caller's steps run (even when the caller reads each step's results);
    with several processes the batches are placed on the calling thread, ahead
    of use (placing checks sizes across processes with a collective, which must
    run in the same order on every process), and JAX's asynchronous dispatch
    overlaps the transfers with the running step.
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
