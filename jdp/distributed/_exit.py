"""Private: how a process of a multi-process job exits.

`flush_and_exit` ends the process at once (with the stall verdict's status once
the stall check stopped the job). With `initialize`'s `fail_fast`, an uncaught
exception exits at once, and SIGTERM gets back its handler from before JAX's
preemption service took it over.
"""

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
    """A `sys.excepthook` that runs `previous`, then exits the process now.

    Otherwise the interpreter's exit would wait at JAX's shutdown barrier for
    every other process: the job would hang instead of failing.
    """

    def hook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
        except Exception:  # pragma: no cover - a broken hook must not block the exit
            traceback.print_exception(exc_type, exc, tb)
        code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
        flush_and_exit(code)

    hook.jdp_fail_fast = True
    return hook


def flush_and_exit(code: int) -> None:
    """Flushes the standard streams and logging, then `os._exit(code)`.

    Once the stall check stops the job (`Watchdog.stopping`), its status wins:
    a collective that then fails must not turn the stall's 124 into a 1.
    """
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
    """Calls `fn(*args)` (which exits) after `seconds`, on a daemon thread.

    `cancel()` the timer once what it watches is done.
    """
    timer = threading.Timer(seconds, fn, args)
    timer.daemon = True
    timer.start()
    return timer


def _install_fail_fast() -> None:
    """Makes an uncaught exception exit this process at once (see `fail_fast`)."""
    if not getattr(sys.excepthook, "jdp_fail_fast", False):
        sys.excepthook = _exit_on_uncaught(sys.excepthook)


def _python_sigterm_handler():
    """SIGTERM's Python-level handler now (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def _restore_sigterm(handler) -> None:
    """Puts back SIGTERM's handler from before JAX joined the job.

    JAX's preemption service makes SIGTERM only record a preemption notice; with
    `fail_fast` it must stop the process, as the launcher expects.
    """
    if handler is not None:  # None off the main thread
        signal.signal(signal.SIGTERM, handler)
