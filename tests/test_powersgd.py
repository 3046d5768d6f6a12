"""`jdp.powersgd`: PowerSGD gradient compression (a piece, and in the optimizer
through `jdp.sync_gradients`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import dynamic_scale as dynamic_scale_lib

import jdp
from jdp import PowerSGDState, powersgd
from jdp.checkpoint import CheckpointManager

LR = 0.1


def loss_fn(params, batch):
    """A small MLP whose first kernel is 3-D (viewed as a (16, 32) matrix)."""
    w0 = params["w0"].reshape(16, 32)
    h = jnp.tanh(batch["x"] @ w0 + params["b0"])
    return jnp.mean((h @ params["w1"] + params["b1"] - batch["y"]) ** 2)


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "b0": jnp.zeros(32),
        "b1": jnp.zeros(8),
        "w0": jnp.asarray(rng.normal(size=(4, 4, 32)) / 4, jnp.float32),
        "w1": jnp.asarray(rng.normal(size=(32, 8)) / 6, jnp.float32),
    }


#: Leaf name -> position among the leaves (dict keys are sorted) and (n, m) view.
COMPRESSED = {"w0": (2, (16, 32)), "w1": (3, (32, 8))}


def make_batches(num_steps, batch_size=32, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch_size, 16)).astype(np.float32),
            "y": rng.normal(size=(batch_size, 8)).astype(np.float32),
        }
        for _ in range(num_steps)
    ]


def make_step(
    sync, num=4, backend="shard_map", tx=None, skip_nonfinite=False, **kwargs
):
    tx = optax.sgd(LR) if tx is None else tx
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, sync=sync, skip_nonfinite=skip_nonfinite),
        devices=jax.devices()[:num],
        backend=backend,
        **kwargs,
    )
    return step, tx


def run(step, state, batches):
    for batch in batches:
        state, _ = step(state, step.shard(batch))
    return state


# -- the NumPy reference, written from the paper ------------------------------------


def np_orthogonalize(p, eps=0.0):
    """Modified Gram-Schmidt over the columns, PyTorch's zero-column rule."""
    p = np.array(p, np.float64)
    for i in range(p.shape[1]):
        norm = np.linalg.norm(p[:, i])
        if eps:
            p[:, i] /= norm + eps
        elif norm > 0:
            p[:, i] /= norm
        p[:, i + 1 :] -= np.outer(p[:, i], p[:, i] @ p[:, i + 1 :])
    return p


def replica_grads(params, batch, num):
    """Each replica's gradient of its slice of the batch (float64 NumPy)."""
    grad = jax.jit(jax.grad(loss_fn))
    size = len(batch["x"]) // num
    params32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    out = []
    for i in range(num):
        part = {k: v[i * size : (i + 1) * size] for k, v in batch.items()}
        out.append(
            jax.tree.map(lambda g: np.asarray(g, np.float64), grad(params32, part))
        )
    return out


def reference(params, qs, batches, num, *, rank, error_feedback=True, draw=None):
    """PowerSGD by the paper (Algorithm 1 with error feedback), then SGD.

    `qs`: the initial Q of each compressed leaf; `draw(name, count)`, if given,
    gives a fresh Q every step instead (no warm start). Returns the params, the
    last Q and each replica's errors.
    """
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    qs = {k: np.asarray(v, np.float64) for k, v in qs.items()}
    errors = [{k: np.zeros(params[k].shape) for k in COMPRESSED} for _ in range(num)]
    for count, batch in enumerate(batches):
        grads = replica_grads(params, batch, num)
        for name in params:
            if name not in COMPRESSED:
                avg = np.mean([g[name] for g in grads], axis=0)
            else:
                n, m = COMPRESSED[name][1]
                ms = [
                    (g[name] + (e[name] if error_feedback else 0)).reshape(n, m)
                    for g, e in zip(grads, errors, strict=True)
                ]
                q = qs[name] if draw is None else draw(name, count)
                q = np_orthogonalize(q)
                p = np_orthogonalize(sum(mi @ q for mi in ms))
                q = sum(mi.T @ p for mi in ms) / num
                approx = p @ q.T
                for e, mi in zip(errors, ms, strict=True):
                    e[name] = (mi - approx).reshape(params[name].shape)
                qs[name] = q
                avg = approx.reshape(params[name].shape)
            params[name] = params[name] - LR * avg
    return params, qs, errors


