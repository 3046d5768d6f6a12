"""Private: argument checks shared by jdp's modules, with one wording for each.

jdp's convention: an argument of the wrong type raises `TypeError`, one of the
right type with a bad value raises `ValueError`; both name the argument, say what
it must be and show what it got, e.g. "`num_processes` must be an int >= 1, got
'2' (a str)." An int here is a Python `int` other than a bool (`True` is an int to
Python, never a count to jdp).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """Whether `value` is a Python int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def describe(value: Any) -> str:
    """`value` as an error message shows a value of the wrong type: `'2' (a str)`."""
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return f"{value!r} ({article} {kind})"


def _at_least(
    name: str, value: Any, minimum: int, *, allow_none: bool, note: str
) -> int | None:
    if value is None and allow_none:
        return None
    requirement = f"an int >= {minimum}"
    if note:
        requirement += f" ({note})"
    if not is_int(value):
        raise TypeError(f"`{name}` must be {requirement}, got {describe(value)}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be {requirement}, got {value!r}.")
    return value


def boolean(name: str, value: Any) -> bool:
    """Returns `value` if it is a bool; a `TypeError` naming `name` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {describe(value)}.")
    return value


def positive_int(
    name: str, value: Any, *, allow_none: bool = False, note: str = ""
) -> int | None:
    """Returns `value` if it is an int >= 1 (not a bool), or None if `allow_none`.

    Args:
      name: The argument's name, as the caller wrote it (shown in backquotes).
      value: The argument.
      allow_none: Accept None (and return it).
      note: Shown in parentheses after the requirement, e.g. "steps per block" or
        "or None to keep the environment's device count".

    Raises:
      TypeError: If `value` is not an int (or is a bool), naming `name`:
        "`num_processes` must be an int >= 1, got '2' (a str)."
      ValueError: If `value` is an int < 1: "... must be an int >= 1, got 0."
    """
    return _at_least(name, value, 1, allow_none=allow_none, note=note)


def non_negative_int(
    name: str, value: Any, *, allow_none: bool = False, note: str = ""
) -> int | None:
    """Like `positive_int`, for an int >= 0.

    Raises:
      TypeError: If `value` is not an int (or is a bool).
      ValueError: If `value` is an int < 0.
    """
    return _at_least(name, value, 0, allow_none=allow_none, note=note)


def index(name: str, value: Any, size: int, *, size_name: str) -> int:
    """Returns `value` if it is an int in `[0, size)`.

    Args:
      name: The argument's name.
      value: The argument.
      size: The number of valid indices.
      size_name: What `size` is called, shown with its value:
        "`process_id` must be an int in [0, num_processes=2), got 2."

    Raises:
      TypeError: If `value` is not an int (or is a bool).
      ValueError: If `value` is an int outside `[0, size)`.
    """
    requirement = f"an int in [0, {size_name}={size})"
    if not is_int(value):
        raise TypeError(f"`{name}` must be {requirement}, got {describe(value)}.")
    if not 0 <= value < size:
        raise ValueError(f"`{name}` must be {requirement}, got {value!r}.")
    return value


def finite_number(
    name: str,
    value: Any,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    note: str = "",
) -> float:
    """Returns `value` as a float if it is a finite real number within bounds.

    Args:
      name: The argument's name.
      value: The argument: a Python or NumPy real number (not a bool, not a str).
      above: Exclusive lower bound, if any.
      at_least: Inclusive lower bound, if any.
      below: Exclusive upper bound, if any.
      note: Shown in parentheses after the requirement.

    Raises:
      TypeError: If `value` is not a real number: "`block_learning_rate` must be
        a finite number > 0, got '1' (a str)."
      ValueError: If it is NaN, infinite, or out of bounds.
    """
    parts = []
    if above is not None:
        parts.append(f"> {above}")
    if at_least is not None:
        parts.append(f">= {at_least}")
    if below is not None:
        parts.append(f"< {below}")
    requirement = "a finite number" + (" " + " and ".join(parts) if parts else "")
    if note:
        requirement += f" ({note})"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"`{name}` must be {requirement}, got {describe(value)}.")
    x = float(value)
    if (
        not math.isfinite(x)
        or (above is not None and not x > above)
        or (at_least is not None and not x >= at_least)
        or (below is not None and not x < below)
    ):
        raise ValueError(f"`{name}` must be {requirement}, got {value!r}.")
    return x
