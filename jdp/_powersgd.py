"""`jdp.powersgd`: PowerSGD low-rank gradient compression, a sync piece."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _collectives, _replica_parts, _sync, _validate, _wire
from jdp._tree import PyTree, is_float


@_replica_parts.declare(local=("error",), required=("count", "q"))
class PowerSGDState(NamedTuple):
    """State of `jdp.powersgd`: the train state's `sync_state`.

    Attributes:
      count: Steps taken, the plain ones before `start_step` included (int32).
      q: One `(m, r)` factor Q per compressed matrix, the same on every replica.
      error: Each replica's error feedback per compressed leaf; None without
        `error_feedback`.
    """

    count: jax.Array  # int32, shape ()
    q: tuple[jax.Array, ...]
    error: tuple[jax.Array, ...] | None

    #: The checkpoint's warning when `restart_local` zeroed the buffers.
    RESTART_NOTE = _wire.WireState.RESTART_NOTE

    def restart_local(self) -> PowerSGDState:
        """Zero errors, for another replica count; the agreed Q carries over."""
        if self.error is None:
            return self
        return self._replace(error=tuple(np.zeros_like(e) for e in self.error))


class _Options(NamedTuple):
    rank: int
    start_step: int
    min_compression_rate: float
    warm_start: bool
    orthogonalization_epsilon: float
    seed: int
    bucket_bytes: int | None


class _Matrix(NamedTuple):
    """A compressed leaf: its position among the leaves, its `(n, m)` view, rank."""

    index: int
    n: int
    m: int
    rank: int


def _plan(leaves: list[Any], options: _Options) -> list[_Matrix]:
    """Floating leaves of 2-D or more that PyTorch's `_should_compress` takes."""
    plan = []
    for i, x in enumerate(leaves):
        shape = jnp.shape(x)
        if len(shape) < 2 or not is_float(x) or math.prod(shape) == 0:
            continue
        n, m = math.prod(shape[:-1]), shape[-1]
        r = min(n, m, options.rank)
        if (n + m) * r * options.min_compression_rate < n * m:
            plan.append(_Matrix(i, n, m, r))
    return plan


def _draw(seed: int, matrix: _Matrix, dtype: Any, count: Any = None) -> jax.Array:
    """A standard normal `(m, r)` Q from the seed, the leaf and maybe the step."""
    key = jax.random.fold_in(jax.random.key(seed), matrix.index)
    if count is not None:
        key = jax.random.fold_in(key, count)
    return jax.random.normal(key, (matrix.m, matrix.rank), jnp.float32).astype(dtype)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _norm(col: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.real(col * jnp.conj(col))))


#: A column that kept less than this fraction of its norm through Gram-Schmidt is
#: orthogonalised once more: what is left of it is then orthogonal to the others
#: to about float32's epsilon over this fraction (1e-4) at worst. (The usual
#: criterion, 1/sqrt(2), would also reorthogonalise many well-conditioned
#: columns and change their last bits for little gain.)
_REORTHOGONALISE_BELOW = 2.0**-10


def _orthogonalize(p: jax.Array, epsilon: float) -> jax.Array:
    """The columns of `p` made orthonormal by modified Gram-Schmidt, as PyTorch.

    Complex columns are orthonormal in the Hermitian inner product. A column that
    lost nearly all of its norm (one in the span of those before it: P where the
    gradient's rank is below the rank asked for) is orthogonalised twice: once,
    what is left is rounding error, which normalising would turn into a unit
    column far from orthogonal to the others (PyTorch's Gram-Schmidt does; its
    QR does not), and P Pᵀ M would add a spurious term as large as M.
    """
    r = p.shape[1]
    start = [_norm(p[:, i]) for i in range(r)]
    for i in range(r):
        col = p[:, i]
        norm = _norm(col)
        if i:
            prev = p[:, :i]
            again = col - _matmul(prev, _matmul(jnp.conj(prev).T, col))
            twice = norm < _REORTHOGONALISE_BELOW * start[i]
            col = jnp.where(twice, again, col)
            norm = jnp.where(twice, _norm(again), norm)
        if epsilon:
            col = col / (norm + epsilon)
        else:
            col = jnp.where(norm > 0, col / jnp.where(norm > 0, norm, 1), 0)
        p = p.at[:, i].set(col)
        if i + 1 < r:
            rest = p[:, i + 1 :]
            dots = _matmul(jnp.conj(col), rest)
            p = p.at[:, i + 1 :].set(rest - dots[None, :] * col[:, None])
    return p


