"""Private: this process's client of JAX's coordination service.

Joining a multi-process job (`jdp.distributed.initialize`) starts JAX's
coordination service (in process 0), which has a small key-value store. jdp uses
it where the processes must agree on something without running a collective on
the devices: `step.shard`'s comparison of the processes' batches and the record
of which processes reached shutdown.
"""

from __future__ import annotations

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
