"""Private: what XLA says about a compiled step (its collectives and its memory)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import numpy as np

PyTree = Any

#: The kinds of collective reported; their opcodes may end in "-start" (async) or
#: begin with "ragged-".
_KINDS = frozenset(
    "all-reduce all-gather reduce-scatter all-to-all collective-permute "
    "collective-broadcast".split()
)


def _kind(opcode: str) -> str | None:
    kind = opcode.removesuffix("-start").removeprefix("ragged-")
    return kind if kind in _KINDS else None


def _dtype_bytes(dtype: str) -> int:
    """Bytes per element of an HLO type: its first number is its width in bits."""
    bits = re.search(r"\d+", dtype)  # none in `pred`: one byte
    return max(1, int(bits.group()) // 8) if bits else 1


_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_CALLED = re.compile(
    r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_GROUPS_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective operation of a compiled (or lowered) step, read from XLA's HLO.

    A debugging aid; see Limitations (docs/limitations.md) for what is stable.

    Attributes:
      kind: `"all-reduce"`, `"all-gather"`, `"reduce-scatter"`, `"all-to-all"`,
        `"collective-permute"` or `"collective-broadcast"`.
      dtype: Element type(s) as XLA names them (`"f32"`, or `"f32,s32"` for a
        tuple of mixed types).
      bytes: Size of the full logical buffer per device (as NCCL's benchmarks
        count): the all-reduced buffer, the gathered result, the scattered input.
      result_bytes: Bytes of the operation's result on each device.
      shapes: Result shapes, one per tuple element.
      replica_groups: The groups of devices that communicate, as tuples of
        device indices (empty when XLA means "all devices").
      order: Position in program order among the step's collectives.
      in_conditional: Whether the op sits inside a `conditional` branch (it runs
        only when that branch is taken, e.g. on BMUF's sync steps).
      name: The HLO instruction name.
    """

    kind: str
    dtype: str
    bytes: int
    result_bytes: int
    shapes: tuple[tuple[int, ...], ...]
    replica_groups: tuple[tuple[int, ...], ...]
    order: int
    in_conditional: bool
    name: str


def _split_type(rest: str) -> tuple[str, str]:
    """Splits `TYPE opcode(...)...` into the type and the remainder."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail.lstrip()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _groups(text: str) -> tuple[tuple[int, ...], ...]:
    if m := _GROUPS_EXPLICIT.search(text) or _PAIRS.search(text):
        return tuple(_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    if not (m := _GROUPS_IOTA.search(text)):
        return ()
    out_shape, reshape = _ints(m.group(1)), _ints(m.group(2))
    ids = np.arange(int(np.prod(reshape))).reshape(reshape)
    if m.group(3):
        ids = ids.transpose(_ints(m.group(3)))
    return tuple(map(tuple, ids.reshape(out_shape[0], -1).tolist()))


def _parse_computations(hlo_text: str):
    """`({computation: its lines}, name of the entry computation or None)`."""
    comps: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith(" "):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
        elif line.startswith("}"):
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _collective(name, typ, rest, opcode, order, in_conditional) -> Collective:
    """The `Collective` of one instruction: `name = typ opcode(...)rest`."""
    kind = _kind(opcode)
    found = _SHAPE.findall(typ)
    if opcode in ("all-gather-start", "collective-permute-start") and len(found) > 1:
        found = found[1:2]  # async start ops return (operand, result[, scratch])
    shapes = [_ints(dims) for _, dims in found]
    result = sum(
        int(np.prod(shape, dtype=np.int64)) * _dtype_bytes(dt)
        for shape, (dt, _) in zip(shapes, found, strict=True)
    )
    groups = _groups(rest)
    scattered = kind == "reduce-scatter" and groups and groups[0]
    full = result * len(groups[0]) if scattered else result
    return Collective(
        kind=kind, dtype=",".join(dict.fromkeys(dt for dt, _ in found)), bytes=full,
        result_bytes=result, shapes=tuple(shapes), replica_groups=groups, order=order,
        in_conditional=in_conditional, name=name,
    )  # fmt: skip


def parse_collectives(hlo_text: str) -> list[Collective]:
    """The collectives of an HLO module's text, in program order.

    Nested computations (while bodies, calls, conditional branches) are expanded
    at their call sites.
    """
    comps, entry = _parse_computations(hlo_text)
    if entry is None:
        return []
    found: list[Collective] = []

    def visit(name: str, in_cond: bool, stack: tuple[str, ...]):
        if name not in comps or name in stack:
            return
        for line in comps[name]:
            if not (m := _INSTR.match(line)):
                continue
            inst, rest = m.groups()
            typ, rest = _split_type(rest)
            opcode = rest.split("(", 1)[0].strip()
            if _kind(opcode):
                found.append(_collective(inst, typ, rest, opcode, len(found), in_cond))
                continue
            branches = _BRANCHES.search(rest)
            callees = _CALLED.findall(rest)
            callees += re.findall(r"[\w.\-]+", branches.group(1)) if branches else []
            for callee in callees:
                visit(callee, in_cond or opcode == "conditional", stack + (name,))

    visit(entry, False, ())
    # A lowered (unscheduled) module prints instructions in dependency order; their
    # names are numbered in creation order, which is the order they were issued.
    if "is_scheduled=true" not in hlo_text.split("\n", 1)[0]:
        found = [
            dataclasses.replace(c, order=i)
            for i, c in enumerate(sorted(found, key=_creation_index))
        ]
    return found


def _creation_index(c: Collective) -> tuple[int, int]:
    m = re.search(r"\.(\d+)$", c.name)
    return (int(m.group(1)) if m else -1, c.order)


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """Per-device memory of one compiled step, XLA's estimates (`step.memory_analysis`).

    Attributes:
      argument_bytes: Inputs of one device: its replica of the state, its batch slice.
      output_bytes: Outputs of one device (new state, metrics).
      alias_bytes: Output bytes written into donated input buffers; counted in
        both of the above but held once.
      temp_bytes: XLA's scratch space: activations, gradients, collective buffers.
      generated_code_bytes: Size of the compiled code.
      peak_bytes: `argument + output - alias + temp`: an upper bound of the peak.
      xla_peak_bytes: XLA's own peak figure, or None (on CPU it leaves out
        temporaries).
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    xla_peak_bytes: int | None

    @classmethod
    def from_xla(cls, stats: Any) -> MemoryAnalysis:
        """Reads a `jaxlib` `CompiledMemoryStats`."""
        arg = int(stats.argument_size_in_bytes)
        out = int(stats.output_size_in_bytes)
        alias = int(stats.alias_size_in_bytes)
        temp = int(stats.temp_size_in_bytes)
        peak = getattr(stats, "peak_memory_in_bytes", None)
        return cls(
            argument_bytes=arg, output_bytes=out, alias_bytes=alias, temp_bytes=temp,
            generated_code_bytes=int(stats.generated_code_size_in_bytes),
            peak_bytes=arg + out - alias + temp,
            xla_peak_bytes=int(peak) if peak else None,
        )  # fmt: skip


