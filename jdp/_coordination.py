"""Private: this process's client of JAX's coordination service.

Joining a multi-process job (`jdp.distributed.initialize`) starts JAX's
coordination service (in process 0), which has a small key-value store. jdp uses
it where the processes must agree on something without running a collective on
the devices: `step.shard`'s comparison of the processes' batches, the record
of which processes reached shutdown, and the comparison of each step's
`check_sync` (`exchange`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from jdp import _jax_compat


def client() -> Any:
    """This process's coordination-service client, or None if it has not joined.

    Example:
      >>> from jdp import _coordination
      >>> _coordination.client() is None  # a single process never joined
      True
    """
    # Private JAX (no public API for the key-value store): see `_jax_compat`.
    return _jax_compat.coordination_client()


def exchange(
    key: str,
    value: str,
    *,
    process: int,
    processes: Sequence[int],
    timeout_s: float,
    client: Any = None,
) -> dict[int, str]:
    """Publishes this process's `value` and reads the other processes' values.

    Each of `processes` calls it with the same `key` (unique to what they
    compare: a key is written once per process) and its own value; this process
    writes `key/process`, then waits for each other process's entry, for at
    most `timeout_s` seconds in all. One write and one blocking read per other
    process, through the coordination service (no device collective).

    Args:
      key: The key under which the processes publish, e.g. `"jdp/x/3"`.
      value: This process's value.
      process: This process's index.
      processes: The processes that take part (this one among them).
      timeout_s: Seconds to wait, in all, for the others' values.
      client: The key-value store to use instead of this process's client (for
        tests).

    Returns:
      `{process: value}` of this process and of every other that published in
      time; a process missing from it did not publish within `timeout_s`.

    Example:
      >>> from jdp import _coordination
      >>> class Store(dict):
      ...     def key_value_set(self, k, v, allow_overwrite=False):
      ...         self[k] = v
      ...     def blocking_key_value_get(self, k, timeout_in_ms):
      ...         return self[k]
      >>> store = Store({"x/1": "b"})
      >>> _coordination.exchange(
      ...     "x", "a", process=0, processes=[0, 1], timeout_s=1, client=store
      ... )
      {0: 'a', 1: 'b'}
    """
    client = client if client is not None else _jax_compat.coordination_client()
    client.key_value_set(f"{key}/{process}", value, allow_overwrite=True)
    values = {process: value}
    deadline = time.monotonic() + timeout_s
    for other in processes:
        if other == process:
            continue
        left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        try:
            values[other] = client.blocking_key_value_get(f"{key}/{other}", left_ms)
        except Exception:
            # JAX raises its own error type when the wait runs out (no public
            # type for it): time tells a timeout from another failure.
            if time.monotonic() < deadline - 0.05:
                raise
    return values
