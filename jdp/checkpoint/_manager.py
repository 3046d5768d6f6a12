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
replica, as a third item (`_replicas`).

Orbax writes each step into a temporary directory and renames it when complete
(or writes a commit marker on object stores), so a save that is killed midway
leaves nothing that `latest_step` reports. One manager at a time may save into a
directory (`_lock`). Checkpoints are read with tensorstore and JSON only:
restoring never unpickles or runs code from the files.
"""

from __future__ import annotations

import collections
import os
import sys
import warnings
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jdp._layout import (
    abstract,
    is_custom,
    is_key,
    key_impl,
    logical_copy,
    logical_like,
    place_like,
)
from jdp._tree import format_problems, keystr
from jdp._version import __version__
from jdp.checkpoint._lock import DirectoryLock
from jdp.checkpoint._replicas import block_start_params, differing_paths

PyTree = Any

#: Orbax item names inside one step directory.
STATE_ITEM = "state"
METADATA_ITEM = "jdp_metadata"
#: Leaves whose replicas differed when saved, with every replica.
REPLICAS_ITEM = "jdp_replicas"
#: Marks a step's JSON as written by this module (and its layout version).
FORMAT = "jdp.checkpoint/1"
#: What a damaged step is renamed to: `<step>.damaged-<n>`.
DAMAGED_SUFFIX = ".damaged-"

NO_CHECKPOINT_MSG = (
    "`CheckpointManager.restore`: no checkpoint in {directory}{why}. Save one with "
    "`manager.save(step, state)` first, or check the directory path."
)

MISMATCH_MSG = (
    "`CheckpointManager.restore`: the checkpoint of step {step} in {directory} does "
    "not match `like` ({count} leaves differ; shapes are per replica, without the "
    "replica axis):{probs}\nFix: build `like` from the same model and optimizer "
    "as the saved state, e.g. `step.replicate(init_state)` or its "
    "`jax.ShapeDtypeStruct`s."
)

ONE_COPY_HINT = (
    "\n`like` is read as one copy (no replica axis: its shapes are the saved "
    "shapes), which must match the saved leaves exactly. To restore into every "
    "replica instead, pass a state replicated by the `jdp.Parallel` that will run "
    "it: `manager.restore(step.replicate(init_state))`."
)

MIXED_LIKE_MSG = (
    "`CheckpointManager.restore`: `like` mixes one-copy leaves (shaped as saved in "
    "step {step}, e.g. {one}) and leaves with a replica axis (e.g. {rep}), so it "
    "is neither one copy nor a replicated state.\nFix: pass one copy (e.g. "
    "`init_state`) to get one copy back, or `step.replicate(init_state)` to "
    "restore into every replica."
)

CORRUPT_MSG = (
    "`CheckpointManager.restore`: the checkpoint of step {step} in {directory} is "
    "corrupted or truncated: {detail} Restore an older step "
    "(`manager.restore(like, step=...)`; `manager.all_steps()` lists the complete "
    "ones), or save again: the next `save` of step {step} or an earlier step moves "
    "the damaged files aside to {directory}/{step}" + DAMAGED_SUFFIX + "<n> "
    "(nothing is deleted)."
)

FALLBACK_MSG = (
    "`CheckpointManager.restore`: step {step} in {directory} is damaged ({detail}); "
    "restoring step {older}, the newest complete step before it, instead. The next "
    "`save` of step {step} or an earlier step moves the damaged step aside to "
    "{directory}/{step}" + DAMAGED_SUFFIX + "<n> (nothing is deleted)."
)

NEWER_INCOMPLETE_MSG = (
    "`CheckpointManager.restore`: step {step} in {directory} is incomplete or "
    "damaged ({detail}); restoring step {older}, the newest complete step, "
    "instead. If no save is still writing step {step}, the next `save` of step "
    "{step} or an earlier step moves it aside to {directory}/{step}"
    + DAMAGED_SUFFIX
    + "<n> (nothing is deleted)."
)

ONLY_DAMAGED_MSG = (
    "`CheckpointManager.restore`: {directory} holds no complete checkpoint, only "
    "incomplete or damaged step(s) {steps}; returning `default`. The next `save` "
    "of step {last} or an earlier step moves them aside to "
    "{directory}/<step>" + DAMAGED_SUFFIX + "<n> (nothing is deleted)."
)

SET_ASIDE_MSG = (
    "`CheckpointManager.save`: step {step} in {directory} was incomplete or "
    "damaged ({detail}); moved it to {target} so that step {step} can be saved "
    "again. Nothing was deleted: inspect or delete {target} yourself."
)

DIFFERING_MSG = (
    "`CheckpointManager.restore`: step {step} in {directory} was saved between "
    "syncs: its {saved} replicas held different values in {count} leaves "
    "({paths}). {why}, so it gets replica 0's copy of those leaves: the replicas' "
    "local work since their last sync is not carried over (restore into "
    "{saved} replicas to resume exactly).{note}"
)

WRITE_FAILED_MSG = (
    "`CheckpointManager.save`: {what} step {step} to {directory} failed "
    "({error}). Step {step} was not committed; the steps saved before it are "
    "intact{kept}.\nFix: check that {directory} is writable and has free space "
    "(or pass another directory), then save again."
)

NOT_REPLICATED_MSG = (
    "`CheckpointManager.save`: `state` is not a replicated state. Expected every "
    "leaf to be a `jax.Array` with a leading replica axis, as returned by a "
    "`jdp.Parallel` step or `step.replicate`. Offending leaves:{probs}\n"
    "Fix: `manager.save(step_number, step.replicate(state))`."
)

_NO_DEFAULT = object()


class _Corrupt(ValueError):
    """A damaged checkpoint (not a `like` that does not match it)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


