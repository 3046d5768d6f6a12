"""`jdp.bmuf`'s options: `Streaming`, `BlockAverage`, their record and checks."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, get_args

import optax

from jdp import _validate, _wire
from jdp._bmuf._outer import BlockMomentum, block_momentum

InnerStateAtSync = Literal["keep", "reset", "average"]
OnBadReplica = Literal["drop"]


@dataclasses.dataclass(frozen=True)
class Streaming:
    """Streaming DiLoCo's schedule, for `jdp.bmuf(streaming=jdp.Streaming(...))`.

    The params are split into `fragments` parts of nearly equal bytes, and one
    fragment syncs every `sync_period / fragments` updates, round-robin.
    `jdp.Streaming()` is the block sync, as `streaming=None`. The BMUF guide
    (docs/guides/bmuf.md) gives the schedule.

    Attributes:
      fragments: The number of fragments, an int >= 1 dividing `sync_period`.
        1 (default): the whole model at once.
      delay: The updates over which a fragment's all-reduce is spread, from a
        snapshot of its local params taken that many updates before its sync
        (0 <= delay <= `sync_period / fragments`). 0 (default): at the sync.
      mix: The weight in [0, 1) of each replica's local fragment at its sync:
        it becomes `(1 - mix) * new + mix * local`. 0.0 (default).

    Raises:
      TypeError: If `fragments` or `delay` is not an int, or `mix` not a number.
      ValueError: If `fragments` < 1, `delay` < 0, or `mix` outside [0, 1).

    Example:
      >>> import optax, jdp
      >>> tx = jdp.bmuf(optax.adam(1e-3), 8,
      ...               streaming=jdp.Streaming(fragments=2, delay=2, mix=0.5))
    """

    fragments: int = 1
    delay: int = 0
    mix: float = 0.0

    def __post_init__(self) -> None:
        _validate.positive_int(
            "fragments", self.fragments, note="1: the whole model at once"
        )
        _validate.non_negative_int("delay", self.delay)
        note = "below 1; 0 discards the delayed local steps"
        mix = _validate.finite_number("mix", self.mix, at_least=0, note=note)
        if mix >= 1:
            why = (
                "each replica would keep its local fragment entirely, so the "
                "replicas would never sync"
                if mix == 1
                else "it would move each replica away from the synced fragment"
            )
            raise ValueError(
                f"`mix` must be a finite number in [0, 1) (the weight of each "
                f"replica's local params in the merged fragment), got {mix!r}: "
                f"{why}. Use a value below 1, e.g. `jdp.Streaming(mix=0.5)`, or "
                "`mix=0.0` (the default)."
            )


@dataclasses.dataclass(frozen=True)
class BlockAverage:
    """How `jdp.bmuf` averages the replicas' params at a sync: `average=`.

    `jdp.BlockAverage()` is the plain mean, as `average=None`.

    Attributes:
      wire: A compressed exchange for the syncs, `jdp.wire.bf16()`, `int8()`
        or `fp8()`: the replicas' pseudo-gradients `start - params` are
        averaged in the narrow type. None (default): the params in their type.
      on_bad_replica: `"drop"`: at a block sync, leave out of the average a
        replica whose params are not finite (or farther than
        `bad_replica_max_norm` from the block start); it restarts from the new
        model with its floating `inner` state reset, and the state's `dropped`
        counts it. Block sync only, without `wire`. None (default): keep all.
      bad_replica_max_norm: With `on_bad_replica="drop"`, the largest L2
        distance of a replica's params from the block start (a finite number
        > 0). None (default): finiteness alone.

    Raises:
      TypeError: If `wire` is not a wire format.
      ValueError: If a value or a combination is not one the attributes allow.

    Example:
      >>> import optax, jdp
      >>> tx = jdp.bmuf(optax.sgd(0.1), 4,
      ...               average=jdp.BlockAverage(on_bad_replica="drop"))
    """

    wire: _wire.Wire | None = None
    on_bad_replica: OnBadReplica | None = None
    bad_replica_max_norm: float | None = None

    def __post_init__(self) -> None:
        _wire.check_wire(self.wire, "jdp.BlockAverage")
        mode, max_norm = self.on_bad_replica, self.bad_replica_max_norm
        if mode is not None and mode not in get_args(OnBadReplica):
            raise ValueError(
                "`on_bad_replica` must be None (average every replica) or 'drop' "
                f"(leave out replicas whose params are not finite); got {mode!r}."
            )
        if max_norm is not None:
            if mode is None:
                raise ValueError(
                    "`bad_replica_max_norm` drops replicas that moved too far, "
                    "which needs `on_bad_replica='drop'`: pass both, `jdp."
                    "BlockAverage(on_bad_replica='drop', bad_replica_max_norm=...)`."
                )
            note = "the largest L2 distance from the block start, or None"
            _validate.finite_number(
                "bad_replica_max_norm", max_norm, above=0, note=note
            )
        if mode is not None and self.wire is not None:
            raise ValueError(
                "`on_bad_replica='drop'` counts the valid replicas in the params' "
                "all-reduce, which a compressed exchange (`wire=`) does not carry: "
                "use `jdp.BlockAverage(wire=None, on_bad_replica='drop')`, or "
                "`on_bad_replica=None`."
            )


class Options(NamedTuple):
    """`jdp.bmuf`'s options as the sync reads them (checked by `check`)."""

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
        """Whether the schedule is Streaming DiLoCo's (else the block sync)."""
        return self.fragments > 1 or self.delay > 0 or self.mix > 0

    @property
    def keeps_inner_state(self) -> bool:
        """Whether no sync changes the inner state."""
        return self.inner_state_at_sync == "keep" and self.on_bad_replica is None


