"""Streaming DiLoCo: fragment syncs, chunked delayed all-reduces, snapshots."""

from __future__ import annotations

import functools

import jax
from jax import lax

from jdp import _collectives
from jdp._bmuf import _update
from jdp._bmuf._average import params_mean
from jdp._bmuf._fragments import plan as make_plan
from jdp._bmuf._fragments import put, take
from jdp._bmuf._state import block_start, cast_like, float_map
from jdp._buckets import after


def merge(params, old_state, state, *, inner, axis, options):
    """The fragment syncs of Streaming DiLoCo (`fragments`, `delay`, `mix`).

    Same arguments and results as `_block.merge`; the schedule is the BMUF
    guide's: 1. a chunk of `pending` all-reduced, 2. a fragment's sync, 3. a
    snapshot, each a `lax.cond` per fragment or chunk over the leaves it touches.
    """
    fragments, delay, outer = options.fragments, options.delay, options.outer
    warmup_steps = options.warmup_steps
    period = options.sync_period // fragments
    axis_name = _collectives.resolve_axis(axis)
    eta = _update.eta(axis_name, options.block_momentum)
    plan = make_plan(params, fragments, delay)
    treedef = jax.tree.structure(params)
    flat, tree = jax.tree.leaves, functools.partial(jax.tree.unflatten, treedef)
    applied, g, start, pending = _update.follow_warmup(
        params, old_state, state, warmup_steps
    )
    active = applied & (old_state.count >= warmup_steps)
    n = state.count - warmup_steps  # this update's number, from 1 after warmup
    phase = (n - 1) % period + 1  # 1 .. period; `period`: a sync step
    fragment = ((n - 1) // period) % fragments  # whose sync ends this window

    p_leaves, g_leaves = flat(params), flat(g)
    s_leaves = None if start is None else flat(start)
    v_leaves = flat(state.velocity) if outer is None else None
    velocity = state.velocity
    pend = flat(pending) if delay else None

    if delay:  # 1. One chunk of the fragment in flight, from the state.
        in_flight = active & (phase > period - delay)
        chunk = fragment * delay + (phase - (period - delay) - 1)
        pend, ref = _reduce_chunks(
            in_flight, chunk, plan, pend, block_start(g_leaves, s_leaves),
            axis_name, options.wire,
        )  # fmt: skip
        g_leaves, s_leaves = (ref, None) if s_leaves is None else (g_leaves, ref)

    # 2. The sync of one fragment.
    is_sync = active & (phase == period)
    leaves = (p_leaves, g_leaves, s_leaves, v_leaves, pend)
    (p_leaves, g_leaves, s_leaves, v_leaves, pend), velocity, inner_state = (
        _sync_fragments(
            [is_sync & (fragment == f) for f in range(fragments)], plan, leaves,
            velocity, None if options.keeps_inner_state else state.inner_state, tree,
            inner=inner, eta=eta, axis_name=axis_name, options=options,
        )
    )  # fmt: skip
    params, g = tree(p_leaves), tree(g_leaves)
    start = None if s_leaves is None else tree(s_leaves)
    v = tree(v_leaves) if outer is None else velocity

    if delay:  # 3. The fragment whose sync is `delay` updates ahead.
        ahead = n + delay
        due = active & (ahead % period == 0)
        pend = _snapshots(due, (ahead // period - 1) % fragments, plan, pend, p_leaves)
        pending = tree(pend)
    return params, _update.with_sync(
        state, inner_state, global_params=g, start=start, velocity=v, pending=pending
    )


def _sync_fragments(dues, plan, leaves, velocity, inner_state, tree, *,
                    inner, eta, axis_name, options):  # fmt: skip
    """The sync of the fragment `f` whose `dues[f]` holds (at most one).

    Returns the flat `leaves` (`(params, g, start, v, pending)`), the outer states
    and the inner state. Without `outer=`, one conditional computes `v` and the
    next writes the rest, so that XLA updates buffers in place.
    """
    p_leaves, g_leaves, s_leaves, v_leaves, pend = leaves
    delay, alpha, wire, outer = options.delay, options.mix, options.wire, options.outer
    at_sync = options.inner_state_at_sync

    def adopt(pieces, local, target, inner_state):
        local_f, new = take(local, pieces), take(target, pieces)
        if alpha:  # torchft's `lerp(target, local, alpha)`
            new = float_map(
                lambda t, x: t + alpha * (x.astype(t.dtype) - t), new, local_f
            )
        if at_sync != "keep":  # one fragment: every leaf with elements is in it
            inner_state = _update.inner_state_at_sync(
                inner_state, tree(put(target, pieces, new)), inner, at_sync, axis_name
            )
        return put(local, pieces, cast_like(new, local_f)), inner_state

    def fragment_mean(source, pieces, ref_f):
        """The replicas' mean of the fragment (with `delay`, already all-reduced)."""
        if delay:
            return take(source, pieces)
        return params_mean(take(source, pieces), ref_f, axis_name, wire)

    for f, pieces in enumerate(plan.fragments):
        due = dues[f]
        source = pend if delay else p_leaves  # what the replicas average
        if outer is not None:

            def outer_update(pieces, written, read, extra):
                (local, g), (source,), (state_f, inner_state) = written, read, extra
                g_f = take(g, pieces)
                avg = fragment_mean(source, pieces, g_f)
                g_f, _, state_f = _update.block_update(
                    g_f, None, state_f, avg, eta, 1.0, outer
                )
                local, inner_state = adopt(
                    pieces, local, put(g, pieces, g_f), inner_state
                )
                # `local` reads the new `g`: written first, with `g`'s update held
                # until it is (XLA updates both in place; else it copies `g` twice).
                g = put(g, pieces, after(g_f, [local[p.leaf] for p in pieces]))
                return [local, g], (state_f, inner_state)

            (p_leaves, g_leaves), (v_f, inner_state) = _when(
                due, pieces, outer_update, [p_leaves, g_leaves], [source],
                (velocity[f], inner_state),
            )  # fmt: skip
            velocity = velocity[:f] + (v_f,) + velocity[f + 1 :]
            continue

        def velocity_update(pieces, written, read, extra):
            (v,), (ref, source) = written, read
            ref_f = take(ref, pieces)
            avg = fragment_mean(source, pieces, ref_f)
            v_f = _update.velocity(
                take(v, pieces), avg, ref_f, eta, options.block_learning_rate
            )
            return [put(v, pieces, v_f)], extra

        def global_update(pieces, written, read, inner_state):
            (local, g, start), (v,) = written, read
            s_f = None if start is None else take(start, pieces)
            g_f, s_f = _update.advance(take(g, pieces), s_f, take(v, pieces), eta)
            if start is not None:
                # The new start reads the old `g`: written first, with `g`'s update
                # held until it is, so that XLA updates `g` in place (else it
                # copies the leaf, in this branch and in the one that does nothing).
                start = put(start, pieces, s_f)
                g_f = after(g_f, [start[p.leaf] for p in pieces])
            g = put(g, pieces, g_f)
            local, inner_state = adopt(
                pieces, local, block_start(g, start), inner_state
            )
            return [local, g, start], inner_state

        (v_leaves,), _ = _when(
            due, pieces, velocity_update, [v_leaves],
            [block_start(g_leaves, s_leaves), source],
        )  # fmt: skip
        (p_leaves, g_leaves, s_leaves), inner_state = _when(
            due, pieces, global_update, [p_leaves, g_leaves, s_leaves], [v_leaves],
            inner_state,
        )  # fmt: skip
    return (p_leaves, g_leaves, s_leaves, v_leaves, pend), velocity, inner_state


def _reduce_chunks(in_flight, chunk, plan, pending, ref, axis_name, wire):
    """`(pending, ref)`, chunk number `chunk` of `pending` averaged if `in_flight`.

    Only a `wire` format reads `ref` (the block start); it then passes through
    the conditionals, which orders them before the sync that writes it.
    """

    def reduce(pieces, written, read, extra):
        pending, ref = written
        ref_f = None if ref is None else take(ref, pieces)
        avg = params_mean(take(pending, pieces), ref_f, axis_name, wire)
        return [put(pending, pieces, avg), ref], extra

    delay = len(plan.chunks[0])
    through = ref if wire is not None else None
    for f, chunks in enumerate(plan.chunks):
        for j, pieces in enumerate(chunks):
            if not pieces:  # a fragment of fewer rows than `delay`
                continue
            due = in_flight & (chunk == f * delay + j)
            (pending, through), _ = _when(due, pieces, reduce, [pending, through], [])
    return pending, (ref if wire is None else through)


def _snapshots(due, which, plan, pending, local):
    """`pending` (flat leaves) with fragment `which` copied from `local`, if `due`."""

    def snapshot(pieces, written, read, extra):
        (pending,), (local,) = written, read
        taken = cast_like(take(local, pieces), take(pending, pieces))
        return [put(pending, pieces, taken)], extra

    for f, pieces in enumerate(plan.fragments):
        (pending,), _ = _when(due & (which == f), pieces, snapshot, [pending], [local])
    return pending


def _when(pred, pieces, fn, written, read, extra=None):
    """`(written, extra)` after `fn` under a `lax.cond` on the leaves `pieces` touch.

    `written` and `read` are lists of flat leaf lists (or None); `fn(pieces,
    written, read, extra) -> (written, extra)` sees the touched leaves alone.
    """
    ids = sorted({p.leaf for p in pieces})
    where = {leaf: i for i, leaf in enumerate(ids)}
    local = tuple(p._replace(leaf=where[p.leaf]) for p in pieces)

    def sub(trees):
        return [None if t is None else [t[i] for i in ids] for t in trees]

    with jax.named_scope(f"bmuf_{fn.__name__}"):  # names it in profiles and HLO
        new, extra = lax.cond(
            pred,
            lambda ops: fn(local, ops[0], ops[1], ops[2]),
            lambda ops: (ops[0], ops[2]),
            (sub(written), sub(read), extra),
        )
    out = [None if t is None else list(t) for t in written]
    for t, leaves in zip(out, new, strict=True):
        if t is not None:
            for i, x in zip(ids, leaves, strict=True):
                t[i] = x
    return out, extra
