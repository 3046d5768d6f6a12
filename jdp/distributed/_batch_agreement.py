"""Private: the cross-process agreement of `step.shard`'s batches.

With several processes each process passes its own share of the global batch to
`step.shard`; the processes' sizes, structures, dtypes and padding are compared
here, through JAX's coordination service (`jdp._coordination.Store`), because a
mismatch would otherwise train on misaligned data without an error. A process
sends its batch's signature only when it changes (or when it pads to the largest
batch), and waits only then, for the processes that have not yet made that
call; a loop of steady shapes sends no message at all (see `_ProcessCheck`).

The data path (`jdp._batching`) knows only its `ProcessAgreement` interface;
`jdp.distributed` plugs `AGREEMENT` into it when imported. This module imports
the data path (for `padded_size`), never the other way round.
"""

from __future__ import annotations

import math
import os
import time
import zlib
from typing import NamedTuple

import jax

from jdp import _coordination
from jdp._batching import padded_size
from jdp._tree import keystr

#: Keys in JAX's coordination service (see `_ProcessCheck`): per process, its
#: record (the last call it made known, and its recent changes of batch); per
#: call, the processes' rows at a call where they disagreed.
_RECORD_KEY = "jdp/step.shard/record/"
_ERROR_KEY = "jdp/step.shard/error/"
#: The environment variable that bounds, in seconds, how long a process whose
#: batch changed waits for another process to pass a matching batch.
TIMEOUT_ENV = "JDP_SHARD_CHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
#: Longest pause between two reads while waiting for the other processes.
_POLL_S = 0.02


def _encode(entries) -> str:
    """`[(number, row)]` as text for the store (rows are tuples of ints)."""
    return " ".join(f"{c}:" + ",".join(map(str, row)) for c, row in entries)


def _decode(value: str) -> list:
    entries = []
    for item in value.split():
        call, _, row = item.partition(":")
        entries.append((int(call), tuple(int(v) for v in row.split(","))))
    return entries


def _by_number(entries: dict) -> dict:
    """`{n: value}` from a directory read of the store (keys ending in `/n`)."""
    found = {}
    for key, value in entries.items():
        tail = key.rstrip("/").rpartition("/")[2]
        if tail.isdigit():
            found[int(tail)] = value
    return found


def row_at(entries, call: int):
    """The row in force at `call`, from a process's `(call, row)` changes.

    Example:
      >>> from jdp.distributed._batch_agreement import row_at
      >>> row_at([(0, (8,)), (5, (6,))], 4), row_at([(0, (8,)), (5, (6,))], 5)
      ((8,), (6,))
    """
    found = None
    for c, row in entries:
        if c > call:
            break
        found = row
    return found


def signature(row: tuple) -> tuple:
    """What of a row the processes must agree on: sizes count unless padding.

    A process publishes its row only when this changes (see `_ProcessCheck`).

    Example:
      >>> from jdp.distributed._batch_agreement import signature
      >>> signature((8, 8, 7, 0, 1, 0)), signature((5, 5, 7, 1, 1, 16))
      ((8, 8, 7, 0, 1, 0), (0, 0, 7, 1, 1, 16))
    """
    return (0, 0, *row[2:]) if row[3] else row


def mismatch(rows) -> str | None:
    """What the processes' rows disagree on: "layout", "pad", "pad_to", "sizes".

    A row is `(fewest examples, most examples, layout checksum, pad, local
    replicas, pad_to or 0)`. Sizes may differ when the processes pad.

    Args:
      rows: One row per process.

    Returns:
      The first field that differs, or None if the rows agree.

    Example:
      >>> from jdp.distributed._batch_agreement import mismatch
      >>> mismatch([(8, 8, 7, 1, 1, 0), (5, 5, 7, 1, 1, 0)]) is None
      True
      >>> mismatch([(8, 8, 7, 0, 1, 0), (5, 5, 7, 0, 1, 0)])
      'sizes'
    """
    rows = list(rows)
    for name, column in (("layout", 2), ("pad", 3), ("pad_to", 5)):
        if len({row[column] for row in rows}) > 1:
            return name
    if rows and not rows[0][3] and len({n for row in rows for n in row[:2]}) > 1:
        return "sizes"
    return None


def describe(row: tuple) -> str:
    """A row in words, for error messages.

    Example:
      >>> from jdp.distributed._batch_agreement import describe
      >>> describe((8, 8, 255, 0, 1, 0))
      '8 examples, pad=False, pad_to=None, layout checksum 000000ff'
    """
    size = f"{row[0]}" if row[0] == row[1] else f"{row[0]}-{row[1]}"
    return (
        ("" if row[3] else f"{size} examples, ")
        + f"pad={bool(row[3])}, pad_to={row[5] or None}, "
        + f"layout checksum {row[2]:08x}"
    )


