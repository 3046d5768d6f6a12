"""Private: how a process of a multi-process job exits (at once, with `fail_fast`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import traceback

from jdp.distributed._state import _this


def _exit_on_uncaught(previous):
    """A `sys.excepthook` that runs `previous`, then exits (not at JAX's barrier)."""

    def hook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
        except Exception:  # pragma: no cover - a broken hook must not block the exit
            traceback.print_exception(exc_type, exc, tb)
        flush_and_exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    hook.jdp_fail_fast = True
    return hook


def flush_and_exit(code: int) -> None:
    """Flushes the streams and logging, then `os._exit` (a stall's status wins)."""
    watch = _this.stall_watch
    if watch is not None and watch.stopping is not None:
        code = watch.stopping
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)


def print_and_exit(message: str) -> None:
    """Prints `message` on stderr, then exits with status 1 (`flush_and_exit`)."""
    print(message, file=sys.stderr, flush=True)
    flush_and_exit(1)


def exit_timer(seconds: float, fn, *args) -> threading.Timer:
    """Calls `fn(*args)` (which exits) after `seconds`, on a daemon thread."""
    timer = threading.Timer(seconds, fn, args)
    timer.daemon = True
    timer.start()
    return timer


def sigterm_handler():
    """SIGTERM's Python-level handler now (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def install_fail_fast(sigterm) -> None:
    """Exits at an uncaught exception; puts back SIGTERM's handler `sigterm`.

    JAX's preemption service took SIGTERM over: it only records a notice.
    """
    if sigterm is not None:  # None off the main thread
        signal.signal(signal.SIGTERM, sigterm)
    if not getattr(sys.excepthook, "jdp_fail_fast", False):
        sys.excepthook = _exit_on_uncaught(sys.excepthook)
