"""The writer's lock on a checkpoint directory: one `CheckpointManager` saves at a time.

The lock is a small JSON file, `<directory>/.jdp-checkpoint.lock`, holding the
owner's process id, host name, process start time and a random token. It is
created with `O_CREAT | O_EXCL` (atomic on local and network file systems), so
of two managers only one gets it. A lock whose owner is gone (a killed process
on the same host, or a manager of this process that was never closed and has
been garbage collected) is stale: the next manager reclaims it. Checking and
reclaiming happen under an advisory `flock` on the directory, so two managers
reclaiming the same stale lock cannot both win.

On object stores (`gs://`, ...) there is no atomic create: the lock is then best
effort (a second manager that starts while the first is writing its lock file may
not see it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import uuid
import warnings
from typing import Any

import jax
import numpy as np
from etils import epath

from jdp._version import __version__
from jdp.checkpoint._common import same_kind_of_error

#: The lock file's name inside the checkpoint directory.
LOCK_NAME = ".jdp-checkpoint.lock"
#: How long to wait for another manager checking the same lock (seconds).
GUARD_TIMEOUT_S = 10.0

LOCKED_MSG = (
    "`CheckpointManager.save`: {directory} is locked by another checkpoint "
    "manager: {owner} holds {lock}. Two managers saving into one directory would "
    "overwrite each other's steps, so only one may save at a time.\nFix: give this "
    "run its own directory, or `close()` the other manager (or let its process "
    "end) first.{stale_hint}"
)

OTHER_HOST_HINT = (
    " If that process is no longer running (its machine was restarted or "
    "lost), delete {lock} and save again: a lock from another host cannot be "
    "checked from here."
)

UNWRITABLE_MSG = (
    "`CheckpointManager.save`: cannot create the lock file {lock} in the "
    "checkpoint directory {directory} ({error}). Nothing was saved.\nFix: make "
    "{directory} writable (and check that it is on a file system with free "
    "space), or pass another directory."
)

# Tokens of the locks held by managers of this process that are still open.
_LIVE: set[str] = set()
_LIVE_GUARD = threading.Lock()


def _stat_fields(pid: int) -> list[str]:
    """The fields of `/proc/PID/stat` after the command name (Linux), or []."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return []
    return stat.rpartition(")")[2].split()  # fields[0] is field 3 of proc(5)


def _process_start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (Linux), else None."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19])  # field 22 of proc(5)
    except (IndexError, ValueError):
        return None


def _process_state(pid: int) -> str | None:
    """A process's state letter from /proc (e.g. "Z" for a zombie), else None."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def process_gone(pid: int, start_time: int | None = None) -> str | None:
    """Why process `pid` of this host is not the live lock owner, or None if it is.

    Args:
      pid: A process id on this host.
      start_time: The start time recorded with the lock; a running process with
        another start time reuses the id of a process that ended.

    Returns:
      None if the process runs (as far as can be told); else a reason: no such
      process, a zombie, or its id reused by another process.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} is no longer running"
    except PermissionError:
        pass  # it exists, owned by another user
    if _process_state(pid) in ("Z", "X"):
        return f"process {pid} is no longer running (it is a zombie)"
    now = _process_start_time(pid)
    if start_time is not None and now is not None and now != start_time:
        return (
            f"process {pid} is no longer running (its id now belongs to a process "
            "started later)"
        )
    return None


def describe_owner(owner: dict[str, Any] | None) -> str:
    """The lock owner for error messages: process id, host and since when."""
    if not owner:
        return "an unknown process (the lock file is unreadable)"
    since = owner.get("created")
    when = (
        time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since))
        if isinstance(since, int | float)
        else ""
    )
    here = owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
    mine = " (this process)" if here else ""
    return f"process {owner.get('pid')} on host {owner.get('host')!r}{when}{mine}"


