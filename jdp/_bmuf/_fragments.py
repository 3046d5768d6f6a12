"""Streaming DiLoCo's fragment plan (the params' split into slices), `take`, `put`."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jdp._tree import PyTree


class Piece(NamedTuple):
    """Rows `start:stop` (first axis) of leaf number `leaf`; `whole`: all of it."""

    leaf: int
    start: int
    stop: int
    whole: bool


class Plan(NamedTuple):
    """The fragments (tuples of pieces) and, per fragment, its `delay` chunks."""

    fragments: tuple[tuple[Piece, ...], ...]
    chunks: tuple[tuple[tuple[Piece, ...], ...], ...]


def plan(params: PyTree, fragments: int, delay: int) -> Plan:
    """The split of `params` into fragments and chunks: a function of the shapes."""
    shapes = tuple(
        (tuple(jnp.shape(x)), jnp.dtype(jnp.result_type(x)).itemsize)
        for x in jax.tree.leaves(params)
    )
    return _plan_of_shapes(shapes, fragments, delay)


@functools.lru_cache(maxsize=64)
def _plan_of_shapes(shapes, fragments: int, delay: int) -> Plan:
    rows = [shape[0] if shape else 1 for shape, _ in shapes]
    row_bytes = [itemsize * int(math.prod(shape[1:])) for shape, itemsize in shapes]
    pieces = tuple(
        Piece(i, 0, r, True) for i, r in enumerate(rows) if r and row_bytes[i]
    )
    frags = _split(pieces, rows, row_bytes, fragments)
    if empty := [f for f, pieces in enumerate(frags) if not pieces]:
        total = sum(rows[p.leaf] for p in pieces)
        raise ValueError(
            f"`jdp.bmuf`: cannot split the parameters into `fragments={fragments}` "
            f"fragments: they have {total} rows (first-axis slices) in all, and "
            f"fragment {empty[0]} would be empty. Use fewer fragments: "
            "`jdp.Streaming(fragments=...)`."
        )
    chunks = tuple(_split(f, rows, row_bytes, delay) for f in frags) if delay else ()
    return Plan(frags, chunks)


def _split(pieces, rows, row_bytes, parts: int) -> tuple[tuple[Piece, ...], ...]:
    """`pieces` cut at row boundaries into `parts` runs of nearly equal bytes."""
    total = sum((p.stop - p.start) * row_bytes[p.leaf] for p in pieces)
    cuts = [total * k / parts for k in range(1, parts)] + [math.inf]
    groups: list[list[Piece]] = [[] for _ in range(parts)]
    offset, group = 0, 0

    def emit(leaf, a, b):
        if b > a:
            groups[group].append(Piece(leaf, a, b, a == 0 and b == rows[leaf]))

    for p in pieces:
        size = (p.stop - p.start) * row_bytes[p.leaf]
        row = p.start
        while cuts[group] < offset + size:
            cut = p.start + round((cuts[group] - offset) / row_bytes[p.leaf])
            cut = min(max(cut, row), p.stop)
            emit(p.leaf, row, cut)
            row, group = cut, group + 1
        emit(p.leaf, row, p.stop)
        offset += size
    return tuple(tuple(g) for g in groups)


def take(xs, pieces) -> list:
    """The pieces' slices of the leaves `xs`, in order."""
    return [xs[p.leaf] if p.whole else xs[p.leaf][p.start : p.stop] for p in pieces]


def put(leaves, pieces, values) -> list:
    """`leaves` with the pieces' slices replaced by `values`."""
    leaves = list(leaves)
    for p, value in zip(pieces, values, strict=True):
        x = leaves[p.leaf]
        value = jnp.asarray(value).astype(jnp.result_type(x))
        if p.whole:
            leaves[p.leaf] = value
        else:
            leaves[p.leaf] = lax.dynamic_update_slice_in_dim(x, value, p.start, 0)
    return leaves
