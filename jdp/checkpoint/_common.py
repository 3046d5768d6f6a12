"""Pieces shared by the checkpoint modules: argument checks, errors, messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def check_step_number(step: Any, what: str) -> int:
    """Returns `step` as an int if it is a non-negative integer step number.

    Args:
      step: A Python int or a 0-d integer array (e.g. `state.step`).
      what: The argument's name, for the messages.

    Returns:
      The step number.

    Raises:
      TypeError: If `step` is not an integer (a bool is not one).
      ValueError: If it is negative or not 0-d.
    """
    if isinstance(step, bool) or not np.issubdtype(np.asarray(step).dtype, np.integer):
        raise TypeError(f"`{what}` must be an integer step number; got {step!r}.")
    if np.ndim(step) != 0 or int(step) < 0:
        raise ValueError(f"`{what}` must be a non-negative integer; got {step!r}.")
    return int(step)


def same_kind_of_error(error: BaseException, message: str) -> OSError:
    """An `OSError` carrying `message`, of `error`'s type where it is one.

    A `PermissionError` stays a `PermissionError` (and so on), so that callers
    may still catch the specific type; an error whose type cannot be built from
    one message becomes a plain `OSError`.

    Args:
      error: The error that was caught.
      message: The message of the new error.

    Returns:
      The new error, to raise `from error`.
    """
    if isinstance(error, OSError):
        try:
            return type(error)(message)
        except TypeError:
            pass
    return OSError(message)


def short_list(names: Sequence[str]) -> str:
    """The first three of `names`, comma-separated, then "and N more".

    For lists inside a sentence; `jdp._tree.format_problems` lists one problem
    a line instead.

    Args:
      names: What to list, e.g. leaf paths.

    Returns:
      E.g. `"a, b, c and 2 more"`.
    """
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
