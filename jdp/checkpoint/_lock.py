"""The writer's lock on a checkpoint directory: one `CheckpointManager` saves at a time.

A JSON file naming its owner, created with `O_CREAT | O_EXCL` (best effort on
object stores); a stale lock is reclaimed under an advisory `flock`.
"""

from __future__ import annotations

import contextlib
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
from jax.experimental import multihost_utils

from jdp._version import __version__
from jdp.checkpoint._common import error_text, same_kind_of_error

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
    try:
        return int(_stat_fields(pid)[19])  # field 22 of proc(5)
    except (IndexError, ValueError):
        return None


def process_gone(pid: int, start_time: int | None = None) -> str | None:
    """Why process `pid` of this host is not the live lock owner, or None if it is."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} is no longer running"
    except PermissionError:
        pass  # it exists, owned by another user
    if _stat_fields(pid)[:1] in (["Z"], ["X"]):  # its state letter
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
    since, when = owner.get("created"), ""
    if isinstance(since, int | float):
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since))
    here = owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
    mine = " (this process)" if here else ""
    return f"process {owner.get('pid')} on host {owner.get('host')!r}{when}{mine}"


class DirectoryLock:
    """An exclusive, reclaimable lock on one checkpoint directory (which must exist)."""

    def __init__(self, directory: epath.Path):
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.token: str | None = None
        self._local = "://" not in os.fspath(directory)

    def read_owner(self) -> dict[str, Any] | None:
        """The lock file's record; None if it is missing or unreadable."""
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def _stale_reason(self, owner: dict[str, Any] | None, guarded: bool) -> str | None:
        """Why the lock held by `owner` is stale, or None if it may be live."""
        if owner is None:  # without the guard, a live manager may be writing it
            unreadable = "the lock file is unreadable (its writer died writing it)"
            return unreadable if guarded else None
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
        """An advisory `flock` on the directory; yields whether it is held."""
        fd, held = None, False
        if self._local:
            with contextlib.suppress(ImportError, OSError):  # then not held
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
                held = True
        try:
            yield held
        finally:
            if fd is not None:
                os.close(fd)  # releases the flock

    def _create(self, token: str) -> bool:
        """Writes the lock file if none exists; False if one does."""
        pid = os.getpid()
        record = {
            "pid": pid, "host": socket.gethostname(),
            "start_time": _process_start_time(pid), "created": time.time(),
            "token": token, "jdp_version": __version__,
        }  # fmt: skip
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
        """Takes the lock, reclaiming a stale one (with a warning)."""
        if self.token is not None:
            return
        token = uuid.uuid4().hex
        with self._guard() as guarded:
            for _ in range(3):
                try:
                    created = self._create(token)
                except OSError as e:
                    message = UNWRITABLE_MSG.format(
                        lock=self.path, directory=self.directory, error=error_text(e)
                    )
                    raise same_kind_of_error(e, message) from e
                if created:
                    with _LIVE_GUARD:
                        _LIVE.add(token)
                    self.token = token
                    return
                owner = self.read_owner()
                if (reason := self._stale_reason(owner, guarded)) is None:
                    raise RuntimeError(self._locked_message(owner))
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                message = (
                    f"`CheckpointManager.save`: reclaimed the stale lock {self.path} "
                    f"left by {describe_owner(owner)}: {reason}."
                )
                warnings.warn(message, RuntimeWarning, stacklevel=4)
        raise RuntimeError(self._locked_message(self.read_owner()))

    def _locked_message(self, owner: dict[str, Any] | None) -> str:
        other_host = owner is not None and owner.get("host") != socket.gethostname()
        return LOCKED_MSG.format(
            directory=self.directory, owner=describe_owner(owner), lock=self.path,
            stale_hint=OTHER_HOST_HINT.format(lock=self.path) if other_host else "",
        )  # fmt: skip

    def release(self) -> None:
        """Removes the lock file if this object still holds it; never raises."""
        token, self.token = self.token, None
        if token is None:
            return
        with _LIVE_GUARD:
            _LIVE.discard(token)
        if (self.read_owner() or {}).get("token") == token:
            with contextlib.suppress(OSError):
                self.path.unlink()


def check_same_directory(directory: epath.Path) -> None:
    """Raises a `ValueError` on every process if the processes' directories differ."""
    if jax.process_count() < 2:
        return
    path = np.frombuffer(os.fspath(directory).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(path))))
    padded = np.pad(path, (0, int(sizes.max()) - len(path)))
    paths = np.asarray(multihost_utils.process_allgather(padded))
    names = [
        bytes(p[:n]).decode(errors="replace") for p, n in zip(paths, sizes, strict=True)
    ]
    if len(set(names)) > 1:
        listing = "\n".join(f"  process {i}: {name}" for i, name in enumerate(names))
        raise ValueError(DIFFERENT_DIRECTORIES_MSG.format(listing=listing))


def acquire_for_job(lock: DirectoryLock) -> None:
    """Takes `lock` on process 0 of a job; every process raises if that fails."""
    error = None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except (RuntimeError, OSError) as e:
            error = e
    if jax.process_count() > 1:
        ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
        if not int(ok) and error is None:
            raise RuntimeError(
                f"`CheckpointManager.save`: process 0 could not lock "
                f"{lock.directory} (see its error); nothing was saved."
            )
    if error is not None:
        raise error