class DirectoryLock:
    """An exclusive, reclaimable lock on one checkpoint directory.

    Args:
      directory: The checkpoint directory (it must exist when `acquire` runs).
    """

    def __init__(self, directory: epath.Path):
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.token: str | None = None
        self._local = "://" not in os.fspath(directory)

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self.token is not None

    def _record(self, token: str) -> dict[str, Any]:
        pid = os.getpid()
        return {
            "pid": pid,
            "host": socket.gethostname(),
            "start_time": _process_start_time(pid),
            "created": time.time(),
            "token": token,
            "jdp_version": __version__,
        }

    def read_owner(self) -> dict[str, Any] | None:
        """The lock file's record; None if it is missing or unreadable."""
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def _stale_reason(self, owner: dict[str, Any] | None, guarded: bool) -> str | None:
        """Why the lock held by `owner` is stale, or None if it may be live."""
        if owner is None:
            # Under the directory guard a lock is never seen half written by a
            # live manager: its writer died mid-write. Without it, it may be.
            if guarded:
                return "the lock file is unreadable (its writer died writing it)"
            return None
        if owner.get("host") != socket.gethostname():
            return None
        pid = owner.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            return "the lock file names no process"
        if pid == os.getpid():
            with _LIVE_GUARD:
                live = owner.get("token") in _LIVE
            return None if live else "its manager in this process was released"
        return process_gone(pid, owner.get("start_time"))

    @contextlib.contextmanager
    def _guard(self):
        """An advisory `flock` on the directory around check-and-create.

        Yields whether the guard is held (not on object stores, nor where the
        file system refuses `flock`).
        """
        fd = None
        if self._local:
            try:
                import fcntl

                fd = os.open(os.fspath(self.directory), os.O_RDONLY)
                deadline = time.monotonic() + GUARD_TIMEOUT_S
                while True:  # held for milliseconds; never wait without bound
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.01)
            except (ImportError, OSError):
                if fd is not None:
                    os.close(fd)
                fd = None
        try:
            yield fd is not None
        finally:
            if fd is not None:
                os.close(fd)  # releases the flock

    def _create(self, record: dict[str, Any]) -> bool:
        """Writes the lock file if none exists; False if one does."""
        data = json.dumps(record).encode()
        if not self._local:
            if self.path.exists():
                return False
            self.path.write_bytes(data)
            return True
        try:
            fd = os.open(os.fspath(self.path), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def acquire(self) -> None:
        """Takes the lock, reclaiming a stale one (with a warning).

        Raises:
          RuntimeError: If a live manager (or one on another host) holds it.
          OSError: If the lock file cannot be written (naming the directory).
        """
        if self.held:
            return
        token = uuid.uuid4().hex
        with self._guard() as guarded:
            for _ in range(3):
                try:
                    created = self._create(self._record(token))
                except OSError as e:
                    raise _unwritable(self, e) from e
                if created:
                    with _LIVE_GUARD:
                        _LIVE.add(token)
                    self.token = token
                    return
                owner = self.read_owner()
                reason = self._stale_reason(owner, guarded)
                if reason is None:
                    raise RuntimeError(self._locked_message(owner))
                self._reclaim(owner, reason)
        raise RuntimeError(self._locked_message(self.read_owner()))

    def _reclaim(self, owner: dict[str, Any] | None, reason: str) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        warnings.warn(
            f"`CheckpointManager.save`: reclaimed the stale lock {self.path} left "
            f"by {describe_owner(owner)}: {reason}.",
            RuntimeWarning,
            stacklevel=5,
        )

    def _locked_message(self, owner: dict[str, Any] | None) -> str:
        other_host = owner is not None and owner.get("host") != socket.gethostname()
        return LOCKED_MSG.format(
            directory=self.directory,
            owner=describe_owner(owner),
            lock=self.path,
            stale_hint=OTHER_HOST_HINT.format(lock=self.path) if other_host else "",
        )

    def release(self) -> None:
        """Removes the lock file if this object still holds it; never raises."""
        token, self.token = self.token, None
        if token is None:
            return
        with _LIVE_GUARD:
            _LIVE.discard(token)
        try:
            owner = self.read_owner()
            if owner is not None and owner.get("token") == token:
                self.path.unlink()
        except OSError:
            pass


def _unwritable(lock: DirectoryLock, error: OSError) -> OSError:
    """The error for a lock file that cannot be written, of `error`'s type."""
    msg = UNWRITABLE_MSG.format(
        lock=lock.path,
        directory=lock.directory,
        error=f"{type(error).__name__}: {error}",
    )
    return same_kind_of_error(error, msg)


DIFFERENT_DIRECTORIES_MSG = (
    "`CheckpointManager.save`: the processes of this job save into different "
    "directories:\n{listing}\nEvery process of a job must pass the same "
    "directory: process 0 writes the checkpoint into its own directory and the "
    "other processes only synchronise with it, so the steps would be saved into "
    "one directory only and a restore from the others would find nothing. "
    "Nothing was saved.\nFix: pass the same path on every process (e.g. "
    "`CheckpointManager(base_dir)`, not a path that holds the process index; an "
    "absolute path if the processes run in different working directories)."
)


def check_same_directory(directory: epath.Path) -> None:
    """Raises on every process of a job if the processes name different directories.

    Every process of a job must call it (it is a collective): the processes
    gather a digest of their directory's path, and where the digests differ,
    the paths themselves, so that every process raises the same error naming
    each process and its directory. A single process returns at once.

    Args:
      directory: The checkpoint directory of this process's manager.

    Raises:
      ValueError: If the processes' directories differ (naming them all).
    """
    if jax.process_count() < 2:
        return
    from jax.experimental import multihost_utils

    path = os.fspath(directory).encode()
    digest = np.frombuffer(hashlib.sha256(path).digest(), np.int32)
    row = np.concatenate([np.array([len(path)], np.int32), digest])
    rows = np.asarray(multihost_utils.process_allgather(row))
    if (rows == rows[0]).all():
        return
    longest = int(rows[:, 0].max())
    padded = np.zeros(longest, np.uint8)
    padded[: len(path)] = np.frombuffer(path, np.uint8)
    paths = np.asarray(multihost_utils.process_allgather(padded))
    names = [
        bytes(paths[i, : int(rows[i, 0])]).decode(errors="replace")
        for i in range(len(rows))
    ]
    listing = "\n".join(f"  process {i}: {name}" for i, name in enumerate(names))
    raise ValueError(DIFFERENT_DIRECTORIES_MSG.format(listing=listing))


def acquire_for_job(lock: DirectoryLock) -> None:
    """Takes `lock` on process 0 of a job; every process raises if that fails.

    Every process of a job must call it (the broadcast is a collective), so
    whether the lock is held is decided by process 0's lock, alike on every
    process. Called by `CheckpointManager.save` itself: a reclaimed stale lock
    is reported at the caller of `save`.

    Args:
      lock: The checkpoint directory's lock.

    Raises:
      RuntimeError: If another manager holds the lock (on process 0; the other
        processes raise that process 0 could not lock the directory).
      OSError: If the lock file cannot be written.
    """
    error = None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except (RuntimeError, OSError) as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
        if not int(ok) and error is None:
            raise RuntimeError(
                f"`CheckpointManager.save`: process 0 could not lock "
                f"{lock.directory} (see its error); nothing was saved."
            )
    if error is not None:
        raise error
