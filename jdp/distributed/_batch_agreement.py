"""Private: `step.shard`'s batches compared across processes (`_PROCESS_CHECK`).

Sizes, structures, dtypes and padding go through JAX's coordination service,
so that a mismatch raises instead of training on misaligned data.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import NamedTuple

import jax

from jdp import _coordination
from jdp._batching import padded_size
from jdp._tree import keystr
from jdp.distributed import _cluster

#: Store keys: per process, its record; per call, the rows of a disagreement.
_RECORD_KEY = "jdp/step.shard/record/"
_ERROR_KEY = "jdp/step.shard/error/"
#: Bounds, in seconds, how long a process whose batch changed waits for the others.
TIMEOUT_ENV = "JDP_SHARD_CHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
#: Longest pause between two reads while waiting for the other processes.
_POLL_S = 0.02


def _encode(entries) -> str:
    """`[(number, row)]` as text for the store (rows are tuples of ints)."""
    return " ".join(f"{c}:" + ",".join(map(str, row)) for c, row in entries)


def _decode(value: str) -> list:
    pairs = (item.partition(":") for item in value.split())
    return [(int(c), tuple(int(v) for v in row.split(","))) for c, _, row in pairs]


def row_at(entries, call: int):
    """The row in force at `call`, from a process's `(call, row)` changes (in order)."""
    return next((row for c, row in reversed(entries) if c <= call), None)


def signature(row: tuple) -> tuple:
    """What of a row the processes must agree on: sizes count unless padding."""
    return (0, 0, *row[2:]) if row[3] else row


def mismatch(rows) -> str | None:
    """The first field the processes' rows disagree on, or None if they agree.

    A row is `(fewest examples, most examples, layout checksum, pad, local
    replicas, pad_to or 0)`; the fields: "layout", "pad", "pad_to", "sizes"
    (which may differ when the processes pad).
    """
    rows = list(rows)
    for name, column in (("layout", 2), ("pad", 3), ("pad_to", 5)):
        if len({row[column] for row in rows}) > 1:
            return name
    if rows and not rows[0][3] and len({n for row in rows for n in row[:2]}) > 1:
        return "sizes"
    return None


def _size(row: tuple) -> str:
    """A row's examples: `8`, or `6-8` where its leaves' sizes differ."""
    return f"{row[0]}" if row[0] == row[1] else f"{row[0]}-{row[1]}"


def describe(row: tuple) -> str:
    """A row in words, for error messages."""
    size = "" if row[3] else f"{_size(row)} examples, "
    pad = f"pad={bool(row[3])}, pad_to={row[5] or None}"
    return f"{size}{pad}, layout checksum {row[2]:08x}"


class Found(NamedTuple):
    """What a `_ProcessCheck` found at a call: the processes' rows there.

    `rows`: process -> its row at `call` (an unconfirmed one's last published);
    `unconfirmed`: process -> the call of its last published change (None: none
    yet), for those that did not confirm `call` before the wait ran out.
    """

    call: int
    rows: dict
    unconfirmed: dict
    waited_s: float = 0.0


