"""Private: argument checks shared by jdp's modules, with one wording for each.

A wrong type raises `TypeError`, a bad value `ValueError`, e.g. "`num_processes`
must be an int >= 1, got '2' (a str)." An int is never a bool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def checked(
    name: str, value: Any, requirement: str, right_type: bool, fits: Callable
) -> Any:
    """`value`, unless not `right_type` (`TypeError`) or not `fits(value)`."""
    if not right_type:
        raise TypeError(f"`{name}` must be {requirement}, got {describe(value)}.")
    if not fits(value):
        raise ValueError(f"`{name}` must be {requirement}, got {value!r}.")
    return value


def _at_least(
    name: str, value: Any, minimum: int, *, allow_none: bool, note: str
) -> int | None:
    if value is None and allow_none:
        return None
    requirement = f"an int >= {minimum}" + (f" ({note})" if note else "")
    return checked(name, value, requirement, is_int(value), lambda v: v >= minimum)


def boolean(name: str, value: Any) -> bool:
    """Returns `value` if it is a bool; a `TypeError` naming `name` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {describe(value)}.")
    return value


def positive_int(
    name: str, value: Any, *, allow_none: bool = False, note: str = ""
) -> int | None:
    """Returns `value` if it is an int >= 1, or None if `allow_none`.

    `note` is shown in parentheses after the requirement.
    """
    return _at_least(name, value, 1, allow_none=allow_none, note=note)


def non_negative_int(
    name: str, value: Any, *, allow_none: bool = False, note: str = ""
) -> int | None:
    """Like `positive_int`, for an int >= 0."""
    return _at_least(name, value, 0, allow_none=allow_none, note=note)


def index(name: str, value: Any, size: int, *, size_name: str) -> int:
    """Returns `value` if it is an int in `[0, size)`, `size` called `size_name`."""
    requirement = f"an int in [0, {size_name}={size})"
    return checked(name, value, requirement, is_int(value), lambda v: 0 <= v < size)


def finite_number(name: str, value: Any, *, above: float | None = None,
                  at_least: float | None = None, below: float | None = None,
                  note: str = "") -> float:  # fmt: skip
    """Returns `value` as a float if it is a finite real number within bounds.

    `above` and `below` are exclusive bounds, `at_least` an inclusive one;
    `note` is shown in parentheses after the requirement.
    """
    bounds = (("> ", above), (">= ", at_least), ("< ", below))
    parts = [f"{op}{bound}" for op, bound in bounds if bound is not None]
    requirement = "a finite number" + (" " + " and ".join(parts) if parts else "")
    if note:
        requirement += f" ({note})"
    real = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)

    def fits(v) -> bool:
        x = float(v)
        return (
            math.isfinite(x)
            and (above is None or x > above)
            and (at_least is None or x >= at_least)
            and (below is None or x < below)
        )

    return float(checked(name, value, requirement, real, fits))