#: Up to this rank, XLA:CPU computes M^T P one column of P at a time.
_CPU_COLUMNS_UP_TO = 8


def _transposed_matmul(m: jax.Array, p: jax.Array) -> jax.Array:
    """M^H P, `(m, r)`: on XLA:CPU, which contracts a first axis slowly, by column.

    (M^T P for real matrices; for complex ones the conjugate transpose, so that
    `P (M^H P)^H = P P^H M` projects M onto P's columns.)
    """
    r = p.shape[1]
    if jax.default_backend() == "cpu" and r <= _CPU_COLUMNS_UP_TO:
        columns = [_matmul(jnp.conj(p[:, j]), m) for j in range(r)]
        return jnp.conj(jnp.stack(columns, axis=1))
    return _matmul(jnp.conj(m).T, p)


def _check_state(state: Any, leaves: list[Any], plan: list[_Matrix], api: str):
    fix = (
        "Make the state with the same piece and params: `jdp.TrainState.create("
        "params=..., tx=..., sync=piece)`, or `tx.init(params)` for "
        "`jdp.sync_gradients(piece)` in the optimizer."
    )
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"`{api}` needs its own state, a `jdp.PowerSGDState`; got "
            f"{type(state).__name__}. {fix}"
        )
    want = [(mat.m, mat.rank) for mat in plan]
    if (got := [tuple(jnp.shape(q)) for q in state.q]) != want:
        raise ValueError(
            f"`{api}`: the state holds Q factors of shapes {got}, but these "
            f"gradients compress {len(plan)} matrices whose Q have shapes {want} "
            f"(the state was made for other params or another rank). {fix}"
        )
    if state.error is not None:
        shapes = [tuple(jnp.shape(e)) for e in state.error]
        want = [tuple(jnp.shape(leaves[mat.index])) for mat in plan]
        if shapes != want:
            raise ValueError(
                f"`{api}`: the state's error buffers have shapes {shapes}, but the "
                f"compressed gradients have shapes {want}. {fix}"
            )


def _psum_all(arrays: list[jax.Array], axis_name, bucket_bytes) -> list[jax.Array]:
    """Sums over replicas, the arrays packed into one flat buffer per bucket."""
    summed = _collectives.bucketed(
        "psum", arrays, axis_name=axis_name, bucket_bytes=bucket_bytes, flatten=True
    )
    return [s.reshape(a.shape) for s, a in zip(summed, arrays, strict=True)]


def _average(
    grads: PyTree, state: PowerSGDState, options: _Options, axis_name, api: str
) -> tuple[PyTree, PowerSGDState]:
    """The replicas' gradients averaged by PowerSGD (Algorithm 1, PyTorch's order)."""
    num = _collectives.axis_size(axis_name, api)
    seed = options.seed
    leaves, treedef = jax.tree.flatten(grads)
    leaves = [jnp.asarray(x) for x in leaves]
    plan = _plan(leaves, options)
    _check_state(state, leaves, plan, api)
    compressed = {mat.index for mat in plan}
    count = state.count

    def all_reduced(xs):
        return _collectives.all_reduce(
            xs, axis_name=axis_name, bucket_bytes=options.bucket_bytes, api=api
        )

    def plain():
        return all_reduced(leaves), state._replace(count=count + 1)

    def compress():
        rest = [i for i in range(len(leaves)) if i not in compressed]
        out = list(leaves)
        for i, x in zip(rest, all_reduced([leaves[i] for i in rest]), strict=True):
            out[i] = x
        ms = []
        for k, mat in enumerate(plan):
            g = leaves[mat.index]
            if state.error is not None:
                g = g + state.error[k].astype(g.dtype)
            ms.append(g.reshape(mat.n, mat.m))
        qs = [
            q.astype(m.dtype)
            if options.warm_start
            else _draw(seed, mat, m.dtype, count)
            for q, m, mat in zip(state.q, ms, plan, strict=True)
        ]
        eps = options.orthogonalization_epsilon
        qs = [_orthogonalize(q, eps) for q in qs]
        ps = [_matmul(m, q) for m, q in zip(ms, qs, strict=True)]
        # No division: P is orthogonalised next (PyTorch sums it too).
        ps = _psum_all(ps, axis_name, options.bucket_bytes)
        ps = [_orthogonalize(p, eps) for p in ps]
        qs = [_transposed_matmul(m, p) for m, p in zip(ms, ps, strict=True)]
        qs = [q / num for q in _psum_all(qs, axis_name, options.bucket_bytes)]
        approx = [_matmul(p, jnp.conj(q).T) for p, q in zip(ps, qs, strict=True)]
        for mat, a in zip(plan, approx, strict=True):
            g = leaves[mat.index]
            out[mat.index] = a.reshape(g.shape).astype(g.dtype)
        error = None
        if state.error is not None:
            error = tuple(
                (m - a).reshape(old.shape).astype(old.dtype)
                for m, a, old in zip(ms, approx, state.error, strict=True)
            )
        new_q = tuple(q.astype(old.dtype) for q, old in zip(qs, state.q, strict=True))
        return out, PowerSGDState(count=count + 1, q=new_q, error=error)

    if not plan:
        out, new_state = plain()
    elif options.start_step == 0:
        out, new_state = compress()
    else:
        out, new_state = lax.cond(count < options.start_step, plain, compress)
    return jax.tree.unflatten(treedef, out), new_state


