"""Shared oracles and models for the tests."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp import _hlo


def assert_trees_close(actual, expected, *, rtol=1e-5, atol=1e-6):
    """Same structure, then every leaf close; the message names the leaf path."""
    a_def = jax.tree_util.tree_structure(actual)
    e_def = jax.tree_util.tree_structure(expected)
    assert a_def == e_def, f"tree structures differ:\n{a_def}\n{e_def}"
    for (path, a), (_, e) in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0],
        jax.tree_util.tree_flatten_with_path(expected)[0],
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(a),
            np.asarray(e),
            rtol=rtol,
            atol=atol,
            err_msg=f"leaf {jax.tree_util.keystr(path)}",
        )


def init_mlp(key, sizes=(8, 16, 16, 4)):
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, sub = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": jax.random.normal(sub, (m, n)) / np.sqrt(m),
            "b": jnp.zeros(n),
        }
    return params


def mlp_apply(params, x):
    n = len(params)
    for i in range(n):
        layer = params[f"layer{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n - 1:
            x = jnp.tanh(x)
    return x


def mlp_loss(params, batch):
    pred = mlp_apply(params, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)


def make_batches(num_steps, batch_size, *, in_dim=8, out_dim=4, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch_size, in_dim)).astype(np.float32),
            "y": rng.normal(size=(batch_size, out_dim)).astype(np.float32),
        }
        for _ in range(num_steps)
    ]


def single_device_train(loss_fn, params, tx, batches):
    """The oracle: plain `jax.jit` + optax on the whole global batch."""

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    return params, opt_state


class CompileCounter:
    """Counts XLA backend compilations while active (jax.monitoring events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self._active = False

    def _listener(self, event, duration, **kwargs):
        if self._active and event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        self._active = True
        return self

    def __exit__(self, *exc):
        self._active = False


def run_steps(step, state, batches):
    """Runs a parallel `step` over global `batches`; the state and each loss."""
    losses = []
    for batch in batches:
        state, metrics = step(state, step.shard(batch))
        losses.append(float(metrics["loss"]))
    return state, losses


def params_history(step, state, batches):
    """Runs a parallel `step` over global `batches`; the state and each step's
    params (on the host)."""
    history = []
    for batch in batches:
        state, _ = step(state, step.shard(batch))
        history.append(jax.device_get(state.params))
    return state, history


# -- a linear model whose gradients NumPy can compute -------------------------------


def linear_params(in_dim, out_dim, seed=0):
    """`{"w": (in_dim, out_dim), "b": (out_dim,)}`, normal float32."""
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(in_dim, out_dim)).astype(np.float32),
        "b": rng.normal(size=(out_dim,)).astype(np.float32),
    }


def linear_loss(params, batch):
    """Mean squared error of `x @ w + b` against `y`."""
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


def linear_grads(params, x, y):
    """`linear_loss`'s gradients in NumPy: the reference's own derivation."""
    err = x @ params["w"] + params["b"] - y
    scale = 2.0 / err.size
    return {"w": scale * x.T @ err, "b": scale * err.sum(axis=0)}


def noise_batches(steps, rows, in_dim, out_dim, seed=1):
    """`steps` batches of `rows` normal inputs and normal targets (no signal)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(rows, in_dim)).astype(np.float32),
            "y": rng.normal(size=(rows, out_dim)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def teacher_batches(num_steps, batch_size, in_dim, out_dim, seed=1):
    """Batches of a fixed random linear teacher plus noise 0.3 (float32)."""
    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=(in_dim, out_dim))
    out = []
    for _ in range(num_steps):
        x = rng.normal(size=(batch_size, in_dim))
        y = x @ w_true + 0.3 * rng.normal(size=(batch_size, out_dim))
        out.append({"x": x.astype(np.float32), "y": y.astype(np.float32)})
    return out


def entry_instructions(hlo_text):
    """`{name: (opcode, element counts of its results, operand names)}` of ENTRY."""
    comps, entry = _hlo._parse_computations(hlo_text)
    out = {}
    for line in comps[entry]:
        m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$", line)
        if not m:
            continue
        typ, rest = _hlo._split_type(m.group(2))
        opcode = rest.split("(", 1)[0].strip()
        counts = [
            int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            for _, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]", typ)
        ]
        out[m.group(1)] = (opcode, counts, re.findall(r"%([\w.\-]+)", rest))
    for name, (opcode, counts, operands) in out.items():  # drop computations' names
        out[name] = (opcode, counts, [o for o in operands if o in out])
    return out


def ancestors(instrs, name):
    """Every instruction `name` depends on, through operands (and control edges)."""
    seen, todo = set(), list(instrs[name][2])
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(instrs[n][2])
    return seen
