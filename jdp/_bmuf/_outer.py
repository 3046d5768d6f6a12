"""The classical block filter of Chen & Huo, written once: `jdp.block_momentum`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp import _collectives, _validate
from jdp._bmuf._state import float_map, lookahead


def eta(axis_name, block_momentum, api="jdp.bmuf"):
    """The block momentum: `block_momentum`, or `1 - 1 / num_replicas` for None."""
    num = _collectives.axis_size(axis_name, api)
    return 1.0 - 1.0 / num if block_momentum is None else block_momentum


def velocity(v, avg, ref, eta, block_learning_rate):
    """The new velocity `eta * v + block_learning_rate * (avg - ref)` (`ref`: start)."""
    delta = float_map(lambda a, s: a - s, avg, ref)
    return filtered(v, delta, eta, block_learning_rate)


def filtered(v, delta, eta, block_learning_rate):
    """The block filter, the one formula: `eta * v + block_learning_rate * delta`."""
    return float_map(lambda v, d: eta * v + block_learning_rate * d, v, delta)


class BlockMomentum(optax.GradientTransformation):
    """`block_momentum`'s transform, carrying its settings for `jdp.bmuf`."""

    learning_rate: float
    momentum: float | None
    nesterov: bool

    def __repr__(self) -> str:
        return (
            f"jdp.block_momentum(learning_rate={self.learning_rate!r}, "
            f"momentum={self.momentum!r}, nesterov={self.nesterov!r})"
        )


def block_momentum(
    learning_rate: float = 1.0, momentum: float | None = None, nesterov: bool = False
) -> BlockMomentum:
    """The classical BMUF block filter, as an optax transform for `jdp.bmuf(outer=)`.

    At a sync, with `start` the block start and `avg` the replicas' mean:
    `v = momentum * v + learning_rate * (avg - start)`, then `g = g + v`. The
    next block starts from `g` or, with `nesterov=True`, from the look-ahead
    `g + momentum * v`. The default `outer` of `jdp.bmuf`.

    Args:
      learning_rate: The block learning rate (a finite number > 0).
      momentum: The block momentum in [0, 1); None (default) means
        `1 - 1 / n`, `n` the replicas `jdp.bmuf`'s axis spans (every replica of
        every host by default; the hosts with `axis_name="host"`). 0.0 is
        plain model averaging.
      nesterov: Start the next block from the look-ahead (the paper's NBM)
        instead of `g` (CBM, default).

    Returns:
      An `optax.GradientTransformation` whose state is `v`, shaped like the
      params; its update of `start - avg` is the new `v` (with `nesterov`,
      `v + momentum * v`).

    Raises:
      TypeError: If an argument has the wrong type.
      ValueError: If `learning_rate` or `momentum` is outside its range above.

    Example:
      >>> import optax, jdp
      >>> tx = jdp.bmuf(optax.sgd(0.1), 4, outer=jdp.block_momentum(momentum=0.5))
    """
    _validate.finite_number(
        "learning_rate", learning_rate, above=0, note="1.0 is the usual setting"
    )
    if momentum is not None:
        note = "or None for the default 1 - 1 / num_replicas"
        _validate.finite_number("momentum", momentum, at_least=0, below=1, note=note)
    if not isinstance(nesterov, (bool, np.bool_)):
        raise TypeError(
            f"`nesterov` must be True or False, got {nesterov!r}: "
            "`jdp.block_momentum(nesterov=True)` starts each block from the "
            "look-ahead."
        )

    def init_fn(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update_fn(updates, state, params=None):
        del params
        e = eta(None, None, "jdp.block_momentum") if momentum is None else momentum
        neg = float_map(lambda u: -u, updates)  # avg - start
        v = filtered(state, neg, e, learning_rate)
        return (lookahead(v, v, e) if nesterov else v), v

    tx = BlockMomentum(init_fn, update_fn)
    tx.learning_rate, tx.momentum, tx.nesterov = learning_rate, momentum, bool(nesterov)
    return tx