class _ProcessCheck:
    """The cross-process batch check, made by the calling thread.

    Process `p` keeps one record in the store, `record/p`: `reached` (the last
    call it made known), `raised` (the last call at which it raised) and its
    recent changes `(call, row)`; `error/n` holds the rows of a disagreement at
    call `n`. At its call `n`, `p` only counts if its `signature` did not change
    (and it does not pad to the largest batch). Otherwise it publishes `(n, row)`
    and reads every record (`q`'s row at `n` is confirmed if `q` reached `n`,
    else `q`'s last row stands in for it); it raises if the confirmed rows
    disagree, goes on if all agree (or the stand-ins agree with a row it went on
    with before), else polls for up to `timeout_s()`. A process whose signature
    did not change goes on into the step and learns of an error from `late`.
    """

    def __init__(self, *, client=None, process=None, timeout_s=None):
        self._given_client, self._given_timeout_s = client, timeout_s
        self._process = process  # `(index, count)` in place of JAX's (tests)
        self._reset(None)

    def _index(self) -> int:
        return self._process[0] if self._process else jax.process_index()

    def _count(self) -> int:
        return self._process[1] if self._process else jax.process_count()

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
        if (client := self._given_client or _coordination.client()) is None:
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
        meaning = (
            "how long `step.shard` waits, after a process's batch changed, for "
            "the other processes to pass a matching one"
        )
        value = _cluster.env_seconds(os.environ, TIMEOUT_ENV, meaning)
        return DEFAULT_TIMEOUT_S if value is None else value

    def check(self, row: tuple, *, need_sizes: bool) -> Found | None:
        """Counts this call; what it found when it compared, or a `late` report."""
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

    def agree(
        self, host, *, pad: bool, pad_to: int | None, num_local: int
    ) -> int | None:
        """Compares this batch with the others'; the padded size for `pad` alone."""
        rows = [x.shape[0] for _, x in host]
        layout = "|".join(f"{keystr(p)}:{x.shape[1:]}:{x.dtype}" for p, x in host)
        checksum = zlib.crc32(layout.encode()) & 0x7FFFFFFF
        mine = (min(rows), max(rows), checksum, int(pad), num_local, pad_to or 0)
        need_sizes = pad and pad_to is None
        if (found := self.check(mine, need_sizes=need_sizes)) is None:
            return None
        late = found.call < self.calls - 1  # reported by another process
        try:
            padded = _compare_processes(
                found, host, num_local=num_local, late=late, timeout_s=self.timeout_s()
            )
        except ValueError:
            self.forget_last()  # the next call compares again, at once
            raise
        return padded if need_sizes and not late else None

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
        """A disagreement another process reported and this one has not raised."""
        client = self.client
        if self.pending is None and client is not None and self.entries:
            if self.reached < self.calls - 1:
                self._publish(client, self.calls - 1)
            reports = _coordination.by_number(client.entries(_ERROR_KEY), _ERROR_KEY)
            if newer := {c: v for c, v in reports.items() if c > self.reported}:
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
        value = f"{reached};{self.raised};{_encode(self.entries)}"
        client.put(f"{_RECORD_KEY}{self._index()}", value)

    def _read(self, client) -> dict:
        """`{process: (reached, raised, changes)}` of every process that published."""
        published = _coordination.by_number(client.entries(_RECORD_KEY), _RECORD_KEY)
        fields = {p: value.split(";") for p, value in published.items()}
        records = {p: (int(a), int(b), _decode(c)) for p, (a, b, c) in fields.items()}
        others = [p for p in range(self._count()) if p != self._index()]
        self.floor = min((records.get(p, (-1,))[0] for p in others), default=-1)
        return records

    def _compare(self, client, call, row, need_sizes, timeout_s) -> Found:
        """Publishes `row` at `call`; the processes' rows there (see the class)."""
        self.waits += 1
        # Only for its first row, or the one it last went on with, may the
        # others' last rows stand in for theirs.
        first = not self.entries
        same = first or signature(row) == self.agreed
        self.entries.append((call, row))
        self._publish(client, call)
        me = self._index()
        start, pause = time.monotonic(), 0.0005
        while True:
            records = self._read(client)
            records.setdefault(me, (call, -1, [(call, row)]))
            rows, unconfirmed, doubtful = {}, {}, False
            for q in range(self._count()):
                reached, raised, entries = records.get(q, (-1, -1, []))
                if q == me or reached >= call:
                    # Before its first row, its calls failed their own checks.
                    rows[q] = row_at(entries, call) or entries[0][1]
                elif entries:
                    unconfirmed[q], rows[q] = entries[-1]
                    # A row with which `q` then raised may be the wrong one.
                    doubtful = doubtful or raised >= entries[-1][0]
                else:
                    unconfirmed[q] = None
            confirmed = {q: r for q, r in rows.items() if q not in unconfirmed}
            waited = time.monotonic() - start
            if not unconfirmed or mismatch(confirmed.values()) is not None:
                return Found(call, dict(sorted(confirmed.items())), {}, waited)
            may_stand_in = same and not doubtful and None not in unconfirmed.values()
            if may_stand_in and not need_sizes and mismatch(rows.values()) is None:
                return Found(call, dict(sorted(rows.items())), {}, waited)
            if waited >= timeout_s:
                absent = [q for q, c in unconfirmed.items() if c is None]
                agree = not absent and mismatch(rows.values()) is None
                none_yet = first and len(absent) == len(unconfirmed)
                if not need_sizes and (agree or none_yet):  # nothing against them
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
        """Publishes that this process raises at `call`: its last row may be wrong."""
        self.raised = call
        if self.entries:
            self._publish(client, max(call, self.reached))