def record(sync_period, outer, warmup_steps, inner_state_at_sync, streaming,
            average) -> Options:  # fmt: skip
    """The record of `jdp.bmuf`'s arguments (`outer` None for `block_momentum`)."""
    _check_value(streaming, Streaming, "streaming", "jdp.Streaming(fragments=2)")
    _check_value(average, BlockAverage, "average", "jdp.BlockAverage(wire=...)")
    outer = block_momentum() if outer is None else outer
    _check_transform(outer, "outer")
    classical = isinstance(outer, BlockMomentum)
    return Options(
        block_learning_rate=outer.learning_rate if classical else 1.0,
        block_momentum=outer.momentum if classical else None,
        nesterov=classical and outer.nesterov, inner_state_at_sync=inner_state_at_sync,
        warmup_steps=warmup_steps, outer=None if classical else outer,
        sync_period=sync_period,
        **vars(streaming or Streaming()), **vars(average or BlockAverage()),
    )  # fmt: skip


def check(inner, options: Options) -> None:
    """`jdp.bmuf`'s checks of its own arguments and of those that span values."""
    _check_transform(inner, "inner")
    sync_period = options.sync_period
    _validate.positive_int("sync_period", sync_period, note="steps per block")
    _validate.non_negative_int("warmup_steps", options.warmup_steps)
    if options.inner_state_at_sync not in get_args(InnerStateAtSync):
        raise ValueError(
            "`inner_state_at_sync` must be one of 'keep', 'reset', 'average'; got "
            f"{options.inner_state_at_sync!r}."
        )
    fragments, delay = options.fragments, options.delay
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
    if fragments > 1 and options.inner_state_at_sync != "keep":
        raise ValueError(
            f"`inner_state_at_sync={options.inner_state_at_sync!r}` acts on the "
            f"whole inner state at once, but with `fragments={fragments}` each "
            "sync merges one fragment: use `inner_state_at_sync='keep'` (as "
            "Streaming DiLoCo does) or `jdp.Streaming(fragments=1)`."
        )
    if options.on_bad_replica is not None and options.streaming:
        raise ValueError(
            "`on_bad_replica='drop'` is supported for the block sync only: got "
            f"`jdp.Streaming(fragments={fragments}, delay={delay}, "
            f"mix={options.mix})`. Use `streaming=None` with "
            "`average=jdp.BlockAverage(on_bad_replica='drop')`, or "
            "`on_bad_replica=None`."
        )


def _check_value(value: Any, kind: type, name: str, example: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise TypeError(
            f"`{name}` must be a `jdp.{kind.__name__}` or None, e.g. "
            f"`{name}={example}`; got {type(value).__name__}."
        )


def _check_transform(tx: Any, name: str) -> None:
    if not all(callable(getattr(tx, method, None)) for method in ("init", "update")):
        raise TypeError(
            f"`{name}` must be an optax transform (with `init` and `update`), e.g. "
            f"`optax.sgd(0.1, momentum=0.9)`; got {type(tx).__name__}."
        )
