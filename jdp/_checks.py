"""`jdp.replicas_in_sync` / `jdp.assert_replicas_in_sync`: catch a forgotten sync."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jdp import _layout
from jdp._tree import PyTree, float_bits, format_problems


def _same(x, ref):
    """Where floats `x` and `ref` are the same number: same bits, both NaN or zero.

    Not `x == ref`: CPUs may read subnormal numbers as zero.
    """
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _same(x.real, ref.real) & _same(x.imag, ref.imag)
    xb, rb = float_bits(x), float_bits(ref)
    magnitude = ~np.array(1 << (8 * xb.dtype.itemsize - 1), xb.dtype)  # no sign
    zeros = ((xb & magnitude) == 0) & ((rb & magnitude) == 0)
    return (xb == rb) | zeros | (jnp.isnan(x) & jnp.isnan(ref))


def _replica_differences(leaves):
    """Per leaf and replica r, the largest |x[r] - x[0]|.

    Inf where a NaN or an infinity differs; where the bits differ, at least
    float32's smallest normal number.
    """
    out = []
    for x in leaves:
        ref = x[:1]
        if jnp.issubdtype(x.dtype, jnp.inexact):
            diff = jnp.abs(x - ref).astype(jnp.float32)
            tiny = np.finfo(np.float32).tiny  # a difference flushed to zero
            diff = jnp.where(jnp.isnan(diff), jnp.inf, jnp.maximum(diff, tiny))
            diff = jnp.where(_same(x, ref), 0.0, diff)
        else:
            diff = jnp.where(x != ref, jnp.inf, 0.0).astype(jnp.float32)
        out.append(diff.reshape(x.shape[0], -1).max(axis=1, initial=0.0))
    return out


def _differences(state: PyTree, atol: float):
    """`(path, replica, difference)` of each leaf whose replicas differ by > `atol`."""
    paths, diffs = _layout.compare_replicas(_replica_differences, state)
    problems = []
    for path, d in zip(paths, diffs, strict=True):
        d = np.asarray(d)
        worst = int(np.argmax(d))
        if d[worst] > atol:
            problems.append((path, worst, float(d[worst])))
    return problems


def replicas_in_sync(state: PyTree, *, atol: float = 0.0) -> bool:
    """Whether every replica of a replicated pytree holds the same values.

    Compares each array leaf's replicas (its leading axis) with replica 0,
    exactly by default (synchronous steps keep replicas bit-identical); NaNs in
    the same places count as equal. The slices of `jdp.zero(tx)`'s sharded
    optimizer state differ by design and are skipped.

    Args:
      state: A pytree replicated by a `jdp.Parallel` step.
      atol: Largest absolute difference tolerated (0 by default).

    Returns:
      True if no leaf differs by more than `atol` between replicas.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
      >>> jdp.replicas_in_sync(step.replicate({"w": jnp.ones(3)}))
      True
    """
    return not _differences(state, atol)


def assert_replicas_in_sync(state: PyTree, *, atol: float = 0.0) -> None:
    """Raises if replicas of a replicated pytree differ, naming the leaves.

    Args:
      state: A pytree replicated by a `jdp.Parallel` step.
      atol: Largest absolute difference tolerated (0 by default).

    Raises:
      AssertionError: Naming the first diverging leaf paths, the replica that
        differs most from replica 0, and the largest difference.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
      >>> jdp.assert_replicas_in_sync(step.replicate({"w": jnp.ones(3)}))
    """
    if problems := _differences(state, atol):
        lines = [
            f"{path}: replica {r} differs from replica 0 by up to {d:.6g}"
            for path, r, d in problems
        ]
        raise AssertionError(
            "`jdp.assert_replicas_in_sync`: replicas are out of sync in "
            f"{len(problems)} leaves (atol={atol}):"
            f"{format_problems(lines)}\nA step that updates the state without "
            "averaging its gradients (`jdp.all_reduce_gradients`) or syncing "
            "computed state (`jdp.sync_batch_stats`) lets replicas drift; "
            "`step.broadcast(state)` resets every replica to replica 0."
        )