def powersgd(
    rank: int = 1,
    *,
    start_step: int = 0,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    seed: int = 0,
    bucket_bytes: int | None = _collectives.DEFAULT_BUCKET_BYTES,
) -> _sync.Sync:
    """PowerSGD: gradients averaged as rank-`rank` factors (PyTorch's `powerSGD_hook`).

    Each floating leaf of two or more axes, viewed as an `(n, m)` matrix,
    travels as factors P (`n x r`) and Q (`m x r`); every replica applies the
    same approximation `P Q^T` of the averaged gradient, with error feedback.
    Other leaves are all-reduced. Vogels et al., NeurIPS 2019
    (https://arxiv.org/abs/1905.13758); see the PowerSGD guide
    (docs/guides/powersgd.md).

    Args:
      rank: The rank r of the factors (an int >= 1).
      start_step: Plain all-reduce steps before compression starts.
      min_compression_rate: Compress a matrix only if `(n + m) * r *
        min_compression_rate < n * m`; 0 compresses every matrix.
      error_feedback: Add each replica's compression error to its next gradient.
      warm_start: Start from the last step's Q, else draw Q every step.
      orthogonalization_epsilon: Added to each column's norm in Gram-Schmidt.
      seed: Seed of the Q draws.
      bucket_bytes: Largest bucket of the all-reduces (25 MiB); None for one
        bucket per dtype.

    Returns:
      A `jdp.Sync` whose state is a `jdp.PowerSGDState`: pass the piece to
      `jdp.TrainState.create(..., sync=piece)` too.

    Raises:
      TypeError: If an argument has the wrong type.
      ValueError: If an argument is out of range; at trace time, if the state
        was made for other params or options.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> tx, sync = optax.sgd(0.1), jdp.powersgd(rank=2)
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=sync),
      ...                        devices=jax.devices()[:4])
      >>> params = {"w": jnp.zeros((64, 32))}
      >>> state = step.replicate(jdp.TrainState.create(params=params, tx=tx, sync=sync))
      >>> batch = step.shard({"x": jnp.ones((8, 64)), "y": jnp.ones((8, 32))})
      >>> ops = step.collectives(state, batch, stage="lowered")
      >>> sorted(op.bytes for op in ops if op.bytes > 4)  # Q: 32 x 2, P: 64 x 2
      [256, 512]
    """
    _validate.positive_int("rank", rank, note="the rank r of P and Q")
    _validate.non_negative_int(
        "start_step", start_step, note="plain all-reduce steps first"
    )
    note = "compress a matrix only if (n + m) * r * rate < n * m"
    rate = _validate.finite_number(
        "min_compression_rate", min_compression_rate, at_least=0, note=note
    )
    _validate.boolean("error_feedback", error_feedback)
    _validate.boolean("warm_start", warm_start)
    eps = _validate.finite_number(
        "orthogonalization_epsilon", orthogonalization_epsilon, at_least=0
    )
    options = _Options(rank, start_step, rate, warm_start, eps, seed, bucket_bytes)
    _validate.checked("seed", seed, "an int", _validate.is_int(seed), lambda v: True)
    _collectives.check_bucket_bytes(bucket_bytes)
    api = "jdp.powersgd"

    def init(params):
        leaves = jax.tree.leaves(params)
        plan = _plan(leaves, options)
        q = tuple(_draw(seed, mat, jnp.result_type(leaves[mat.index])) for mat in plan)
        error = None
        if error_feedback:
            error = tuple(jnp.zeros_like(leaves[mat.index]) for mat in plan)
        return PowerSGDState(count=jnp.zeros((), jnp.int32), q=q, error=error)

    def update(grads, state, params, axis_name):
        del params
        return (*_average(grads, state, options, axis_name, api), {})

    return _sync.Sync(init, update)
