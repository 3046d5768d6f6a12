"""Private: what `jdp.distributed.initialize` set up in this process."""

from __future__ import annotations

import dataclasses

from jdp.distributed import _watchdog


@dataclasses.dataclass
class _ThisProcess:
    """jdp.distributed's one mutable state: `initialize`'s config and set-up."""

    config: dict | None = None
    shutdown_timeout_s: int = 300
    stall_watch: _watchdog.Watchdog | None = None
    exit_hooks: list = dataclasses.field(default_factory=list)


_this = _ThisProcess()
