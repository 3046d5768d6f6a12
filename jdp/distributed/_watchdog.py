"""Private: the stall check of a job started without `python -m jdp.launch`.

Each process publishes its progress count under `jdp/stall/p/<process>`, and a
daemon thread judges the counts (`_progress.Tracker`); the first verdict
written stops every process with `EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import socket
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from jdp import _coordination, _progress, _validate
from jdp._progress import UNEVEN_STEPS_HINT, plural, process_list
from jdp.distributed import _cluster

#: The default of `initialize`'s `stall_timeout_s` (seconds; unset or "0": off).
ENV_STALL_TIMEOUT = "JDP_STALL_TIMEOUT_S"
#: The exit status of a stalled job's processes (as `timeout(1)`'s).
EXIT_CODE = 124
#: How long a process waits for the stuck processes' stacks, and for the others
#: to print, before it exits.
STACK_WAIT_S = 5.0
ACK_WAIT_S = 3.0
#: How long process 0 (the coordination service's host) outlives the others:
#: JAX aborts a process whose service goes away before it exits.
COORDINATOR_LAST_S = 2.0
#: How long leaving the job waits for the check's thread (its period is at most 2 s).
STOP_WAIT_S = 5.0

_PREFIX = "jdp/stall/"
_PROGRESS = _PREFIX + "p/"
_VERDICT = _PREFIX + "verdict"
_STACK = _PREFIX + "stack/"
_ACK = _PREFIX + "ack/"

_log = logging.getLogger("jdp.distributed")


def timeout_from(
    stall_timeout_s: float | None, environ: Mapping[str, str]
) -> float | None:
    """`initialize`'s `stall_timeout_s`, checked, else `$JDP_STALL_TIMEOUT_S`'s."""
    if stall_timeout_s is None:
        meaning = "the stall check's limit; 0 or unset: no stall check"
        return _cluster.env_seconds(
            environ, ENV_STALL_TIMEOUT, meaning, zero_is_unset=True
        )
    real = _validate.is_int(stall_timeout_s) or isinstance(stall_timeout_s, float)
    need = (
        f"a number of seconds > 0, or None (read ${ENV_STALL_TIMEOUT}; unset: no "
        "stall check)"
    )
    seconds = _validate.checked(
        "stall_timeout_s", stall_timeout_s, need, real, lambda v: 0 < v < math.inf
    )
    return float(seconds)


class Verdict(NamedTuple):
    """What stopped the job."""

    #: "stall", or "finished" (processes wait in a step that the finished
    #: process `finished` never started).
    kind: str
    #: The processes that stopped making progress (their stacks are shown).
    behind: list[int]
    #: Every process's progress count, by process.
    counts: dict[int, int]
    finished: int | None = None

    def to_json(self) -> str:
        return json.dumps(self._asdict())

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        d = json.loads(text)
        d["counts"] = {int(k): v for k, v in d["counts"].items()}
        return cls(**d)


class Tracker(_progress.Tracker):
    """`_progress.Tracker`, with the job's `Verdict`."""

    def verdict(self, now: float) -> Verdict | None:
        """The wait for a finished process, or the stall, found now (or None)."""
        counts = dict(enumerate(self.counts))
        if found := self.finished_early(now):
            return Verdict("finished", found[1], counts, found[0])
        if behind := self.stalled(now):
            return Verdict("stall", behind, counts)
        return None


def describe(verdict: Verdict, timeout_s: float, grace_s: float, who: Mapping) -> str:
    """The message of `verdict`; `who`: `{process: "host, pid N"}` where known."""
    counts, n = verdict.counts, len(verdict.counts)

    def named(r: int) -> str:
        return f"process {r} of {n}" + (f" ({who[r]})" if who.get(r) else "")

    if verdict.kind == "finished":
        first, waiting = verdict.finished, verdict.behind
        at = sorted({counts[r] for r in waiting})
        one = len(waiting) == 1
        return (
            f"{named(first)} finished its program after "
            f"{plural(counts[first], 'step call')} while "
            f"{process_list(waiting)} {'is' if one else 'are'} still running (at "
            f"step call {', '.join(map(str, at))}) and made no progress for "
            f"{grace_s:g} s: {'it waits' if one else 'they wait'} in a step that "
            f"process {first} will never join. {UNEVEN_STEPS_HINT}"
        )
    behind = verdict.behind
    low, high = counts[behind[0]], max(counts.values())
    if low == high:
        of = "" if len(behind) == n else f" (of {n}) still running"
        return (
            f"none of the {len(behind)} processes{of} made progress for more than "
            f"{timeout_s:g} s, all at step call {low}: they wait for each other (a "
            "deadlock), or a step takes longer than that."
        )
    one = len(behind) == 1
    subject = named(behind[0]) if one else f"{process_list(behind)} of {n}"
    last = (
        f"its last step call was number {low}" if low else "before its first step call"
    )
    return (
        f"{subject} stopped making progress first: none for more than "
        f"{timeout_s:g} s ({last}), while the others reached step call {high} and "
        f"wait for {'it' if one else 'them'}."
    )


