"""Compressed all-reduce (`jdp.wire`, `jdp.all_reduce(wire=, error_feedback=)`).

The oracle is a NumPy reference of the exchange written from its description
(quantise, all-to-all, float32 mean per chunk owner, quantise again, all-gather),
with worker and server error feedback; with two replicas, quantise, all-gather and a
float32 mean on every replica, with worker error feedback.
"""

import math
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import ancestors, entry_instructions

import jdp
from jdp import _hlo, _wire

# -- NumPy reference -------------------------------------------------------------


def np_encode(x, name, block):
    """Block-wise quantisation of a float32 vector, as the wire formats describe."""
    if name == "bf16":
        return x.astype(ml_dtypes.bfloat16), None
    qmax = {"int8": 127.0, "fp8": 448.0}[name]
    blocks = x.reshape(-1, block)
    amax = np.abs(blocks).max(axis=1)
    scale = np.where(amax == 0, 1, amax * np.float32(1 / qmax)).astype(np.float32)
    scale = np.maximum(scale, np.finfo(np.float32).tiny)
    scaled = blocks / scale[:, None]
    if name == "int8":
        q = np.clip(np.round(scaled), -127, 127).astype(np.int8)
    else:
        q = scaled.astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape), scale


def np_decode(q, scale, block):
    values = q.astype(np.float32)
    if scale is None:
        return values
    return (values.reshape(-1, block) * scale[:, None]).reshape(q.shape)


