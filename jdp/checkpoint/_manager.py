"""`jdp.checkpoint.CheckpointManager`; the modules next to it do the work."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
import weakref
from typing import Any

import jax
from etils import epath

from jdp import _validate
from jdp._tree import PyTree
from jdp.checkpoint import _restore
from jdp.checkpoint._common import check_step_number, error_text
from jdp.checkpoint._damage import DAMAGED_SUFFIX, CheckpointCorruptedError, set_aside
from jdp.checkpoint._extra import encode_extra
from jdp.checkpoint._lock import DirectoryLock, acquire_for_job, check_same_directory
from jdp.checkpoint._save import check_not_overwriting, check_replicated, save_items
from jdp.checkpoint._store import StepStore, check_directory

FALLBACK_MSG = (
    "`CheckpointManager.restore`: step {step} in {directory} is damaged ({detail}); "
    "restoring step {older}, the newest complete step before it, instead. The next "
    "`save` of step {step} or an earlier step moves the damaged step aside to "
    "{directory}/{step}" + DAMAGED_SUFFIX + "<n> (nothing is deleted)."
)

ONLY_DAMAGED_MSG = (
    "`CheckpointManager.restore`: {directory} holds no complete checkpoint, only "
    "incomplete or damaged step(s) {steps}; returning `default`. The next `save` "
    "of step {last} or an earlier step moves them aside to "
    "{directory}/<step>" + DAMAGED_SUFFIX + "<n> (nothing is deleted)."
)

_NO_DEFAULT = object()

#: The stores whose async save may still be writing, finished at exit. Stores,
#: not managers: a manager dropped unclosed is still garbage collected.
_UNFINISHED: set[StepStore] = set()
_exit_hook_registered = False
_exit_hook_guard = threading.Lock()

EXIT_FAILED_MSG = (
    "`CheckpointManager`: the async save still running when the interpreter "
    "exited failed: {error}\n"
)


def _finish_saves_at_exit() -> None:
    """Waits for every pending async save at exit; failures are printed."""
    while _UNFINISHED:
        store = _UNFINISHED.pop()
        try:
            store.finish_pending()
        except Exception as e:  # a failed write: report it, finish the others
            sys.stderr.write(EXIT_FAILED_MSG.format(error=error_text(e)))


def _register_exit_hook() -> None:
    """Registers `_finish_saves_at_exit` once, to run before orbax's pools stop."""
    global _exit_hook_registered
    # Its pools' shutdown hook registers at import; hooks run last-first: ours first.
    import concurrent.futures.thread  # noqa: F401

    with _exit_hook_guard:
        if _exit_hook_registered:
            return
        register = getattr(threading, "_register_atexit", atexit.register)
        try:
            register(_finish_saves_at_exit)
        except RuntimeError:  # the interpreter is already shutting down
            return
        _exit_hook_registered = True


def _check_positive(name: str, value: Any, *, optional: bool) -> None:
    """Raises unless `value` is an int >= 1, or None if `optional`."""
    if value is None and optional:
        return
    need = "a positive integer" + (" or None" if optional else "")
    is_int = isinstance(value, int)  # `True` too: a bad value, not a bad type
    _validate.checked(name, value, need, is_int, lambda v: v is not True and v >= 1)


def _newest_intact(store, directory, candidates: list[int], read) -> Any:
    """`read(step)` of the newest intact step of `candidates`; marks damaged ones."""
    first_error = None
    for i, candidate in enumerate(candidates):
        try:
            return read(candidate)
        except CheckpointCorruptedError as e:
            store.mark_damaged(candidate, e.detail)
            first_error = first_error or e
            if i + 1 < len(candidates):
                warnings.warn(FALLBACK_MSG.format(
                    step=candidate, directory=directory, detail=e.detail,
                    older=candidates[i + 1],
                ), RuntimeWarning, stacklevel=3)  # fmt: skip
    raise first_error


