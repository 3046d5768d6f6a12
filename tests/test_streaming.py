"""Streaming DiLoCo in `jdp.bmuf`: `jdp.Streaming(fragments, delay, mix)`."""

import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import linear_loss

import jdp
from jdp import _bmuf, _hlo
from jdp.checkpoint import CheckpointManager

IN, OUT = 6, 3
LR = 0.05
NUM = 4


def linear_params(seed=0):
    return helpers.linear_params(IN, OUT, seed)


def linear_batches(num_steps, batch_size, seed=1):
    return helpers.teacher_batches(num_steps, batch_size, IN, OUT, seed)


# -- the NumPy reference of the fragment schedule -------------------------------


def fragment_indices(params, fragments):
    """Indices into the flat vector `concat(w.ravel(), b)` of each fragment."""
    plan = _bmuf._plan(params, fragments, 0)
    leaves = jax.tree.leaves(params)  # ["b", "w"] (sorted keys)
    offsets = np.cumsum([0] + [x.size for x in leaves])
    out = []
    for pieces in plan.fragments:
        idx = []
        for p in pieces:
            x = leaves[p.leaf]
            row = int(np.prod(x.shape[1:]))
            idx.extend(
                range(offsets[p.leaf] + p.start * row, offsets[p.leaf] + p.stop * row)
            )
        out.append(np.asarray(idx))
    return out


def flat(params):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)]).astype(
        np.float64
    )


def np_grad(theta, x, y):
    """Gradient of the linear loss at the flat vector [b, w.ravel()]."""
    b, w = theta[:OUT], theta[OUT:].reshape(IN, OUT)
    d = 2 * (x @ w + b - y) / y.size
    return np.concatenate([d.sum(0), (x.T @ d).ravel()])


