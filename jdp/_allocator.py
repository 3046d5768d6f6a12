"""Private: glibc's allocator set for XLA:CPU's step temporaries.

Why, and who sets it: "Temporaries over 32 MiB on CPU" in the performance guide.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

#: Set to 1 to keep glibc's own settings in jdp's entry points.
ENV_OPT_OUT = "JDP_DEFAULT_MALLOC"
#: glibc's variables jdp sets, and their `mallopt` parameters (glibc's <malloc.h>).
#: Freed blocks up to 1 GiB stay in the heap; one arena, since a thread other than
#: the main one (XLA's) has an arena of its own, of heaps of at most 64 MiB.
SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": (-3, 1 << 30),
    "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30),
    "MALLOC_ARENA_MAX": (-8, 1),
}
#: Device nodes of an accelerator's host (NVIDIA, AMD, TPU), where the temporaries
#: are the device's: no one arena there (the input pipelines' threads would wait).
ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/accel0")


def _settings(env: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """What to set: `SETTINGS`, less the one arena on an accelerator's host."""
    on_cpu = env.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if on_cpu or not any(os.path.exists(node) for node in ACCELERATOR_NODES):
        return SETTINGS
    return {k: v for k, v in SETTINGS.items() if k != "MALLOC_ARENA_MAX"}


def _left_alone(env: Mapping[str, str]) -> bool:
    opted_out = env.get(ENV_OPT_OUT, "") not in ("", "0")
    return opted_out or any(name in env for name in SETTINGS)


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with jdp's glibc settings for a process to start, unless left alone."""
    out = dict(env)
    if not _left_alone(env) and sys.platform.startswith("linux"):
        out.update({name: str(v) for name, (_, v) in _settings(env).items()})
    return out


def tune() -> bool:
    """Sets glibc's thresholds and arena count in this process; whether it did.

    Call it before the model exists and before JAX starts its threads: blocks
    allocated before keep their kind, and a thread keeps the arena it has.
    """
    if _left_alone(os.environ) or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no `mallopt`)
        return False
    return all([mallopt(*setting) == 1 for setting in _settings(os.environ).values()])
