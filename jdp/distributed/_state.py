"""Private: what `jdp.distributed.initialize` set up in this process.

The package's one mutable state (`_this`): the job joined, how long shutdown
waits, the stall check, and which exit hooks are installed.
"""

from __future__ import annotations

import dataclasses

from jdp.distributed import _watchdog


@dataclasses.dataclass
class _ThisProcess:
    """What `initialize` set up in this process: jdp.distributed's one mutable state.

    Attributes:
      config: The arguments of the successful `initialize` (or None).
      shutdown_timeout_s: Its `timeout_s`: how long `shutdown` waits for the
        other processes.
      stall_watch: The stall check (`stall_timeout_s`), while in a job.
      exit_hook_installed: Whether `shutdown` is registered to run at exit.
      finish_hook_installed: Whether the stall check is told at exit that this
        process finished.
    """

    config: dict | None = None
    shutdown_timeout_s: int = 300
    stall_watch: _watchdog.Watchdog | None = None
    exit_hook_installed: bool = False
    finish_hook_installed: bool = False


_this = _ThisProcess()