def _check_step_number(step: Any, what: str) -> int:
    if isinstance(step, bool) or not np.issubdtype(np.asarray(step).dtype, np.integer):
        raise TypeError(f"`{what}` must be an integer step number; got {step!r}.")
    if np.ndim(step) != 0 or int(step) < 0:
        raise ValueError(f"`{what}` must be a non-negative integer; got {step!r}.")
    return int(step)


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def _crc32(x: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(x)).cast("B"))


def _key_impl_name(x: Any) -> str | None:
    """The PRNG implementation of a typed-key leaf (array or struct), else None."""
    return key_impl(x) if is_key(x) else None


def _as_key_data(x: Any) -> Any:
    """Typed PRNG keys as their raw key data (an array or a struct), else `x`."""
    if not is_key(x):
        return x
    if isinstance(x, jax.Array):
        return jax.random.key_data(x)
    return jax.eval_shape(jax.random.key_data, x)


def _data_shape(x: Any) -> tuple[int, ...] | None:
    """A `like` leaf's shape as saved (key data for typed keys); None if shapeless."""
    if is_key(x):
        return tuple(_as_key_data(x).shape)
    try:
        return tuple(np.shape(x))
    except Exception:  # an object NumPy cannot size
        return None


def _host_copy(x: Any) -> Any:
    """A leaf of the logical copy as a fresh NumPy array this process owns.

    Copying (rather than viewing device memory) keeps an async save correct when
    the next step donates the state's buffers. A leaf that is not fully
    addressable (one logical copy spread over several hosts) stays a `jax.Array`:
    orbax writes each host's part. Typed PRNG keys are saved as their key data.
    """
    x = _as_key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x
    return np.array(x, copy=True)


def _same_kind_of_error(error: BaseException, message: str) -> OSError:
    """An `OSError` carrying `message`, of `error`'s type where it is one."""
    if isinstance(error, OSError):
        try:
            return type(error)(message)
        except TypeError:
            pass
    return OSError(message)