def reference_streaming(
    params, batches, *, sync_period, fragments, delay, mix, eta=0.5, nesterov_outer=None
):
    """Streaming DiLoCo on `NUM` replicas, plain SGD inner, in float64.

    Written from the documented semantics: update n (from 1) ends with the sync
    of fragment (n / P - 1) mod F when P = H / F divides n; the pseudo-gradient is
    taken `delay` updates before, after update n - delay; the local fragment then
    becomes g + mix * (local - g).
    """
    frags = fragment_indices(params, fragments)
    period = sync_period // fragments
    theta0 = flat(params)
    local = [theta0.copy() for _ in range(NUM)]
    snap = [theta0.copy() for _ in range(NUM)]
    g, v = theta0.copy(), np.zeros_like(theta0)
    for n, batch in enumerate(batches, start=1):
        xs = np.split(batch["x"].astype(np.float64), NUM)
        ys = np.split(batch["y"].astype(np.float64), NUM)
        for i in range(NUM):
            local[i] = local[i] - LR * np_grad(local[i], xs[i], ys[i])
        if n % period == 0:
            idx = frags[(n // period - 1) % fragments]
            source = snap if delay else local
            avg = np.mean([s[idx] for s in source], axis=0)
            if nesterov_outer is None:  # the block filter, eta and zeta = 1
                v[idx] = eta * v[idx] + (avg - g[idx])
                g[idx] = g[idx] + v[idx]
            else:  # optax.sgd(lr, momentum, nesterov=True) on g - avg
                lr, mu = nesterov_outer
                pseudo = g[idx] - avg
                v[idx] = pseudo + mu * v[idx]
                g[idx] = g[idx] - lr * (pseudo + mu * v[idx])
            for i in range(NUM):
                local[i][idx] = g[idx] + mix * (local[i][idx] - g[idx])
        if delay and (n + delay) % period == 0:
            idx = frags[((n + delay) // period - 1) % fragments]
            for i in range(NUM):
                snap[i][idx] = local[i][idx]
    return np.stack(local), g, v


def run(params, batches, *, backend="shard_map", num=NUM, **kw):
    tx = jdp.bmuf(optax.sgd(LR), **kw)
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:num],
        backend=backend,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return step, state


def check(state, want_local, want_g, want_v=None, rtol=1e-5, atol=1e-5):
    got = jax.device_get(state)
    local = np.stack(
        [flat(jax.tree.map(lambda x, i=i: x[i], got.params)) for i in range(NUM)]
    )
    np.testing.assert_allclose(local, want_local, rtol=rtol, atol=atol)
    g = jax.tree.map(lambda x: x[0], got.opt_state.global_params)
    np.testing.assert_allclose(flat(g), want_g, rtol=rtol, atol=atol)
    if want_v is not None:
        v = jax.tree.map(lambda x: x[0], got.opt_state.velocity)
        np.testing.assert_allclose(flat(v), want_v, rtol=rtol, atol=atol)
    jdp.assert_replicas_in_sync(got.opt_state.global_params)


SCHEDULES = [
    # (sync_period, fragments, delay, mix)
    (4, 2, 0, 0.0),
    (4, 2, 0, 0.5),
    (4, 2, 1, 0.0),
    (4, 2, 1, 0.5),
    (4, 2, 2, 0.0),
    (4, 2, 2, 0.5),
    (8, 4, 2, 0.5),
    (4, 4, 1, 0.0),
]


@pytest.mark.parametrize(
    "sync_period, fragments, delay, mix",
    SCHEDULES,
    ids=[f"H{h}-F{f}-tau{t}-mix{m}" for h, f, t, m in SCHEDULES],
)
def test_matches_numpy_reference(sync_period, fragments, delay, mix):
    # Three full cycles, plus one update so the replicas differ at the end.
    batches = linear_batches(3 * sync_period + 1, 16)
    params = linear_params()
    _, state = run(
        params,
        batches,
        sync_period=sync_period,
        streaming=jdp.Streaming(fragments, delay, mix),
        outer=jdp.block_momentum(momentum=0.5),
    )
    want_local, want_g, want_v = reference_streaming(
        params,
        batches,
        sync_period=sync_period,
        fragments=fragments,
        delay=delay,
        mix=mix,
    )
    check(state, want_local, want_g, want_v)
    assert not jdp.replicas_in_sync(state.params, atol=1e-4)


@pytest.mark.parametrize("delay", [0, 1, 2])
def test_outer_nesterov_matches_numpy_reference_on_both_backends(backend, delay):
    """DiLoCo's outer optimizer, one state per fragment."""
    batches = linear_batches(13, 16)
    params = linear_params()
    kw = dict(sync_period=4, fragments=2, delay=delay, mix=0.5)
    _, state = run(
        params,
        batches,
        backend=backend,
        sync_period=4,
        streaming=jdp.Streaming(fragments=2, delay=delay, mix=0.5),
        outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    )
    want_local, want_g, _ = reference_streaming(
        params, batches, nesterov_outer=(0.7, 0.9), **kw
    )
    check(state, want_local, want_g)


# -- the defaults are the block sync, bit for bit --------------------------------


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(tree))]


def test_default_schedule_is_the_block_sync_bit_for_bit(monkeypatch):
    """`jdp.Streaming()` (`fragments=1, delay=0, mix=0.0`) is today's block sync;
    the streaming code path run with them gives the same bits too."""
    params, batches = linear_params(), linear_batches(10, 16)
    inner = optax.sgd(LR, momentum=0.9)
    runs = {}
    for name, kw in [
        ("plain", {}),
        ("explicit", {"streaming": jdp.Streaming(fragments=1, delay=0, mix=0.0)}),
        ("nesterov", {"outer": jdp.block_momentum(momentum=0.6, nesterov=True)}),
    ]:
        tx = jdp.bmuf(inner, sync_period=3, **kw)
        runs[name] = run_with(tx, params, batches)
    with monkeypatch.context() as m:  # the streaming implementation at F = 1
        m.setattr(_bmuf._Options, "streaming", property(lambda self: True))
        streamed = run_with(jdp.bmuf(inner, sync_period=3), params, batches)
        streamed_nesterov = run_with(
            jdp.bmuf(inner, 3, outer=jdp.block_momentum(momentum=0.6, nesterov=True)),
            params,
            batches,
        )
    assert bits(runs["explicit"]) == bits(runs["plain"])
    assert bits(streamed) == bits(runs["plain"])
    assert bits(streamed_nesterov) == bits(runs["nesterov"])
    assert bits(streamed_nesterov) != bits(runs["plain"])


def run_with(tx, params, batches, num=NUM, backend="shard_map"):
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:num],
        backend=backend,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return state


