"""Private: the entry point of every process started by `jdp.launch`.

Usage (by the launcher only; run by path, so that starting a process imports
nothing but the standard library before the target does):
  python .../jdp/launch/_worker.py --script path/to/script.py [args...]
  python .../jdp/launch/_worker.py --module package.module [args...]
  python .../jdp/launch/_worker.py --call payload.pkl result.pkl

It runs the target like `python script.py` / `python -m module` would, with one
difference: if the target fails (an uncaught exception or a non-zero exit), the
process prints the traceback and exits at once. A normal interpreter exit would run
JAX's shutdown barrier first, which waits for the other processes (up to its
shutdown timeout) and turns a failure into a hang.
"""

from __future__ import annotations

import logging
import os
import pickle
import runpy
import sys
import threading
import time
import traceback
import types


def flush_and_exit(code: int) -> None:
    """Flushes the standard streams and logging, then `os._exit(code)`."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pragma: no cover - e.g. a closed pipe
            pass
    logging.shutdown()
    os._exit(code)


def _run_script(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")


def _run_module(name: str, args: list[str]) -> None:
    sys.argv = [name, *args]
    sys.path[0] = os.getcwd()
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def _run_call(payload_path: str, result_path: str) -> None:
    with open(payload_path, "rb") as f:
        # Two pickles: first where to import from (plain strings), then the call,
        # whose `fn` is pickled by reference and needs that to be found.
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
    """Imports the parent's main script as `__mp_main__` (multiprocessing's spawn).

    Functions defined in the launching script are pickled as `__main__.name`; as
    with `multiprocessing`, the script is run again under another name (so its
    `if __name__ == "__main__":` block does not run) and stands in for `__main__`.
    """
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    sys.modules["__mp_main__"] = module
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = module


def _exit_when_orphaned(period_s: float = 1.0) -> None:
    """Exits this process if the launcher dies (e.g. SIGKILL): no orphaned jobs."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:
                try:  # the launcher read our output: this may hit a closed pipe
                    print("jdp.launch: the launcher died; exiting.", file=sys.stderr)
                except Exception:
                    pass
                flush_and_exit(1)

    threading.Thread(target=watch, name="jdp-orphan-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    """Runs the target named by `argv`; exits at once if it fails."""
    if len(argv) < 2 or argv[0] not in ("--script", "--module", "--call"):
        print(__doc__, file=sys.stderr)
        flush_and_exit(2)
    _exit_when_orphaned()
    mode, target, rest = argv[0], argv[1], argv[2:]
    try:
        if mode == "--script":
            _run_script(target, rest)
        elif mode == "--module":
            _run_module(target, rest)
        else:
            _run_call(target, rest[0])
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        flush_and_exit(e.code if isinstance(e.code, int) else 1)
    except KeyboardInterrupt:
        traceback.print_exc()
        flush_and_exit(130)
    except BaseException:
        traceback.print_exc()
        flush_and_exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
