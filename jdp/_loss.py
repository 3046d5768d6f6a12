"""How a train step calls its loss and differentiates it.

The loss's parameters (batch statistics, `rng`, `step`), microbatches (a
`lax.scan`), sparse row gradients, `jdp.weighted` losses and the loss reported
over the kept replicas, and loss scaling with flax's `DynamicScale`.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from jdp import _collectives, _metrics, _sync
from jdp._tree import format_problems, is_float, keystr
from jdp.sparse._lookup import IndexedRows

PyTree = Any


#: Parameters a `loss_fn` may declare by name to receive them from the step.
LOSS_KEYWORDS = ("rng", "step")


def loss_keywords(loss_fn: Callable[..., Any]) -> tuple[str, ...]:
    """The `LOSS_KEYWORDS` `loss_fn` declares (it was read before, so it can be)."""
    params = inspect.signature(loss_fn).parameters
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(k for k in LOSS_KEYWORDS if k in params and params[k].kind in keyword)


def takes_batch_stats(loss_fn: Callable[..., Any]) -> bool:
    """Whether `loss_fn` is `(params, batch_stats, batch)` (else `(params, batch)`).

    Read from its required positional parameters: two or three, not counting
    the `LOSS_KEYWORDS` it declares (`rng`, `step`).
    """
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError) as e:
        raise TypeError(
            "`jdp.make_train_step` reads `loss_fn`'s parameters to tell "
            "`loss_fn(params, batch)` from `loss_fn(params, batch_stats, batch)`, "
            f"but cannot read them from {loss_fn!r} ({e}). Wrap it in a `def` "
            "with those parameters."
        ) from e
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = signature.parameters.values()
    required = [
        p
        for p in params
        if p.kind in kinds and p.default is p.empty and p.name not in LOSS_KEYWORDS
    ]
    var = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    if len(required) in (2, 3) and not (var and len(required) < 3):
        return len(required) == 3
    raise TypeError(
        "`jdp.make_train_step` needs `loss_fn(params, batch)` or, for a state "
        "with batch statistics, `loss_fn(params, batch_stats, batch)`; got a "
        f"`loss_fn{signature}` with {len(required)} required positional "
        "parameter(s)" + (" and *args" if var else "") + ". Wrap it in a `def` "
        "with those parameters." + _rng_hint(signature)
    )


def _rng_hint(signature: inspect.Signature, always: bool = False) -> str:
    """A sentence for a loss whose PRNG key parameter is not named `rng`.

    flax's examples call it `dropout_rng`; jdp passes a key only to `rng`, and
    takes any other parameter for the batch statistics or the batch.
    """
    keys = [
        name
        for name in signature.parameters
        if name not in LOSS_KEYWORDS
        and any(word in name.lower() for word in ("rng", "key", "seed"))
    ]
    if keys:
        return (
            f" If `{keys[0]}` is a PRNG key (for dropout), name it `rng`: the step "
            "hands this replica's key only to a parameter named `rng` (drawn from "
            "the state's `rng`, `jdp.TrainState.create(..., rng=key)`), and takes "
            "any other parameter for the batch statistics or the batch."
        )
    if always:
        return (
            " (A parameter that receives a PRNG key must be named `rng`; any other "
            "is taken for the batch statistics or the batch.)"
        )
    return ""


def check_batch_stats(
    state: PyTree, takes_stats: bool, api: str, loss_fn: Callable[..., Any]
) -> None:
    """`loss_fn`'s parameters and the state's `batch_stats` must go together."""
    has_stats = getattr(state, "batch_stats", None) is not None
    if takes_stats and not has_stats:
        signature = inspect.signature(loss_fn)  # read before, so it can be
        raise ValueError(
            f"`{api}`: `loss_fn{signature}` takes three parameters, read as "
            "`(params, batch_stats, batch)`, but the state has no `batch_stats` "
            "(None). Pass `jdp.TrainState.create(..., batch_stats=...)`, or write "
            "`loss_fn(params, batch)`." + _rng_hint(signature, always=True)
        )
    if has_stats and not takes_stats:
        raise ValueError(
            f"`{api}`: the state has `batch_stats`, but `loss_fn` takes two "
            "parameters, `(params, batch)`, so they would never be updated. Write "
            "`loss_fn(params, batch_stats, batch) -> (loss, new_batch_stats)`, or "
            "create the state without `batch_stats`."
        )


# -- gradients ------------------------------------------------------------------


class Gradients(NamedTuple):
    """One replica's loss, gradients and what came with them."""

    loss: jax.Array  # the loss, or a `jdp.weighted` loss's total
    weight: jax.Array | None  # a `jdp.weighted` loss's weight, else None
    aux: PyTree
    new_stats: PyTree
    grads: PyTree