class CheckpointManager:
    """Saves one copy of a replicated state; restores it into every replica.

    Built on `orbax.checkpoint.CheckpointManager`; the number of devices, hosts
    and the backend may change between `save` and `restore`. A step is committed
    only when complete and never overwritten, and one manager at a time saves
    into a directory. See the Checkpoints guide (docs/guides/checkpoints.md).

    Args:
      directory: Directory holding one subdirectory per saved step (created at
        the first save); any path `etils.epath` understands (local, `gs://`).
      max_to_keep: How many of the newest steps to keep (3 by default); older
        ones are deleted after each save. None keeps all.
      save_interval_steps: Save only steps that are multiples of this (1 by
        default); `save(..., force=True)` overrides.
      async_save: If True, `save` returns once the state is copied to host
        memory and writes in the background; `wait_until_finished`, `close`,
        leaving the `with` block and the interpreter's exit wait for it.

    Raises:
      TypeError: If `max_to_keep` or `save_interval_steps` is not an integer
        (or None for `max_to_keep`).
      ValueError: If `max_to_keep` or `save_interval_steps` is less than 1, or a
        bool.

    Example:
      `restore(like, default=like)` resumes a run, or starts it when the
      directory holds no checkpoint yet; `restore` with one copy returns one:

      >>> import tempfile, jax, jax.numpy as jnp, optax, jdp
      >>> tx = optax.sgd(0.1)
      >>> step = jdp.parallelize(
      ...     jdp.make_train_step(lambda p, b: jnp.mean((b * p["w"] - 1.0) ** 2), tx)
      ... )
      >>> init = jdp.TrainState.create(params={"w": 0.0}, tx=tx)
      >>> like = step.replicate(init)
      >>> directory = tempfile.mkdtemp()
      >>> for run in range(2):  # a first run, then a resumed one
      ...     with jdp.checkpoint.CheckpointManager(directory) as manager:
      ...         state = manager.restore(like, default=like)
      ...         first = int(step.unreplicate(state).step) + 1
      ...         for i in range(first, first + 2):
      ...             state, _ = step(state, step.shard(jnp.ones(8)))
      ...             _ = manager.save(i, state)
      ...         print(f"run {run}: steps {first} to {i}")
      run 0: steps 1 to 2
      run 1: steps 3 to 4
      >>> with jdp.checkpoint.CheckpointManager(directory) as manager:
      ...     one = manager.restore(init)  # one copy, e.g. for evaluation
      ...     manager.all_steps()
      [2, 3, 4]
      >>> int(one.step), one.params["w"].shape
      (4, ())
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = False,
    ):
        _check_positive("max_to_keep", max_to_keep, optional=True)
        _check_positive("save_interval_steps", save_interval_steps, optional=False)
        path = os.fspath(directory)
        # orbax needs absolute paths; URLs (gs://...) already are.
        self.directory = epath.Path(path if "://" in path else os.path.abspath(path))
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.async_save = bool(async_save)
        self._store = StepStore(
            self.directory, max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps, async_save=self.async_save,
        )  # fmt: skip
        self._lock = DirectoryLock(self.directory)
        self._lock_settled = False
        self._job_checked = False  # every process of a job names this directory
        # Releases the lock if the manager is dropped (or at exit) unclosed.
        self._release_at_exit = weakref.finalize(self, self._lock.release)
        self._store.open(create=False)

    def all_steps(self) -> list[int]:
        """Step numbers of the complete checkpoints, oldest first.

        A save still in progress, one that was interrupted, and a step found
        damaged are not listed.
        """
        return self._store.complete_steps()

    def latest_step(self) -> int | None:
        """The newest complete step, or None if there is none."""
        return (self.all_steps() or [None])[-1]

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record saved with a step (the newest complete one by default).

        Args:
          step: The step number; None for the latest.

        Returns:
          A dict: `format`, `step`, `jdp_version`, `jax_version`,
          `python_version`, `num_replicas`, `backend` and `axis_name` (None
          without `save`'s `parallel`), `process_count`, `state_type`; `leaves`,
          one `{"path", "shape", "dtype", "crc32"}` per leaf in pytree order
          (plus `"key_impl"` for typed PRNG keys, and `"per_replica"` for a leaf
          saved with every replica); and `extra` in its JSON form, if saved.

        Raises:
          FileNotFoundError: If there is no such (complete) checkpoint.
        """
        return dict(self._store.metadata(_restore.resolve_step(self._store, step)))

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        parallel: Any = None,
        force: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """Saves one copy of a replicated state under a step number.

        Writes replica 0's value of every leaf, and every replica of the leaves
        whose replicas differ (`jdp.bmuf` between syncs). The copy is taken
        before `save` returns, so the next step may donate `state`. An
        incomplete or damaged step with this number or a later one is moved
        aside to `<step>.damaged-<n>`, with a warning.

        Args:
          step: The step number, a non-negative integer (a Python int or a 0-d
            integer array such as `step.unreplicate(state).step`).
          state: A state replicated by a `jdp.Parallel` step.
          parallel: Optionally the `jdp.Parallel` that runs `state`: its backend
            and axis name are recorded, and the state's layout checked.
          force: Save even if `step` is not a multiple of `save_interval_steps`.
          extra: What a resume needs besides the state, e.g. `{"epoch": 3,
            "key": key}`: a dict with string keys of JSON values and NumPy or
            JAX arrays (typed PRNG keys included), nested, kept in the step's
            JSON record (process 0's); checked at every call. See the Restarts
            guide (docs/guides/restarts.md).

        Returns:
          True if a checkpoint was written (or, with `async_save`, started), False
          if `save_interval_steps` skipped this step (nothing on disk touched).

        Raises:
          TypeError: If `step` is not an integer, or `extra` is not a dict or
            holds a value that cannot be saved (naming its key).
          ValueError: If `state` is not replicated, or `step` is not newer than
            the latest checkpoint; at the first save, if the processes of a job
            pass different directories.
          RuntimeError: If another manager holds the directory's lock, naming
            its process id and host.
          NotADirectoryError: If the directory (or one above it) is a file.
          OSError: If the directory cannot be written (naming it and the step),
            is a dangling or looping symbolic link, or an earlier async save
            failed.
        """
        step = check_step_number(step, "step")
        encode_extra(extra, encode=False)  # raises naming the key, at any step
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        check_replicated(state, flat, parallel)
        if not self._job_checked:  # a collective: before any process may raise
            check_same_directory(self.directory)
            self._job_checked = True
        check_directory(self.directory, "save")
        store = self._store
        try:
            manager = store.open(create=True)
        except Exception as e:  # e.g. a parent of the directory is a file
            raise store.write_failed(step, e, what="creating the directory for") from e
        if not (force or store.due(manager, step)):
            return False  # touches nothing on disk: cheap to call every step
        if not self._lock_settled:
            acquire_for_job(self._lock)
            self._lock_settled = True
        store.finish_pending()
        damaged = check_not_overwriting(store, step)
        set_aside(self.directory, damaged)
        store.forget(damaged)
        store.reload_if_changed()
        store.write(step, save_items(step, state, flat, parallel, extra))
        if self.async_save:  # finished at exit if nothing waits for it before
            _UNFINISHED.add(store)
            _register_exit_hook()
        return True

    def restore(
        self,
        like: PyTree,
        *,
        step: int | None = None,
        default: Any = _NO_DEFAULT,
        with_extra: bool = False,
    ) -> PyTree | tuple[PyTree, dict[str, Any]]:
        """Loads a saved copy into every replica of `like`'s layout, or as one copy.

        With `step=None`, a newest step that is damaged or incomplete is
        reported with a `RuntimeWarning` and the newest intact step restored.

        Args:
          like: A replicated state with the layout to restore into
            (`step.replicate(init_state)`, or its `jax.ShapeDtypeStruct`s with
            shardings; the replica count and backend may differ from the saving
            run's), or one copy with the saved shapes (e.g. `init_state`). Its
            static fields (e.g. `TrainState.tx`) are kept.
          step: The step number to load; None (default) loads the latest.
          default: Returned as it is when `step` is None and the directory holds
            no complete checkpoint, so that `manager.restore(like, default=like)`
            resumes a run or starts it. A path that can never hold checkpoints
            (a file, a dangling or looping symbolic link) raises even so.
          with_extra: Return `(state, extra)`: the `extra` saved with the
            restored step (`{}` if none, or for `default`); arrays come back as
            NumPy arrays, typed PRNG keys as keys, tuples as lists.

        Returns:
          A pytree like `like`: for a replicated `like`, `jax.Array`s shaped and
          sharded like its leaves; for one copy, NumPy arrays, or `jax.Array`s
          placed like `like`'s. With `with_extra`, `(state, extra)`.

        Raises:
          FileNotFoundError: If the directory holds no complete checkpoint (and
            no `default` is given), or not one for `step`.
          TypeError: If `step` is not an integer, or a leaf of a replicated
            `like` has no dtype or sharding.
          ValueError: If the saved structure, shapes or dtypes differ from
            `like` (naming the first differing leaves), `like` mixes one-copy
            and replicated leaves or has a 0-d leaf where the replica axis
            belongs, or `step` is negative; a `CheckpointCorruptedError` if the
            files are damaged and no older step is intact.
          NotADirectoryError: If the directory (or one above it) is a file.
          OSError: If the directory (or one above it) is a dangling or looping
            symbolic link, or an earlier async save of this manager failed.
          RuntimeError: If reading a step fails for a reason that is not damage
            (its files are then left as they are).
        """
        check_directory(self.directory, "restore")
        store = self._store
        store.finish_pending()

        def read(s: int) -> Any:
            state = _restore.restore_step(store, s, like)
            return (state, _restore.read_extra(store, s)) if with_extra else state

        if step is not None:
            candidates = [_restore.resolve_step(store, step)]
        elif candidates := self.all_steps()[::-1]:  # newest first
            _restore.warn_newer_incomplete(store, candidates[0])
        else:
            on_disk = store.steps_on_disk() if self.directory.exists() else []
            if default is _NO_DEFAULT:
                _restore.resolve_step(store, None)  # raises, naming what is there
            if on_disk:
                warnings.warn(ONLY_DAMAGED_MSG.format(
                    directory=self.directory, steps=on_disk, last=on_disk[-1]
                ), RuntimeWarning, stacklevel=2)  # fmt: skip
            return (default, {}) if with_extra else default
        return _newest_intact(store, self.directory, candidates, read)

    def wait_until_finished(self) -> None:
        """Blocks until an async save has been written and committed.

        Raises:
          OSError: If the background save failed, naming the directory and step.
        """
        try:
            self._store.finish_pending()
        finally:
            _UNFINISHED.discard(self._store)

    def close(self) -> None:
        """Waits for pending saves, releases orbax's resources and the lock.

        Raises:
          OSError: If a background save failed (the lock is released anyway).
        """
        try:
            self.wait_until_finished()
            self._store.close()
        finally:
            self._lock.release()
            self._lock_settled = False

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({os.fspath(self.directory)!r}, max_to_keep="
            f"{self.max_to_keep}, save_interval_steps={self.save_interval_steps}, "
            f"async_save={self.async_save})"
        )
