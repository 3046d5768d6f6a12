"""`jdp.checkpoint.CheckpointManager`: save one copy, restore into every replica.

It decides what to save and which step to restore; the modules next to it do
the work: `_store` (orbax's manager, the complete steps), `_format` (items and
record), `_integrity`, `_damage`, `_extra`, `_save` and `_restore` (a step each
way), `_per_replica` (leaves whose replicas differ) and `_lock` (writer lock).
"""

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

from jdp.checkpoint import _restore
from jdp.checkpoint._common import check_step_number, error_text
from jdp.checkpoint._damage import DAMAGED_SUFFIX, CheckpointCorruptedError, set_aside
from jdp.checkpoint._extra import encode_extra
from jdp.checkpoint._lock import DirectoryLock, acquire_for_job, check_same_directory
from jdp.checkpoint._save import check_not_overwriting, check_replicated, save_items
from jdp.checkpoint._store import StepStore, check_directory

PyTree = Any

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
    """Waits for every pending async save, so that exiting never loses a step.

    Orbax commits a step with thread pools that the interpreter shuts down at
    exit. Failures are printed: nothing could catch them.
    """
    while _UNFINISHED:
        store = _UNFINISHED.pop()
        try:
            store.finish_pending()
        except Exception as e:  # a failed write: report it, finish the others
            sys.stderr.write(EXIT_FAILED_MSG.format(error=error_text(e)))


def _register_exit_hook() -> None:
    """Registers `_finish_saves_at_exit` once per process (at the first async save).

    As a `threading` exit hook: those run before `concurrent.futures` shuts its
    pools down (`atexit` hooks run after).
    """
    global _exit_hook_registered
    # Imported first, it registers its pools' shutdown first: ours runs before.
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
    """Raises unless `value` is an int >= 1 (or, if `optional`, None)."""
    if (value is None and optional) or (
        isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ):
        return
    message = (
        f"`{name}` must be a positive integer"
        + (" or None" if optional else "")
        + f"; got {value!r}."
    )
    # `True` is an int to Python: a bad value, not a bad type.
    raise (ValueError if isinstance(value, int) else TypeError)(message)


def _newest_intact(store, directory, candidates: list[int], read) -> Any:
    """`read(step)` of the newest intact step of `candidates` (newest first).

    A damaged step is marked so and reported with a `RuntimeWarning` naming the
    older step tried next; if none is intact, the first error is raised.
    """
    first_error = None
    for i, candidate in enumerate(candidates):
        try:
            return read(candidate)
        except CheckpointCorruptedError as e:
            store.mark_damaged(candidate, e.detail)
            first_error = first_error or e
            if i + 1 < len(candidates):
                warnings.warn(
                    FALLBACK_MSG.format(
                        step=candidate,
                        directory=directory,
                        detail=e.detail,
                        older=candidates[i + 1],
                    ),
                    RuntimeWarning,
                    stacklevel=3,
                )
    raise first_error