class Found(NamedTuple):
    """What a `_ProcessCheck` found at a call: the processes' rows there."""

    call: int
    #: process -> its row at `call`; for a process in `unconfirmed`, its last
    #: published row (absent if it has published none).
    rows: dict
    #: process -> the call of its last published change (None: it has published
    #: none), for the processes that did not confirm their row at `call` before
    #: the wait ran out with something against them; else empty.
    unconfirmed: dict
    #: Seconds waited for them.
    waited_s: float = 0.0


class _ProcessCheck:
    """The cross-process batch check, made by the calling thread (no thread).

    It reads and writes the key-value store of JAX's coordination service (which
    `jdp.distributed.initialize` set up), not the devices. What it must do: start
    no background thread; send no message at all in a loop whose batches keep
    their shapes; and raise a clear error, rather than hang or train on
    misaligned data, when the processes' batches disagree.

    Every process makes the same `shard` calls in the same order, so a call has
    the same index `n` on every process, which each process counts by itself. A
    process's *signature* at a call is what the processes must agree on
    (`signature` of its row: structure, trailing shapes and dtypes as a
    checksum, `pad`, `pad_to`, and the sizes unless it pads). In the store,
    process `p` keeps one record, `record/p`: `reached`, the last call it made
    known; `raised`, the last call at which it raised a disagreement; and its
    changes `(call, row)`, each row in force from its call to the next change
    (before the first, its calls failed their own checks). A change is dropped
    once every process was seen at the next one or later, so one write
    publishes a change, one directory read gets every process's history, and
    the records stay small without deletes (a record per change and call would
    need both).
    `error/n` holds the rows at a call `n` where a process found a
    disagreement. At its call `n`, `p`:

    1. only counts, sending nothing, if its signature is that of its last call;
    2. otherwise (its first call, a short last batch, a change back, the call
       after an error or after a call that failed its own checks, and every call
       that pads to the largest batch, `pad=True` without `pad_to`, whose sizes
       must be exchanged) publishes `(n, row)` with `reached = n` (one write)
       and reads every record (one read). `q`'s row at `n` is *confirmed* if
       `q` reached `n`; if not, `q`'s last row *stands in* for it;
    3. raises at once if the confirmed rows disagree, and goes on if every row
       is confirmed and they agree. It also goes on, without waiting, when the
       stand-ins agree with its row and that row is the one it last went on
       with (or its first): a publication after an error or a failed call. A
       stand-in from a process that raised with it does not count: that row
       may be the wrong one;
    4. otherwise waits, reading again (pauses of up to `_POLL_S`), for at most
       `$JDP_SHARD_CHECK_TIMEOUT` seconds (60, `DEFAULT_TIMEOUT_S`): a process
       that has not made call `n` yet may change there too (every process
       shrinks at the last batch), and it then confirms at once. When the time
       runs out, `p` raises, naming each process that did not confirm and its
       last row, and its own row, unless nothing speaks against them: their
       rows agree (padding to the largest batch needs them confirmed), or, at
       `p`'s first publication, they have published nothing yet (each compares
       with `p`'s record at its own first one).

    Every disagreement is raised by a process whose signature changed: take the
    first call `n` at which the signatures differ, and a process `p` whose
    signature changed there to one that some `q` does not have. If `q` reached
    `n`, `p` sees its row and raises. If not, `q`'s last row is its row at a
    call from `p`'s previous change `m` to `n - 1`: at `m`, `p` went on only
    once `q` had confirmed `m` (by the same argument at `m`, a stand-in did not
    agree with `p`'s change there), and `q` publishes each change. The
    signatures agree from `m` to `n - 1`, so that row has `p`'s old signature,
    not its new one: `p` waits, and raises once `q` confirms `n` or the time
    runs out. (At its first call, `p` compares with every process that
    published; the others compare with `p`'s record at their own first call.)

    In agreement, a wait ends as soon as the processes behind reach call `n`,
    which they do without waiting for `p`: a process waits only for processes
    behind it, and a device collective that follows call `n` in the program
    comes after call `n` on every process. After a disagreement was raised,
    processes that go on are brought back into agreement by step 3 without
    waiting; the argument above covers the first disagreement only, though the
    tests find every later one raised too.

    The cost: a process in the wrong whose signature did not change (process 0
    keeps passing 8 examples when process 1 passes its short last batch of 6)
    sends nothing and so learns nothing: it goes on into its step, whose
    collective blocks, while process 1 waits for it until the time runs out and
    raises. Under `jdp.launch` the job then ends, as it does whenever a process
    fails (elsewhere the blocked process stays until the job is stopped); a
    process that goes on after the error can learn of it from `late`. And
    processes more than the time limit apart when their batches change (one
    loading data for minutes) get an error where they should not: give them more
    time with `$JDP_SHARD_CHECK_TIMEOUT`.
    """

    def __init__(
        self,
        *,
        client=None,
        process: tuple[int, int] | None = None,
        timeout_s: float | None = None,
    ):
        """A check for this process.

        Args:
          client: A key-value store to use instead of the coordination
            service's client (for tests).
          process: `(index, count)` to use instead of JAX's process index and
            count (for tests).
          timeout_s: Seconds to wait instead of `$JDP_SHARD_CHECK_TIMEOUT`.
        """
        self._given_client = client
        self._process = process
        self._given_timeout_s = timeout_s
        self._reset(None)

    def _index(self) -> int:
        return jax.process_index() if self._process is None else self._process[0]

    def _count(self) -> int:
        return jax.process_count() if self._process is None else self._process[1]

    def _reset(self, client) -> None:
        self._raw_client = client
        self.client = _coordination.Store.of(client)
        self.calls = 0  # `shard` calls so far (in multi-process mode)
        self.last = None  # the signature of its last call (None: publish next)
        self.entries: list = []  # its changes (call, row), as published
        self.reached = -1  # the last call its published record makes known
        self.floor = -1  # a call that every process was seen to have reached
        self.reported = -1  # the last call whose disagreement it has raised
        self.raised = -1  # the last call at which it raised a disagreement
        self.agreed = None  # the signature it last compared and went on with
        self.pending = None  # a `Found` reported by another process, to raise
        self.waits = 0  # calls that compared (each sends a message)

    def _client(self):
        client = self._given_client or _coordination.client()
        if client is None:
            raise RuntimeError(
                "`step.shard` across processes compares the processes' batches "
                "through JAX's coordination service, which is not running: call "
                "`jdp.distributed.initialize()` first."
            )
        if client is not self._raw_client:
            self._reset(client)
        return self.client

    def timeout_s(self) -> float:
        """How long a process whose batch changed waits for the others to match."""
        if self._given_timeout_s is not None:
            return self._given_timeout_s
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise ValueError(
                f"`step.shard`: ${TIMEOUT_ENV}={text!r} must be a number of "
                "seconds above 0 (how long a process whose batch changed waits "
                "for the other processes to pass a matching one)."
            )
        return value

    def check(self, row: tuple, *, need_sizes: bool) -> Found | None:
        """Counts this call, with `row`; compares it when it must (see the class).

        Args:
          row: This process's row at this call.
          need_sizes: Compare even if the row did not change, and wait for every
            process's row (to agree on the largest size).

        Returns:
          What this process found at this call when it compared, or what another
          process found at an earlier call (`call` < this call) and reported;
          None otherwise.
        """
        client = self._client()
        call = self.calls
        self.calls += 1
        now = None
        mine = signature(row)
        if need_sizes or mine != self.last:
            timeout_s = self.timeout_s()
            self.last = mine
            now = self._compare(client, call, row, need_sizes, timeout_s)
            if now.unconfirmed or mismatch(now.rows.values()) is not None:
                self.pending = None  # this call raises already
                self._report(client, now)
                return now
            self.agreed = mine
        late, self.pending = self.pending, None
        if late is not None:
            self._disown(client, call)
        return late or now

    def count_only(self) -> None:
        """Counts a call that failed its own checks (the next call publishes)."""
        try:
            self._client()
        except RuntimeError:  # no service: the caller's own error says enough
            return
        self.calls += 1
        self.last = None

    def forget_last(self) -> None:
        """Makes the next call publish and compare (after a disagreement)."""
        self.last = None

    @property
    def late(self) -> Found | None:
        """A disagreement another process reported and this one has not raised.

        Publishes how far this process got, so that a process waiting for it
        can decide, and reads the reports (a write and a read; `shard` never
        calls it: a process whose batch did not change sends nothing).
        """
        client = self.client
        if self.pending is None and client is not None and self.entries:
            if self.reached < self.calls - 1:
                self._publish(client, self.calls - 1)
            reports = _by_number(client.entries(_ERROR_KEY))
            newer = {c: v for c, v in reports.items() if c > self.reported}
            if newer:
                first = min(newer)
                self.pending = Found(first, dict(_decode(newer[first])), {})
                self.reported = max(newer)
        return self.pending

    def _publish(self, client, reached: int) -> None:
        """Writes this process's record (`reached`, `raised`, recent changes)."""
        keep = 0  # the change in force at `floor`, and the later ones
        for i, (c, _) in enumerate(self.entries):
            if c <= self.floor:
                keep = i
        self.entries = self.entries[keep:]
        self.reached = reached
        client.put(
            f"{_RECORD_KEY}{self._index()}",
            f"{reached};{self.raised};{_encode(self.entries)}",
        )

    def _read(self, client) -> dict:
        """`{process: (reached, raised, changes)}` of every process that published."""
        records = {}
        for p, value in _by_number(client.entries(_RECORD_KEY)).items():
            reached, raised, entries = value.split(";")
            records[p] = (int(reached), int(raised), _decode(entries))
        others = [p for p in range(self._count()) if p != self._index()]
        self.floor = min((records.get(p, (-1,))[0] for p in others), default=-1)
        return records

    def _compare(self, client, call, row, need_sizes, timeout_s) -> Found:
        """Publishes `row` at `call`; the processes' rows there (see the class)."""
        self.waits += 1
        # Its row is the one it last went on with (it publishes again after an
        # error, or a call that failed its own checks), or its first: only then
        # may the others' last rows stand in for theirs (see the class).
        first = not self.entries
        same = first or signature(row) == self.agreed
        self.entries.append((call, row))
        self._publish(client, call)
        me = self._index()
        start = time.monotonic()
        pause = 0.0005
        while True:
            records = self._read(client)
            rows, unconfirmed, doubtful = {}, {}, False
            for q in range(self._count()):
                mine = (call, -1, [(call, row)])
                reached, raised, entries = records.get(
                    q, mine if q == me else (-1, -1, [])
                )
                if q == me or reached >= call:
                    # Before its first row, its calls failed their own checks.
                    rows[q] = row_at(entries, call) or entries[0][1]
                elif entries:
                    rows[q] = entries[-1][1]
                    unconfirmed[q] = entries[-1][0]
                    # A row with which `q` then raised may be the wrong one.
                    doubtful = doubtful or raised >= entries[-1][0]
                else:
                    unconfirmed[q] = None
            confirmed = {q: r for q, r in rows.items() if q not in unconfirmed}
            waited = time.monotonic() - start
            if not unconfirmed or mismatch(confirmed.values()) is not None:
                return Found(call, dict(sorted(confirmed.items())), {}, waited)
            stand_ins_agree = (
                same
                and not doubtful
                and None not in unconfirmed.values()
                and mismatch(rows.values()) is None
            )
            if stand_ins_agree and not need_sizes:
                return Found(call, dict(sorted(rows.items())), {}, waited)
            if waited >= timeout_s:
                absent = [q for q, c in unconfirmed.items() if c is None]
                if not need_sizes and (
                    (not absent and mismatch(rows.values()) is None)
                    or (first and len(absent) == len(unconfirmed))
                ):  # nothing to say against them (see the class)
                    return Found(call, dict(sorted(rows.items())), {}, waited)
                return Found(call, dict(sorted(rows.items())), unconfirmed, waited)
            time.sleep(min(pause, max(timeout_s - waited, 0)))
            pause = min(2 * pause, _POLL_S)

    def _report(self, client, found: Found) -> None:
        """Leaves `found` in the store for processes that go on (see `late`)."""
        self.reported = max(self.reported, found.call)
        client.put(f"{_ERROR_KEY}{found.call}", _encode(sorted(found.rows.items())))
        self._disown(client, found.call)

    def _disown(self, client, call: int) -> None:
        """Publishes that this process raises at `call`.

        Until it publishes its row again, no process then takes its last row for
        its row at a later call (it may be the wrong one).
        """
        self.raised = call
        if self.entries:
            self._publish(client, max(call, self.reached))


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
    found = check.check(mine, need_sizes=need_sizes)
    if found is None:
        return None
    late = found.call < check.calls - 1  # reported by another process
    try:
        padded = _compare_processes(
            found, host, num_local=num_local, late=late, timeout_s=check.timeout_s
        )
    except ValueError:
        check.forget_last()  # the next call compares again, at once
        raise
    return padded if need_sizes and not late else None


