"""Private: the entry point of every process started by `jdp.launch`.

Usage (by the launcher only; run by path, so that nothing but the standard
library is imported before the target):
  python .../jdp/launch/_worker.py --script path/to/script.py [args...]
  python .../jdp/launch/_worker.py --module package.module [args...]
  python .../jdp/launch/_worker.py --call payload.pkl result.pkl

It runs the target as `python script.py` / `python -m module` would, except that
a failing target (an uncaught exception or a non-zero exit) prints its traceback
and exits at once: a normal exit would first wait at JAX's shutdown barrier for
the other processes, turning a failure into a hang. With `$JDP_PROGRESS_FILE`
set, a thread reports the process's progress there (`report_progress`), and a
last record marks a target that finished without an error (`report_finished`).
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import pickle
import runpy
import sys
import sysconfig
import threading
import time
import traceback
import types

#: Where the launcher wants this process's progress reports (a JSON file).
ENV_PROGRESS_FILE = "JDP_PROGRESS_FILE"
#: The module whose `count()` is this process's progress (never imported here).
PROGRESS_MODULE = "jdp._progress"
#: Seconds between two progress reports.
REPORT_S = 0.5

# Set once the target has finished without an error (see `report_finished`).
_finished = threading.Event()
# Held while a record is made and written: the last record written is the newest.
_write_lock = threading.Lock()


def _exit_now(code: int) -> None:
    """`jdp.distributed`'s `flush_and_exit(code)`, imported only as the process ends."""
    try:
        from jdp.distributed._exit import flush_and_exit
    except BaseException:  # pragma: no cover - a broken installation
        os._exit(code)
    flush_and_exit(code)


def _run_target(target: str, args: list[str], *, module: bool) -> None:
    """Runs a script, or a module (`module`), as `__main__`."""
    sys.argv = [target, *args]
    if module:
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def _run_call(payload_path: str, result_path: str) -> None:
    with open(payload_path, "rb") as f:
        # First where to import from, then the call (`fn` is pickled by reference).
        where = pickle.load(f)
        for entry in where["sys_path"]:
            if entry not in sys.path:
                sys.path.append(entry)
        sys.path[0] = os.getcwd()
        if where["main"] is not None:
            _import_main(where["main"])
        payload = pickle.load(f)
    sys.argv = [payload_path]
    if payload["initialize"]:
        import jdp.distributed

        jdp.distributed.initialize()
    result = payload["fn"](*payload["args"], **payload["kwargs"])
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, result_path)


def _import_main(path: str) -> None:
    """Imports the parent's main script as `__mp_main__`, then `__main__` (for `fn`)."""
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    sys.modules["__mp_main__"] = module
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = module


def _exit_when_orphaned() -> None:
    """Exits this process if the launcher dies (e.g. SIGKILL): no orphaned jobs."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        with contextlib.suppress(Exception):  # our output may be a closed pipe
            print("jdp.launch: the launcher died; exiting.", file=sys.stderr)
        _exit_now(1)

    threading.Thread(target=watch, name="jdp-orphan-watch", daemon=True).start()


def _library_dirs() -> tuple[str, ...]:
    """Directories of code that is not the program's own: Python's, packages, jdp."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # jdp
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def _describe_frame(frame, base: str | None = None, *, source: bool = True) -> str:
    """`file:line in function`, then the line's source; `file` relative to `base`."""
    code = frame.f_code
    path = os.path.realpath(code.co_filename)
    shown = os.path.relpath(path, base) if base else os.path.basename(path)
    lineno = frame.f_lineno  # None while the frame is between two lines
    text = f"{shown}:{'?' if lineno is None else lineno} in {code.co_name}"
    line = linecache.getline(code.co_filename, lineno).strip() if lineno else ""
    return f"{text}: `{line}`" if source and line else text


def where(thread_id: int, library_dirs: tuple[str, ...]) -> str | None:
    """Where thread `thread_id` is: its innermost frame in the program's own code.

    E.g. ``train.py:40 in main: `float(loss)`, inside jax/_src/array.py:623 in
    _value``; None if the thread has no Python frame.
    """
    innermost = own = sys._current_frames().get(thread_id)
    if innermost is None:
        return None
    while own is not None and (  # out of library code (and `<frozen ...>`)
        own.f_code.co_filename.startswith("<")
        or os.path.realpath(own.f_code.co_filename).startswith(library_dirs)
    ):
        own = own.f_back
    if own is None:
        return _describe_frame(innermost)
    text = _describe_frame(own)
    if innermost is not own:
        path = os.path.realpath(innermost.f_code.co_filename)
        base = next((d for d in library_dirs if path.startswith(d)), None)
        if base is not None and os.path.basename(base.rstrip(os.sep)) == "jdp":
            base = os.path.dirname(base.rstrip(os.sep))  # show jdp/... paths
        text += ", inside " + _describe_frame(innermost, base, source=False)
    return text


def _progress_record() -> dict:
    # The module may be caught while it is being imported, without `count` yet.
    count = getattr(sys.modules.get(PROGRESS_MODULE), "count", None)
    record = {"pid": os.getpid(), "beats": count() if count is not None else 0}
    if _finished.is_set():
        record["finished"] = True
    return record


def _write_record(path: str, record: dict) -> bool:
    """Replaces the record at `path` atomically; False if that failed."""
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:  # the launcher removed its directory: it is ending
        return False
    return True


def report_progress(path: str) -> None:
    """Writes this process's progress to `path` every `REPORT_S` seconds (a thread).

    The record, `{"pid", "beats", "where"}` (and `"finished": true` after
    `report_finished`), is replaced atomically when it changed.
    """
    main_id = threading.main_thread().ident
    library_dirs = _library_dirs()

    def report():
        last = None
        while True:
            with _write_lock:
                record = _progress_record()
                try:
                    record["where"] = where(main_id, library_dirs)
                except Exception:  # a frame caught mid-change: the count goes out
                    record["where"] = last.get("where") if last else None
                if record != last and _write_record(path, record):
                    last = record
            time.sleep(REPORT_S)

    threading.Thread(target=report, name="jdp-progress", daemon=True).start()


def report_finished(path: str) -> None:
    """Writes the last record now (before JAX's shutdown barrier): finished."""
    with _write_lock:
        _finished.set()
        _write_record(path, {**_progress_record(), "where": None})


def main(argv: list[str]) -> None:
    """Runs the target named by `argv`; exits at once if it fails."""
    if len(argv) < 2 or argv[0] not in ("--script", "--module", "--call"):
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)  # nothing ran yet: a normal exit is as quick
    _exit_when_orphaned()
    if progress := os.environ.get(ENV_PROGRESS_FILE):
        report_progress(progress)
    mode, target, rest = argv[0], argv[1], argv[2:]
    try:
        if mode == "--call":
            _run_call(target, rest[0])
        else:
            _run_target(target, rest, module=mode == "--module")
    except SystemExit as e:
        if e.code not in (None, 0):
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            _exit_now(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:
        traceback.print_exc()
        _exit_now(130 if isinstance(e, KeyboardInterrupt) else 1)
    if progress:
        report_finished(progress)


if __name__ == "__main__":
    main(sys.argv[1:])