def np_exchange(grads, name, block, worker=None, server=None):
    """One compressed mean over replicas: `grads` is (N, size) float32, the
    leaves' values each padded with zeros to whole blocks, side by side.

    Returns the mean every replica receives and the new worker and server errors
    (None without error feedback), the server error of the chunk each replica
    owns first in its row.
    """
    num, total = grads.shape
    bsize = 1 if name == "bf16" else block
    per_replica = -(-total // num)
    chunk = -(-per_replica // bsize) * bsize  # whole blocks
    padded = chunk * num
    x = np.zeros((num, padded), np.float32)
    x[:, :total] = grads
    if worker is not None:
        x[:, :total] += worker
    enc = [np_encode(x[i], name, bsize) for i in range(num)]
    new_worker = np.stack([x[i] - np_decode(*enc[i], bsize) for i in range(num)])
    if num == 2:  # every replica decodes both vectors: no owner, no second rounding
        out = (np_decode(*enc[0], bsize) + np_decode(*enc[1], bsize)) / np.float32(2)
        if worker is None:
            return out[:total], None, None
        return out[:total], new_worker[:, :total], server
    out = np.zeros(padded, np.float32)
    new_server = np.zeros((num, padded), np.float32)
    for j in range(num):  # chunk j, owned by replica j
        sl = slice(j * chunk, (j + 1) * chunk)
        parts = []
        for i in range(num):
            q, s = enc[i]
            s_j = (
                None if s is None else s[j * chunk // bsize : (j + 1) * chunk // bsize]
            )
            parts.append(np_decode(q[sl], s_j, bsize))
        own = np.sum(np.stack(parts), axis=0) / np.float32(num)
        if server is not None:
            own = own + server[j, :chunk]
        q2, s2 = np_encode(own.astype(np.float32), name, bsize)
        back = np_decode(q2, s2, bsize)
        new_server[j, :chunk] = own - back
        out[sl] = back
    if worker is None:
        return out[:total], None, None
    return out[:total], new_worker[:, :total], new_server[:, :total]


# -- formats ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bf16", "int8", "fp8"])
def test_encode_and_decode_match_numpy(name):
    wire = {"bf16": jdp.wire.bf16(), "int8": jdp.wire.int8(64), "fp8": jdp.wire.fp8(64)}
    wire = wire[name]
    x = np.random.default_rng(0).normal(size=1024).astype(np.float32)
    x[:64] = 0.0  # an all-zero block keeps scale 1 and decodes to zeros
    x[64:128] *= 1e4  # blocks of very different magnitude
    q, s = jax.jit(wire.encode)(jnp.asarray(x))
    bsize = 1 if name == "bf16" else 64
    q_ref, s_ref = np_encode(x, name, bsize)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    if s_ref is not None:
        np.testing.assert_array_equal(np.asarray(s), s_ref)
    decoded = np.asarray(wire.decode(q, s))
    np.testing.assert_array_equal(decoded, np_decode(q_ref, s_ref, bsize))
    assert np.all(decoded[:64] == 0)
    # The error is bounded by half a quantisation step of each block.
    bound = {"bf16": 2**-8, "int8": 0.5 / 127, "fp8": 2**-4}[name]
    blocks = np.abs(x).reshape(-1, 64).max(axis=1, keepdims=True)
    err = np.abs(decoded - x).reshape(-1, 64)
    rel = np.abs(x).reshape(-1, 64) if name != "int8" else blocks
    assert np.all(err <= bound * rel + 1e-30)


@pytest.mark.parametrize("wire", [jdp.wire.int8(16), jdp.wire.fp8(16)], ids=str)
def test_blocks_of_tiny_values_stay_finite(wire):
    # A scale below float32's smallest normal number would be flushed to zero.
    x = np.zeros(64, np.float32)
    x[:16] = 1e-37
    x[16:32] = np.linspace(-3e-38, 3e-38, 16)
    x[32:48] = 5.0
    q, s = jax.jit(wire.encode)(jnp.asarray(x))
    decoded = np.asarray(jax.jit(wire.decode)(q, s))
    assert np.all(np.isfinite(decoded))
    np.testing.assert_allclose(decoded[32:48], 5.0)
    assert np.all(np.abs(decoded[:32]) <= 1e-36)
    nan = x.copy()
    nan[40] = np.nan
    decoded = np.asarray(jax.jit(lambda v: wire.decode(*wire.encode(v)))(nan))
    assert np.all(np.isnan(decoded[32:48])) and np.all(np.isfinite(decoded[:32]))


@pytest.mark.parametrize("block", [1, 7, 48, 256, 1000, 4096])
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_block_scales_of_any_block_size_match_numpy(name, block):
    # Blocks sharing a factor with 32 reduce in two steps, the others in one.
    wire = {"int8": jdp.wire.int8, "fp8": jdp.wire.fp8}[name](block)
    x = np.random.default_rng(block).normal(size=3 * block).astype(np.float32)
    x[:block] *= -1e3  # far larger than the next blocks, signs flipped
    x[block : 2 * block] = -0.0
    q, s = jax.jit(wire.encode)(jnp.asarray(x))
    q_ref, s_ref = np_encode(x, name, block)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))


def full_size_passes(fn, *args, size):
    """The instructions of `fn`'s compiled program that read `size` or more values.

    Each as it runs: `"kLoop"` for a fusion XLA emits as a loop, `"kCustom"` for
    one it hands to a library, else the opcode (a copy, a concatenate).
    """
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    comps, entry = _hlo._parse_computations(hlo)
    values, passes = {}, []
    for line in comps[entry]:
        m = _hlo._INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        typ, rest = _hlo._split_type(rest)
        values[name] = max(
            (math.prod(_hlo._ints(dims)) for _, dims in _hlo._SHAPE.findall(typ)),
            default=1,
        )
        opcode, _, operands = rest.partition("(")
        if opcode in ("parameter", "bitcast", "tuple", "get-tuple-element"):
            continue
        names = re.findall(r"%([\w.\-]+)", operands.split(")")[0])
        if any(values.get(n, 0) >= size for n in names):
            kind = re.search(r"kind=(\w+)", rest)
            passes.append(kind.group(1) if kind else opcode)
    return passes


@pytest.mark.parametrize("wire", [jdp.wire.int8(), jdp.wire.fp8()], ids=str)
def test_codec_reads_the_gradient_in_few_loops(wire):
    # The block scales are one fused loop over the values where they are made
    # (no library reduction reading a copy): encoding reads the vector twice
    # (scales, payload); with error feedback four passes touch it (vector +
    # error, scales, payload, new error); the owner's side of the exchange
    # likewise. XLA:CPU fuses no reduction with the loop that uses its result and
    # writes one array per loop: these are as few as it allows.
    n = 1 << 20
    x = jnp.zeros(n, jnp.float32)

    def send(v, e):
        state = _wire.WireState((e,), e)
        return _wire._quantise([v], [n], [n], wire, state, 1)

    def average(rows, scales, e):
        return _wire._average(rows, scales, wire, e)

    rows = jnp.zeros((2, n), wire.dtype)
    scales = jnp.ones((2, n // wire.block_size), jnp.float32)
    for fn, args, most in [
        (wire.encode, (x,), 2),
        (send, (x, x), 4),
        (average, (rows, scales, x), 4),
    ]:
        passes = full_size_passes(fn, *args, size=n)
        assert "kCustom" not in passes and 1 < len(passes) <= most, (fn, passes)


def test_the_int8_exchange_loads_no_value_through_a_bitcast():
    # XLA:CPU runs a pad of a concatenation as a scalar loop (the payload of 8
    # leaves, 5x as long at 9M values), and does not vectorise a loop that loads
    # through a bitcast (the owner's average, 2.7x). int8 travels as int8, the last
    # leaf takes the padding, and the scales as float32: no loop that reads through
    # a bitcast writes more than all the scales' bytes.
    devices = jax.devices()[:4]
    params, tx = mlp_params((64, 300, 300, 11)), optax.sgd(0.1)  # 445 blocks
    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=sync), devices=devices
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    batch = step.shard(
        {"x": jnp.ones((2 * len(devices), 64)), "y": jnp.zeros((2 * len(devices), 11))}
    )
    comps, entry = _hlo._parse_computations(
        step.lower(state, batch).compile().as_text()
    )
    most = (
        4 * (len(devices) + 1) * sum(-(-x.size // 256) for x in jax.tree.leaves(params))
    )

    def size(line):  # of the instruction's result
        return math.prod(_hlo._ints(re.search(r"= \w+\[([0-9,]*)\]", line).group(1)))

    for name, lines in comps.items():
        assert not any(re.search(r"\bpad\(%concatenate", x) for x in lines), name
        if name != entry and any(" bitcast-convert(" in x for x in lines):
            assert size(next(x for x in lines if "ROOT" in x)) <= most, name


def test_bytes_per_value_counts_the_scales():
    assert jdp.wire.bf16().bytes_per_value == 2.0
    assert jdp.wire.int8(block_size=128).bytes_per_value == 1.0 + 4 / 128
    assert jdp.wire.fp8(block_size=32).bytes_per_value == 1.0 + 4 / 32


# -- the exchange in a train step -----------------------------------------------------


def linear_loss(params, batch):
    # d loss / d w = this replica's row of the batch: the gradients are the data.
    return jnp.sum(params["w"] * batch[0]) + jnp.sum(params["b"] * batch[0, :3])


def run(sync, grads_per_step, backend, num, *, tx=None, skip_nonfinite=False):
    """Trains with SGD(1) on linear losses whose gradients are given per replica."""
    tx = tx or optax.sgd(1.0)
    size = grads_per_step.shape[-1]
    params = {"w": jnp.zeros(size), "b": jnp.zeros(3)}
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=sync, skip_nonfinite=skip_nonfinite),
        backend=backend,
        devices=jax.devices()[:num],
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    params_seen = []
    for g in grads_per_step:
        state, _ = step(state, step.shard(jnp.asarray(g)))
        params_seen.append(jax.device_get(step.unreplicate(state).params))
    return step, state, params_seen


@pytest.mark.parametrize("num", [2, 4])
@pytest.mark.parametrize("name", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_exchange_matches_numpy_reference_over_steps(
    backend, name, error_feedback, num
):
    size, steps = 700, 3
    wire = {"bf16": jdp.wire.bf16(), "int8": jdp.wire.int8(32), "fp8": jdp.wire.fp8(32)}
    sync = jdp.all_reduce(wire=wire[name], error_feedback=error_feedback)
    rng = np.random.default_rng(1)
    grads = rng.normal(size=(steps, num, size)).astype(np.float32)
    grads *= np.linspace(0.01, 10, size, dtype=np.float32)  # uneven magnitudes
    _, state, seen = run(sync, grads, backend, num)
    # The exchanged values: each leaf padded to whole blocks, in pytree order
    # ("b" before "w").
    bsize = 1 if name == "bf16" else 32
    pb, pw = -(-3 // bsize) * bsize, -(-size // bsize) * bsize
    flat = np.zeros((steps, num, pb + pw), np.float32)
    flat[..., :3] = grads[..., :3]
    flat[..., pb : pb + size] = grads
    worker = server = None
    if error_feedback:
        worker = np.zeros((num, pb + pw), np.float32)
        server = np.zeros((num, pb + pw), np.float32)
    w = np.zeros(size, np.float32)
    for t in range(steps):
        mean, worker, server = np_exchange(flat[t], name, 32, worker, server)
        w = w - mean[pb : pb + size]
        np.testing.assert_allclose(seen[t]["w"], w, rtol=2e-6, atol=2e-6)
    # Every replica ends with the same bits.
    shards = [np.asarray(x.data) for x in state.params["w"].addressable_shards]
    assert len(shards) == num
    assert all(np.array_equal(shards[0], x) for x in shards[1:])
    if not error_feedback:
        assert state.sync_state is None
        return

    def rows(x):
        return np.stack([np.asarray(s.data) for s in x.addressable_shards]).reshape(
            num, -1
        )

    got_b, got_w = state.sync_state.worker
    np.testing.assert_allclose(rows(got_b), worker[:, :pb], atol=1e-5)
    np.testing.assert_allclose(rows(got_w), worker[:, pb:], atol=1e-5)
    np.testing.assert_allclose(rows(state.sync_state.server), server, atol=1e-5)


def test_error_feedback_recovers_what_quantisation_drops():
    # A constant gradient far below one int8 step of its block: without error
    # feedback it is lost every step; with it, it arrives on average.
    num, size, steps = 2, 64, 40
    g = np.zeros((num, size), np.float32)
    g[:, 0] = 100.0  # sets the block's scale
    g[:, 1] = 0.1  # < half a step (100 / 127 / 2)
    grads = np.broadcast_to(g, (steps, num, size))
    lost = run(jdp.all_reduce(wire=jdp.wire.int8(64)), grads, "shard_map", num)[2]
    kept = run(
        jdp.all_reduce(wire=jdp.wire.int8(64), error_feedback=True),
        grads,
        "shard_map",
        num,
    )[2]
    assert lost[-1]["w"][1] == 0.0
    np.testing.assert_allclose(-kept[-1]["w"][1], 0.1 * steps, rtol=0.05)


def test_error_buffers_differ_per_replica_and_the_guard_ignores_them():
    sync = jdp.all_reduce(wire=jdp.wire.int8(16), error_feedback=True)
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=sync),
        devices=jax.devices()[:4],
        check_sync=1,
    )
    params = {"w": jnp.zeros(100), "b": jnp.zeros(3)}
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    batch = np.random.default_rng(0).normal(size=(4, 100)).astype(np.float32)
    for _ in range(3):  # the guard compares every step; the buffers differ
        state, _ = step(state, step.shard(batch))
    assert not jdp.replicas_in_sync(state)
    assert jdp.replicas_in_sync(state.replace(sync_state=None))
    rows = [np.asarray(s.data) for s in state.sync_state.worker[1].addressable_shards]
    assert not np.array_equal(rows[0], rows[1])


@pytest.mark.parametrize("num", [2, 4])
def test_transform_form_equals_the_sync_piece(backend, num):
    size = 300
    grads = np.random.default_rng(2).normal(size=(3, num, size)).astype(np.float32)
    wire = jdp.wire.int8(32)
    piece = run(jdp.all_reduce(wire=wire, error_feedback=True), grads, backend, num)
    tx = optax.chain(
        jdp.sync_gradients(jdp.all_reduce(wire=wire, error_feedback=True)),
        optax.sgd(1.0),
    )
    chained = run(jdp.local(), grads, backend, num, tx=tx)
    for a, b in zip(piece[2], chained[2], strict=True):
        np.testing.assert_array_equal(a["w"], b["w"])
    # Its error buffers live in the optimizer state.
    assert isinstance(chained[1].opt_state[0], jdp.wire.WireState)


def test_skipped_step_keeps_the_error_buffers():
    sync = jdp.all_reduce(wire=jdp.wire.int8(16), error_feedback=True)
    grads = np.random.default_rng(3).normal(size=(2, 2, 50)).astype(np.float32)
    grads[1, 1, 7] = np.nan
    step, state, seen = run(sync, grads, "shard_map", 2, skip_nonfinite=True)
    np.testing.assert_array_equal(seen[1]["w"], seen[0]["w"])
    assert int(step.unreplicate(state).skipped_steps) == 1
    first_step, first, _ = run(sync, grads[:1], "shard_map", 2, skip_nonfinite=True)
    np.testing.assert_array_equal(
        jax.device_get(step.unreplicate(state).sync_state.server),
        jax.device_get(first_step.unreplicate(first).sync_state.server),
    )


# -- bytes --------------------------------------------------------------------------


def mlp_params(sizes):
    key = jax.random.key(0)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"layer{i}"] = {
            "w": jax.random.normal(jax.random.fold_in(key, i), (a, b)) / a**0.5,
            "b": jnp.zeros(b),
        }
    return params


def mlp_loss(params, batch):
    x = batch["x"]
    for i in range(len(params)):
        layer = params[f"layer{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - batch["y"]) ** 2)


def wire_bytes(collectives, num):
    """Bytes each device sends (a bandwidth-optimal algorithm, NCCL's bus bytes)."""
    factor = {"all-reduce": 2 * (num - 1) / num}
    return sum(c.bytes * factor.get(c.kind, (num - 1) / num) for c in collectives)


@pytest.mark.parametrize("num", [2, 8])
def test_compiled_program_sends_the_narrow_bytes(num):
    sizes = (64, 512, 512, 10)
    params = mlp_params(sizes)
    tx = optax.sgd(0.1)
    batch = {"x": jnp.ones((16, 64)), "y": jnp.zeros((16, 10))}
    out = {}
    for name, sync in {
        "f32": jdp.all_reduce(),
        "bf16": jdp.all_reduce(wire=jdp.wire.bf16()),
        "int8": jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True),
        "fp8": jdp.all_reduce(wire=jdp.wire.fp8(), error_feedback=True),
    }.items():
        step = jdp.parallelize(
            jdp.make_train_step(mlp_loss, tx, sync=sync), devices=jax.devices()[:num]
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
        ops = step.collectives(state, step.shard(batch))
        loss_metric = [c for c in ops if c.kind == "all-reduce" and c.bytes <= 16]
        grads = [c for c in ops if c not in loss_metric]
        out[name] = (wire_bytes(grads, num), grads)
    f32 = out["f32"][0]
    assert out["bf16"][0] <= 0.51 * f32
    assert out["int8"][0] <= 0.27 * f32
    assert out["fp8"][0] <= 0.27 * f32
    # An all-to-all and an all-gather of int8 (fp8 as its bits), each followed by
    # one of the float32 scales; with two replicas the all-gathers alone.
    # bfloat16 travels as its bits, not widened to float32.
    kinds = [("all-gather", "f32"), ("all-gather", "s8")]
    if num > 2:
        kinds += [("all-to-all", "f32"), ("all-to-all", "s8")]
    for name in ("int8", "fp8"):
        assert sorted((c.kind, c.dtype) for c in out[name][1]) == kinds
    assert {c.dtype for c in out["bf16"][1]} == {"u16"}


@pytest.mark.parametrize("num", [2, 4])
def test_the_scales_travel_after_the_values_which_are_not_copied(num):
    # Two collectives could run in different orders on different processes: each
    # collective of the scales reads the result of the values' collective before
    # it, so every process runs them in that order. The values are sent from where
    # XLA writes them: no copy of them (one buffer with the scales copied them).
    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(mlp_loss, tx, sync=sync), devices=jax.devices()[:num]
    )
    params = mlp_params((64, 300, 300, 11))
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    batch = step.shard({"x": jnp.ones((2 * num, 64)), "y": jnp.zeros((2 * num, 11))})
    instrs = entry_instructions(step.lower(state, batch).compile().as_text())
    total = sum(-(-x.size // 256) * 256 for x in jax.tree.leaves(params))
    kinds = ["all-gather"] + (["all-to-all"] if num > 2 else [])
    for kind in kinds:
        found = {n: v[1][0] for n, v in instrs.items() if v[0].startswith(kind)}
        values, scales = max(found, key=found.get), min(found, key=found.get)
        assert len(found) == 2 and values in ancestors(instrs, scales), found
    copies = [n for n, v in instrs.items() if v[0] == "copy" and v[1][0] >= total / num]
    assert not copies, copies


# -- checkpoints --------------------------------------------------------------------


def test_checkpoint_resumes_the_error_buffers_exactly(tmp_path):
    num, size = 4, 200
    grads = np.random.default_rng(4).normal(size=(6, num, size)).astype(np.float32)
    sync = jdp.all_reduce(wire=jdp.wire.int8(32), error_feedback=True)
    step, state, seen = run(sync, grads, "shard_map", num)
    _, half, _ = run(sync, grads[:3], "shard_map", num)
    with jdp.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, half)
        like = step.replicate(
            jdp.TrainState.create(
                params={"w": jnp.zeros(size), "b": jnp.zeros(3)},
                tx=optax.sgd(1.0),
                sync=sync,
            )
        )
        restored = manager.restore(like, step=3)
    for g in grads[3:]:
        restored, _ = step(restored, step.shard(jnp.asarray(g)))
    np.testing.assert_array_equal(
        jax.device_get(step.unreplicate(restored).params["w"]), seen[-1]["w"]
    )
    for a, b in zip(
        jax.tree.leaves(restored.sync_state),
        jax.tree.leaves(state.sync_state),
        strict=True,
    ):
        rows_a = [np.asarray(s.data) for s in a.addressable_shards]
        rows_b = [np.asarray(s.data) for s in b.addressable_shards]
        np.testing.assert_array_equal(np.stack(rows_a), np.stack(rows_b))


def test_checkpoint_into_another_replica_count_restarts_the_buffers(tmp_path):
    sync = jdp.all_reduce(wire=jdp.wire.int8(32), error_feedback=True)
    grads = np.random.default_rng(5).normal(size=(2, 4, 100)).astype(np.float32)
    _, state, _ = run(sync, grads, "shard_map", 4)
    two = jdp.parallelize(
        jdp.make_train_step(linear_loss, optax.sgd(1.0), sync=sync),
        devices=jax.devices()[:2],
    )
    like = two.replicate(
        jdp.TrainState.create(
            params={"w": jnp.zeros(100), "b": jnp.zeros(3)},
            tx=optax.sgd(1.0),
            sync=sync,
        )
    )
    with jdp.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(2, state)
        with pytest.warns(RuntimeWarning, match="Error-feedback buffers .* zero"):
            restored = manager.restore(like, step=2)
    host = two.unreplicate(restored)
    assert not any(np.any(np.asarray(w)) for w in host.sync_state.worker)
    assert not np.any(np.asarray(host.sync_state.server))
    assert host.params["w"].shape == (100,)
    restored, _ = two(restored, two.shard(jnp.asarray(grads[0, :2])))  # trains on


# -- errors -------------------------------------------------------------------------


def test_error_feedback_needs_a_wire():
    with pytest.raises(ValueError, match=r"error_feedback=True.*no `wire`"):
        jdp.all_reduce(error_feedback=True)


def test_wire_and_reduce_dtype_together_are_refused():
    with pytest.raises(ValueError, match=r"both `wire=jdp.wire.int8\(\)`.*drop"):
        jdp.all_reduce(wire=jdp.wire.int8(), reduce_dtype=jnp.bfloat16)


def test_wire_must_be_a_format():
    with pytest.raises(TypeError, match=r"`wire` must be a wire format.*got str"):
        jdp.all_reduce(wire="int8")
    with pytest.raises(TypeError, match=r"`error_feedback` must be True or False"):
        jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=1)
    with pytest.raises(ValueError, match=r"`block_size` must be an int >= 1"):
        jdp.wire.int8(block_size=0)
    with pytest.raises(TypeError, match=r"`block_size` must be an int >= 1"):
        jdp.wire.fp8(block_size=2.5)


@pytest.mark.parametrize("num", [2, 4])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_value_of_a_large_gradient_reaches_the_synced_result(bad, num):
    # 1024 blocks a chunk: where XLA:CPU hands a max reduction to a library, which
    # turns a NaN into a number. The scales received (and, with more than two
    # replicas, the owner's) must stay NaN (or inf), so the step sees the bad block
    # and skips.
    sync, tx = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True), optax.sgd(1.0)

    def loss_fn(params, batch):
        return jnp.sum(params["w"] * batch[0])  # the gradient is the batch

    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, sync=sync, skip_nonfinite=True),
        devices=jax.devices()[:num],
    )
    params = {"w": jnp.zeros((1024, 512))}
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    grads = np.ones((num, 1024, 512), np.float32)
    grads[1, 700, 300] = bad
    state, metrics = step(state, step.shard(grads))
    assert int(metrics["skipped"]) == 1
    np.testing.assert_array_equal(step.unreplicate(state).params["w"], 0.0)
    state, metrics = step(state, step.shard(np.ones((num, 1024, 512), np.float32)))
    assert int(metrics["skipped"]) == 0
    np.testing.assert_allclose(step.unreplicate(state).params["w"], -1.0, rtol=1e-2)


