"""`jdp.bmuf`'s options: their record and the checks made when it is built."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import optax

from jdp import _validate, _wire

InnerStateAtSync = Literal["keep", "reset", "average"]
OnBadReplica = Literal["drop"]


class Options(NamedTuple):
    """`jdp.bmuf`'s block-filter options, as given (checked by `check`)."""

    block_learning_rate: float
    block_momentum: float | None
    nesterov: bool
    inner_state_at_sync: InnerStateAtSync
    warmup_steps: int
    outer: optax.GradientTransformation | None
    fragments: int = 1
    delay: int = 0
    mix: float = 0.0
    sync_period: int = 1
    wire: _wire.Wire | None = None
    on_bad_replica: OnBadReplica | None = None
    bad_replica_max_norm: float | None = None

    @property
    def stores_start(self) -> bool:
        """Whether the state keeps `start` (else the block start is `g`)."""
        return self.nesterov and self.outer is None

    @property
    def streaming(self) -> bool:
        """Whether the schedule is Streaming DiLoCo's (else today's block sync)."""
        return self.fragments > 1 or self.delay > 0 or self.mix > 0


def check(inner, sync_period, options: Options) -> None:
    """`jdp.bmuf`'s argument checks (see its Raises section)."""
    block_learning_rate = options.block_learning_rate
    block_momentum = options.block_momentum
    inner_state_at_sync, outer = options.inner_state_at_sync, options.outer
    _check_transform(inner, "inner")
    _wire.check_wire(options.wire, "jdp.bmuf")
    _validate.positive_int("sync_period", sync_period, note="steps per block")
    _validate.finite_number(
        "block_learning_rate",
        block_learning_rate,
        above=0,
        note="1.0 is the usual setting",
    )
    if block_momentum is not None:
        _validate.finite_number(
            "block_momentum",
            block_momentum,
            at_least=0,
            below=1,
            note="or None for the default 1 - 1 / num_replicas",
        )
    _validate.non_negative_int("warmup_steps", options.warmup_steps)
    _check_streaming(sync_period, options)
    _check_bad_replica(options)
    if inner_state_at_sync not in get_args(InnerStateAtSync):
        raise ValueError(
            "`inner_state_at_sync` must be one of 'keep', 'reset', 'average'; got "
            f"{inner_state_at_sync!r}."
        )
    if outer is not None:
        _check_transform(outer, "outer")
        if block_momentum is not None or options.nesterov or block_learning_rate != 1.0:
            raise ValueError(
                "`outer` replaces the block filter, so `block_learning_rate`, "
                "`block_momentum` and `nesterov` cannot be set with it; fold them "
                "into `outer`, e.g. `outer=optax.sgd(block_learning_rate, "
                "momentum=block_momentum, nesterov=True)`."
            )


def _check_bad_replica(options: Options) -> None:
    """The checks of `on_bad_replica` and `bad_replica_max_norm`."""
    mode, max_norm = options.on_bad_replica, options.bad_replica_max_norm
    if mode is not None and mode not in get_args(OnBadReplica):
        raise ValueError(
            "`on_bad_replica` must be None (average every replica) or 'drop' "
            f"(leave out replicas whose params are not finite); got {mode!r}."
        )
    if max_norm is not None:
        if mode is None:
            raise ValueError(
                "`bad_replica_max_norm` drops replicas that moved too far, which "
                "needs `on_bad_replica='drop'`: pass both."
            )
        _validate.finite_number(
            "bad_replica_max_norm",
            max_norm,
            above=0,
            note="the largest L2 distance from the block start, or None",
        )
    if mode is None:
        return
    if options.streaming:
        raise ValueError(
            "`on_bad_replica='drop'` is supported for the block sync only: "
            f"got `fragments={options.fragments}`, `delay={options.delay}`, "
            f"`mix={options.mix}`. Use `fragments=1, delay=0, mix=0.0`, or "
            "`on_bad_replica=None`."
        )
    if options.wire is not None:
        raise ValueError(
            "`on_bad_replica='drop'` counts the valid replicas in the params' "
            "all-reduce, which a compressed exchange (`wire=`) does not carry: "
            "use `wire=None` with it, or `on_bad_replica=None`."
        )


def _check_streaming(sync_period: int, options: Options) -> None:
    """The checks of `fragments`, `delay` and `mix` (Streaming DiLoCo)."""
    fragments, delay, mix = options.fragments, options.delay, options.mix
    _validate.positive_int("fragments", fragments, note="1: the whole model at once")
    _validate.non_negative_int("delay", delay)
    if sync_period % fragments:
        raise ValueError(
            f"`sync_period` ({sync_period}) must be divisible by `fragments` "
            f"({fragments}): one fragment syncs every sync_period / fragments "
            "steps, so that each syncs every `sync_period` steps. Use e.g. "
            f"`sync_period={fragments * max(1, round(sync_period / fragments))}`."
        )
    period = sync_period // fragments
    if delay > period:
        raise ValueError(
            f"`delay` ({delay}) must be at most sync_period / fragments "
            f"({sync_period} / {fragments} = {period}): a fragment's all-reduce "
            "must end before the next fragment's begins."
        )
    mix = _validate.finite_number(
        "mix", mix, at_least=0, note="below 1; 0 discards the delayed local steps"
    )
    if mix >= 1:
        why = (
            "each replica would keep its local fragment entirely, so the replicas "
            "would never sync"
            if mix == 1
            else "it would move each replica away from the synced fragment"
        )
        raise ValueError(
            f"`mix` must be a finite number in [0, 1) (the weight of each "
            f"replica's local params in the merged fragment), got {mix!r}: {why}. "
            "Use a value below 1, e.g. `mix=0.5`, or `mix=0.0` (the default)."
        )
    if fragments > 1 and options.inner_state_at_sync != "keep":
        raise ValueError(
            f"`inner_state_at_sync={options.inner_state_at_sync!r}` acts on the "
            f"whole inner state at once, but with `fragments={fragments}` each "
            "sync merges one fragment: use `inner_state_at_sync='keep'` (as "
            "Streaming DiLoCo does) or `fragments=1`."
        )


def _check_transform(tx: Any, name: str) -> None:
    if not (
        callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))
    ):
        raise TypeError(
            f"`{name}` must be an optax transform (with `init` and `update`), e.g. "
            f"`optax.sgd(0.1, momentum=0.9)`; got {type(tx).__name__}."
        )