def initial_qs(state):
    return {
        name: np.asarray(q)
        for name, q in zip(COMPRESSED, state.sync_state.q, strict=True)
    }


def assert_close(actual, expected, rtol=2e-4, atol=2e-6):
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=atol)


def check_against_reference(step, sync, num, batches, *, rank, **ref_options):
    init = jdp.TrainState.create(params=init_params(), tx=step_tx(), sync=sync)
    state = run(step, step.replicate(init), batches)
    params, qs, errors = reference(
        init.params, initial_qs(init), batches, num, rank=rank, **ref_options
    )
    one = step.unreplicate(state)
    for name in params:
        assert_close(one.params[name], params[name])
    for k, name in enumerate(COMPRESSED):
        assert_close(one.sync_state.q[k], qs[name])
        if ref_options.get("error_feedback", True):
            every = np.asarray(state.sync_state.error[k])  # (num, *shape)
            for i in range(num):
                assert_close(every[i], errors[i][name], atol=1e-5)
    assert int(one.sync_state.count) == len(batches)
    return state


def step_tx():
    return optax.sgd(LR)


# -- numerics -------------------------------------------------------------------------


@pytest.mark.parametrize("num", [4, 8])
def test_one_step_matches_the_papers_algorithm(backend, num):
    sync = powersgd(rank=2)
    step, _ = make_step(sync, num, backend)
    check_against_reference(step, sync, num, make_batches(1), rank=2)


@pytest.mark.parametrize(
    ("warm_start", "error_feedback"), [(True, True), (False, True), (True, False)]
)
def test_three_steps_match_the_reference(warm_start, error_feedback):
    sync = powersgd(
        rank=2, warm_start=warm_start, error_feedback=error_feedback, seed=5
    )
    step, _ = make_step(sync, 4)
    draw = None
    if not warm_start:  # the documented draw: fold_in(fold_in(key(seed), leaf), count)

        def draw(name, count):
            index, (_, m) = COMPRESSED[name]
            key = jax.random.fold_in(
                jax.random.fold_in(jax.random.key(5), index), count
            )
            return np.asarray(jax.random.normal(key, (m, 2)))

    state = check_against_reference(
        step,
        sync,
        4,
        make_batches(3),
        rank=2,
        error_feedback=error_feedback,
        draw=draw,
    )
    assert (state.sync_state.error is None) == (not error_feedback)


def test_warm_start_on_pmap_matches_the_reference():
    sync = powersgd(rank=1)
    step, _ = make_step(sync, 4, "pmap")
    check_against_reference(step, sync, 4, make_batches(3), rank=1)


def test_initial_q_is_a_fixed_draw_per_leaf():
    params = init_params()
    state = jdp.TrainState.create(params=params, tx=step_tx(), sync=powersgd(3, seed=7))
    for k, (index, (_, m)) in enumerate(COMPRESSED.values()):
        key = jax.random.fold_in(jax.random.key(7), index)
        want = jax.random.normal(key, (m, 3))
        np.testing.assert_array_equal(state.sync_state.q[k], want)
    other = jdp.TrainState.create(params=params, tx=step_tx(), sync=powersgd(3, seed=8))
    assert not np.array_equal(state.sync_state.q[0], other.sync_state.q[0])
    assert [e.shape for e in state.sync_state.error] == [(4, 4, 32), (32, 8)]
    assert not any(np.any(e) for e in state.sync_state.error)


