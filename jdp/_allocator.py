"""Private: glibc's allocator set up for XLA:CPU's per-step temporaries.

XLA:CPU allocates a step's temporaries (gradients, optimizer updates) on every
call and frees them after it. glibc serves a block above its mmap threshold (32
MiB at most, by default) with fresh pages from the kernel and returns them when
it is freed, so a model whose temporaries pass that size has their pages faulted
in again at every step: the 8.9M-parameter MLP of `benchmarks/allocator.py`
takes 42-50 ms a step instead of 27-31 ms on one core. Raising the mmap and trim
thresholds to 1 GiB keeps freed blocks in the heap for the next step. JAX's
performance guide gives the same advice, as environment variables.

jdp's own entry points use it: the processes `python -m jdp.launch` and
`jdp.launch.run` start (through glibc's `MALLOC_*_` variables, read when a
process starts) and `python -m jdp.demo` (`tune`, at run time, before JAX
allocates the model). Where the variables are already set, or with
`JDP_DEFAULT_MALLOC=1`, glibc's own settings stay.
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
    return env.get(ENV_OPT_OUT, "") not in ("", "0") or any(
        name in env for name in GLIBC_VARIABLES
    )


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with glibc's thresholds for a process to start, unless left alone.

    Example:
      >>> from jdp import _allocator
      >>> _allocator.child_env({})["MALLOC_MMAP_THRESHOLD_"]
      '1073741824'
      >>> _allocator.child_env({"JDP_DEFAULT_MALLOC": "1"})
      {'JDP_DEFAULT_MALLOC': '1'}
    """
    out = dict(env)
    if not _left_alone(env) and sys.platform.startswith("linux"):
        out.update(dict.fromkeys(GLIBC_VARIABLES, str(THRESHOLD_BYTES)))
    return out


def tune() -> bool:
    """Sets glibc's thresholds in this process; whether it did.

    Not on other C libraries or systems, and not where `JDP_DEFAULT_MALLOC=1` or
    glibc's variables are set (the process then started with what they say).
    Blocks allocated before keep their kind; call it before the model exists.
    """
    if _left_alone(os.environ) or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no `mallopt`)
        return False
    done = mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
    return mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1 and done