_PROCESS_CHECK = _ProcessCheck()


def _compare_processes(
    found: Found, host, *, num_local: int, late=False, timeout_s=None
) -> int | None:
    """Raises unless every process's row agrees; the padded size when padding.

    `late`: `found` is another process's, from an earlier call.
    """
    every, me = found.rows, jax.process_index()
    when = hint = ""
    if late:
        when = (
            f"at an earlier call (call {found.call} of `step.shard` on this process), "
        )
    elif found.unconfirmed:
        when = _unconfirmed(found, me)
        limit = "the time limit" if timeout_s is None else f"{timeout_s:g} s"
        hint = (
            f" (Should a process only run more than {limit} behind the "
            "others, e.g. while it loads data, give it more time with the "
            f"environment variable {TIMEOUT_ENV}.)"
        )
    what = mismatch(every.values())
    if what is None and found.unconfirmed:  # a process published nothing yet
        raise ValueError(
            f"`step.shard`: {when}every process must call `step.shard` as often, "
            "in the same order."
        )
    if what == "layout":
        first = min(every)
        odd = [p for p in sorted(every) if every[p][2] != every[first][2]]
        raise ValueError(
            f"`step.shard`: {when}the processes passed batches of different "
            f"structure, trailing shapes or dtypes (process {odd[0]} differs from "
            f"process {first}; this is process {me}, whose leaves are: "
            + ", ".join(f"{keystr(p)} {x.shape} {x.dtype}" for p, x in host[:5])
            + "). Every process must pass the same leaves with the same shapes "
            "(except the leading size) and dtypes." + hint
        )
    if what in ("pad", "pad_to"):
        if what == "pad":
            values = {p: bool(row[3]) for p, row in every.items()}
            rule = "pad, or none"
        else:
            values = {p: row[5] or None for p, row in every.items()}
            rule = "pass the same `pad_to` (the global batch size to pad to), or none"
        listed = ", ".join(f"process {p}: {what}={values[p]}" for p in sorted(values))
        raise ValueError(
            f"`step.shard`: {when}the processes called `step.shard` with different "
            f"`{what}` ({listed}); every process must {rule}." + hint
        )
    if what == "sizes":
        listed = ", ".join(f"process {p}: {_size(every[p])}" for p in sorted(every))
        raise ValueError(
            f"`step.shard`: {when}the processes passed local batches of different "
            "sizes; with several processes every process must pass a local batch of "
            f"the same size (its share of the global batch); got {listed} examples. "
            "Give every process the same number of examples (e.g. drop the smaller "
            "last batch of an epoch), or call `step.shard(batch, pad=True)`, which "
            "pads every process to the largest local batch and returns a mask." + hint
        )
    rows = list(every.values())
    return max(padded_size(row[1], num_local) for row in rows) if rows[0][3] else None


def _unconfirmed(found: Found, me: int) -> str:
    """How the message starts when some processes did not confirm their rows."""
    others = [
        f"process {q} has passed no batch yet"
        if since is None
        else f"process {q} passes {describe(found.rows[q])} (since its call {since})"
        for q, since in sorted(found.unconfirmed.items())
    ]
    return (
        f"at call {found.call} of `step.shard` the batch of this process (process "
        f"{me}) changed to {describe(found.rows[me])}, while "
        + "; ".join(others)
        + f", and passed no other batch in the {found.waited_s:.0f} s this "
        "process waited: "
    )