def test_hand_written_step_agrees_with_the_train_step():
    """Inside the optimizer (`tx.update` + `optax.apply_updates`) the same schedule."""
    tx = jdp.bmuf(
        optax.sgd(LR),
        sync_period=4,
        outer=jdp.block_momentum(momentum=0.5),
        streaming=jdp.Streaming(fragments=2, delay=1, mix=0.5),
    )

    def hand_written(state, batch):
        grads = jax.grad(linear_loss)(state.params, batch)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(
            params=params, opt_state=opt_state, step=state.step + 1
        ), {}

    batches = linear_batches(13, 16)
    states = []
    for fn in (jdp.make_train_step(linear_loss, tx, sync=jdp.local()), hand_written):
        step = jdp.parallelize(fn, devices=jax.devices()[:NUM])
        state = step.replicate(jdp.TrainState.create(params=linear_params(), tx=tx))
        for batch in batches:
            state, _ = step(state, step.shard(batch))
        states.append(jax.device_get(state))
    want_local, want_g, _ = reference_streaming(
        linear_params(), batches, sync_period=4, fragments=2, delay=1, mix=0.5
    )
    for state in states:
        check(state, want_local, want_g)


# -- the split ---------------------------------------------------------------------


MLP_SHAPES = {  # 256-2048-2048-2048-10
    f"layer{i}": {"w": (a, b), "b": (b,)}
    for i, (a, b) in enumerate([(256, 2048), (2048, 2048), (2048, 2048), (2048, 10)])
}


@pytest.mark.parametrize("fragments", [2, 3, 4, 7])
def test_fragments_have_nearly_equal_bytes_and_cover_every_element_once(fragments):
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
        MLP_SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    plan = _bmuf._plan(params, fragments, 4)
    leaves = jax.tree.leaves(params)
    row_bytes = [4 * int(np.prod(x.shape[1:])) for x in leaves]
    seen = [np.zeros(x.shape[0], int) for x in leaves]
    sizes = []
    for f, pieces in enumerate(plan.fragments):
        sizes.append(sum((p.stop - p.start) * row_bytes[p.leaf] for p in pieces))
        for p in pieces:
            seen[p.leaf][p.start : p.stop] += 1
        # Its chunks are the fragment again, in 4 runs of nearly equal bytes.
        chunk_sizes = [
            sum((p.stop - p.start) * row_bytes[p.leaf] for p in c)
            for c in plan.chunks[f]
        ]
        assert sum(chunk_sizes) == sizes[-1]
        assert max(chunk_sizes) - min(chunk_sizes) <= 2 * max(row_bytes)
    assert all(np.all(s == 1) for s in seen)
    total = sum(x.size * 4 for x in leaves)
    assert sum(sizes) == total
    # Within one row (8 KiB) of total / F each, so the largest weights were cut.
    for size in sizes:
        assert abs(size - total / fragments) <= max(row_bytes)
    # A function of the shapes alone: the same for arrays of any values.
    values = jax.tree.map(lambda s: np.full(s.shape, 3.0, np.float32), params)
    assert _bmuf._plan(values, fragments, 4) == plan


def test_too_many_fragments_for_the_rows_is_refused():
    tx = jdp.bmuf(optax.sgd(0.1), 8, streaming=jdp.Streaming(fragments=8))
    with pytest.raises(ValueError, match=r"`fragments=8`.*have 3 rows.*Use fewer"):
        tx.init({"w": jnp.ones((2, 5)), "b": jnp.ones(())})


