"""Private: how a process of a multi-process job exits.

`flush_and_exit` ends the process at once (with the stall verdict's status once
the stall check stopped the job), and `initialize`'s `fail_fast` hooks make a
failing process end so instead of holding up the job: an uncaught exception
exits at once, and SIGTERM stops the process again after JAX's preemption
service took it over.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback

from jdp.distributed._state import _this


def _exit_on_uncaught(previous):
    """A `sys.excepthook` that prints the traceback, then exits the process now.

    An uncaught exception normally ends in the interpreter's exit handlers, where
    JAX's shutdown barrier waits for every other process (for up to its shutdown
    timeout): the job would hang instead of failing.
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

    Once the stall check has decided to stop the job (`Watchdog.stopping`), the
    process exits with its status whatever path gets here first: a collective
    that fails because another process already left must not turn the stall's
    124 into an error's 1.
    """
    watch = _this.stall_watch
    if watch is not None and getattr(watch, "stopping", None) is not None:
        code = watch.stopping
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pragma: no cover
            pass
    logging.shutdown()
    os._exit(code)


def _install_fail_fast() -> None:
    """Makes an uncaught exception exit this process at once (see `fail_fast`)."""
    if not getattr(sys.excepthook, "jdp_fail_fast", False):
        sys.excepthook = _exit_on_uncaught(sys.excepthook)


def _python_sigterm_handler():
    """SIGTERM's Python-level handler now (None if not readable or not Python's)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def _restore_sigterm(handler) -> None:
    """Puts back SIGTERM's handler from before JAX joined the job.

    JAX's preemption service takes SIGTERM over: the signal then only records a
    preemption notice (for `jax.experimental.multihost_utils`' sync points) and
    the process runs on. With `fail_fast` (under `python -m jdp.launch`, SIGTERM
    comes from the launcher stopping the job), it must stop the process as in
    any program.
    """
    if handler is None or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, handler)
