"""Private: glibc's mmap and trim thresholds raised for XLA:CPU's step temporaries.

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
#: glibc's variables for them (the trailing underscore is glibc's spelling).
GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
# `mallopt` parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _left_alone(env: Mapping[str, str]) -> bool:
    opted_out = env.get(ENV_OPT_OUT, "") not in ("", "0")
    return opted_out or any(name in env for name in GLIBC_VARIABLES)


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with glibc's thresholds for a process to start, unless left alone."""
    out = dict(env)
    if not _left_alone(env) and sys.platform.startswith("linux"):
        out.update(dict.fromkeys(GLIBC_VARIABLES, str(THRESHOLD_BYTES)))
    return out


def tune() -> bool:
    """Sets glibc's thresholds in this process; whether it did.

    Call it before the model exists: blocks allocated before keep their kind.
    """
    if _left_alone(os.environ) or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no `mallopt`)
        return False
    done = mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
    return mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1 and done
