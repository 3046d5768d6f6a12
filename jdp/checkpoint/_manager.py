"""`jdp.checkpoint.CheckpointManager`: save one copy, restore into every replica.

Caffe2's `GetCheckpointParams` saves the first device's blobs and the iteration
counter; `FinalizeAfterCheckpoint` copies them back to every device after loading.
This module does the same on orbax-checkpoint: a save writes one logical copy of a
replicated state (`jdp._layout.logical_copy`) as an orbax PyTree item plus a JSON
item of metadata (jdp version, replica count, backend, every leaf's path, shape,
dtype and CRC-32); a restore reads that copy and places it into the layout of a
replicated `like` state (`jdp._layout.place_like`), so the number of replicas,
the devices and the backend may all differ from the run that saved it.

Orbax writes each step into a temporary directory and renames it when complete
(or writes a commit marker on object stores), so a save that is killed midway
leaves nothing that `latest_step` reports. Checkpoints are read with tensorstore
and JSON only: restoring never unpickles or runs code from the files.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jdp._layout import is_key, key_impl, logical_copy, logical_like, place_like
from jdp._tree import format_problems, keystr
from jdp._version import __version__

PyTree = Any

#: Orbax item names inside one step directory.
STATE_ITEM = "state"
METADATA_ITEM = "jdp_metadata"
#: Marks a step's JSON as written by this module (and its layout version).
FORMAT = "jdp.checkpoint/1"

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

UNREPLICATED_LIKE_HINT = (
    "\n`like` looks like one unreplicated copy (its shapes are the saved shapes). "
    "Pass a state replicated by the `jdp.Parallel` that will run it: "
    "`manager.restore(step.replicate(init_state))`."
)

CORRUPT_MSG = (
    "`CheckpointManager.restore`: the checkpoint of step {step} in {directory} is "
    "corrupted or truncated: {detail} Restore another step (`manager.all_steps()` "
    "lists them) or save again."
)

NOT_REPLICATED_MSG = (
    "`CheckpointManager.save`: `state` is not a replicated state. Expected every "
    "leaf to be a `jax.Array` with a leading replica axis, as returned by a "
    "`jdp.Parallel` step or `step.replicate`. Offending leaves:{probs}\n"
    "Fix: `manager.save(step_number, step.replicate(state))`."
)


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

    Each step is written into a temporary directory and committed when complete,
    so a save that crashes midway is ignored. A step number is never overwritten.
    Restoring checks the saved structure, shapes and dtypes against `like` and
    every leaf's checksum, and never unpickles anything.

    With several processes, every process calls `save` and `restore`; orbax lets
    one process write the copy and the metadata and synchronises the others.

    Args:
      directory: Directory holding one subdirectory per saved step (created on the
        first save). Any path `etils.epath` understands (local, `gs://`, ...).
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
      >>> import tempfile, jax, jax.numpy as jnp, optax, jdp
      >>> tx = optax.sgd(0.1)
      >>> step = jdp.parallelize(
      ...     jdp.make_train_step(lambda p, b: jnp.mean((b * p["w"] - 1.0) ** 2), tx)
      ... )
      >>> state = step.replicate(jdp.TrainState.create(params={"w": 0.0}, tx=tx))
      >>> state, _ = step(state, step.shard(jnp.ones(8)))
      >>> with jdp.checkpoint.CheckpointManager(tempfile.mkdtemp()) as manager:
      ...     _ = manager.save(1, state)
      ...     like = step.replicate(jdp.TrainState.create(params={"w": 0.0}, tx=tx))
      ...     restored = manager.restore(like)
      ...     manager.latest_step()
      1
      >>> int(step.unreplicate(restored).step)
      1
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
        self._open(create=False)

    # -- orbax plumbing -----------------------------------------------------------

    def _open(self, *, create: bool) -> ocp.CheckpointManager | None:
        """The orbax manager; made lazily so that reading never creates directories."""
        if self._manager is None and (create or self.directory.exists()):
            policies = ocp.checkpoint_managers
            options = ocp.CheckpointManagerOptions(
                create=True,
                enable_async_checkpointing=self.async_save,
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
                item_names=(STATE_ITEM, METADATA_ITEM),
            )
        return self._manager

    def _read_metadata(self, step: int) -> dict[str, Any]:
        """The step's JSON record; ValueError if it is missing or unreadable."""
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

    def _corrupt(self, step: int, detail: str) -> ValueError:
        """The error for a damaged checkpoint of `step`."""
        return ValueError(
            CORRUPT_MSG.format(step=step, directory=self.directory, detail=detail)
        )

    def _is_complete(self, step: int) -> bool:
        """Whether orbax committed the step and both of its items are present."""
        if step in self._complete:
            return True
        path = self.directory / str(step)
        try:
            if not ocp.step.is_path_finalized(path):
                return False
            if not (path / STATE_ITEM).exists():
                return False
            meta = self._read_metadata(step)
        except (ValueError, OSError):
            return False
        self._complete[step] = meta
        return True

    # -- public API ---------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Step numbers of the complete checkpoints, oldest first.

        A save still in progress (async) or one that was interrupted is not
        listed.

        Returns:
          A sorted list of step numbers (empty if there are none).
        """
        manager = self._open(create=False)
        if manager is None:
            return []
        return sorted(s for s in manager.all_steps() if self._is_complete(s))

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
        pytree order.

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
        checkpoint is the size of one model whatever the replica count. The
        copy is taken before `save` returns, so the next step may donate
        `state` even while an async save is still writing.

        Under `jdp.bmuf` the copy includes the global model, the block velocity
        and the step count, but the replicas' local models differ between syncs:
        save right after a sync (`step % sync_period == 0`), when
        `jdp.make_train_step` has left every replica with the same bits, and the
        resume is bit-exact.

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
          if `save_interval_steps` skipped this step.

        Raises:
          TypeError: If `step` is not an integer.
          ValueError: If `state` is not replicated, `step` already has a
            checkpoint, or `step` is older than the latest checkpoint (nothing is
            overwritten).
        """
        step = _check_step_number(step, "step")
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        self._check_replicated(state, flat, parallel)
        manager = self._open(create=True)
        existing = list(manager.all_steps())
        if step in existing:
            raise ValueError(
                f"`CheckpointManager.save`: step {step} already has a checkpoint in "
                f"{self.directory}; checkpoints are never overwritten. Save under a "
                "new step number, or delete that step's directory first."
            )
        if existing and step < max(existing):
            raise ValueError(
                f"`CheckpointManager.save`: step {step} is older than the latest "
                f"checkpoint ({max(existing)}) in {self.directory}. Step numbers must "
                "increase; to branch off an older step, save into a new directory."
            )
        if not force and not manager.should_save(step):
            return False
        logical = logical_copy(state)
        host = jax.tree.map(_host_copy, logical)
        meta = self._make_metadata(step, state, logical, host, flat, parallel)
        self._complete.pop(step, None)
        manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.PyTreeSave(host),
                    METADATA_ITEM: ocp.args.JsonSave(meta),
                }
            ),
            force=True,
        )
        return True

    def restore(self, like: PyTree, *, step: int | None = None) -> PyTree:
        """Loads a saved copy into every replica of `like`'s layout.

        Args:
          like: A replicated state with the layout to restore into: the state a
            `jdp.Parallel` would run (`step.replicate(init_state)`), or the same
            tree of `jax.ShapeDtypeStruct`s with shardings. Its replica count,
            devices and backend need not match the run that saved. Its static
            fields (e.g. `TrainState.tx`) are kept.
          step: The step number to load; None (default) loads the latest.

        Returns:
          A pytree like `like` (same structure and static fields), with
          `jax.Array` leaves shaped and sharded like `like`'s, every replica equal
          to the saved copy.

        Raises:
          FileNotFoundError: If the directory holds no complete checkpoint, or
            not one for `step`.
          TypeError: If a leaf of `like` has no shape, dtype or sharding.
          ValueError: If the checkpoint's structure, shapes or dtypes differ from
            `like` (naming the first differing leaf paths and both shapes), or
            if its files are corrupted or truncated.
        """
        manager = self._open(create=False)
        if manager is not None:
            manager.wait_until_finished()
        step = self._resolve_step(step)
        flat_like = jax.tree_util.tree_flatten_with_path(like)[0]
        self._check_like(flat_like)
        # One logical copy of `like`: what was saved (ZeRO-sharded optimizer
        # state appears as the full optimizer state).
        flat_logical, treedef = jax.tree_util.tree_flatten_with_path(logical_like(like))
        flat_logical = [
            (path, _as_key_data(x), _key_impl_name(x)) for path, x in flat_logical
        ]
        meta = self._complete.get(step) or self._read_metadata(step)
        self._check_matches(step, meta, flat_logical, flat_like)
        records = meta["leaves"]
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
            host = manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.PyTreeRestore(
                            item=item, restore_args=restore_args
                        )
                    }
                ),
            )[STATE_ITEM]
            host_leaves = treedef.flatten_up_to(host)
        except Exception as e:  # tensorstore/orbax raise many types for bad files
            detail = f"reading its arrays failed ({type(e).__name__}: {e})."
            raise self._corrupt(step, detail) from e
        self._verify(step, records, host_leaves)
        return place_like(jax.tree_util.tree_unflatten(treedef, host_leaves), like)

    def wait_until_finished(self) -> None:
        """Blocks until an async save has been written and committed.

        Raises:
          Exception: Whatever made the background save fail.
        """
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None

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

    # -- checks -------------------------------------------------------------------

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        manager = self._open(create=False)
        ignored = sorted(set(manager.all_steps() if manager else ()) - set(steps))
        note = (
            f" Step(s) {ignored} exist but are incomplete or damaged (a save that "
            "was interrupted or is still running, or corrupted files) and are ignored."
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
                    "sharding=x.sharding), replicated_state)`."
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
        flat_logical: Sequence[tuple[Any, Any]],
        flat_like: Sequence[tuple[Any, Any]],
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
        # (position in pytree order, checkpoint side first, message): the first
        # entry is the first leaf where the two trees part.
        found = []
        for i, (path, (shape, dtype)) in enumerate(saved.items()):
            if path not in wanted:
                found.append(
                    (
                        i,
                        0,
                        f"{path}: in the checkpoint with shape {shape} {dtype}, "
                        "not in `like`",
                    )
                )
        for i, (path, (shape, dtype)) in enumerate(wanted.items()):
            if path not in saved:
                found.append(
                    (
                        i,
                        1,
                        f"{path}: not in the checkpoint; `like` has shape "
                        f"{shape} {dtype}",
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
        if probs:
            msg = MISMATCH_MSG.format(
                step=step,
                directory=self.directory,
                count=len(probs),
                probs=format_problems(probs),
            )
            full = {keystr(path): tuple(ref.shape) for path, ref in flat_like}
            common = full.keys() & saved.keys()
            if common and all(full[p] == saved[p][0] for p in common):
                msg += UNREPLICATED_LIKE_HINT
            raise ValueError(msg)

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
        flat: Sequence[tuple[Any, Any]],
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
            leaves.append(record)
        num_replicas = (
            parallel.num_replicas if parallel is not None else int(flat[0][1].shape[0])
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