def _first(paths: Sequence[str]) -> str:
    shown = ", ".join(paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _restore_item(manager, step: int, name: str, item, restore_args):
    """Reads one orbax PyTree item of a step into `item`'s structure."""
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
    return manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]


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
    `jdp.BMUFState` the params are set to the block start, so a new block starts
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

    With several processes, every process calls `save` and `restore`; orbax lets
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
        the `with` block wait for it. False by default.

    Raises:
      ValueError: If `max_to_keep` or `save_interval_steps` is not a positive
        integer.

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
        for name, value, optional in (
            ("max_to_keep", max_to_keep, True),
            ("save_interval_steps", save_interval_steps, False),
        ):
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"`{name}` must be a positive integer"
                    + (" or None" if optional else "")
                    + f"; got {value!r}."
                )
        path = os.fspath(directory)
        # orbax needs absolute paths; URLs (gs://...) already are.
        self.directory = epath.Path(path if "://" in path else os.path.abspath(path))
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.async_save = bool(async_save)
        self._manager: ocp.CheckpointManager | None = None
        self._complete: dict[int, dict[str, Any]] = {}
        # Steps whose arrays a restore found damaged: {step: what is wrong}.
        self._damaged: dict[int, str] = {}
        self._pending: int | None = None  # the step an async save is writing
        self._lock = DirectoryLock(self.directory)
        self._lock_settled = False
        # Releases the lock if the manager is dropped (or at exit) unclosed.
        self._release_at_exit = weakref.finalize(self, self._lock.release)
        self._open(create=False)

    # -- orbax plumbing -----------------------------------------------------------

    def _open(self, *, create: bool) -> ocp.CheckpointManager | None:
        """The orbax manager; made lazily so that reading never creates directories."""
        if self._manager is None and (create or self.directory.exists()):
            policies = ocp.checkpoint_managers
            options = ocp.CheckpointManagerOptions(
                create=True,
                enable_async_checkpointing=self.async_save,
                # Directories are made before `save` returns: when that fails,
                # orbax's background threads would otherwise wait for them for
                # minutes (its coordination timeout) and keep the process from
                # exiting.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                save_decision_policy=policies.AnySavePolicy(
                    [
                        policies.FixedIntervalPolicy(self.save_interval_steps),
                        policies.PreemptionCheckpointingPolicy(),
                    ]
                ),
                preservation_policy=policies.LatestN(n=self.max_to_keep),
            )
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                item_names=(STATE_ITEM, METADATA_ITEM, REPLICAS_ITEM),
            )
        return self._manager

    def _discard(self) -> None:
        """Drops the orbax manager after a failed save; the next save makes anew."""
        manager, self._manager = self._manager, None
        if manager is not None:
            try:
                manager.close()
            except Exception:  # the failure was already reported
                pass

    def _write_failed(
        self, step: int | None, error: BaseException, *, what: str
    ) -> OSError:
        """The error for a save that could not be written, naming the step."""
        try:
            kept = self.all_steps()
        except Exception:  # the directory may be unreadable too
            kept = []
        message = WRITE_FAILED_MSG.format(
            what=what,
            step=step,
            directory=self.directory,
            error=f"{type(error).__name__}: {error}",
            kept=f" ({kept})" if kept else "",
        )
        return _same_kind_of_error(error, message)

    def _finish_pending(self) -> None:
        """Waits for an async save; raises its failure as a jdp error."""
        if self._manager is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            step, self._pending = self._pending, None
            self._discard()
            raise self._write_failed(step, e, what="the background write of") from e
        self._pending = None

    def _acquire_lock(self) -> None:
        """Takes the directory's lock (process 0 of a multi-process job).

        Every process of a job must take the same path here (the broadcast is a
        collective), so whether the lock is held is decided by process 0's lock
        and remembered on every process alike.
        """
        if self._lock_settled:
            return
        error = None
        if jax.process_index() == 0:
            try:
                self._lock.acquire()
            except (RuntimeError, OSError) as e:
                error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
            if not int(ok) and error is None:
                raise RuntimeError(
                    f"`CheckpointManager.save`: process 0 could not lock "
                    f"{self.directory} (see its error); nothing was saved."
                )
        if error is not None:
            raise error
        self._lock_settled = True

    def _read_metadata(self, step: int) -> dict[str, Any]:
        """The step's JSON record; `_Corrupt` if it is missing or unreadable."""
        manager = self._open(create=False)
        try:
            meta = manager.restore(
                step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()})
            )[METADATA_ITEM]
        except Exception as e:  # orbax/json raise many types for a damaged file
            detail = f"its metadata could not be read ({type(e).__name__}: {e})."
            raise self._corrupt(step, detail) from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise self._corrupt(step, f"its metadata is not a {FORMAT!r} record.")
        return meta

    def _corrupt(self, step: int, detail: str) -> _Corrupt:
        """The error for a damaged checkpoint of `step`."""
        return _Corrupt(
            CORRUPT_MSG.format(step=step, directory=self.directory, detail=detail),
            detail,
        )

    def _steps_on_disk(self) -> list[int]:
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

    def _incomplete(self, step: int) -> str | None:
        """Why the step on disk is not a complete checkpoint, or None if it is."""
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
            meta = self._read_metadata(step)
        except _Corrupt as e:
            return e.detail
        except OSError as e:
            return f"it cannot be read ({type(e).__name__}: {e})"
        self._complete[step] = meta
        return None

    def _verify_arrays(self, step: int) -> str | None:
        """Reads every array of a step and checks its CRC-32; what is wrong, or None.

        Needs no `like`: the arrays are matched to the records by shape, dtype
        and checksum. Only for a step that would block a save.
        """
        meta = self._complete.get(step) or self._read_metadata(step)
        want = collections.Counter()
        for r in meta["leaves"]:
            if r.get("crc32") is not None:
                want[(tuple(r["shape"]), r["dtype"], r["crc32"])] += 1
            per = r.get("per_replica") or {}
            if per.get("crc32") is not None:
                shape = (meta["num_replicas"], *r["shape"])
                want[(shape, r["dtype"], per["crc32"])] += 1
        have = collections.Counter()
        manager = self._open(create=False)
        items = [STATE_ITEM]
        if any(r.get("per_replica") for r in meta["leaves"]):
            items.append(REPLICAS_ITEM)
        try:
            for item in items:
                tree = manager.item_metadata(step)[item]
                args = _numpy_restore(getattr(tree, "tree", tree))
                got = manager.restore(step, args=ocp.args.Composite(**{item: args}))
                for x in jax.tree.leaves(got[item]):
                    x = np.asarray(x)
                    have[(x.shape, _dtype_name(x.dtype), _crc32(x))] += 1
        except Exception as e:  # tensorstore/orbax raise many types for bad files
            return f"reading its arrays failed ({type(e).__name__}: {e})"
        bad = sum((want - have).values())
        if bad:
            return f"{bad} of its arrays do not match the CRC-32 recorded at save"
        return None

    def _set_aside(self, damaged: dict[int, str]) -> None:
        """Renames damaged steps to `<step>.damaged-<n>` (process 0), with warnings."""
        if not damaged:
            return
        if jax.process_index() == 0:
            for step, detail in sorted(damaged.items()):
                n = 1
                while (self.directory / f"{step}{DAMAGED_SUFFIX}{n}").exists():
                    n += 1
                target = self.directory / f"{step}{DAMAGED_SUFFIX}{n}"
                try:
                    (self.directory / str(step)).rename(target)
                except OSError as e:
                    raise _same_kind_of_error(
                        e,
                        f"`CheckpointManager.save`: step {step} in {self.directory} "
                        f"is incomplete or damaged ({detail}), and moving it aside "
                        f"to {target} failed ({type(e).__name__}: {e}). Nothing was "
                        f"saved.\nFix: move or delete {self.directory / str(step)} "
                        "yourself, then save again.",
                    ) from e
                warnings.warn(
                    SET_ASIDE_MSG.format(
                        step=step,
                        directory=self.directory,
                        detail=detail,
                        target=target,
                    ),
                    RuntimeWarning,
                    stacklevel=3,
                )
        for step in damaged:
            self._complete.pop(step, None)
            self._damaged.pop(step, None)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jdp_checkpoint_set_aside")

    # -- public API ---------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Step numbers of the complete checkpoints, oldest first.

        A save still in progress (async), one that was interrupted, and a step a
        `restore` found damaged are not listed.

        Returns:
          A sorted list of step numbers (empty if there are none).
        """
        if self._open(create=False) is None:
            return []
        return [s for s in self._steps_on_disk() if self._incomplete(s) is None]

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
        with every replica, shape `(num_replicas, *shape)`).

        Args:
          step: The step number; None for the latest.

        Returns:
          The record as a dict.

        Raises:
          FileNotFoundError: If there is no such (complete) checkpoint.
        """
        step = self._resolve_step(step)
        return dict(self._complete.get(step) or self._read_metadata(step))

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        parallel: Any = None,
        force: bool = False,
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

        Returns:
          True if a checkpoint was written (or, with `async_save`, started), False
          if `save_interval_steps` skipped this step (then nothing on disk is
          read or written).

        Raises:
          TypeError: If `step` is not an integer.
          ValueError: If `state` is not replicated, `step` already has a
            checkpoint, or `step` is older than the latest checkpoint (nothing is
            overwritten).
          RuntimeError: If another manager (in this process or another one)
            holds the directory's lock, naming its process id and host.
          OSError: If the directory cannot be written (naming it and the step),
            or an earlier async save failed.
        """
        step = _check_step_number(step, "step")
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        self._check_replicated(state, flat, parallel)
        try:
            manager = self._open(create=True)
        except Exception as e:  # e.g. a parent of the directory is a file
            raise self._write_failed(step, e, what="creating the directory for") from e
        if not (force or self._due(manager, step)):
            return False  # touches nothing on disk: cheap to call every step
        self._acquire_lock()
        self._finish_pending()
        manager = self._open(create=True)
        self._set_aside(self._check_not_overwriting(step))
        if set(manager.all_steps()) != set(self._steps_on_disk()):
            manager.reload()  # another manager wrote here since this one looked

        per_replica = set(differing_paths(state))
        logical = logical_copy(state)
        host = jax.tree.map(_host_copy, logical)
        replicas = {
            keystr(path): _host_copy(x)
            for path, x in flat
            if keystr(path) in per_replica
        }
        meta = self._make_metadata(step, state, logical, host, replicas, parallel)
        items = {
            STATE_ITEM: ocp.args.PyTreeSave(host),
            METADATA_ITEM: ocp.args.JsonSave(meta),
        }
        if replicas:
            index = {r["path"]: i for i, r in enumerate(meta["leaves"])}
            items[REPLICAS_ITEM] = ocp.args.PyTreeSave(
                {f"leaf_{index[path]}": x for path, x in replicas.items()}
            )
        self._complete.pop(step, None)
        try:
            manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            self._discard()
            raise self._write_failed(step, e, what="writing") from e
        self._pending = step if self.async_save else None
        return True

    def restore(
        self, like: PyTree, *, step: int | None = None, default: Any = _NO_DEFAULT
    ) -> PyTree:
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
            no complete checkpoint (none yet, or only damaged ones: then with a
            warning), so that `state = manager.restore(like, default=like)`
            resumes a run or starts it. Without it, that raises.

        Returns:
          A pytree like `like` (same structure and static fields). For a
          replicated `like`: `jax.Array` leaves shaped and sharded like
          `like`'s, every replica equal to the saved copy (or, for leaves saved
          with every replica and as many replicas, its own value). For one
          copy: NumPy arrays, or `jax.Array`s placed like `like`'s arrays (typed
          PRNG keys are always keys).

        Raises:
          FileNotFoundError: If the directory holds no complete checkpoint (and
            no `default` is given), or not one for `step`.
          TypeError: If a leaf of a replicated `like` has no shape, dtype or
            sharding.
          ValueError: If the checkpoint's structure, shapes or dtypes differ from
            `like` (naming the first differing leaf paths and both shapes), if
            `like` mixes one-copy and replicated leaves, or if its files are
            corrupted or truncated (and no older step is intact).
          OSError: If an earlier async save of this manager failed.
        """
        self._finish_pending()
        if step is not None:
            step = self._resolve_step(step)
            try:
                return self._restore_step(step, like)
            except _Corrupt as e:
                self._damaged[step] = e.detail  # a later save may set it aside
                self._complete.pop(step, None)
                raise
        candidates = self.all_steps()[::-1]
        if not candidates:
            on_disk = self._steps_on_disk() if self.directory.exists() else []
            if default is _NO_DEFAULT:
                self._resolve_step(None)  # raises, naming what is there
            if on_disk:
                warnings.warn(
                    ONLY_DAMAGED_MSG.format(
                        directory=self.directory, steps=on_disk, last=on_disk[-1]
                    ),
                    RuntimeWarning,
                    stacklevel=2,
                )
            return default
        self._warn_newer_incomplete(candidates[0])
        first_error = None
        for i, candidate in enumerate(candidates):
            try:
                return self._restore_step(candidate, like)
            except _Corrupt as e:
                self._damaged[candidate] = e.detail
                self._complete.pop(candidate, None)
                first_error = first_error or e
                if i + 1 < len(candidates):
                    warnings.warn(
                        FALLBACK_MSG.format(
                            step=candidate,
                            directory=self.directory,
                            detail=e.detail,
                            older=candidates[i + 1],
                        ),
                        RuntimeWarning,
                        stacklevel=2,
                    )
        raise first_error

    def wait_until_finished(self) -> None:
        """Blocks until an async save has been written and committed.

        Raises:
          OSError: If the background save failed, naming the directory and step.
        """
        self._finish_pending()

    def close(self) -> None:
        """Waits for pending saves, releases orbax's resources and the lock.

        Raises:
          OSError: If a background save failed (the lock is released anyway).
        """
        try:
            self._finish_pending()
            if self._manager is not None:
                self._manager.close()
                self._manager = None
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

    # -- save: never overwrite ------------------------------------------------------

    def _due(self, manager: ocp.CheckpointManager, step: int) -> bool:
        """Whether `save_interval_steps` (or a preemption) asks for this step."""
        return step % self.save_interval_steps == 0 or manager.reached_preemption(step)

    def _check_not_overwriting(self, step: int) -> dict[int, str]:
        """Raises if a complete step >= `step` is on disk; returns the damaged ones.

        A step that looks complete is read in full (its checksums checked) before
        it is allowed to block the save.
        """
        damaged, intact = {}, []
        for s in self._steps_on_disk():
            if s < step:
                continue
            reason = self._incomplete(s) or self._verify_arrays(s)
            if reason is None:
                intact.append(s)
            else:
                damaged[s] = reason
        if step in intact:
            raise ValueError(
                f"`CheckpointManager.save`: step {step} already has a checkpoint in "
                f"{self.directory}; checkpoints are never overwritten. Save under a "
                "new step number, or delete that step's directory first."
            )
        if intact:
            raise ValueError(
                f"`CheckpointManager.save`: step {step} is older than the latest "
                f"checkpoint ({max(intact)}) in {self.directory}. Step numbers must "
                "increase; to branch off an older step, save into a new directory."
            )
        return damaged

    # -- restore ------------------------------------------------------------------

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        ignored = sorted(set(self._steps_on_disk()) - set(steps))
        note = (
            f" Step(s) {ignored} exist but are incomplete or damaged (a save that "
            "was interrupted or is still running, or corrupted files) and are "
            "ignored; the next `save` of one of these step numbers or an earlier "
            "one moves them aside."
            if ignored
            else ""
        )
        if step is None:
            if not steps:
                missing = not self.directory.exists()
                why = " (the directory does not exist)" if missing else ""
                raise FileNotFoundError(
                    NO_CHECKPOINT_MSG.format(directory=self.directory, why=why) + note
                )
            return steps[-1]
        step = _check_step_number(step, "step")
        if step not in steps:
            raise FileNotFoundError(
                f"`CheckpointManager.restore`: no complete checkpoint for step {step} "
                f"in {self.directory}; the complete steps are {steps}. Pass one of "
                "them, or `step=None` for the latest." + note
            )
        return step

    def _warn_newer_incomplete(self, newest: int) -> None:
        for s in self._steps_on_disk():
            if s > newest:
                warnings.warn(
                    NEWER_INCOMPLETE_MSG.format(
                        step=s,
                        directory=self.directory,
                        detail=self._incomplete(s),
                        older=newest,
                    ),
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _restore_step(self, step: int, like: PyTree) -> PyTree:
        meta = self._complete.get(step) or self._read_metadata(step)
        flat_like = jax.tree_util.tree_flatten_with_path(like)[0]
        if self._is_one_copy(step, meta, flat_like):
            return self._restore_one_copy(step, meta, like, flat_like)
        return self._restore_replicated(step, meta, like, flat_like)

    def _is_one_copy(
        self,
        step: int,
        meta: dict[str, Any],
        flat_like: Sequence[tuple[Any, Any]],
    ) -> bool:
        """Whether `like` is one copy (True) or replicated; raises if it mixes."""
        saved = {r["path"]: tuple(r["shape"]) for r in meta.get("leaves", [])}
        one, rep = [], []
        for path, x in flat_like:
            name, shape = keystr(path), _data_shape(x)
            if name not in saved or shape is None:
                continue
            if shape == saved[name]:
                one.append(f"{name} {shape}")
            elif len(shape) >= 1 and shape[1:] == saved[name]:
                rep.append(f"{name} {shape}")
        if one and rep:
            raise ValueError(
                MIXED_LIKE_MSG.format(step=step, one=_first(one), rep=_first(rep))
            )
        return bool(one)

    def _read_state(self, step: int, records: Sequence[dict[str, Any]], treedef):
        """The saved copy's leaves as NumPy arrays, checked against their records."""
        manager = self._open(create=False)
        item = jax.tree_util.tree_unflatten(
            treedef,
            [jax.ShapeDtypeStruct(tuple(r["shape"]), r["dtype"]) for r in records],
        )
        restore_args = jax.tree_util.tree_unflatten(
            treedef,
            [
                ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype(r["dtype"]))
                for r in records
            ],
        )
        try:
            host = _restore_item(manager, step, STATE_ITEM, item, restore_args)
            leaves = treedef.flatten_up_to(host)
        except Exception as e:  # tensorstore/orbax raise many types for bad files
            detail = f"reading its arrays failed ({type(e).__name__}: {e})."
            raise self._corrupt(step, detail) from e
        self._verify(step, records, leaves)
        return leaves

    def _restore_replicated(self, step, meta, like, flat_like) -> PyTree:
        self._check_like(flat_like)
        # One logical copy of `like`: what was saved (ZeRO-sharded optimizer
        # state appears as the full optimizer state).
        flat_logical, treedef = jax.tree_util.tree_flatten_with_path(logical_like(like))
        flat_logical = [
            (path, _as_key_data(x), _key_impl_name(x)) for path, x in flat_logical
        ]
        self._check_matches(step, meta, flat_logical)
        records = meta["leaves"]
        host_leaves = self._read_state(step, records, treedef)
        host = jax.tree_util.tree_unflatten(treedef, host_leaves)
        per = {i: r for i, r in enumerate(records) if r.get("per_replica")}
        if not per:
            return place_like(host, like)
        like_by_path = {
            keystr(path): x
            for path, x in jax.tree_util.tree_flatten_with_path(
                like, is_leaf=is_custom
            )[0]
        }
        counts = set()
        for r in per.values():
            ref = like_by_path.get(r["path"])
            counts.add(None if ref is None or is_custom(ref) else ref.shape[0])
        if counts == {meta["num_replicas"]}:
            own = self._read_replicas(step, meta, per, like_by_path)
            return _place_with(host, like, own)
        count = next(iter(counts)) if len(counts) == 1 else None
        why = f"`like` has {count} replicas" if count else "`like` lays them out"
        host = self._one_copy_of_differing(step, meta, host, per, why)
        return place_like(host, like)

    def _read_replicas(self, step, meta, per, like_by_path) -> dict[str, jax.Array]:
        """The leaves saved with every replica, placed like `like`'s leaves."""
        num = meta["num_replicas"]
        item, restore_args = {}, {}
        for i, r in per.items():
            shape = (num, *r["shape"])
            item[f"leaf_{i}"] = jax.ShapeDtypeStruct(shape, r["dtype"])
            restore_args[f"leaf_{i}"] = ocp.ArrayRestoreArgs(
                sharding=like_by_path[r["path"]].sharding,
                global_shape=shape,
                dtype=np.dtype(r["dtype"]),
            )
        manager = self._open(create=False)
        try:
            got = _restore_item(manager, step, REPLICAS_ITEM, item, restore_args)
        except Exception as e:  # tensorstore/orbax raise many types for bad files
            detail = (
                "reading the leaves saved with every replica failed "
                f"({type(e).__name__}: {e})."
            )
            raise self._corrupt(step, detail) from e
        out = {}
        for i, r in per.items():
            x = got[f"leaf_{i}"]
            crc = r["per_replica"].get("crc32")
            if crc is not None and x.is_fully_addressable:
                host = np.asarray(x)
                if host.shape != (num, *r["shape"]) or _crc32(host) != crc:
                    raise self._corrupt(
                        step,
                        f"leaf {r['path']} (saved with every replica) does not "
                        "match the CRC-32 recorded when it was saved.",
                    )
            if r.get("key_impl"):
                x = jax.random.wrap_key_data(x, impl=r["key_impl"])
            out[r["path"]] = x
        return out

    def _one_copy_of_differing(self, step, meta, host, per, why) -> PyTree:
        """Warns that per-replica values are dropped; BMUF: params to block start."""
        host, note = block_start_params(host)
        paths = [r["path"] for r in per.values()]
        warnings.warn(
            DIFFERING_MSG.format(
                step=step,
                directory=self.directory,
                saved=meta["num_replicas"],
                count=len(paths),
                paths=_first(paths),
                why=why,
                note=note,
            ),
            RuntimeWarning,
            stacklevel=5,
        )
        return host

    def _restore_one_copy(self, step, meta, like, flat_like) -> PyTree:
        """One logical copy, shaped like `like` (which has no replica axis)."""
        flat_logical = []
        for path, x in flat_like:
            ref = x if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else abstract(x)
            flat_logical.append((path, _as_key_data(ref), _key_impl_name(ref)))
        self._check_matches(step, meta, flat_logical, hint=ONE_COPY_HINT)
        records = meta["leaves"]
        treedef = jax.tree.structure(like)
        host_leaves = self._read_state(step, records, treedef)
        per = {i: r for i, r in enumerate(records) if r.get("per_replica")}
        if per:
            host = jax.tree_util.tree_unflatten(treedef, host_leaves)
            host = self._one_copy_of_differing(
                step, meta, host, per, "`like` is one copy"
            )
            host_leaves = jax.tree.leaves(host)
        out = [
            _place_one(x, ref, r.get("key_impl"))
            for x, (_, ref), r in zip(host_leaves, flat_like, records, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    # -- checks -------------------------------------------------------------------

    @staticmethod
    def _check_replicated(
        state: PyTree, flat: Sequence[tuple[Any, Any]], parallel: Any
    ) -> None:
        if not flat:
            raise ValueError("`CheckpointManager.save`: `state` has no array leaves.")
        probs = []
        for path, x in flat:
            if not isinstance(x, jax.Array) or x.ndim == 0:
                kind = "0-d jax.Array" if isinstance(x, jax.Array) else type(x).__name__
                probs.append(f"{keystr(path)}: a {kind} of shape {np.shape(x)}")
        if probs:
            raise ValueError(NOT_REPLICATED_MSG.format(probs=format_problems(probs)))
        if parallel is not None:
            parallel._check_state(state)

    @staticmethod
    def _check_like(flat_like: Sequence[tuple[Any, Any]]) -> None:
        for path, ref in flat_like:
            if getattr(ref, "sharding", None) is None or not hasattr(ref, "dtype"):
                raise TypeError(
                    f"`CheckpointManager.restore`: leaf {keystr(path)} of `like` is "
                    f"a {type(ref).__name__} without a sharding, not a "
                    "replicated `jax.Array` or a `jax.ShapeDtypeStruct` with a "
                    "sharding. Pass `step.replicate(init_state)`, or "
                    "`jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, "
                    "sharding=x.sharding), replicated_state)`; or one copy whose "
                    "shapes are the saved ones to get one copy back."
                )
            if len(ref.shape) == 0:
                raise TypeError(
                    f"`CheckpointManager.restore`: leaf {keystr(path)} of `like` has "
                    "shape (), so it has no replica axis. Pass a state replicated by "
                    "the `jdp.Parallel` that will run it: "
                    "`manager.restore(step.replicate(init_state))`."
                )

    def _check_matches(
        self,
        step: int,
        meta: dict[str, Any],
        flat_logical: Sequence[tuple[Any, Any, Any]],
        *,
        hint: str = "",
    ) -> None:
        def describe(dtype, key_impl):
            return dtype if key_impl is None else f"{dtype} ({key_impl} key data)"

        saved = {
            r["path"]: (tuple(r["shape"]), describe(r["dtype"], r.get("key_impl")))
            for r in meta.get("leaves", [])
        }
        wanted = {
            keystr(path): (tuple(ref.shape), describe(_dtype_name(ref.dtype), impl))
            for path, ref, impl in flat_logical
        }
        probs = _differences(saved, wanted)
        if probs:
            raise ValueError(
                MISMATCH_MSG.format(
                    step=step,
                    directory=self.directory,
                    count=len(probs),
                    probs=format_problems(probs),
                )
                + hint
            )

    def _verify(
        self, step: int, records: Sequence[dict[str, Any]], leaves: Sequence[Any]
    ) -> None:
        for record, x in zip(records, leaves, strict=True):
            x = np.asarray(x)
            detail = None
            if (
                x.shape != tuple(record["shape"])
                or _dtype_name(x.dtype) != record["dtype"]
            ):
                detail = (
                    f"leaf {record['path']} was read back with shape {x.shape} "
                    f"{_dtype_name(x.dtype)}, but was saved with shape "
                    f"{tuple(record['shape'])} {record['dtype']}."
                )
            elif record.get("crc32") is not None and _crc32(x) != record["crc32"]:
                detail = (
                    f"leaf {record['path']} does not match the CRC-32 recorded when "
                    "it was saved."
                )
            if detail:
                raise self._corrupt(step, detail)

    @staticmethod
    def _make_metadata(
        step: int,
        state: PyTree,
        logical: PyTree,
        host: PyTree,
        replicas: dict[str, Any],
        parallel: Any,
    ) -> dict[str, Any]:
        leaves = []
        for (path, x), one in zip(
            jax.tree_util.tree_flatten_with_path(host)[0],
            jax.tree.leaves(logical),
            strict=True,
        ):
            record = {
                "path": keystr(path),
                "shape": list(x.shape),
                "dtype": _dtype_name(x.dtype),
                "crc32": _crc32(x) if isinstance(x, np.ndarray) else None,
            }
            if is_key(one):  # saved as its key data
                record["key_impl"] = _key_impl_name(one)
            every = replicas.get(record["path"])
            if every is not None:
                record["per_replica"] = {
                    "crc32": _crc32(every) if isinstance(every, np.ndarray) else None
                }
            leaves.append(record)
        flat = jax.tree.leaves(state)
        num_replicas = (
            parallel.num_replicas if parallel is not None else int(flat[0].shape[0])
        )
        cls = type(state)
        return {
            "format": FORMAT,
            "step": step,
            "jdp_version": __version__,
            "jax_version": jax.__version__,
            "python_version": sys.version.split()[0],
            "num_replicas": num_replicas,
            "backend": getattr(parallel, "backend", None),
            "axis_name": getattr(parallel, "axis_name", None),
            "process_count": jax.process_count(),
            "state_type": f"{cls.__module__}.{cls.__qualname__}",
            "leaves": leaves,
        }


def _differences(
    saved: dict[str, tuple[Any, str]], wanted: dict[str, tuple[Any, str]]
) -> list[str]:
    """Where two `{path: (shape, dtype)}` maps differ, first difference first."""
    # (position in pytree order, checkpoint side first, message): the first
    # entry is the first leaf where the two trees part.
    found = []
    for i, (path, (shape, dtype)) in enumerate(saved.items()):
        if path not in wanted:
            found.append(
                (
                    i,
                    0,
                    f"{path}: in the checkpoint with shape {shape} {dtype}, not in "
                    "`like`",
                )
            )
    for i, (path, (shape, dtype)) in enumerate(wanted.items()):
        if path not in saved:
            found.append(
                (
                    i,
                    1,
                    f"{path}: not in the checkpoint; `like` has shape {shape} {dtype}",
                )
            )
        elif saved[path] != (shape, dtype):
            s_shape, s_dtype = saved[path]
            found.append(
                (
                    i,
                    1,
                    f"{path}: the checkpoint has shape {s_shape} {s_dtype}, "
                    f"`like` has shape {shape} {dtype}",
                )
            )
    probs = [text for _, _, text in sorted(found)]
    if not probs and list(saved) != list(wanted):
        probs.append("the leaves are the same but in a different pytree order")
    return probs


def _numpy_restore(tree: PyTree) -> ocp.args.PyTreeRestore:
    """Orbax arguments that read a saved item's tree (its metadata) as NumPy."""

    def is_leaf(m):
        return hasattr(m, "shape") and hasattr(m, "dtype")

    return ocp.args.PyTreeRestore(
        item=jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree, is_leaf=is_leaf
        ),
        restore_args=jax.tree.map(
            lambda m: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype(m.dtype)),
            tree,
            is_leaf=is_leaf,
        ),
    )