class Introspection:
    """`step.collectives` and `step.memory_analysis`; mixed into `jdp.Parallel`."""

    def collectives(
        self,
        state: PyTree,
        batch: PyTree,
        *,
        stage: Literal["compiled", "lowered"] = "compiled",
    ) -> list[Collective]:
        """Lists what one step communicates, read from XLA's HLO.

        Args:
          state: Replicated state, as for a call.
          batch: Sharded batch, as for a call.
          stage: `"compiled"` (default): what really runs, after XLA combined and
            retyped the collectives; `"lowered"`: one entry per `psum` the step
            issued, in the dtype it asked for.

        Returns:
          One `jdp.Collective` per collective, in program order.

        Raises:
          ValueError: If `stage` is neither `"compiled"` nor `"lowered"`.

        Example:
          >>> import jax, jax.numpy as jnp, jdp
          >>> def step_fn(state, batch):
          ...     return state, {"s": batch.sum()}
          >>> step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
          >>> ops = step.collectives(step.replicate({}), step.shard(jnp.ones(4)))
          >>> [(c.kind, c.dtype, c.bytes) for c in ops]  # the sum, replica 0's value
          [('all-reduce', 'f32', 8)]
        """
        if stage not in ("compiled", "lowered"):
            raise ValueError(f"`stage` must be 'compiled' or 'lowered', got {stage!r}.")
        lowered = self.lower(state, batch)
        if stage == "compiled":
            return parse_collectives(lowered.compile().as_text())
        return parse_collectives(lowered.as_text(dialect="hlo"))

    def memory_analysis(self, state: PyTree, batch: PyTree) -> MemoryAnalysis:
        """Per-device memory of one step: compiles it (nothing runs) and asks XLA.

        Args:
          state: Replicated state, as for a call.
          batch: Sharded batch, as for a call.

        Returns:
          A `jdp.MemoryAnalysis`.

        Raises:
          RuntimeError: If XLA reports no memory analysis on this platform.

        Example:
          >>> import jax, jax.numpy as jnp, jdp
          >>> step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
          >>> mem = step.memory_analysis(
          ...     step.replicate({"w": jnp.zeros(256)}), step.shard(jnp.zeros(2))
          ... )
          >>> mem.argument_bytes >= 256 * 4, mem.alias_bytes == 256 * 4
          (True, True)
        """
        if (stats := self.lower(state, batch).compile().memory_analysis()) is None:
            raise RuntimeError(
                "`step.memory_analysis`: XLA reports no memory analysis for this "
                f"platform ({self.devices[0].platform})."
            )
        return MemoryAnalysis.from_xla(stats)
