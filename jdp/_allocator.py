"""Private: glibc's allocator set for XLA:CPU's step temporaries.

The mmap and trim thresholds are raised so that freed blocks up to 1 GiB stay in the
heap for the next step, and one arena serves every thread: a thread other than the
main one allocates from an arena of its own, whose heaps are at most 64 MiB, so a
larger block from an XLA worker thread would be freshly mapped (and faulted in) on
every step whatever the thresholds.

Why, and who sets them: "Temporaries over 32 MiB on CPU" in the performance guide.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

#: Set to 1 to keep glibc's own settings in jdp's entry points.
ENV_OPT_OUT = "JDP_DEFAULT_MALLOC"
#: The mmap and trim thresholds jdp sets, in bytes.
THRESHOLD_BYTES = 1 << 30
#: glibc's variables jdp sets (the trailing underscores are glibc's spelling), and
#: their `mallopt` parameters from glibc's <malloc.h>.
SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": (-3, THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": (-1, THRESHOLD_BYTES),
    "MALLOC_ARENA_MAX": (-8, 1),
}
GLIBC_VARIABLES = tuple(SETTINGS)


def _left_alone(env: Mapping[str, str]) -> bool:
    opted_out = env.get(ENV_OPT_OUT, "") not in ("", "0")
    return opted_out or any(name in env for name in GLIBC_VARIABLES)


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with glibc's thresholds for a process to start, unless left alone."""
    out = dict(env)
    if not _left_alone(env) and sys.platform.startswith("linux"):
        out.update({name: str(value) for name, (_, value) in SETTINGS.items()})
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
    return all([mallopt(param, value) == 1 for param, value in SETTINGS.values()])