# -- communication ---------------------------------------------------------------


WIDE = {"w1": (32, 64), "b1": (64,), "w2": (64, 32), "b2": (32,)}


def wide_params():
    rng = np.random.default_rng(0)
    return {k: (0.1 * rng.normal(size=s)).astype(np.float32) for k, s in WIDE.items()}


def wide_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)


def wide_batch(n=16):
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(n, 32)).astype(np.float32),
        "y": rng.normal(size=(n, 32)).astype(np.float32),
    }


@pytest.mark.parametrize("delay", [0, 1, 2, 4])
def test_per_step_bytes_from_the_program(backend, delay):
    """Each conditional all-reduce is one step's share: |Θ|/F bytes with delay 0,
    |Θ|/(F·τ) with τ >= 1, |Θ|/H with τ = H/F; over all branches, |Θ| once."""
    sync_period, fragments = 16, 4
    params = wide_params()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    tx = jdp.bmuf(
        optax.sgd(0.1), sync_period, streaming=jdp.Streaming(fragments, delay)
    )
    step = jdp.parallelize(
        jdp.make_train_step(wide_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:4],
        backend=backend,
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    ops = step.collectives(state, step.shard(wide_batch()), stage="compiled")
    assert {c.kind for c in ops} == {"all-reduce"}
    assert sum(c.bytes for c in ops if not c.in_conditional) == 8  # the loss
    branch = [c.bytes for c in ops if c.in_conditional]
    assert sum(branch) == param_bytes
    share = fragments * max(delay, 1)
    # Compiled, XLA combines each branch's all-reduces into one: one per step.
    assert len(branch) == share
    assert max(branch) <= 1.1 * param_bytes / share
    if delay == sync_period // fragments:
        assert max(branch) <= 1.1 * param_bytes / sync_period


def branch_copies(hlo_text, branch):
    """`{conditional: [shapes copied]}` in branch `branch` of every `jdp.bmuf`
    conditional: 0, the `lax.cond`'s false branch (what a step without a sync
    runs), or 1, the branch of the sync."""
    comps, _ = _hlo._parse_computations(hlo_text)
    found = {}
    for lines in comps.values():
        for line in lines:
            if " conditional(" not in line or "bmuf" not in line:
                continue
            name = line.split("=", 1)[0].strip()
            branches = re.search(r"branch_computations=\{%([^,}]+), %([^,}]+)\}", line)
            found[name] = [
                re.search(r"= (\w+\[[\d,]*\])", x)[1]
                for x in comps[branches[branch + 1]]
                if " copy(" in x
            ]
    return found


def untaken_branch_copies(hlo_text):
    """`{conditional: copies}` of the branches that a step without a sync runs."""
    return {k: len(v) for k, v in branch_copies(hlo_text, 0).items()}


@pytest.mark.parametrize(
    "kw",
    [
        {"streaming": jdp.Streaming(fragments=4, delay=0)},
        {"streaming": jdp.Streaming(fragments=4, delay=1)},
        {"streaming": jdp.Streaming(fragments=4, delay=4)},
        {"streaming": jdp.Streaming(fragments=4, delay=2, mix=0.5)},
        {
            "streaming": jdp.Streaming(fragments=4, delay=2),
            "outer": jdp.block_momentum(nesterov=True),
        },
        {
            "streaming": jdp.Streaming(fragments=4, delay=2),
            "outer": optax.sgd(0.7, momentum=0.9),
        },
        {
            "streaming": jdp.Streaming(fragments=4, delay=2),
            "average": jdp.BlockAverage(wire=jdp.wire.bf16()),
        },
    ],
    ids=["d0", "d1", "d4", "mix", "nesterov", "outer", "wire"],
)
def test_a_step_without_a_sync_copies_nothing(kw):
    """XLA updates a conditional's operand in place only when nothing else reads
    its old value; else it copies the whole leaf in the branch that does
    nothing, on every step (it used to: 1.7x the local step's time on CPU)."""
    tx = jdp.bmuf(optax.sgd(0.1), sync_period=16, **kw)
    step = jdp.parallelize(
        jdp.make_train_step(wide_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:4],
    )
    state = step.replicate(jdp.TrainState.create(params=wide_params(), tx=tx))
    text = step.lower(state, step.shard(wide_batch())).compile().as_text()
    copies = untaken_branch_copies(text)
    # One conditional per chunk and two per fragment at least: all checked.
    fragments, delay = kw["streaming"].fragments, kw["streaming"].delay
    assert len(copies) >= 2 * fragments + fragments * delay
    assert not any(copies.values()), copies


@pytest.mark.parametrize(
    "kw",
    [
        {"streaming": jdp.Streaming(fragments=4, delay=1)},
        {
            "streaming": jdp.Streaming(fragments=4, delay=2, mix=0.5),
            "outer": optax.sgd(0.7, momentum=0.9, nesterov=True),
        },
        {
            "streaming": jdp.Streaming(fragments=4, delay=2),
            "outer": jdp.block_momentum(nesterov=True),
        },
        {
            "streaming": jdp.Streaming(fragments=4, delay=1),
            "outer": optax.sgd(0.7, momentum=0.9),
            "average": jdp.BlockAverage(wire=jdp.wire.bf16()),
        },
    ],
    ids=["d1", "diloco-mix", "nesterov", "outer-wire"],
)
def test_a_sync_writes_the_rows_of_a_split_leaf_in_place(kw):
    """A fragment's sync writes its rows of a leaf it splits into the global model
    and into the params, each in place: the params read the new global rows only
    once they are written, or the global update waits for the new block start that
    reads the old rows. (With `outer=`, XLA copied every split leaf twice on each
    sync.) A leaf a fragment holds whole is one new value in two buffers: a copy."""
    tx = jdp.bmuf(optax.sgd(0.1), sync_period=16, **kw)
    step = jdp.parallelize(
        jdp.make_train_step(wide_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:4],
    )
    params = wide_params()
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    text = step.lower(state, step.shard(wide_batch())).compile().as_text()
    leaves = jax.tree.leaves(params)
    plan = _bmuf._plan(params, 4, kw["streaming"].delay)
    pieces = [p for fragment in plan.fragments for p in fragment]
    split = {
        "f32[{}]".format(",".join(map(str, leaves[p.leaf].shape)))
        for p in pieces
        if not p.whole
    }
    assert split == {"f32[32,64]", "f32[64,32]"}  # the weights, cut into rows
    copies = branch_copies(text, 1)
    assert len(copies) >= 2 * 4
    assert not [c for cs in copies.values() for c in cs if c in split], copies


def depends_on_inputs(jaxpr, tainted):
    """The psum/all-reduce equations of `jaxpr` whose operand depends on a
    tainted input (following values into and out of nested jaxprs)."""
    found = []
    tainted = set(tainted)

    def walk(jaxpr, tainted):
        for eqn in jaxpr.eqns:
            ins = [v in tainted for v in eqn.invars if not hasattr(v, "val")]
            hit = any(ins)
            if eqn.primitive.name in ("psum", "psum_invariant", "all_reduce"):
                found.append(hit)
            subs = [
                p
                for p in eqn.params.values()
                if hasattr(p, "jaxpr") or hasattr(p, "eqns")
            ]
            branches = eqn.params.get("branches", ())
            if eqn.primitive.name == "cond":
                # operands are invars[1:], the index invars[0]
                ops = [
                    v in tainted if not hasattr(v, "val") else False
                    for v in eqn.invars[1:]
                ]
                outs = set()
                for br in branches:
                    inner = br.jaxpr
                    inner_t = {v for v, t in zip(inner.invars, ops, strict=True) if t}
                    out_t = walk(inner, inner_t)
                    outs |= {i for i, v in enumerate(inner.outvars) if v in out_t}
                for i, v in enumerate(eqn.outvars):
                    if i in outs:
                        tainted.add(v)
                continue
            for sub in subs:
                inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
                walk(inner, set(inner.invars) if hit else set())
            if hit:
                tainted.update(eqn.outvars)
        return tainted

    walk(jaxpr, tainted)
    return found


@pytest.mark.parametrize("delay", [0, 1, 4])
def test_delayed_all_reduce_does_not_wait_for_the_steps_gradients(delay):
    """With delay >= 1 every parameter all-reduce reads the state (the snapshot),
    not this step's gradients, so XLA may overlap it with the step's compute."""
    tx = jdp.bmuf(optax.sgd(0.1), 8, streaming=jdp.Streaming(2, delay))
    params = wide_params()

    def one_step(params, opt_state, batch):
        grads = jax.grad(wide_loss)(params, batch)
        merges = []
        updates, new = tx.update(grads, opt_state, params, **{_bmuf.MERGES_ARG: merges})
        return _bmuf.merge_updated(
            optax.apply_updates(params, updates), opt_state, new, merges
        )

    stacked = jax.tree.map(lambda x: jnp.stack([x] * 2), params)
    opt_state = jax.vmap(tx.init)(stacked)
    batch = jax.tree.map(lambda x: jnp.stack([x] * 2), wide_batch())
    closed = jax.make_jaxpr(jax.vmap(one_step, axis_name="data"))(
        stacked, opt_state, batch
    )
    jaxpr = closed.jaxpr
    num_p = len(jax.tree.leaves(stacked))
    num_s = len(jax.tree.leaves(opt_state))
    # The batch (and so the gradients and the updated params) are tainted.
    batch_vars = jaxpr.invars[num_p + num_s :]
    param_vars = jaxpr.invars[:num_p]
    flags = depends_on_inputs(jaxpr, list(batch_vars) + list(param_vars))
    assert flags, "no all-reduce found"
    if delay:
        assert not any(flags)
    else:  # the sync all-reduces the params this step updated
        assert all(flags)


# -- checkpoints -------------------------------------------------------------------


def leaves_by_path(tree):
    return {
        jax.tree_util.keystr(path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    }


def assert_same_bits(actual, expected):
    """Same leaves, same bits; `{path: array}` dicts are taken as they are."""
    actual, expected = (
        x
        if isinstance(x, dict) and all(k.startswith(".") for k in x)
        else leaves_by_path(x)
        for x in (actual, expected)
    )
    assert actual.keys() == expected.keys()
    for path, e in expected.items():
        assert actual[path].dtype == e.dtype and actual[path].shape == e.shape, path
        assert actual[path].tobytes() == e.tobytes(), f"leaf {path} differs"


def streaming_step(num, backend="shard_map"):
    tx = jdp.bmuf(
        optax.sgd(LR, momentum=0.9),
        sync_period=8,
        streaming=jdp.Streaming(fragments=2, delay=3, mix=0.5),
        outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    )
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=jdp.local()),
        devices=jax.devices()[:num],
        backend=backend,
    )
    return step, jdp.TrainState.create(params=linear_params(), tx=tx)


