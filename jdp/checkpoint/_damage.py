"""What counts as damage of a step's files, its errors, and setting it aside.

Only an integrity failure is a `CheckpointCorruptedError`; any other failure to
read a step is a `RuntimeError` saying the files are not judged damaged.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import jax
from etils import epath
from jax.experimental import multihost_utils

from jdp.checkpoint._common import error_text, same_kind_of_error

#: What a damaged step is renamed to: `<step>.damaged-<n>`.
DAMAGED_SUFFIX = ".damaged-"

CORRUPT_MSG = (
    "`CheckpointManager.restore`: the checkpoint of step {step} in {directory} is "
    "corrupted or truncated: {detail} Restore an older step "
    "(`manager.restore(like, step=...)`; `manager.all_steps()` lists the complete "
    "ones), or save again: the next `save` of step {step} or an earlier step moves "
    "the damaged files aside to {directory}/{step}" + DAMAGED_SUFFIX + "<n> "
    "(nothing is deleted)."
)

SET_ASIDE_MSG = (
    "`CheckpointManager.save`: step {step} in {directory} was incomplete or "
    "damaged ({detail}); moved it to {target} so that step {step} can be saved "
    "again. Nothing was deleted: inspect or delete {target} yourself."
)

NOT_DAMAGE_MSG = (
    "`CheckpointManager.{caller}`: reading step {step} in {directory} failed "
    "({error}). This is not a sign of damaged files (a checksum that differs, or "
    "a file that is missing, truncated or undecodable, raises "
    "`jdp.checkpoint.CheckpointCorruptedError`), so step {step} was left as it "
    "is: nothing was moved aside.\nFix: check that the installed "
    "orbax-checkpoint and tensorstore are versions jdp supports; if they are, "
    "please report this error with its traceback."
)


class CheckpointCorruptedError(ValueError):
    """A checkpoint step whose files are damaged (not a `like` that does not match).

    Raised by `CheckpointManager.restore` when a step's files fail an integrity
    check: a CRC-32 that differs from the one recorded at save, or a file that
    is missing, truncated or undecodable. The next `save` of that step number
    (or an earlier one) moves the step aside to `<step>.damaged-<n>`.

    Args:
      message: The whole error message.
      directory, step, detail: As the attributes.

    Attributes:
      directory: The checkpoint directory (a string), or None.
      step: The damaged step number, or None.
      detail: What is wrong with the step, or None.

    Example:
      >>> import jdp
      >>> issubclass(jdp.checkpoint.CheckpointCorruptedError, ValueError)
      True
    """

    def __init__(self, message: str, *, directory: Any = None,
                 step: int | None = None, detail: str | None = None):  # fmt: skip
        super().__init__(message)
        self.directory = None if directory is None else str(directory)
        self.step = step
        self.detail = detail

    def __reduce__(self):  # pickles the keyword attributes too
        kwargs = {"directory": self.directory, "step": self.step, "detail": self.detail}
        return functools.partial(type(self), **kwargs), (str(self),)


def corrupt(directory: epath.Path, step: int, detail: str) -> CheckpointCorruptedError:
    """The error for a damaged checkpoint of `step`, saying what to do."""
    return CheckpointCorruptedError(
        CORRUPT_MSG.format(step=step, directory=directory, detail=detail),
        directory=directory, step=step, detail=detail,
    )  # fmt: skip


def is_damage(error: BaseException) -> bool:
    """Whether an error raised reading a step's files means they are damaged."""
    return isinstance(error, OSError | ValueError | KeyError | EOFError | zlib.error)


def not_damage(
    directory: epath.Path, step: int, error: BaseException, *, caller: str = "restore"
) -> RuntimeError:
    """The error for a failure to read a step that is not damage (`is_damage`)."""
    return RuntimeError(NOT_DAMAGE_MSG.format(
        caller=caller, step=step, directory=directory, error=error_text(error)
    ))  # fmt: skip


@contextlib.contextmanager
def reading(directory: epath.Path, step: int, failed: str) -> Iterator[None]:
    """Raises errors reading `step` as damage (`corrupt`) or `not_damage`."""
    try:
        yield
    except CheckpointCorruptedError:
        raise
    except Exception as e:  # orbax, tensorstore and JSON raise many types
        if not is_damage(e):
            raise not_damage(directory, step, e) from e
        raise corrupt(directory, step, f"{failed} ({error_text(e)}).") from e


def set_aside(directory: epath.Path, damaged: dict[int, str]) -> None:
    """Renames the `damaged` steps to `<step>.damaged-<n>` (a collective)."""
    if not damaged:
        return
    if jax.process_index() == 0:
        for step, detail in sorted(damaged.items()):
            n = 1
            while (target := directory / f"{step}{DAMAGED_SUFFIX}{n}").exists():
                n += 1
            try:
                (directory / str(step)).rename(target)
            except OSError as e:
                raise same_kind_of_error(
                    e,
                    f"`CheckpointManager.save`: step {step} in {directory} "
                    f"is incomplete or damaged ({detail}), and moving it aside "
                    f"to {target} failed ({error_text(e)}). Nothing was "
                    f"saved.\nFix: move or delete {directory / str(step)} "
                    "yourself, then save again.",
                ) from e
            warnings.warn(SET_ASIDE_MSG.format(
                step=step, directory=directory, detail=detail, target=target
            ), RuntimeWarning, stacklevel=3)  # fmt: skip
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jdp_checkpoint_set_aside")