def loss_kwargs(state, keywords, axis_name, api) -> Callable[[Any], dict]:
    """`part -> {keyword: value}` for the `LOSS_KEYWORDS` the loss declares.

    `step` is the state's step counter; `rng` this replica's key for this step
    (and microbatch `part`, unless None): `fold_in` of the state's `rng` with
    the step, the part and the replica index.
    """
    if "rng" in keywords and getattr(state, "rng", None) is None:
        raise ValueError(
            f"`{api}`: `loss_fn` takes `rng`, but the state has no `rng` (None). "
            "Create it with a key, e.g. `jdp.TrainState.create(..., "
            "rng=jax.random.key(0))`; the step then hands `loss_fn` a key of its "
            "own on every replica and step."
        )

    def kwargs(part):
        out = {}
        if "step" in keywords:
            out["step"] = state.step
        if "rng" in keywords:
            key = jax.random.fold_in(state.rng, state.step)
            if part is not None:
                key = jax.random.fold_in(key, part)
            out["rng"] = _collectives.replica_key(key, axis_name=axis_name)
        return out

    return kwargs


def gradients(
    value_and_grad, loss_fn, state, batch, *, has_aux, microbatches, loss_kwargs
):
    """`loss_and_grads` over the whole batch, or accumulated over microbatches.

    With `microbatches=k` the replica's batch is split into `k` equal parts along
    its leading axis and processed in sequence (`lax.scan`, so activations of one
    part are live at a time). For a loss that is a mean over examples, gradients
    and losses are averaged over the parts, which equals the whole batch at once;
    for a `jdp.weighted` loss, totals, weights and gradients are summed, which
    is exact whatever the parts' weights. Sparse row gradients (`jdp.sparse.
    rows()`) are concatenated over the parts (the sum of their scatter-adds),
    not accumulated in a dense table. Every part starts from the step's
    batch statistics: their floating leaves (BatchNorm's running averages) end
    as the mean over the parts, one update per step as with the whole batch,
    while the others (RNG counters) carry from one part to the next, so each
    part draws its own dropout masks. Auxiliary values are combined as
    `_combine_parts` says.
    """
    if microbatches == 1:
        return loss_and_grads(
            value_and_grad,
            loss_fn,
            state,
            batch,
            has_aux=has_aux,
            kwargs=loss_kwargs(None),
        )
    k = microbatches
    bad = [
        f"{keystr(p)}: {np.shape(x)[0] if np.ndim(x) else 'a scalar'}"
        for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
        if np.ndim(x) == 0 or np.shape(x)[0] % k
    ]
    if bad:
        raise ValueError(
            f"`make_train_step(..., microbatches={k})` splits every batch leaf "
            f"into {k} parts along its leading axis, but these leaves' sizes per "
            f"replica are not multiples of {k}:{format_problems(bad)}\nFix: a "
            f"per-replica batch that is a multiple of {k} (the global batch a "
            f"multiple of {k} x num_replicas)."
        )
    parts = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
    stats = getattr(state, "batch_stats", None)

    def part_grads(index, part):
        return loss_and_grads(
            value_and_grad,
            loss_fn,
            state,
            part,
            has_aux=has_aux,
            kwargs=loss_kwargs(index),
        ).grads

    if value_and_grad is jax.value_and_grad:
        zeros = jax.tree.map(jax.numpy.zeros_like, state.params)
    else:  # a sync piece's own: its gradients may hold sparse rows
        first = jax.tree.map(lambda x: x[0], parts)
        shapes = jax.eval_shape(part_grads, jax.numpy.uint32(0), first)
        zeros = jax.tree.map(
            lambda s: jax.numpy.zeros(s.shape, s.dtype), _split_rows(shapes)[0]
        )

    def body(carry, indexed):
        index, part = indexed
        total, carried = carry
        current = state
        if stats is not None:  # floats from the step's start, the rest carried
            current = state.replace(
                batch_stats=jax.tree.map(
                    lambda s, c: s if is_float(s) else c, stats, carried
                )
            )
        out = loss_and_grads(
            value_and_grad,
            loss_fn,
            current,
            part,
            has_aux=has_aux,
            kwargs=loss_kwargs(index),
        )
        dense, rows = _split_rows(out.grads)
        total = jax.tree.map(lambda a, g: a + g, total, dense)
        carried = carried if stats is None else out.new_stats
        return (total, carried), out._replace(grads=rows)

    indices = jax.numpy.arange(k, dtype=jax.numpy.uint32)
    (total, carried), outs = lax.scan(body, (zeros, stats), (indices, parts))
    new_stats = None
    if stats is not None:
        new_stats = jax.tree.map(
            lambda per_part, c: per_part.mean(0) if is_float(per_part) else c,
            outs.new_stats,
            carried,
        )
    aux = _combine_parts(outs.aux, k)
    # Sparse rows of the parts are concatenated: their scatter-add is the sum.
    rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), outs.grads)
    if outs.weight is not None:
        grads = _join_rows(total, rows)
        return Gradients(outs.loss.sum(0), outs.weight.sum(0), aux, new_stats, grads)
    grads = jax.tree.map(lambda g: g / k if is_float(g) else g, _join_rows(total, rows))
    return Gradients(outs.loss.mean(0), None, aux, new_stats, grads)