def _place_one(x: np.ndarray, ref: Any, impl: str | None) -> Any:
    """One restored leaf of a one-copy `like`: NumPy, or placed like `ref`."""
    sharding = getattr(ref, "sharding", None)
    if isinstance(ref, jax.Array | jax.ShapeDtypeStruct) and sharding is not None:
        x = jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])
    elif impl is not None:
        x = jax.numpy.asarray(x)
    if impl is not None:
        x = jax.random.wrap_key_data(x, impl=impl)
    return x


def _place_with(host: PyTree, like: PyTree, own: dict[str, jax.Array]) -> PyTree:
    """`place_like(host, like)`, but the leaves in `own` (by path) taken as they are.

    Leaves saved with every replica are never inside a custom layout node, so
    they are top-level leaves of `like` flattened with `is_leaf=is_custom`.
    """

    def mask(path, x):
        return None if keystr(path) in own else x

    like_rest = jax.tree_util.tree_map_with_path(mask, like, is_leaf=is_custom)
    host_rest = jax.tree_util.tree_map_with_path(mask, host)
    placed = place_like(host_rest, like_rest)
    placed_by_path = {
        keystr(path): x
        for path, x in jax.tree_util.tree_flatten_with_path(placed, is_leaf=is_custom)[
            0
        ]
    }

    def pick(path, _):
        name = keystr(path)
        return own[name] if name in own else placed_by_path[name]

    return jax.tree_util.tree_map_with_path(pick, like, is_leaf=is_custom)