def _compare_processes(
    found: Found, host, *, num_local: int, late: bool = False, timeout_s=None
):
    """Raises unless every process's row agrees; the padded size when padding.

    `late`: `found` is what another process found at an earlier call (counted
    from 0 over this process's `step.shard` calls). `timeout_s`: for the message
    when some row was not confirmed (a number, or a function that gives it).
    """
    every, me = found.rows, jax.process_index()
    when = ""
    if late:
        when = (
            f"at an earlier call (call {found.call} of `step.shard` on this process), "
        )
    elif found.unconfirmed:
        when = _unconfirmed(found, me)
    what = mismatch(every.values())
    if what is None and found.unconfirmed:  # a process published nothing yet
        what = "none"
    if what == "none":
        raise ValueError(
            f"`step.shard`: {when}every process must call `step.shard` as often, "
            "in the same order."
        )
    if what == "layout":
        first = min(every)
        odd = [p for p in sorted(every) if every[p][2] != every[first][2]]
        raise ValueError(
            f"`step.shard`: {when}the processes passed batches of different "
            "structure, "
            f"trailing shapes or dtypes (process {odd[0]} differs from process "
            f"{first}; this is process {me}, whose leaves are: "
            + ", ".join(f"{keystr(p)} {x.shape} {x.dtype}" for p, x in host[:5])
            + "). Every process must pass the same leaves with the same shapes "
            "(except the leading size) and dtypes." + _hint(found, timeout_s)
        )
    if what == "pad":
        listed = ", ".join(
            f"process {p}: pad={bool(row[3])}" for p, row in sorted(every.items())
        )
        raise ValueError(
            f"`step.shard`: {when}the processes called `step.shard` with different "
            f"`pad` ({listed}); every process must pad, or none."
            + _hint(found, timeout_s)
        )
    if what == "pad_to":
        listed = ", ".join(
            f"process {p}: pad_to={row[5] or None}" for p, row in sorted(every.items())
        )
        raise ValueError(
            f"`step.shard`: {when}the processes called `step.shard` with different "
            f"`pad_to` ({listed}); every process must pass the same `pad_to` (the "
            "global batch size to pad to), or none." + _hint(found, timeout_s)
        )
    if what == "sizes":
        listed = ", ".join(
            f"process {p}: {row[0]}" + (f"-{row[1]}" if row[1] != row[0] else "")
            for p, row in sorted(every.items())
        )
        raise ValueError(
            f"`step.shard`: {when}the processes passed local batches of "
            "different sizes; with several "
            "processes every process must pass a local batch of the same size "
            f"(its share of the global batch); got {listed} examples. Give every "
            "process the same number of examples (e.g. drop the smaller last "
            "batch of an epoch), or call `step.shard(batch, pad=True)`, which "
            "pads every process to the largest local batch and returns a mask."
            + _hint(found, timeout_s)
        )
    rows = list(every.values())
    if rows[0][3]:
        return max(padded_size(row[1], num_local) for row in rows)
    return None