def test_mid_fragment_resume_is_bit_exact(tmp_path, backend):
    """Saved with a chunk all-reduced and two in flight: everything comes back."""
    step, init = streaming_step(NUM, backend)
    batches = linear_batches(20, 16)
    state = step.replicate(init)
    save_at = 10  # fragment 0 syncs after update 12; its snapshot was after 9
    for batch in batches[:save_at]:
        state, _ = step(state, step.shard(batch))
    pending = jax.device_get(state.opt_state.pending)
    # Per-replica snapshots in flight (chunk 0 already holds the mean).
    assert np.any(pending["w"][0] != pending["w"][1])
    with CheckpointManager(tmp_path) as manager:
        manager.save(save_at, state, parallel=step)
        meta = manager.metadata()
        saved = leaves_by_path(state)
        straight = state  # the step donates it
        for batch in batches[save_at:]:
            straight, _ = step(straight, step.shard(batch))
        straight = leaves_by_path(straight)
        restored = manager.restore(step.replicate(init))
    per_replica = [r["path"] for r in meta["leaves"] if r.get("per_replica")]
    assert any(".pending" in p for p in per_replica)
    assert not any("global_params" in p for p in per_replica)
    assert_same_bits(restored, saved)
    for batch in batches[save_at:]:
        restored, _ = step(restored, step.shard(batch))
    assert_same_bits(restored, straight)