def _is_rows(x) -> bool:
    return isinstance(x, IndexedRows)


def _split_rows(grads: PyTree) -> tuple[PyTree, PyTree]:
    """`grads` as its dense part and its sparse rows (`IndexedRows`).

    Each of the two has None where the other has a leaf, so that `_join_rows`
    puts them back together.
    """
    dense = jax.tree.map(lambda g: None if _is_rows(g) else g, grads, is_leaf=_is_rows)
    rows = jax.tree.map(lambda g: g if _is_rows(g) else None, grads, is_leaf=_is_rows)
    return dense, rows


def _join_rows(dense: PyTree, rows: PyTree) -> PyTree:
    """The inverse of `_split_rows`."""
    return jax.tree.map(
        lambda r, d: d if r is None else r,
        rows,
        dense,
        is_leaf=lambda x: x is None or _is_rows(x),
    )


def _combine_parts(aux: PyTree, k: int) -> PyTree:
    """The auxiliary values of `k` microbatches (stacked) as one step's.

    `jdp.weighted` values: totals and weights summed; `jdp.metrics.sum`: summed;
    `jdp.metrics.gather`: concatenated in batch order; unmarked scalars:
    averaged (as over replicas). An unmarked array is refused: whether it holds
    one value per example (to concatenate) or something to average, only the
    step's author knows.
    """

    def combine(path, x):
        if isinstance(x, _metrics.Weighted):
            return _metrics.Weighted(x.total.sum(0), x.weight.sum(0))
        if isinstance(x, _metrics.Reduced):
            value = x.value
            if x.how == "sum":
                if value.dtype == jax.numpy.bool_:
                    value = value.astype(jax.numpy.int32)
                return _metrics.Reduced(value.sum(0), "sum")
            if value.ndim >= 2:
                value = value.reshape((-1,) + value.shape[2:])
            return _metrics.Reduced(value, "gather")
        if np.ndim(x) > 1:
            raise ValueError(
                f"`make_train_step(..., microbatches={k})`: the auxiliary value "
                f"{keystr(path)} has shape {np.shape(x)[1:]} per microbatch, and "
                "jdp cannot tell how to combine the microbatches' values. Mark "
                "per-example values `jdp.metrics.gather(x)` (concatenated in batch "
                "order), counts `jdp.metrics.sum(x)`, ratios `jdp.weighted(total, "
                "weight)`, or reduce it to a scalar (averaged)."
            )
        total = x.astype(jax.numpy.int32) if x.dtype == jax.numpy.bool_ else x
        total = total.sum(0)
        if not is_float(x):
            x = x.astype(jax.numpy.result_type(float))
        mean = x.mean(0)
        _collectives.record_total(mean, total)  # a `jdp.metrics.sum` around it
        return mean

    return jax.tree_util.tree_map_with_path(combine, aux, is_leaf=_metrics.is_marker)