def test_a_wire_compresses_under_loss_scaling_and_skips_with_it():
    # The scaler unscales each replica's gradients; the wire then exchanges
    # them, and the step skips (and backs the scale off) on the synced result.
    from flax.training.dynamic_scale import DynamicScale

    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=sync), devices=jax.devices()[:2]
    )
    params = {"w": jnp.zeros(8), "b": jnp.zeros(3)}
    state = step.replicate(
        jdp.TrainState.create(
            params=params, tx=tx, sync=sync, dynamic_scale=DynamicScale()
        )
    )
    batch = step.shard(jnp.ones((2, 8)))
    kinds = {(c.kind, c.dtype) for c in step.collectives(state, batch)}
    assert ("all-gather", "s8") in kinds
    state, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 0
    before = step.unreplicate(state)
    bad = np.ones((2, 8), np.float32)
    bad[1, 0] = np.inf
    state, metrics = step(state, step.shard(bad))
    after = step.unreplicate(state)
    assert int(metrics["skipped"]) == 1
    assert float(after.dynamic_scale.scale) == float(before.dynamic_scale.scale) / 2
    for a, b in zip(
        jax.tree.leaves((after.params, after.sync_state)),
        jax.tree.leaves((before.params, before.sync_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_a_state_without_the_buffers_is_refused():
    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=sync), devices=jax.devices()[:2]
    )
    params = {"w": jnp.zeros(8), "b": jnp.zeros(3)}
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    with pytest.raises(ValueError, match=r"keeps state of its own.*sync=sync"):
        step(state, step.shard(jnp.ones((2, 8))))


def test_buffers_without_a_piece_that_keeps_them_are_refused():
    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx), devices=jax.devices()[:2]
    )
    params = {"w": jnp.zeros(8), "b": jnp.zeros(3)}
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    with pytest.raises(ValueError, match=r"holds a `sync_state`.*keeps none"):
        step(state, step.shard(jnp.ones((2, 8))))


def test_buffers_for_other_params_are_refused():
    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(linear_loss, tx, sync=sync), devices=jax.devices()[:2]
    )
    params = {"w": jnp.zeros(8), "b": jnp.zeros(3)}
    state = jdp.TrainState.create(params=params, tx=tx, sync=sync)
    state = state.replace(
        sync_state=jdp.wire.WireState((jnp.zeros(256),), jnp.zeros(256))
    )
    with pytest.raises(ValueError, match=r"made for other params.*1 worker buffers"):
        step(step.replicate(state), step.shard(jnp.ones((2, 8))))


def test_create_refuses_a_sync_that_is_not_a_piece():
    with pytest.raises(TypeError, match=r"`sync` must be a `jdp.Sync`.*got str"):
        jdp.TrainState.create(params={"w": jnp.zeros(2)}, tx=optax.sgd(1.0), sync="x")


def test_one_replica_sends_nothing_and_changes_nothing():
    sync = jdp.all_reduce(wire=jdp.wire.int8(), error_feedback=True)
    grads = np.random.default_rng(6).normal(size=(2, 1, 40)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step, state, seen = run(sync, grads, "shard_map", 1)
    np.testing.assert_array_equal(seen[-1]["w"], -grads[:, 0].sum(axis=0))