def test_into_another_count_every_fragment_starts_from_its_global_copy(tmp_path):
    step, init = streaming_step(NUM)
    state = step.replicate(init)
    # Fragment 0 synced after update 4 (mixed); fragment 1's snapshot was taken
    # after 5, its chunk 0 all-reduced at 6, chunks 1 and 2 still in flight.
    for batch in linear_batches(6, 16):
        state, _ = step(state, step.shard(batch))
    copy = step.unreplicate(state)
    g = copy.opt_state.global_params
    assert np.any(np.asarray(copy.params["w"]) != np.asarray(g["w"]))
    pending = jax.device_get(state.opt_state.pending)
    assert np.any(pending["w"][0] != pending["w"][1])  # per replica in flight
    two, _ = streaming_step(2)
    with CheckpointManager(tmp_path) as manager:
        manager.save(6, state)
        with pytest.warns(
            RuntimeWarning,
            match=r"(?s)between syncs.*block start.*fragment sync in flight "
            r"\(`delay`\) restarts from the block start",
        ):
            restored = manager.restore(two.replicate(init))
    jdp.assert_replicas_in_sync(restored)
    got = two.unreplicate(restored)
    assert_same_bits(got.params, g)
    assert_same_bits(got.opt_state.global_params, g)
    # The snapshot in flight restarts from the block start on every replica
    # (not replica 0's local params): the coming sync applies no progress.
    pending = jax.device_get(restored.opt_state.pending)
    for r in range(2):
        assert_same_bits(jax.tree.map(lambda x, r=r: np.asarray(x)[r], pending), g)
    restored, _ = two(restored, two.shard(linear_batches(1, 8, seed=5)[0]))
    assert np.all(np.isfinite(np.asarray(restored.params["w"])))