def _unconfirmed(found: Found, me: int) -> str:
    """How the message starts when some processes did not confirm their rows."""
    others = []
    for q, since in sorted(found.unconfirmed.items()):
        if since is None:
            others.append(f"process {q} has passed no batch yet")
        else:
            others.append(
                f"process {q} passes {describe(found.rows[q])} (since its call {since})"
            )
    return (
        f"at call {found.call} of `step.shard` the batch of this process (process "
        f"{me}) changed to {describe(found.rows[me])}, while "
        + "; ".join(others)
        + f", and passed no other batch in the {found.waited_s:.0f} s this "
        "process waited: "
    )


def _hint(found: Found, timeout_s) -> str:
    if not found.unconfirmed:
        return ""
    limit = timeout_s() if callable(timeout_s) else timeout_s
    limit = f"{limit:g} s" if limit is not None else "the time limit"
    return (
        " (Should a process only run more than "
        f"{limit} behind the others, e.g. while it loads data, give it more time "
        f"with the environment variable {TIMEOUT_ENV}.)"
    )


class BatchAgreement:
    """`step.shard`'s agreement across processes (`_batching.ProcessAgreement`).

    Works on this process's check, `_PROCESS_CHECK`; `jdp.distributed` plugs
    `AGREEMENT` into `jdp._batching` when imported.
    """

    def agree(
        self, host, *, pad: bool, pad_to: int | None, num_local: int
    ) -> int | None:
        """Compares this process's batch with the others' (`_check_process_batches`)."""
        return _check_process_batches(host, pad=pad, pad_to=pad_to, num_local=num_local)

    def count_only(self) -> None:
        """Counts a call that failed its own checks (`_ProcessCheck.count_only`)."""
        _PROCESS_CHECK.count_only()


AGREEMENT = BatchAgreement()
