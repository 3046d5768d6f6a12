"""Private: this process's client of JAX's coordination service.

Its key-value store (`Store`) is where processes agree without a device
collective: `step.shard`'s batches, shutdown, the stall check, `check_sync`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from jdp import _jax_compat


class Store:
    """The coordination service's key-value store: string keys under `jdp/`, values.

    The one caller of the client's `key_value_*` methods; a call raises what the
    client raises (the service may be gone).
    """

    def __init__(self, client: Any):
        self._client = client

    @classmethod
    def of(cls, client: Any) -> Store | None:
        """`client` as a `Store` (None stays None, a `Store` stays itself)."""
        return client if client is None or isinstance(client, Store) else cls(client)

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


def by_number(entries: dict[str, str], prefix: str) -> dict[int, str]:
    """`{n: value}` of the `entries` whose key is `prefix` then a number n."""
    return {
        int(key[len(prefix) :]): value
        for key, value in entries.items()
        if key.startswith(prefix) and key[len(prefix) :].isdigit()
    }


def store() -> Store | None:
    """This process's store (`Store`), or None if it has not joined a job."""
    return Store.of(client())


def client() -> Any:
    """This process's coordination-service client, or None if it has not joined."""
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
    """Publishes this process's `value`; `{process: value}` of those within `timeout_s`.

    Each of `processes` calls it with the same `key`; `client` replaces this
    process's store (for tests).
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
            # JAX's timeout has no public type: time tells it from a failure.
            if time.monotonic() < deadline - 0.05:
                raise
    return values
