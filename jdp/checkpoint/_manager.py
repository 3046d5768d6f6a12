"""`jdp.checkpoint.CheckpointManager`: save one copy, restore into every replica.

Caffe2's `GetCheckpointParams` saves the first device's blobs and the iteration
counter; `FinalizeAfterCheckpoint` copies them back to every device after loading.
This module does the same on orbax-checkpoint: a save writes one logical copy of a
replicated state (`jdp._layout.logical_copy`) as an orbax PyTree item plus a JSON
item of metadata (jdp version, replica count, backend, every leaf's path, shape,
dtype and CRC-32); a restore reads that copy and places it into the layout of a
replicated `like` state (`jdp._layout.place_like`), so the number of replicas,
the devices and the backend may all differ from the run that saved it. Leaves
whose replicas differ (between the syncs of `jdp.bmuf`) are also saved with every
replica, as a third item (`_per_replica`).

Orbax writes each step into a temporary directory and renames it when complete
(or writes a commit marker on object stores), so a save that is killed midway
leaves nothing that `latest_step` reports; an async save still writing when the
interpreter exits is finished first (`_finish_saves_at_exit`). One manager at a
time may save into a directory (`_lock`), and the processes of a job must all
name the same one. Checkpoints are read with tensorstore and JSON only:
restoring never unpickles or runs code from the files.

`CheckpointManager` decides what to save and which step to restore; the work is
done by the private modules next to it: `_store` (orbax's manager, which steps are
complete), `_format` (the items, the record, checksums, reading them back),
`_integrity` (the checks against the record), `_damage` (what is damage, its
errors, damaged steps set aside), `_extra` (the resume extras as JSON), `_save`
and `_restore` (one step each way), `_per_replica` and `_replicas` (the leaves
whose replicas differ) and `_lock` (the directory's writer lock).
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

from jdp.checkpoint._common import check_step_number
from jdp.checkpoint._damage import (
    DAMAGED_SUFFIX,
    CheckpointCorruptedError,
    set_aside,
)
from jdp.checkpoint._extra import encode_extra
from jdp.checkpoint._lock import (
    DirectoryLock,
    acquire_for_job,
    check_same_directory,
)
from jdp.checkpoint._restore import (
    read_extra,
    resolve_step,
    restore_step,
    warn_newer_incomplete,
)
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

#: The step stores whose async save may still be writing, finished before the
#: interpreter exits (`_finish_saves_at_exit`). It holds the stores, not their
#: managers: a manager dropped without `close` is garbage collected as before,
#: and its last save is still committed at exit.
_UNFINISHED: set[StepStore] = set()
_exit_hook_registered = False
_exit_hook_guard = threading.Lock()

EXIT_FAILED_MSG = (
    "`CheckpointManager`: the async save still running when the interpreter "
    "exited failed: {error}\n"
)


def _finish_saves_at_exit() -> None:
    """Waits for every pending async save, so that exiting never loses a step.

    A script that ends without `close()` or `wait_until_finished()` would
    otherwise lose its last async save: orbax writes it in background threads,
    and commits it with thread pools that the interpreter shuts down first.
    Failures are printed (the process is exiting: nothing could catch them).
    """
    while _UNFINISHED:
        store = _UNFINISHED.pop()
        try:
            store.finish_pending()
        except Exception as e:  # a failed write: report it, finish the others
            sys.stderr.write(EXIT_FAILED_MSG.format(error=f"{type(e).__name__}: {e}"))


def _register_exit_hook() -> None:
    """Registers `_finish_saves_at_exit` once per process (at the first async save).

    `concurrent.futures` shuts its thread pools down before `atexit` hooks run,
    and orbax commits a step with them: the hook must run before that, which
    `threading`'s own exit hooks do (registered later, they run earlier).
    Where they do not exist, `atexit` is the fallback.
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
    """Checks a count argument of `CheckpointManager`.

    Args:
      name: The argument's name.
      value: The argument.
      optional: Whether None is allowed.

    Raises:
      TypeError: If `value` is not an int (nor None where allowed).
      ValueError: If it is an int < 1, or a bool.
    """
    if (value is None and optional) or (
        isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ):
        return
    message = (
        f"`{name}` must be a positive integer"
        + (" or None" if optional else "")
        + f"; got {value!r}."
    )
    # `True` is an int to Python: reported as a bad value, as it always was.
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

    A thin layer over `orbax.checkpoint.CheckpointManager`. `save(step, state)`
    writes replica 0's copy of `state` (Caffe2's `GetCheckpointParams`), the step
    number, and a JSON record of the jdp version, the replica count, the backend
    and every leaf's path, shape, dtype and CRC-32. `restore(like)` reads the
    newest complete step and gives every replica of `like`'s layout the saved
    copy (Caffe2's `FinalizeAfterCheckpoint`, i.e. `step.broadcast`), so a run may
    resume on a different number of devices or hosts. Static pytree fields (such
    as `jdp.TrainState.tx`) are not saved: they come from `like`.

    Leaves whose replicas differ when saved (the local params and inner optimizer
    state of `jdp.bmuf` between syncs) are saved with every replica too, and a
    restore into the same number of replicas gives each replica its own values
    back, so the run resumes bit for bit. Into another number of replicas (or as
    one copy) those leaves get replica 0's copy, with a warning; for a
    `jdp.bmuf` state the params are set to the block start, so a new block starts
    from the global model.

    `restore(like)` with one copy (no replica axis, e.g. `init_state` itself or
    its `jax.ShapeDtypeStruct`s) returns one copy: NumPy arrays, or `jax.Array`s
    placed like `like`'s arrays. For notebooks, evaluation and export.

    Each step is written into a temporary directory and committed when complete,
    so a save that crashes midway is ignored. A step number is never overwritten:
    while a manager saves into a directory it holds a lock file there
    (`.jdp-checkpoint.lock`, with its process id and host; taken at the first
    `save`, released by `close`), so a second manager's `save` raises at once
    (naming the holder) instead of waiting; a lock left by a process that no
    longer runs on this host is reclaimed. Restoring checks the saved structure,
    shapes and dtypes against `like` and every leaf's checksum, and never
    unpickles anything.

    A damaged or incomplete newest step is never silent: `restore()` warns,
    naming it, and restores the newest intact step; the next `save` of that step
    number (or an earlier one) moves the damaged files aside to
    `<directory>/<step>.damaged-<n>` (with a warning naming the new path) instead
    of refusing to overwrite them. Nothing is deleted.

    A save that fails (an unwritable directory, a full disk) raises an `OSError`
    naming the directory and the step; with `async_save` the error of the
    background write is raised by the next `save`, `wait_until_finished`,
    `restore` or `close`. The process can always exit afterwards.

    With several processes, every process calls `save` and `restore` with the
    same directory (the first `save` checks it on every process); orbax lets
    one process write the copy and the metadata and synchronises the others.

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
          A sorted list of step numbers (empty if there are none).
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
        step = resolve_step(self._store, step)
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

        Writes replica 0's value of every leaf (`step.unreplicate`'s copy), so the
        checkpoint is the size of one model whatever the replica count. Leaves
        whose replicas differ (under `jdp.bmuf`, the local params and inner
        optimizer state between syncs) are written with every replica as well,
        so a restore into as many replicas resumes bit for bit. The copy is
        taken before `save` returns, so the next step may donate `state` even
        while an async save is still writing.

        The first `save` locks the directory against other managers until
        `close`. Right before writing, the directory is listed again: a step
        saved meanwhile (by an earlier manager) is never overwritten, and an
        incomplete or damaged step with this number or a later one is moved
        aside to `<step>.damaged-<n>` (with a warning) so that training can go
        on from an earlier step.

        Args:
          step: The step number, a non-negative integer (a Python int or a 0-d
            integer array such as `step.unreplicate(state).step`).
          state: A state replicated by a `jdp.Parallel` step, e.g. the one it
            returned.
          parallel: Optionally the `jdp.Parallel` that runs `state`: its backend
            and axis name are recorded in the metadata, and the state's layout is
            checked against it.
          force: Save even if `step` is not a multiple of `save_interval_steps`.
          extra: What a resume needs besides the state, saved with it: e.g. the
            data position and a PRNG key, `{"epoch": 3, "batch": 120, "key":
            key}`. A dict with string keys of JSON values (None, bool, int,
            float, str, lists, tuples, dicts with string keys) and NumPy or JAX
            arrays (typed PRNG keys included), nested as you like; kept in the
            step's JSON record (arrays base64-encoded), so keep it small: large
            arrays belong in the state. `restore(..., with_extra=True)` returns
            it. Process 0's `extra` is written: give every process the same.
            Checked at every call, also when the step is skipped.

        Returns:
          True if a checkpoint was written (or, with `async_save`, started), False
          if `save_interval_steps` skipped this step (then nothing on disk is
          read or written).

        Raises:
          TypeError: If `step` is not an integer.
          TypeError: If `extra` is not a dict or holds a value that cannot be
            saved (naming its key, e.g. `extra['loader']`).
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
          like: Either a replicated state with the layout to restore into (the
            state a `jdp.Parallel` would run, `step.replicate(init_state)`, or
            the same tree of `jax.ShapeDtypeStruct`s with shardings; its replica
            count, devices and backend need not match the run that saved), or
            one copy whose leaves have exactly the saved shapes (e.g.
            `init_state`, or its `jax.ShapeDtypeStruct`s). Its static fields
            (e.g. `TrainState.tx`) are kept.
          step: The step number to load; None (default) loads the latest.
          default: Returned as it is when `step` is None and the directory holds
            no complete checkpoint (it does not exist yet or holds none, or only
            damaged ones: then with a warning), so that
            `state = manager.restore(like, default=like)` resumes a run or
            starts it. Without it, that raises. A path that can never hold
            checkpoints (a file, or a dangling or looping symbolic link) raises
            even with a `default`: a typo must not start training from scratch.
          with_extra: Return `(state, extra)`: the `extra` saved with the
            restored step (the same step as the state, also after a fallback
            from a damaged step), `{}` if it was saved without, or when
            `default` is returned. JSON values come back as saved (tuples as
            lists), arrays as NumPy arrays, typed PRNG keys as typed keys.

        Returns:
          A pytree like `like` (same structure and static fields). For a
          replicated `like`: `jax.Array` leaves shaped and sharded like
          `like`'s, every replica equal to the saved copy (or, for leaves saved
          with every replica and as many replicas, its own value). For one
          copy: NumPy arrays, or `jax.Array`s placed like `like`'s arrays (typed
          PRNG keys are always keys). With `with_extra`, a pair
          `(state, extra)`.

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
            state = restore_step(store, s, like)
            return (state, read_extra(store, s)) if with_extra else state

        if step is not None:
            step = resolve_step(store, step)
            try:
                return read(step)
            except CheckpointCorruptedError as e:
                store.mark_damaged(step, e.detail)  # a later save may set it aside
                raise
        candidates = self.all_steps()[::-1]
        if not candidates:
            on_disk = store.steps_on_disk() if self.directory.exists() else []
            if default is _NO_DEFAULT:
                resolve_step(store, None)  # raises, naming what is there
            if on_disk:
                warnings.warn(
                    ONLY_DAMAGED_MSG.format(
                        directory=self.directory, steps=on_disk, last=on_disk[-1]
                    ),
                    RuntimeWarning,
                    stacklevel=2,
                )
            return (default, {}) if with_extra else default
        warn_newer_incomplete(store, candidates[0])
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
            self._store.finish_pending()
            self._store.close()
        finally:
            _UNFINISHED.discard(self._store)
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