def _dump_stack() -> str:
    """This process's Python stacks (`faulthandler`), but the stall check's own."""
    with tempfile.TemporaryFile(mode="w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    others = [b for b in blocks if not b.lstrip().startswith("Current thread")]
    return "\n\n".join(others or blocks)


class Watchdog:
    """The stall check of one process: a daemon thread; `exit_fn(status)` exits."""

    def __init__(self, client, process_id: int, num_processes: int, timeout_s: float,
                 *, exit_fn: Callable[[int], None]):  # fmt: skip
        self.client = _coordination.Store.of(client)
        self.me, self.n = process_id, num_processes
        self.timeout_s, self.exit_fn = timeout_s, exit_fn
        self.period_s = min(max(timeout_s / 10, 0.1), 2.0)
        self.tracker = Tracker(num_processes, timeout_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finished = False
        self._published: tuple[int, bool] | None = None
        #: The status this process exits with, once a verdict stops the job.
        self.stopping: int | None = None
        self.who: dict[int, str] = {}
        self._lock = threading.Lock()

    def start(self) -> Watchdog:
        self._publish()
        self._thread = threading.Thread(
            target=self._run, name="jdp-stall-watch", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, wait_s: float = 0.0) -> None:
        """Ends the check, waiting up to `wait_s` for its thread to end."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def mark_finished(self) -> None:
        """Says that this process makes no more steps (its program has finished)."""
        self._finished = True
        with contextlib.suppress(Exception):  # the service may be gone
            self._publish()

    def _publish(self) -> None:
        with self._lock:
            now = (_progress.count(), self._finished)
            if now == self._published:
                return
            who = f"{socket.gethostname()}, pid {os.getpid()}"
            value = json.dumps({"n": now[0], "done": now[1], "who": who})
            self.client.put(f"{_PROGRESS}{self.me}", value)
            self._published = now

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                verdict = self._check()
            except Exception:  # the service went away (a shutdown, a crash)
                if self._stop.is_set() or self._finished:
                    return  # past this process's last step: nothing to watch
                continue
            if verdict is not None and not self._stop.is_set():
                self._act(verdict)
                return

    def _check(self) -> Verdict | None:
        """One round: publish, read, judge; the job's verdict, if any."""
        self._publish()
        entries = self.client.entries(_PREFIX)
        reports = {}
        for rank, value in _coordination.by_number(entries, _PROGRESS).items():
            record = json.loads(value)
            reports[rank] = (int(record["n"]), bool(record["done"]))
            self.who[rank] = record.get("who", "")
        if _VERDICT in entries:
            return Verdict.from_json(entries[_VERDICT])
        self.tracker.update(reports, time.monotonic())
        if (found := self.tracker.verdict(time.monotonic())) is None:
            return None
        # The first process to write it wins: every process acts on one.
        with contextlib.suppress(Exception):
            self.client.put(_VERDICT, found.to_json(), overwrite=False)
        return Verdict.from_json(self.client.get(_VERDICT))

    def _act(self, verdict: Verdict) -> None:
        """Prints the verdict (with the stuck processes' stacks), then exits."""
        self.stopping = EXIT_CODE
        stacks: dict[int, str] = {}
        if self.me in verdict.behind:
            stacks[self.me] = _dump_stack()
            with contextlib.suppress(Exception):
                self.client.put(f"{_STACK}{self.me}", stacks[self.me])
        show = [r for r in verdict.behind if r != self.me]
        if self.me != 0 and self.me not in verdict.behind:
            show = []  # process 0 shows them: one copy in a merged output
        deadline = time.monotonic() + STACK_WAIT_S
        for r in show:
            try:
                left_s = deadline - time.monotonic()
                stacks[r] = self.client.wait(f"{_STACK}{r}", left_s)
            except Exception:
                stacks[r] = ""
        self._print(verdict, stacks, show)
        with contextlib.suppress(Exception):
            self.client.put(f"{_ACK}{self.me}", "1")
        # Exit together: JAX may end a job one of whose processes left before
        # the others printed.
        deadline = time.monotonic() + ACK_WAIT_S
        for r in range(self.n):
            if r != self.me:
                with contextlib.suppress(Exception):
                    self.client.wait(f"{_ACK}{r}", deadline - time.monotonic())
        if self.me == 0 and self.n > 1:
            time.sleep(COORDINATOR_LAST_S)  # the others leave first
        self.exit_fn(EXIT_CODE)

    def _print(self, verdict: Verdict, stacks: dict, shown: list[int]) -> None:
        text = "jdp.distributed: " + describe(
            verdict, self.timeout_s, self.tracker.finished_grace_s, self.who
        )
        for r in verdict.behind:
            if r in stacks and stacks[r]:
                text += (
                    f"\nThe Python stack of process {r} (faulthandler, every thread):\n"
                )
                text += textwrap.indent(stacks[r].rstrip(), "    ") + "\n"
            elif r in shown:
                text += (
                    f"\nProcess {r} did not send its stack within {STACK_WAIT_S:g} "
                    "s: its threads cannot run (it may hold Python's GIL in "
                    "native code) or it has gone."
                )
        if not stacks and verdict.behind:
            text += (
                f"\n(The stack of {process_list(verdict.behind)} is in the output "
                f"of {'process 0 and of ' if 0 not in verdict.behind else ''}"
                f"{process_list(verdict.behind)}.)"
            )
        text += (
            f"\nStopping process {self.me} of {self.n} with status {EXIT_CODE}. If "
            f"a process may take longer than {self.timeout_s:g} s between two steps "
            "(an evaluation, a checkpoint), raise `stall_timeout_s` of "
            f"`jdp.distributed.initialize` (or ${ENV_STALL_TIMEOUT})."
        )
        with contextlib.suppress(Exception):  # a closed stream must not block the exit
            print(text, file=sys.stderr, flush=True)
        _log.debug("stall check: %s", verdict)
