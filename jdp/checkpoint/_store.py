"""The steps in a checkpoint directory: orbax's manager, and which are complete.

`StepStore` makes the orbax manager lazily (reading never creates directories)
and drops it after a failed save.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from jdp.checkpoint import _format, _integrity
from jdp.checkpoint._common import error_text, same_kind_of_error
from jdp.checkpoint._damage import CheckpointCorruptedError
from jdp.checkpoint._format import METADATA_ITEM, REPLICAS_ITEM, STATE_ITEM

NO_CHECKPOINT_MSG = (
    "`CheckpointManager.restore`: no checkpoint in {directory}{why}. Save one with "
    "`manager.save(step, state)` first, or check the directory path."
)

WRITE_FAILED_MSG = (
    "`CheckpointManager.save`: {what} step {step} to {directory} failed "
    "({error}). Step {step} was not committed; the steps saved before it are "
    "intact{kept}.\nFix: check that {directory} is writable and has free space "
    "(or pass another directory), then save again."
)

NOT_A_DIRECTORY_MSG = (
    "`CheckpointManager.{caller}`: the checkpoint directory {directory} {what}. "
    "Expected a directory holding one subdirectory per saved step, or a path "
    "that does not exist yet (to start a new run).\nFix: {fix}"
)


def check_directory(directory: epath.Path, caller: str) -> None:
    """Raises if `directory` is (or is under) a file or a dangling or looping link."""
    path = os.fspath(directory)
    problem = None if "://" in path else _first_problem(path)  # none on object stores
    if problem is None:
        return
    error, where, what, fix = problem
    what = what if where == path else f"cannot be created: {where}, above it, {what}"
    message = NOT_A_DIRECTORY_MSG.format(
        caller=caller, directory=directory, what=what, fix=fix
    )
    raise error(message)


def _first_problem(path: str) -> tuple[type[OSError], str, str, str] | None:
    """`(error type, where, what is wrong, fix)` for `path` or a parent, or None."""
    current = path
    while True:
        link = os.path.islink(current)
        target = _link_target(current) if link else None
        try:
            info = os.stat(current)
        except FileNotFoundError:
            if link:
                return (
                    OSError, current,
                    f"is a symbolic link to {target}, which does not exist",
                    f"create {target} (`mkdir -p`), point {current} at an "
                    "existing directory, or pass another path.",
                )  # fmt: skip
        except NotADirectoryError:
            pass  # a file above it: found further up
        except OSError as e:
            if e.errno != errno.ELOOP:
                return None  # unreadable: the caller's own error says so
            if link:
                return (
                    OSError, current,
                    f"is a symbolic link to {target} that loops (following the "
                    "links never reaches a directory)",
                    f"point {current} at a real directory (or remove it), or "
                    "pass another path.",
                )  # fmt: skip
        else:
            if stat.S_ISDIR(info.st_mode):
                return None
            what = f"a symbolic link to {target}, which is " if link else ""
            return (
                NotADirectoryError, current, f"is {what}a file, not a directory",
                f"check the path for a typo, or move {current} away.",
            )  # fmt: skip
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def _link_target(link: str) -> str:
    """Where a symbolic link points, as an absolute path (relative targets too)."""
    return os.path.normpath(os.path.join(os.path.dirname(link), os.readlink(link)))


class StepStore:
    """The step directories under one checkpoint directory (absolute, or a URL)."""

    def __init__(self, directory: epath.Path, *, max_to_keep: int | None,
                 save_interval_steps: int, async_save: bool):  # fmt: skip
        self.directory = directory
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.async_save = async_save
        self._manager: ocp.CheckpointManager | None = None
        self._complete: dict[int, dict[str, Any]] = {}
        # Steps whose arrays a restore found damaged: {step: what is wrong}.
        self._damaged: dict[int, str] = {}
        self._pending: int | None = None  # the step an async save is writing

    def open(self, *, create: bool) -> ocp.CheckpointManager | None:
        """The orbax manager (made with `create`; else None without a directory)."""
        if self._manager is None and (create or self.directory.exists()):
            policies = ocp.checkpoint_managers
            options = ocp.CheckpointManagerOptions(
                create=True, enable_async_checkpointing=self.async_save,
                # Directories made before `save` returns: else, when that fails,
                # orbax's threads wait minutes for them and block the exit.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                save_decision_policy=policies.AnySavePolicy([
                    policies.FixedIntervalPolicy(self.save_interval_steps),
                    policies.PreemptionCheckpointingPolicy(),
                ]),
                preservation_policy=policies.LatestN(n=self.max_to_keep),
            )  # fmt: skip
            self._manager = ocp.CheckpointManager(
                self.directory, options=options,
                item_names=(STATE_ITEM, METADATA_ITEM, REPLICAS_ITEM),
            )  # fmt: skip
        return self._manager

    def reload_if_changed(self) -> None:
        """Makes orbax list the steps again if another manager wrote here since."""
        manager = self.open(create=True)
        if set(manager.all_steps()) != set(self.steps_on_disk()):
            manager.reload()

    def due(self, manager: ocp.CheckpointManager, step: int) -> bool:
        """Whether `save_interval_steps` (or a preemption) asks for this step."""
        return step % self.save_interval_steps == 0 or manager.reached_preemption(step)

    def write(self, step: int, items: dict[str, Any]) -> None:
        """Saves (or, with `async_save`, starts saving) `items` as `step`."""
        manager = self.open(create=True)
        self._complete.pop(step, None)
        try:
            manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            self._discard()
            raise self.write_failed(step, e, what="writing") from e
        self._pending = step if self.async_save else None

    def finish_pending(self) -> None:
        """Waits for an async save; raises its failure as an `OSError`."""
        if self._manager is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            step, self._pending = self._pending, None
            self._discard()
            raise self.write_failed(step, e, what="the background write of") from e
        self._pending = None

    def write_failed(self, step: int | None, error: BaseException, *,
                     what: str) -> OSError:  # fmt: skip
        """The `OSError` for a save of `step` that failed (`what`: e.g. "writing")."""
        try:
            kept = self.complete_steps()
        except Exception:  # the directory may be unreadable too
            kept = []
        message = WRITE_FAILED_MSG.format(
            what=what, step=step, directory=self.directory, error=error_text(error),
            kept=f" ({kept})" if kept else "",
        )  # fmt: skip
        return same_kind_of_error(error, message)

    def close(self) -> None:
        """Releases orbax's resources (after `finish_pending`)."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()

    def _discard(self) -> None:
        """Drops the orbax manager after a failed save; the next save makes anew."""
        with contextlib.suppress(Exception):  # the failure was already reported
            self.close()

    def steps_on_disk(self) -> list[int]:
        """Every step directory on disk, committed or not, damaged or not."""
        try:
            entries = list(self.directory.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(
            int(p.name)
            for p in entries
            if p.name.isascii() and p.name.isdigit() and p.is_dir()
        )

    def complete_steps(self) -> list[int]:
        """Step numbers of the complete checkpoints, oldest first."""
        if self.open(create=False) is None:
            return []
        return [s for s in self.steps_on_disk() if self.incomplete(s) is None]

    def incomplete(self, step: int) -> str | None:
        """Why a step on disk is not a complete checkpoint, or None if it is."""
        if step in self._complete:
            return None
        if step in self._damaged:
            return self._damaged[step]
        path = self.directory / str(step)
        try:
            if not ocp.step.is_path_finalized(path):
                return "it was never committed: a save was interrupted or is running"
            if not (path / STATE_ITEM).exists():
                return f"its `{STATE_ITEM}` item is missing"
            meta = _format.read_metadata(self.open(create=False), self.directory, step)
        except CheckpointCorruptedError as e:
            return e.detail
        except OSError as e:
            return f"it cannot be read ({error_text(e)})"
        self._complete[step] = meta
        return None

    def metadata(self, step: int) -> dict[str, Any]:
        """The record of a step: the one `incomplete` kept, else read from disk."""
        if step in self._complete:
            return self._complete[step]
        return _format.read_metadata(self.open(create=False), self.directory, step)

    def verify_arrays(self, step: int) -> str | None:
        """What is wrong with a step's arrays (`_integrity.verify_arrays`), or None."""
        return _integrity.verify_arrays(self.directory, step, self.metadata(step))

    def mark_damaged(self, step: int, detail: str) -> None:
        """Records that a restore found `step` damaged: no longer complete."""
        self._damaged[step] = detail
        self._complete.pop(step, None)

    def forget(self, steps: Iterable[int]) -> None:
        """Forgets what is known of `steps` (e.g. after they were moved aside)."""
        for step in steps:
            self._complete.pop(step, None)
            self._damaged.pop(step, None)
