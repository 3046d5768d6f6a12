"""`jdp.sync_gradients`: the gradient all-reduce as an optax transform."""

from __future__ import annotations

from typing import Any

import optax

from jdp import _collectives


def sync_gradients(
    *,
    axis_name: _collectives.AxisName | None = None,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
    reverse: bool = True,
    reduce_dtype: Any = None,
    flatten: bool | None = None,
) -> optax.GradientTransformation:
    """Averages updates over replicas; put it first in an `optax.chain`.

    The optax form of `jdp.all_reduce_gradients` (same options), in the spirit of
    `optax.contrib.sam(batch_axis_name=...)`: a step that does not average its
    gradients itself gets synchronous data parallelism from its optimizer alone.
    Stateless (`optax.EmptyState`).

    Args:
      axis_name: Replica axis; None (default) uses the one bound by the
        enclosing `jdp.parallelize`.
      bucket_bytes: Largest bucket in bytes (25 MiB); None for one bucket per dtype.
      reverse: Pack leaves last-first.
      reduce_dtype: Optional wire dtype (e.g. `jnp.bfloat16`).
      flatten: Flat buffers or tuples per bucket (see `jdp.all_reduce_gradients`).

    Returns:
      An `optax.GradientTransformation`.

    Example:
      >>> import optax, jdp
      >>> tx = optax.chain(jdp.sync_gradients(), optax.clip_by_global_norm(1.0),
      ...                  optax.adam(1e-3))
      >>> # use it with `jdp.make_train_step(loss_fn, tx, grad_sync="none")`
    """
    _collectives.check_bucket_bytes(bucket_bytes)
    options = dict(axis_name=axis_name, bucket_bytes=bucket_bytes, reverse=reverse)

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        synced = _collectives.all_reduce(
            updates,
            reduce_dtype=reduce_dtype,
            flatten=flatten,
            api="jdp.sync_gradients",
            **options,
        )
        return synced, state

    return optax.GradientTransformation(init_fn, update_fn)