class CheckpointManager:
    """Saves one copy of a replicated state; restores it into every replica.

    Built on `orbax.checkpoint.CheckpointManager`. `save(step, state)` writes
    replica 0's copy of `state` (Caffe2's `GetCheckpointParams`) and a JSON
    record of the jdp version, replica count, backend and every leaf's path,
    shape, dtype and CRC-32. `restore(like)` gives every replica of `like`'s
    layout the newest complete step's copy (Caffe2's `FinalizeAfterCheckpoint`),
    so a run may resume on another number of devices or hosts. Static pytree
    fields (such as `jdp.TrainState.tx`) are not saved: they come from `like`.

    Leaves whose replicas differ (`jdp.bmuf`'s local params and inner optimizer
    state between syncs) are saved with every replica too: restored into as many
    replicas, the run resumes bit for bit; into another number (or as one copy)
    they get replica 0's copy, with a warning, and a `jdp.bmuf` state's params
    are set to the block start, so a new block starts from the global model.

    `restore(like)` with one copy (no replica axis, e.g. `init_state` or its
    `jax.ShapeDtypeStruct`s) returns one copy: NumPy arrays, or `jax.Array`s
    placed like `like`'s. For notebooks, evaluation and export.

    A step is committed only when complete, so a save that crashes midway is
    ignored, and a step number is never overwritten. From its first `save` to
    `close`, a manager holds a lock file in the directory
    (`.jdp-checkpoint.lock`, naming its process and host): another manager's
    `save` raises at once, naming the holder; a lock left by a process no longer
    running on this host is reclaimed. Restoring checks the structure, shapes
    and dtypes against `like` and every leaf's checksum, and never unpickles.

    A damaged or incomplete newest step is never silent: `restore()` warns,
    naming it, and restores the newest intact step; the next `save` of that
    step number (or an earlier one) moves it aside to
    `<directory>/<step>.damaged-<n>`, with a warning. Nothing is deleted.

    A save that fails (an unwritable directory, a full disk) raises an `OSError`
    naming the directory and the step; with `async_save`, the next `save`,
    `wait_until_finished`, `restore` or `close` raises it. The process can
    always exit afterwards. With several processes, every process calls `save`
    and `restore` with the same directory (the first `save` checks it).

    Args:
      directory: Directory holding one subdirectory per saved step (created on the
        first save). Any path `etils.epath` understands (local, `gs://`, ...;
        on object stores the lock is best effort).
      max_to_keep: How many of the newest checkpoints to keep (3 by default);
        older ones are deleted after each save. None keeps all.
      save_interval_steps: Save only when the step number is a multiple of this
        (1 by default: every call to `save`); `save(..., force=True)` overrides.
      async_save: If True, `save` returns once the state is copied to host memory
        and writes in the background; `wait_until_finished`, `close` and leaving
        the `with` block wait for it, and so does the interpreter's exit (a
        script that ends without `close` still commits its last step). False
        by default.

    Raises:
      TypeError: If `max_to_keep` or `save_interval_steps` is not an integer
        (or None for `max_to_keep`).
      ValueError: If `max_to_keep` or `save_interval_steps` is less than 1, or a
        bool.

    Example:
      Resume or start, in one line: `restore(like, default=like)` returns `like`
      itself when the directory holds no checkpoint yet. `restore` with one copy
      returns one copy:

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
            self.directory,
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            async_save=self.async_save,
        )
        self._lock = DirectoryLock(self.directory)
        self._lock_settled = False
        self._job_checked = False  # every process of a job names this directory
        # Releases the lock if the manager is dropped (or at exit) unclosed.
        self._release_at_exit = weakref.finalize(self, self._lock.release)
        self._store.open(create=False)

    def all_steps(self) -> list[int]:
        """Step numbers of the complete checkpoints, oldest first.

        A save still in progress (async), one that was interrupted, and a step a
        `restore` found damaged are not listed.

        Returns:
          A sorted list of step numbers, maybe empty.
        """
        return self._store.complete_steps()

    def latest_step(self) -> int | None:
        """The newest complete step, or None if there is none.

        Returns:
          A step number that `restore` can read, or None.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record saved with a step (the newest complete one by default).

        Keys: `format`, `step`, `jdp_version`, `jax_version`, `python_version`,
        `num_replicas`, `backend` and `axis_name` (None when `save` was not given
        `parallel`), `process_count`, `state_type`, and `leaves`: one
        `{"path", "shape", "dtype", "crc32"}` per leaf of the saved copy, in
        pytree order, plus `"key_impl"` for typed PRNG keys and
        `"per_replica": {"crc32": ...}` for a leaf whose replicas differed (saved
        with every replica, shape `(num_replicas, *shape)`). A step saved with
        `extra` also has `extra`, in its JSON form (arrays base64-encoded):
        `restore(..., with_extra=True)` decodes it.

        Args:
          step: The step number; None for the latest.

        Returns:
          The record as a dict.

        Raises:
          FileNotFoundError: If there is no such (complete) checkpoint.
        """
        step = _restore.resolve_step(self._store, step)
        return dict(self._store.metadata(step))

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

        Writes replica 0's value of every leaf (`step.unreplicate`'s copy): one
        model's size whatever the replica count. Leaves whose replicas differ
        (`jdp.bmuf` between syncs) are written with every replica as well. The
        copy is taken before `save` returns, so the next step may donate `state`
        even while an async save is still writing.

        The first `save` locks the directory against other managers until
        `close`. Right before writing, the directory is listed again: a step
        saved meanwhile is never overwritten, and an incomplete or damaged step
        with this number or a later one is moved aside to `<step>.damaged-<n>`
        (with a warning) so that training can go on from an earlier step.

        Args:
          step: The step number, a non-negative integer (a Python int or a 0-d
            integer array such as `step.unreplicate(state).step`).
          state: A state replicated by a `jdp.Parallel` step, e.g. the one it
            returned.
          parallel: Optionally the `jdp.Parallel` that runs `state`: its backend
            and axis name are recorded in the metadata, and the state's layout is
            checked against it.
          force: Save even if `step` is not a multiple of `save_interval_steps`.
          extra: What a resume needs besides the state, e.g. `{"epoch": 3,
            "batch": 120, "key": key}`: a dict with string keys of JSON values
            (None, bool, int, float, str, lists, tuples, dicts with string keys)
            and NumPy or JAX arrays (typed PRNG keys included), nested as you
            like. Kept in the step's JSON record (arrays base64-encoded), so keep
            it small; `restore(..., with_extra=True)` returns it. Process 0's is
            written: give every process the same. Checked at every call.

        Returns:
          True if a checkpoint was written (or, with `async_save`, started), False
          if `save_interval_steps` skipped this step (then nothing on disk is
          read or written).

        Raises:
          TypeError: If `step` is not an integer, or `extra` is not a dict or
            holds a value that cannot be saved (naming its key).
          ValueError: If `state` is not replicated, `step` already has a
            checkpoint, or `step` is older than the latest checkpoint (nothing is
            overwritten); or, at the first save, if the processes of a job pass
            different directories (naming each process's directory).
          RuntimeError: If another manager (in this process or another one)
            holds the directory's lock, naming its process id and host.
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

        With `step=None`, a newest step that turns out damaged (or was never
        committed) is reported with a `RuntimeWarning` naming it, and the newest
        intact step before it is restored instead.

        Args:
          like: Either a replicated state with the layout to restore into
            (`step.replicate(init_state)`, or its `jax.ShapeDtypeStruct`s with
            shardings; replica count, devices and backend need not match the run
            that saved), or one copy with exactly the saved shapes (e.g.
            `init_state` or its `jax.ShapeDtypeStruct`s). Its static fields
            (e.g. `TrainState.tx`) are kept.
          step: The step number to load; None (default) loads the latest.
          default: Returned as it is when `step` is None and the directory holds
            no complete checkpoint (none yet, or only damaged ones: then with a
            warning), so that `state = manager.restore(like, default=like)`
            resumes a run or starts it; without it, that raises. A path that can
            never hold checkpoints (a file, a dangling or looping symbolic link)
            raises even so: a typo must not start training from scratch.
          with_extra: Return `(state, extra)`: the `extra` saved with the
            restored step (also after a fallback), `{}` if it was saved without
            or `default` is returned. JSON values come back as saved (tuples as
            lists), arrays as NumPy arrays, typed PRNG keys as typed keys.

        Returns:
          A pytree like `like` (same structure and static fields): for a
          replicated `like`, `jax.Array`s shaped and sharded like its leaves,
          every replica the saved copy (or its own saved value); for one copy,
          NumPy arrays or `jax.Array`s placed like `like`'s (typed PRNG keys as
          keys). With `with_extra`, `(state, extra)`.

        Raises:
          FileNotFoundError: If the directory holds no complete checkpoint (and
            no `default` is given), or not one for `step`.
          TypeError: If `step` is not an integer, or a leaf of a replicated
            `like` has no dtype or sharding.
          ValueError: If the checkpoint's structure, shapes or dtypes differ from
            `like` (naming the first differing leaf paths and both shapes), if
            `like` mixes one-copy and replicated leaves or has a 0-d leaf where
            the replica axis belongs, if `step` is negative, or if its files are
            corrupted or truncated (and no older step is intact): then a
            `jdp.checkpoint.CheckpointCorruptedError`.
          NotADirectoryError: If the directory (or one above it) is a file.
          OSError: If the directory (or one above it) is a dangling or looping
            symbolic link, or an earlier async save of this manager failed.
          RuntimeError: If reading a step fails for a reason that is not damage
            (its files are then left as they are, and not reported damaged).
        """
        check_directory(self.directory, "restore")
        store = self._store
        store.finish_pending()

        def read(s: int) -> Any:
            state = _restore.restore_step(store, s, like)
            return (state, _restore.read_extra(store, s)) if with_extra else state

        if step is not None:
            step = _restore.resolve_step(store, step)
            try:
                return read(step)
            except CheckpointCorruptedError as e:
                store.mark_damaged(step, e.detail)  # a later save may set it aside
                raise
        candidates = self.all_steps()[::-1]
        if not candidates:
            on_disk = store.steps_on_disk() if self.directory.exists() else []
            if default is _NO_DEFAULT:
                _restore.resolve_step(store, None)  # raises, naming what is there
            if on_disk:
                warnings.warn(
                    ONLY_DAMAGED_MSG.format(
                        directory=self.directory, steps=on_disk, last=on_disk[-1]
                    ),
                    RuntimeWarning,
                    stacklevel=2,
                )
            return (default, {}) if with_extra else default
        _restore.warn_newer_incomplete(store, candidates[0])
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
            f"CheckpointManager({os.fspath(self.directory)!r}, "
            f"max_to_keep={self.max_to_keep}, "
            f"save_interval_steps={self.save_interval_steps}, "
            f"async_save={self.async_save})"
        )
