"""What counts as damage of a checkpoint step's files, its errors, and setting it aside.

Only a real integrity failure (a checksum that differs, a file missing,
truncated or undecodable) is a `CheckpointCorruptedError`; anything else that
fails while reading a step (`is_damage` tells them apart) is raised as a
`RuntimeError` that says the files are not judged damaged (`not_damage`), and
nothing is moved aside for it. A damaged step is moved aside to
`<step>.damaged-<n>` by the next `save` (`set_aside`); nothing is deleted.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import jax
from etils import epath

from jdp.checkpoint._common import same_kind_of_error

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
    check: an array whose CRC-32 differs from the one recorded at save, or a
    file that is missing, truncated or cannot be decoded. A subclass of
    `ValueError`, which `restore` raised for damaged files before this class
    existed. Any other failure while reading a step is not reported as damage.

    The next `save` of that step number (or an earlier one) moves the damaged
    step aside to `<directory>/<step>.damaged-<n>` (nothing is deleted).

    Args:
      message: The whole error message.
      directory: The checkpoint directory.
      step: The damaged step.
      detail: What is wrong with the step, one sentence.

    Attributes:
      directory: The checkpoint directory (a string), or None.
      step: The damaged step number, or None.
      detail: What is wrong with the step, or None.

    Example:
      >>> import jdp
      >>> issubclass(jdp.checkpoint.CheckpointCorruptedError, ValueError)
      True
    """

    def __init__(
        self,
        message: str,
        *,
        directory: Any = None,
        step: int | None = None,
        detail: str | None = None,
    ):
        super().__init__(message)
        self.directory = None if directory is None else str(directory)
        self.step = step
        self.detail = detail

    def __reduce__(self):
        kwargs = {"directory": self.directory, "step": self.step, "detail": self.detail}
        return _rebuild_corrupted, (str(self), kwargs)


def _rebuild_corrupted(
    message: str, kwargs: dict[str, Any]
) -> CheckpointCorruptedError:
    """Unpickles a `CheckpointCorruptedError` with its attributes."""
    return CheckpointCorruptedError(message, **kwargs)


def corrupt(directory: epath.Path, step: int, detail: str) -> CheckpointCorruptedError:
    """The error for a damaged checkpoint of `step`.

    Args:
      directory: The checkpoint directory.
      step: The damaged step.
      detail: What is wrong with it.

    Returns:
      The error, naming the step and what to do.
    """
    return CheckpointCorruptedError(
        CORRUPT_MSG.format(step=step, directory=directory, detail=detail),
        directory=directory,
        step=step,
        detail=detail,
    )


def is_damage(error: BaseException) -> bool:
    """Whether an error raised while reading a step's files means they are damaged.

    Tensorstore raises a `ValueError` for data it cannot find or decode, the file
    system an `OSError`, JSON a `ValueError`, orbax a `KeyError` for a missing
    item: these are damage. Anything else (a `TypeError` inside orbax, say) is a
    failure of the reader, not of the files.

    Args:
      error: What reading raised.

    Returns:
      True for damage.

    Example:
      >>> from jdp.checkpoint._damage import is_damage
      >>> is_damage(ValueError("DATA_LOSS: ...")), is_damage(TypeError("'<'"))
      (True, False)
    """
    return isinstance(error, OSError | ValueError | KeyError | EOFError | zlib.error)


def not_damage(
    directory: epath.Path,
    step: int,
    error: BaseException,
    *,
    caller: str = "restore",
) -> RuntimeError:
    """The error for a failure to read a step that is not damage (`is_damage`).

    Args:
      directory: The checkpoint directory.
      step: The step being read.
      error: What reading raised.
      caller: The `CheckpointManager` method, for the message.

    Returns:
      A `RuntimeError` to raise `from error`.
    """
    return RuntimeError(
        NOT_DAMAGE_MSG.format(
            caller=caller,
            step=step,
            directory=directory,
            error=f"{type(error).__name__}: {error}",
        )
    )


# -- damaged steps ----------------------------------------------------------------


def set_aside(directory: epath.Path, damaged: dict[int, str]) -> None:
    """Renames damaged steps to `<step>.damaged-<n>` (process 0), with warnings.

    Called by `CheckpointManager.save` itself: the warnings name its caller.
    Every process of a job calls it; process 0 renames, the others wait for it.

    Args:
      directory: The checkpoint directory.
      damaged: What is wrong with each step to move aside, by step.

    Raises:
      OSError: If a step cannot be renamed (naming it and what to do).
    """
    if not damaged:
        return
    if jax.process_index() == 0:
        for step, detail in sorted(damaged.items()):
            n = 1
            while (directory / f"{step}{DAMAGED_SUFFIX}{n}").exists():
                n += 1
            target = directory / f"{step}{DAMAGED_SUFFIX}{n}"
            try:
                (directory / str(step)).rename(target)
            except OSError as e:
                raise same_kind_of_error(
                    e,
                    f"`CheckpointManager.save`: step {step} in {directory} "
                    f"is incomplete or damaged ({detail}), and moving it aside "
                    f"to {target} failed ({type(e).__name__}: {e}). Nothing was "
                    f"saved.\nFix: move or delete {directory / str(step)} "
                    "yourself, then save again.",
                ) from e
            warnings.warn(
                SET_ASIDE_MSG.format(
                    step=step, directory=directory, detail=detail, target=target
                ),
                RuntimeWarning,
                stacklevel=3,
            )
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jdp_checkpoint_set_aside")