def keep_finite_stats(new: PyTree, old: PyTree, extra: dict) -> PyTree:
    """A skipped step's batch statistics: the new ones where they are finite.

    A loss scaler's overflow (gradients only) leaves the forward pass's
    statistics finite, and flax's recipe keeps them; a NaN or inf in the forward
    pass would make them NaN for good, so a skipped step keeps the old leaf.
    """
    skipped = extra["skipped"] > 0

    def one(n, o):
        if not is_float(n):
            return n
        bad = skipped & ~jax.numpy.all(jax.numpy.isfinite(n))
        return lax.select(bad, o, n)

    return jax.tree.map(one, new, old)


def normalise(out: Gradients, axis_name) -> tuple[jax.Array, PyTree]:
    """The loss metric and the gradients the sync piece averages.

    For a `jdp.weighted` loss, every replica's summed gradients are scaled by
    `kept / kept_weight`, `kept` counting the replicas whose gradients are
    finite and `kept_weight` their weight, so that the mean over those replicas
    (what the pieces compute: every replica, or the valid ones with
    `on_bad_replica="drop"`) is their sum over their weight, exactly one
    device's per-token mean whatever the split. With every replica finite that
    is `num_replicas / global weight`; a non-finite replica makes the average
    non-finite anyway, unless the piece drops it, and then its weight is not
    counted either. A kept weight of 0 (nothing but padding) gives zero
    gradients. The loss is the global total over the global weight, the same
    on every replica.
    """
    if out.weight is None:
        return out.loss, out.grads
    _collectives.axis_size(axis_name, "jdp.weighted")
    weight = out.weight.astype(out.loss.dtype)
    valid = _sync.finite(out.grads).astype(out.loss.dtype)
    total, weight, kept_weight, kept = lax.psum(
        (out.loss, weight, valid * weight, valid), axis_name
    )
    some = kept_weight > 0
    scale = jax.numpy.where(some, kept / jax.numpy.where(some, kept_weight, 1), 0)
    grads = jax.tree.map(
        lambda g: g * scale.astype(g.dtype) if is_float(g) else g, out.grads
    )
    return jax.numpy.where(some, total / jax.numpy.where(some, weight, 1), 0), grads


def kept_loss(out: Gradients, loss: jax.Array, extra: dict, axis_name):
    """`(loss, extra)`: the loss over the replicas a sync piece kept, if it says.

    A piece that leaves bad replicas out (`on_bad_replica="drop"`) puts each
    replica's share under `_sync.KEPT` in its metrics: `num_replicas / kept` on
    a kept replica, 0 on a dropped one (1 everywhere when none was kept), so
    that the metrics' mean over replicas is the kept replicas' mean: a dropped
    replica's NaN does not make the step's loss NaN, and no collective is
    added. A `jdp.weighted` loss: the kept replicas' totals over their weights
    (one scalar sum). Other pieces' metrics are returned as they are.
    """
    if _sync.KEPT not in extra:
        return loss, extra
    extra = dict(extra)
    share = extra.pop(_sync.KEPT)
    kept = share > 0
    if out.weight is None:
        kept_loss = jax.numpy.where(kept, loss * share.astype(loss.dtype), 0)
        return kept_loss.astype(loss.dtype), extra
    zero = jax.numpy.zeros_like(out.loss)
    total, weight = lax.psum(
        (
            jax.numpy.where(kept, out.loss, zero),
            jax.numpy.where(kept, out.weight.astype(out.loss.dtype), zero),
        ),
        axis_name,
    )
    some = weight > 0
    return jax.numpy.where(some, total / jax.numpy.where(some, weight, 1), 0), extra


#: A loss scale below this no longer scales anything up: flax's `DynamicScale`
#: got there by halving on one non-finite step after another.
COLLAPSED_SCALE = 1.0


def _report_collapse(scale) -> None:
    warnings.warn(
        f"The loss scale collapsed to {float(scale):.3g}: flax's `DynamicScale` "
        "halves it on every step whose gradients are not finite, and it got below "
        f"{COLLAPSED_SCALE} (from 2**15 by default), so every recent step was "
        "skipped. Scaling does not cure a loss or gradient that is NaN or inf "
        "whatever the scale: look for NaN/inf in the data, a log of 0 or a "
        "division by 0, or train in float32/bfloat16.",
        RuntimeWarning,
        stacklevel=2,
    )


def warn_if_collapsed(scale, axis_name) -> None:
    """A host warning (from replica 0, on the steps it happens) for a dead scale."""
    first = lax.axis_index(axis_name) == 0
    lax.cond(
        first & (scale < COLLAPSED_SCALE),
        lambda s: jax.debug.callback(_report_collapse, s),
        lambda s: None,
        scale,
    )


