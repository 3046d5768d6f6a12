"""Private: this process's client of JAX's coordination service.

Joining a multi-process job (`jdp.distributed.initialize`) starts JAX's
coordination service (in process 0), which has a small key-value store. jdp uses
it where the processes must agree on something without running a collective on
the devices: `step.shard`'s comparison of the processes' batches, the record
of which processes reached shutdown, the stall check's progress reports and
verdict, and the comparison of each step's `check_sync` (`exchange`). Each goes
through `Store`, the one place that calls the store's methods.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from jdp import _jax_compat


class Store:
    """The coordination service's key-value store, as every jdp protocol uses it.

    jdp's protocols over the store (`exchange`, `step.shard`'s batch
    agreement, the stall check's progress and verdict, shutdown's arrivals) go
    through these five calls; only this class calls the client's `key_value_*`
    methods. Keys are strings under `jdp/`, values strings. A call raises what
    the client raises (the service may be gone); callers decide what that means.

    Example:
      >>> from jdp import _coordination
      >>> class Fake(dict):  # the client's methods, over a dict
      ...     def key_value_set(self, k, v, allow_overwrite=False):
      ...         if k in self and not allow_overwrite:
      ...             raise KeyError(k)
      ...         self[k] = v
      ...     def key_value_try_get(self, k):
      ...         return self[k]
      ...     def blocking_key_value_get(self, k, timeout_in_ms):
      ...         return self[k]
      ...     def key_value_dir_get(self, prefix):
      ...         return [(k, v) for k, v in self.items() if k.startswith(prefix)]
      >>> store = _coordination.Store.of(Fake())
      >>> store.put("jdp/x/0", "a"); store.put("jdp/x/1", "b")
      >>> store.entries("jdp/x/"), store.get("jdp/x/1"), store.wait("jdp/x/0", 1.0)
      ({'jdp/x/0': 'a', 'jdp/x/1': 'b'}, 'b', 'a')
    """

    def __init__(self, client: Any):
        self._client = client

    @classmethod
    def of(cls, client: Any) -> Store | None:
        """`client` as a `Store` (None stays None, a `Store` stays itself)."""
        if client is None or isinstance(client, Store):
            return client
        return cls(client)

    def put(self, key: str, value: str, *, overwrite: bool = True) -> None:
        """Writes `value` at `key`; with `overwrite=False`, raises if it is set."""
        self._client.key_value_set(key, value, allow_overwrite=overwrite)

    def get(self, key: str) -> str:
        """The value at `key` now; raises if there is none."""
        return self._client.key_value_try_get(key)

    def wait(self, key: str, timeout_s: float) -> str:
        """The value at `key`, waiting up to `timeout_s` for it; raises after."""
        return self._client.blocking_key_value_get(key, max(int(timeout_s * 1000), 1))

    def entries(self, prefix: str) -> dict[str, str]:
        """Every `{key: value}` whose key starts with `prefix` (a directory)."""
        return dict(self._client.key_value_dir_get(prefix))


def store() -> Store | None:
    """This process's store (`Store`), or None if it has not joined a job."""
    return Store.of(client())


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
    kv = Store.of(client) if client is not None else store()
    kv.put(f"{key}/{process}", value)
    values = {process: value}
    deadline = time.monotonic() + timeout_s
    for other in processes:
        if other == process:
            continue
        try:
            values[other] = kv.wait(f"{key}/{other}", deadline - time.monotonic())
        except Exception:
            # JAX raises its own error type when the wait runs out (no public
            # type for it): time tells a timeout from another failure.
            if time.monotonic() < deadline - 0.05:
                raise
    return values