# -- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sync_period, kw, match",
    [
        (
            6,
            {"streaming": jdp.Streaming(fragments=4)},
            r"`sync_period` \(6\) must be divisible by `fragments` \(4\)",
        ),
        (
            8,
            {"streaming": jdp.Streaming(fragments=4, delay=3)},
            r"`delay` \(3\) must be at most sync_period / fragments \(8 / 4 = 2\)",
        ),
        (
            8,
            {"streaming": jdp.Streaming(fragments=2), "inner_state_at_sync": "reset"},
            r"`inner_state_at_sync='reset'` acts on the whole inner state.*"
            r"`fragments=2`.*`jdp.Streaming\(fragments=1\)`",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_schedules_name_the_argument(sync_period, kw, match):
    with pytest.raises(ValueError, match=match):
        jdp.bmuf(optax.sgd(0.1), sync_period, **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mix": 1.5}, r"`mix` must be a finite number in \[0, 1\)"),
        (
            {"fragments": 2, "mix": 1.0},
            r"`mix` must be a finite number in \[0, 1\) .*got 1.0: each replica "
            r"would keep its local fragment entirely, so the replicas would never "
            r"sync.*`jdp.Streaming\(mix=0.5\)`",
        ),
        ({"mix": -0.1}, r"`mix` must be a finite number >= 0"),
        ({"mix": float("nan")}, r"`mix` must be .*got nan"),
        ({"fragments": 0}, r"`fragments` must be"),
        ({"fragments": -2}, r"`fragments` must be"),
        ({"delay": -1}, r"`delay` must be"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_a_bad_streaming_value_names_its_field(kw, match):
    with pytest.raises(ValueError, match=match):
        jdp.Streaming(**kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"fragments": 2.0}, "`fragments` must be an int"),
        ({"delay": "1"}, "`delay` must be an int"),
        ({"mix": "0.5"}, r"`mix` must be a finite number"),
    ],
)
def test_wrong_schedule_types_are_type_errors(kw, match):
    with pytest.raises(TypeError, match=match):
        jdp.Streaming(**kw)


def test_a_streaming_value_is_immutable_and_plain_by_default():
    schedule = jdp.Streaming(fragments=2, delay=1, mix=0.5)
    with pytest.raises(AttributeError):
        schedule.fragments = 4
    assert schedule == jdp.Streaming(2, 1, 0.5)
    params, batches = linear_params(), linear_batches(7, 16)
    inner = optax.sgd(LR, momentum=0.9)
    plain, default = (
        run_with(jdp.bmuf(inner, 3, streaming=value), params, batches)
        for value in (None, jdp.Streaming())
    )
    assert bits(default) == bits(plain)


def test_inner_state_at_sync_applies_with_one_fragment_and_a_delay():
    """With one fragment `reset` still acts at each sync (the whole inner state)."""
    tx = jdp.bmuf(
        optax.sgd(LR, momentum=0.9),
        sync_period=4,
        streaming=jdp.Streaming(delay=2),
        inner_state_at_sync="reset",
    )
    state = run_with(tx, linear_params(), linear_batches(4, 16))
    for leaf in jax.tree.leaves(state.opt_state.inner_state):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)
    state = run_with(tx, linear_params(), linear_batches(5, 16))
    assert all(
        np.any(np.asarray(x) != 0) for x in jax.tree.leaves(state.opt_state.inner_state)
    )


