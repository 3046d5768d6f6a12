"""Pieces shared by the checkpoint modules: argument checks, errors, messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def check_step_number(step: Any, what: str) -> int:
    """`step` (a Python int or a 0-d integer array) as an int; `what` names it."""
    if isinstance(step, bool) or not np.issubdtype(np.asarray(step).dtype, np.integer):
        raise TypeError(f"`{what}` must be an integer step number; got {step!r}.")
    if np.ndim(step) != 0 or int(step) < 0:
        raise ValueError(f"`{what}` must be a non-negative integer; got {step!r}.")
    return int(step)


def error_text(error: BaseException) -> str:
    """`"TypeName: message"`, for the messages that quote a caught error."""
    return f"{type(error).__name__}: {error}"


def same_kind_of_error(error: BaseException, message: str) -> OSError:
    """An `OSError` with `message`, of `error`'s type where that can be built."""
    if isinstance(error, OSError):
        try:
            return type(error)(message)
        except TypeError:
            pass
    return OSError(message)


def short_list(names: Sequence[str]) -> str:
    """The first three of `names`, comma-separated, then "and N more"."""
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