def np_orthogonalize_hermitian(p):
    """Modified Gram-Schmidt in the Hermitian inner product (complex columns)."""
    p = np.array(p, np.complex128)
    for i in range(p.shape[1]):
        p[:, i] /= np.linalg.norm(p[:, i])
        p[:, i + 1 :] -= np.outer(p[:, i], p[:, i].conj() @ p[:, i + 1 :])
    return p


def test_complex_matrices_are_compressed_with_conjugate_transposes():
    """One step on complex gradients is the paper's algorithm with M^H for M^T:
    the average is P P^H M, a projection, so no replica's error outgrows its
    gradient. (With plain transposes it was an oblique projection.)"""
    num, shape = 4, (12, 10)
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(num, *shape)) + 1j * rng.normal(size=(num, *shape))
    tx = jdp.sync_gradients(powersgd(rank=2, min_compression_rate=0))
    params = {"w": jnp.zeros(shape, jnp.complex64)}

    def step_fn(state, batch):
        updates, opt = tx.update({"w": batch[0]}, state["opt"], params)
        return {"opt": opt, "avg": updates["w"]}, {}

    step = jdp.parallelize(step_fn, devices=jax.devices()[:num])
    init = {"opt": tx.init(params), "avg": params["w"]}
    state, _ = step(step.replicate(init), step.shard(grads.astype(np.complex64)))
    q = np_orthogonalize_hermitian(init["opt"].q[0])
    p = np_orthogonalize_hermitian(sum(g @ q for g in grads))
    q = sum(g.conj().T @ p for g in grads) / num
    want = p @ q.conj().T
    np.testing.assert_allclose(step.unreplicate(state)["avg"], want, atol=1e-4)
    errors = np.asarray(state["opt"].error[0])  # (num, *shape)
    for g, e in zip(grads, errors, strict=True):
        np.testing.assert_allclose(e, g - want, atol=1e-4)
    mean = grads.mean(0)
    assert np.linalg.norm(mean - want) < np.linalg.norm(mean)


def test_rank_is_capped_by_the_matrix():
    params = {"w": jnp.ones((3, 40))}
    sync = powersgd(rank=8, min_compression_rate=0)
    state = jdp.TrainState.create(params=params, tx=step_tx(), sync=sync)
    assert state.sync_state.q[0].shape == (40, 3)