def check_loss_scaling(sync, microbatches: int) -> None:
    if isinstance(sync, _sync.OwnUpdate):
        raise ValueError(
            "A state with a `dynamic_scale` (loss scaling) needs a `jdp.Sync` "
            "(e.g. `jdp.all_reduce()`): `jdp.zero()` and `jdp.sparse.rows()` "
            "apply the optimizer themselves and do not support loss scaling."
        )
    if microbatches != 1:
        raise ValueError(
            "A state with a `dynamic_scale` (loss scaling) cannot be combined with "
            "`microbatches`: accumulate in float32 instead, or drop the scaler."
        )


def scaled(scale):
    """`value_and_grad` through a flax `DynamicScale` (loss scaling).

    The scaled loss is differentiated and the gradients unscaled (to float32)
    by `DynamicScale.value_and_grad`, without its `axis_name`: the sync piece
    syncs them next, and the step decides on the synced gradients, agreed by
    every replica (`next_scale`).
    """

    def value_and_grad(fun, *, has_aux):
        grad_fn = scale.value_and_grad(fun, has_aux=has_aux)

        def value_and_grads(*args):
            _, _, value, grads = grad_fn(*args)
            return value, grads

        return value_and_grads

    return value_and_grad


def next_scale(scale, finite: jax.Array):
    """The `DynamicScale` after a step whose synced gradients were `finite`.

    flax's own rule (grow after `growth_interval` finite steps, back off
    otherwise), driven by the verdict every replica agreed on: the gradient of
    `x * c` is `c`, finite exactly when `finite`.
    """
    c = jax.numpy.where(finite, 0.0, jax.numpy.nan).astype(jax.numpy.float32)
    new, _, _, _ = scale.value_and_grad(lambda x: x * c)(jax.numpy.float32(0.0))
    return new


def loss_and_grads(
    value_and_grad, loss_fn, state, batch, *, has_aux, kwargs
) -> Gradients:
    """One replica's `loss_fn`, differentiated.

    A state with `batch_stats` calls `loss_fn(params, batch_stats, batch) ->
    (loss, new_batch_stats)` (or `(loss, (new_batch_stats, aux))` with
    `has_aux`); otherwise `loss_fn(params, batch)`. The loss may be a
    `jdp.weighted(total, weight)`: the total is differentiated, the weight
    returned beside it (no gradient flows into it). `aux` and `new_stats` are
    None when absent. `kwargs` (`rng`, `step`) are passed by name.
    """
    loss_fn = _fresh_arguments(loss_fn)
    with_stats = getattr(state, "batch_stats", None) is not None

    def split(*args):
        out = loss_fn(*args, **kwargs)
        if with_stats:
            loss, rest = out
            new_stats, aux = rest if has_aux else (rest, None)
        else:
            (loss, aux), new_stats = (out if has_aux else (out, None)), None
        weight = None
        if isinstance(loss, _metrics.Weighted):
            loss, weight = loss.total, lax.stop_gradient(loss.weight)
        return loss, (weight, aux, new_stats)

    args = (state.batch_stats, batch) if with_stats else (batch,)
    (loss, (weight, aux, new_stats)), grads = value_and_grad(split, has_aux=True)(
        state.params, *args
    )
    return Gradients(loss, weight, aux, new_stats, grads)


def _fresh_arguments(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`loss_fn` with the arguments it is not differentiated by rebuilt inside.

    `jax.value_and_grad` hands the arguments it does not differentiate (batch
    statistics, the batch) to the function as the very objects it was given. A
    flax NNX `Variable` remembers the trace it was made in and refuses updates
    from another one, so a `loss_fn` that `nnx.merge`s the batch statistics and
    runs BatchNorm in training mode would fail with "Cannot mutate BatchStat
    from a different trace level". Rebuilding those pytrees inside the
    differentiated function (same leaves, new nodes) makes them this trace's
    own, as `nnx.merge(..., copy=True)` would; other pytrees are unaffected.
    """

    @functools.wraps(loss_fn)
    def with_fresh_arguments(params, *rest, **kwargs):
        return loss_fn(params, *jax.tree.map(lambda x: x, rest), **kwargs)

    return with_fresh_arguments