# -- a compressed exchange for the syncs ------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [{}, {"streaming": jdp.Streaming(fragments=2, delay=1, mix=0.5)}],
    ids=["block", "streaming"],
)
def test_wire_compresses_the_pseudo_gradient(kw):
    """`BlockAverage(wire=)`: the replicas' pseudo-gradients `start - params` go over an
    all-to-all and an all-gather of the narrow type; results stay close."""
    params, batches = wide_params(), [wide_batch() for _ in range(9)]
    runs = {}
    for name, wire in [("plain", None), ("bf16", jdp.wire.bf16())]:
        tx = jdp.bmuf(
            optax.sgd(0.1),
            sync_period=4,
            outer=jdp.block_momentum(momentum=0.5),
            average=jdp.BlockAverage(wire=wire),
            **kw,
        )
        step = jdp.parallelize(
            jdp.make_train_step(wide_loss, tx, sync=jdp.local()),
            devices=jax.devices()[:4],
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        ops = step.collectives(state, step.shard(batches[0]), stage="lowered")
        for batch in batches:
            state, _ = step(state, step.shard(batch))
        runs[name] = (jax.device_get(state), ops)
    plain, plain_ops = runs["plain"]
    packed, packed_ops = runs["bf16"]
    assert {c.kind for c in plain_ops if c.in_conditional} == {"all-reduce"}
    kinds = {c.kind for c in packed_ops if c.in_conditional}
    assert kinds == {"all-to-all", "all-gather"}, kinds
    # Two-byte elements on the wire (sent as their bits).
    assert {c.dtype for c in packed_ops if c.in_conditional} <= {"bf16", "u16"}
    np.testing.assert_allclose(
        flat(packed.opt_state.global_params),
        flat(plain.opt_state.global_params),
        rtol=2e-2,
        atol=2e-3,
    )
    assert bits(packed.opt_state.global_params) != bits(plain.opt_state.global_params)
    jdp.assert_replicas_in_sync(packed.opt_state.global_params)


def test_wire_must_be_a_wire_format():
    with pytest.raises(
        TypeError, match=r"`jdp.BlockAverage`: `wire` must be a wire format"
    ):
        jdp.BlockAverage(wire="int8")