@pytest.mark.parametrize("rank", [4, 6, 8])
def test_a_rank_at_or_above_the_gradients_rank_is_exact(rank):
    """One example per replica of 4 gives a rank-4 (32, 8) gradient: at rank 6 or
    8 Gram-Schmidt normalised the rounding error left of P's extra columns into
    columns far from orthogonal, and P Pᵀ M missed M by half its norm."""
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(32, 8)) / 6, jnp.float32)}
    batch = {
        "x": rng.normal(size=(4, 32)).astype(np.float32),
        "y": rng.normal(size=(4, 8)).astype(np.float32),
    }

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    sync = powersgd(rank=rank, min_compression_rate=0, error_feedback=False)
    tx = optax.sgd(1.0)
    step = jdp.parallelize(
        jdp.make_train_step(loss, tx, sync=sync), devices=jax.devices()[:4]
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    state, _ = step(state, step.shard(batch))
    applied = params["w"] - step.unreplicate(state).params["w"]
    exact = jax.grad(loss)(params, batch)["w"]
    assert np.linalg.matrix_rank(np.asarray(exact)) == 4
    gap = float(jnp.linalg.norm(applied - exact) / jnp.linalg.norm(exact))
    assert gap < 1e-4, gap


def test_start_step_runs_the_plain_all_reduce_first():
    batches = make_batches(3)
    sync = powersgd(rank=1, start_step=2)
    step, tx = make_step(sync)
    plain, _ = make_step(jdp.all_reduce())
    init = jdp.TrainState.create(params=init_params(), tx=tx, sync=sync)
    state = run(step, step.replicate(init), batches[:2])
    expected = run(plain, plain.replicate(init.replace(sync_state=None)), batches[:2])
    one = step.unreplicate(state)
    for name, value in step.unreplicate(expected).params.items():
        np.testing.assert_allclose(one.params[name], value, rtol=1e-6, atol=1e-7)
    assert int(one.sync_state.count) == 2
    assert not any(np.any(e) for e in one.sync_state.error)  # no error yet
    for q, q0 in zip(one.sync_state.q, init.sync_state.q, strict=True):
        np.testing.assert_array_equal(q, q0)
    # The third step compresses: not the plain average any more.
    state = run(step, state, batches[2:])
    expected = run(plain, expected, batches[2:])
    w = step.unreplicate(state).params["w1"]
    assert not np.allclose(w, step.unreplicate(expected).params["w1"], atol=1e-6)
    assert any(np.any(e) for e in step.unreplicate(state).sync_state.error)
    # One program: both the plain and the compressed all-reduces, in a conditional.
    ops = step.collectives(state, step.shard(batches[0]), stage="lowered")
    assert all(c.in_conditional for c in ops if c.bytes > 4)


# -- what travels ---------------------------------------------------------------------


def reduced_bytes(step, state, batch, stage="lowered"):
    ops = step.collectives(state, step.shard(batch), stage=stage)
    return sorted(c.bytes for c in ops if c.kind == "all-reduce")


def test_vectors_and_small_matrices_go_through_the_plain_all_reduce():
    params = {"b": jnp.zeros(56), "small": jnp.zeros((4, 3)), "w": jnp.zeros((64, 48))}

    def loss(params, batch):
        h = batch["x"] @ params["w"] + params["small"].sum() + params["b"][:48]
        return jnp.mean(h**2)

    sync = powersgd(rank=1)  # small: (4 + 3) * 1 * 2 >= 12, stays plain
    tx = step_tx()
    step = jdp.parallelize(
        jdp.make_train_step(loss, tx, sync=sync), devices=jax.devices()[:4]
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    batch = {"x": jnp.ones((8, 64))}
    sizes = [b for b in reduced_bytes(step, state, batch) if b > 4]  # not the loss
    # P (64 x 1) and Q (48 x 1), and the plain all-reduce of the vector and the
    # small matrix (one `psum`, lowered as one all-reduce per leaf).
    assert sizes == sorted([64 * 4, 48 * 4, 56 * 4, 12 * 4])


def test_a_2048_matrix_at_rank_4_sends_under_a_fiftieth():
    params = {
        "w0": jnp.zeros((64, 2048)),
        "b0": jnp.zeros(2048),
        "w1": jnp.zeros((2048, 2048)),
        "b1": jnp.zeros(2048),
        "w2": jnp.zeros((2048, 8)),
    }

    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["w0"] + params["b0"])
        h = jnp.tanh(h @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"]) ** 2)

    batch = {"x": jnp.ones((8, 64))}
    tx = step_tx()
    totals = {}
    for name, sync in [("plain", jdp.all_reduce()), ("powersgd", powersgd(rank=4))]:
        step = jdp.parallelize(
            jdp.make_train_step(loss, tx, sync=sync), devices=jax.devices()[:2]
        )
        init = jdp.TrainState.create(params=params, tx=tx, sync=sync)
        totals[name] = sum(reduced_bytes(step, step.replicate(init), batch, "compiled"))
    assert totals["plain"] >= 4 * (64 * 2048 + 2048 * 2048)
    assert totals["powersgd"] * 50 <= totals["plain"], totals


# -- replicas: what differs, what agrees, checkpoints --------------------------------


def test_errors_differ_between_replicas_and_q_agrees():
    sync = powersgd(rank=1)
    step, tx = make_step(sync, check_sync=1)  # the guard runs every call
    init = jdp.TrainState.create(params=init_params(), tx=tx, sync=sync)
    state = run(step, step.replicate(init), make_batches(2))
    assert not jdp.replicas_in_sync(state.sync_state.error)
    assert jdp.replicas_in_sync(state.sync_state.q)
    assert jdp.replicas_in_sync(state.params)
    assert jdp.replicas_in_sync(state.opt_state)
    must_agree = jdp.make_train_step(loss_fn, tx, sync=sync).must_agree
    kept = must_agree(state)
    assert kept.sync_state.error is None
    jax.tree.map(np.testing.assert_array_equal, kept.sync_state.q, state.sync_state.q)
    jax.tree.map(np.testing.assert_array_equal, kept.params, state.params)
    assert isinstance(kept.sync_state, PowerSGDState)


def test_checkpoint_mid_run_resumes_bit_identically(tmp_path):
    sync = powersgd(rank=2)
    step, tx = make_step(sync)
    init = jdp.TrainState.create(params=init_params(), tx=tx, sync=sync)
    batches = make_batches(4)
    state = run(step, step.replicate(init), batches[:2])
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state, parallel=step)
        meta = manager.metadata()
        straight = run(step, state, batches[2:])
        restored = manager.restore(step.replicate(init))
    per_replica = [r["path"] for r in meta["leaves"] if r.get("per_replica")]
    assert per_replica == [".sync_state.error[0]", ".sync_state.error[1]"]
    resumed = run(step, restored, batches[2:])
    for a, b in zip(
        jax.tree.leaves(jax.device_get(resumed)),
        jax.tree.leaves(jax.device_get(straight)),
        strict=True,
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_restore_into_another_replica_count_restarts_the_errors(tmp_path):
    sync = powersgd(rank=2)
    step, tx = make_step(sync, 4)
    init = jdp.TrainState.create(params=init_params(), tx=tx, sync=sync)
    state = run(step, step.replicate(init), make_batches(2))
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state, parallel=step)
        other, _ = make_step(sync, 2)
        with pytest.warns(
            RuntimeWarning, match=r"(?s)sync_state\.error\[0\].*start again from zero"
        ):
            restored = manager.restore(other.replicate(init))
    one = other.unreplicate(restored)
    assert not any(np.any(e) for e in jax.device_get(restored.sync_state.error))
    saved = step.unreplicate(state)
    for a, b in zip(one.sync_state.q, saved.sync_state.q, strict=True):
        np.testing.assert_array_equal(a, b)  # Q agreed: it carries over
    run(other, restored, make_batches(1))  # and training goes on


# -- the optax transform --------------------------------------------------------------


def test_the_transform_equals_the_sync_piece():
    batches = make_batches(3)
    sync = powersgd(rank=2, start_step=1)
    step, tx = make_step(sync)
    init = jdp.TrainState.create(params=init_params(), tx=tx, sync=sync)
    piece = step.unreplicate(run(step, step.replicate(init), batches))

    chained = optax.chain(
        jdp.sync_gradients(powersgd(rank=2, start_step=1)), optax.sgd(LR)
    )
    local, _ = make_step(jdp.local(), tx=chained)
    start = jdp.TrainState.create(params=init_params(), tx=chained)
    alone = local.unreplicate(run(local, local.replicate(start), batches))
    for name, value in piece.params.items():
        np.testing.assert_allclose(alone.params[name], value, rtol=1e-6, atol=1e-7)
    for a, b in zip(
        jax.tree.leaves(alone.opt_state[0]),
        jax.tree.leaves(piece.sync_state),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_transform_issues_no_collective_when_told_not_to():
    tx = jdp.sync_gradients(powersgd(rank=1))
    params = init_params()
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    # Outside any step: it would need the replica axis if it communicated.
    updates, same = tx.update(grads, state, params, jdp_collectives=False)
    assert updates is grads and same is state
    with pytest.raises(RuntimeError, match="not bound here"):
        tx.update(grads, state, params)


# -- training, edge cases -------------------------------------------------------------


def test_training_converges_on_a_toy_regression():
    """Loss falls, and at rank 2 about as fast as with the exact average."""
    rng = np.random.default_rng(3)
    true_w = rng.normal(size=(32, 16)) @ rng.normal(size=(16, 24)) / 8
    xs = rng.normal(size=(64, 32)).astype(np.float32)
    batch = {"x": xs, "y": (xs @ true_w).astype(np.float32)}

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    tx = optax.sgd(0.1)
    params = {"w": jnp.zeros((32, 24)), "b": jnp.zeros(24)}
    losses = {}
    for name, sync in [("exact", jdp.all_reduce()), ("powersgd", powersgd(rank=2))]:
        step = jdp.parallelize(jdp.make_train_step(loss, tx, sync=sync))
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
        losses[name] = []
        for _ in range(60):
            state, metrics = step(state, step.shard(batch))
            losses[name].append(float(metrics["loss"]))
    compressed, exact = losses["powersgd"], losses["exact"]
    assert compressed[-1] < 0.4 * compressed[0], compressed
    assert compressed[-1] < 1.1 * exact[-1], (compressed[-1], exact[-1])


def test_a_2d_host_mesh_and_16_bit_leaves_train():
    """The factors of a bfloat16 leaf stay bfloat16; a host-mesh axis works."""
    params = {**init_params(), "w1": init_params()["w1"].astype(jnp.bfloat16)}

    def loss(params, batch):
        return loss_fn({**params, "w1": params["w1"].astype(jnp.float32)}, batch)

    sync, tx = powersgd(rank=2), step_tx()
    init = jdp.TrainState.create(params=params, tx=tx, sync=sync)
    finals = []
    for axis_name in ["data", ("host", "device")]:
        step = jdp.parallelize(
            jdp.make_train_step(loss, tx, sync=sync),
            axis_name=axis_name,
            devices=jax.devices()[:4],
        )
        state = run(step, step.replicate(init), make_batches(2))
        finals.append(step.unreplicate(state))
    one = finals[0]
    assert one.sync_state.q[1].dtype == one.sync_state.error[1].dtype == jnp.bfloat16
    assert one.params["w1"].dtype == jnp.bfloat16
    assert np.any(np.asarray(one.params["w1"] != params["w1"]))
    for a, b in zip(
        jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1]), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_zero_gradients_stay_finite():
    params = {"w": jnp.ones((16, 16)), "unused": jnp.ones((16, 16))}

    def loss(params, batch):
        return jnp.mean((batch @ params["w"]) ** 2)

    sync, tx = powersgd(rank=2), step_tx()
    step = jdp.parallelize(
        jdp.make_train_step(loss, tx, sync=sync), devices=jax.devices()[:2]
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
    state, _ = step(state, step.shard(jnp.ones((4, 16))))
    one = step.unreplicate(state)
    np.testing.assert_array_equal(one.params["unused"], params["unused"])
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(one))


def test_skip_nonfinite_keeps_everything():
    sync = powersgd(rank=1)
    step, tx = make_step(sync, skip_nonfinite=True)
    init = jdp.TrainState.create(params=init_params(), tx=tx, sync=sync)
    state = run(step, step.replicate(init), make_batches(1))
    before = step.unreplicate(state)
    bad = make_batches(1, seed=9)[0]
    bad["x"][3, 0] = np.nan
    state, metrics = step(state, step.shard(bad))
    assert int(metrics["skipped"]) == 1
    after = step.unreplicate(state)
    assert int(after.skipped_steps) == 1
    for a, b in zip(
        jax.tree.leaves((after.params, after.sync_state)),
        jax.tree.leaves((before.params, before.sync_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rank": 0}, ValueError, r"`rank` must be an int >= 1 .*got 0"),
        ({"rank": 2.0}, TypeError, r"`rank` must be an int >= 1"),
        ({"start_step": -1}, ValueError, r"`start_step` must be an int >= 0"),
        (
            {"min_compression_rate": -1.0},
            ValueError,
            r"`min_compression_rate` must be a finite number >= 0",
        ),
        (
            {"min_compression_rate": float("nan")},
            ValueError,
            r"`min_compression_rate`",
        ),
        ({"error_feedback": 1}, TypeError, r"`error_feedback` must be True or False"),
        ({"warm_start": "yes"}, TypeError, r"`warm_start` must be True or False"),
        (
            {"orthogonalization_epsilon": -1e-8},
            ValueError,
            r"`orthogonalization_epsilon` must be a finite number >= 0",
        ),
        ({"seed": "0"}, TypeError, r"`seed` must be an int"),
        ({"bucket_bytes": 0}, ValueError, r"`bucket_bytes` must be an int >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        powersgd(**kwargs)


def test_a_state_made_for_another_rank_is_refused():
    step, tx = make_step(powersgd(rank=2))
    init = jdp.TrainState.create(params=init_params(), tx=tx, sync=powersgd(rank=1))
    with pytest.raises(
        ValueError, match=r"Q factors of shapes \[\(32, 1\), \(8, 1\)\]"
    ):
        step(step.replicate(init), step.shard(make_batches(1)[0]))


def test_a_state_made_without_the_piece_is_refused():
    step, tx = make_step(powersgd(rank=2))
    init = jdp.TrainState.create(params=init_params(), tx=tx)
    with pytest.raises(ValueError, match=r"sync=sync"):
        step(step.replicate(init), step.shard(make_batches(1)[0]))


def test_a_foreign_sync_state_is_refused():
    sync = powersgd(rank=2)
    step, tx = make_step(sync)
    init = jdp.TrainState.create(params=init_params(), tx=tx, sync=sync)
    init = init.replace(sync_state={"count": jnp.zeros((), jnp.int32)})
    with pytest.raises(
        TypeError,
        match=r"`sync_state` was made by another sync piece: it holds a dict, where "
        r"this step's piece keeps a PowerSGDState",
    ):
        step(step.replicate(init), step.shard(make_batches(1)[0]))


def test_a_powersgd_state_under_an_error_feedback_step_names_both():
    params = init_params()
    tx = optax.sgd(0.1)
    init = jdp.TrainState.create(params=params, tx=tx, sync=powersgd(rank=2))
    sync = jdp.all_reduce(wire=jdp.wire.bf16(), error_feedback=True)
    step = jdp.parallelize(
        jdp.make_train_step(loss_fn, tx, sync=sync), devices=jax.devices()[:2]
    )
    with pytest.raises(
        TypeError,
        match=r"the state's `sync_state` was made by another sync piece: it holds a "
        r"PowerSGDState, where this step's piece keeps a WireState\. Create the "
        r"state with the same piece as the step: `jdp\.TrainState\.create\(params="
        r"\.\.\., tx=\.\.\., sync=sync\)`",
    ):
        step(step.replicate(init), step.shard(make_batches(1)[0]))


def test_loss_scaling_compresses_the_unscaled_gradients():
    # A power-of-two scale unscales exactly: the same bits as without it.
    sync = powersgd(rank=2)
    step, tx = make_step(sync)
    batches = make_batches(2)
    plain = jdp.TrainState.create(params=init_params(), tx=tx, sync=sync)
    plain = step.unreplicate(run(step, step.replicate(plain), batches))
    init = jdp.TrainState.create(
        params=init_params(),
        tx=tx,
        sync=sync,
        dynamic_scale=dynamic_scale_lib.DynamicScale(),
    )
    state = step.replicate(init)
    for b in batches:
        state, metrics = step(state, step.shard(b))
        assert int(metrics["skipped"]) == 0
    scaled = step.unreplicate(state)
    for a, b in zip(
        jax.tree.leaves((scaled.params, scaled.sync_state)),
        jax.tree.leaves((plain.params, plain.sync_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
