"""`jdp._allocator`: glibc's thresholds in the processes jdp's entry points start."""

import os
import subprocess
import sys

import pytest

from jdp import _allocator
from jdp.launch import _setup

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION")


def test_the_launchers_processes_get_the_thresholds():
    env = _setup.process_env(
        {"PATH": "/bin"}, process_id=0, num_processes=2, port=1, devices_per_process=1
    )
    if sys.platform.startswith("linux"):
        assert env["MALLOC_MMAP_THRESHOLD_"] == str(2**30)
        assert env["MALLOC_TRIM_THRESHOLD_"] == str(2**30)
        assert env["MALLOC_ARENA_MAX"] == "1"
    assert env["PATH"] == "/bin"


@pytest.mark.parametrize(
    "base",
    [
        {"JDP_DEFAULT_MALLOC": "1"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_ARENA_MAX": "4"},
    ],
    ids=["opt-out", "own-mmap", "own-trim", "own-arenas"],
)
def test_a_users_own_setting_is_kept(base):
    env = _setup.process_env(
        base, process_id=0, num_processes=2, port=1, devices_per_process=1
    )
    for name in _allocator.SETTINGS:
        assert env.get(name) == base.get(name)


TUNE = "from jdp import _allocator; print(_allocator.tune())"


@pytest.mark.skipif(not GLIBC, reason="glibc only")
@pytest.mark.parametrize(
    "extra, expected",
    [
        ({}, "True"),
        ({"JDP_DEFAULT_MALLOC": "1"}, "False"),
        ({"JDP_DEFAULT_MALLOC": "0"}, "True"),
    ],
    ids=["default", "opt-out", "zero"],
)
def test_tune_sets_the_thresholds_unless_told_not_to(extra, expected):
    assert _run_without_glibc_settings(TUNE, extra) == expected


def _run_without_glibc_settings(code: str, extra: dict) -> str:
    """What `code` prints, run in a fresh process with `extra` but no MALLOC_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("JDP_DEFAULT_MALLOC", None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


MAPPED = """
import ctypes, threading
from jdp import _allocator
tuned = _allocator.tune()

class Info(ctypes.Structure):  # glibc's `struct mallinfo` (int fields)
    _fields_ = [(n, ctypes.c_int) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                "keepcost".split()]

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo.restype = Info
seen = []

def worker():  # as an XLA thread allocates a step's temporaries
    for _ in range(2):
        block = libc.malloc(96 << 20)
        ctypes.memset(block, 1, 96 << 20)
        seen.append(libc.mallinfo().hblkhd)
        libc.free(block)

thread = threading.Thread(target=worker)
thread.start()
thread.join()
print(tuned, seen[-1] >= 96 << 20)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc only")
@pytest.mark.parametrize(
    "extra, expected",
    [({}, "True False"), ({"JDP_DEFAULT_MALLOC": "1"}, "False True")],
    ids=["tuned", "glibc-default"],
)
def test_a_threads_large_block_comes_from_the_heap_once_tuned(extra, expected):
    # glibc maps a block over its mmap threshold, and any block over 64 MiB from a
    # thread's own arena, afresh on every allocation; tuned, the second 96 MiB block
    # of a non-main thread reuses the heap (no mapped bytes while it is held).
    assert _run_without_glibc_settings(MAPPED, extra) == expected


@pytest.mark.parametrize(
    "extra, arena", [({}, None), ({"JAX_PLATFORMS": "cpu"}, "1")], ids=["gpu", "cpu"]
)
def test_an_accelerators_host_keeps_its_arenas(monkeypatch, tmp_path, extra, arena):
    # A host with a GPU device node: the thresholds, but not the one arena (the
    # step's temporaries are on the device), unless JAX is told to run on CPU.
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(_allocator, "ACCELERATOR_NODES", (str(node),))
    env = _allocator.child_env({"PATH": "/bin", **extra})
    if sys.platform.startswith("linux"):
        assert env["MALLOC_MMAP_THRESHOLD_"] == str(2**30)
        assert env.get("MALLOC_ARENA_MAX") == arena
