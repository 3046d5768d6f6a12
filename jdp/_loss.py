"""How a train step calls its loss (parameters, microbatches, weights, scaling)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _collectives, _metrics, _sync
from jdp._tree import PyTree, format_problems, is_float, keystr
from jdp.sparse._lookup import is_rows, split_rows

#: Parameters a `loss_fn` may declare by name to receive them from the step.
LOSS_KEYWORDS = ("rng", "step")


def loss_keywords(loss_fn: Callable[..., Any]) -> tuple[str, ...]:
    """The `LOSS_KEYWORDS` `loss_fn` declares (it was read before, so it can be)."""
    params = inspect.signature(loss_fn).parameters
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(k for k in LOSS_KEYWORDS if k in params and params[k].kind in keyword)


def takes_batch_stats(loss_fn: Callable[..., Any]) -> bool:
    """Whether `loss_fn` is `(params, batch_stats, batch)` (else `(params, batch)`)."""
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
    required = [p for p in params if p.kind in kinds and p.default is p.empty]
    required = [p for p in required if p.name not in LOSS_KEYWORDS]
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
    """A sentence for a loss whose PRNG key parameter is not named `rng`."""
    words = ("rng", "key", "seed")
    keys = [n for n in signature.parameters if any(w in n.lower() for w in words)]
    if keys := [n for n in keys if n not in LOSS_KEYWORDS]:
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


class Gradients(NamedTuple):
    """One replica's loss, gradients and what came with them."""

    loss: jax.Array  # the loss, or a `jdp.weighted` loss's total
    weight: jax.Array | None  # a `jdp.weighted` loss's weight, else None
    aux: PyTree
    new_stats: PyTree
    grads: PyTree


def loss_kwargs(state, keywords, axis_name, api) -> Callable[[Any], dict]:
    """`part -> {keyword: value}`; `rng` folds in the step, `part`, the replica."""
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
    """`loss_and_grads` over the batch, or accumulated over microbatches (a scan).

    Mean losses and gradients are averaged over the parts, `jdp.weighted` ones
    summed, sparse rows concatenated; floating batch statistics end as their mean.
    """

    def run(current, part, index):
        kwargs = loss_kwargs(index)
        return loss_and_grads(
            value_and_grad, loss_fn, current, part, has_aux=has_aux, kwargs=kwargs
        )

    if microbatches == 1:
        return run(state, batch, None)
    k = microbatches
    if bad := [
        f"{keystr(p)}: {np.shape(x)[0] if np.ndim(x) else 'a scalar'}"
        for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
        if np.ndim(x) == 0 or np.shape(x)[0] % k
    ]:
        raise ValueError(
            f"`make_train_step(..., microbatches={k})` splits every batch leaf "
            f"into {k} parts along its leading axis, but these leaves' sizes per "
            f"replica are not multiples of {k}:{format_problems(bad)}\nFix: a "
            f"per-replica batch that is a multiple of {k} (the global batch a "
            f"multiple of {k} x num_replicas)."
        )
    parts = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
    stats = getattr(state, "batch_stats", None)
    if value_and_grad is jax.value_and_grad:
        zeros = jax.tree.map(jnp.zeros_like, state.params)
    else:  # a sync piece's own: its gradients may hold sparse rows
        first = jax.tree.map(lambda x: x[0], parts)
        shapes = jax.eval_shape(lambda p: run(state, p, jnp.uint32(0)).grads, first)
        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), split_rows(shapes)[0]
        )

    def body(carry, indexed):
        index, part = indexed
        total, carried = carry
        current = state
        if stats is not None:  # floats from the step's start, the rest carried
            floats = jax.tree.map(lambda s, c: s if is_float(s) else c, stats, carried)
            current = state.replace(batch_stats=floats)
        out = run(current, part, index)
        dense, rows = split_rows(out.grads)
        total = jax.tree.map(jnp.add, total, dense)
        carried = carried if stats is None else out.new_stats
        return (total, carried), out._replace(grads=rows)

    indices = jnp.arange(k, dtype=jnp.uint32)
    (total, carried), outs = lax.scan(body, (zeros, stats), (indices, parts))
    new_stats = None
    if stats is not None:  # floats: the parts' mean; the rest: carried
        mean = lambda x, c: x.mean(0) if is_float(x) else c  # noqa: E731
        new_stats = jax.tree.map(mean, outs.new_stats, carried)
    aux = _combine_parts(outs.aux, k)
    # Sparse rows of the parts are concatenated: their scatter-add is the sum.
    rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), outs.grads)
    grads = jax.tree.map(
        lambda r, d: d if r is None else r, rows, total,
        is_leaf=lambda x: x is None or is_rows(x),
    )  # fmt: skip
    if outs.weight is not None:
        return Gradients(outs.loss.sum(0), outs.weight.sum(0), aux, new_stats, grads)
    grads = jax.tree.map(lambda g: g / k if is_float(g) else g, grads)
    return Gradients(outs.loss.mean(0), None, aux, new_stats, grads)


def _summable(x: jax.Array) -> jax.Array:
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def _combine_parts(aux: PyTree, k: int) -> PyTree:
    """The `k` microbatches' stacked auxiliary values as one step's (by marker)."""

    def combine(path, x):
        if isinstance(x, _metrics.Weighted):
            return _metrics.Weighted(x.total.sum(0), x.weight.sum(0))
        if isinstance(x, _metrics.Reduced):
            value = x.value
            if x.how == "sum":
                return _metrics.Reduced(_summable(value).sum(0), "sum")
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
        x = _metrics.as_array(path, x)  # a PRNG key or text named, as a metric
        total = _summable(x).sum(0)
        mean = (x if is_float(x) else x.astype(jnp.result_type(float))).mean(0)
        _collectives.record_total(mean, total)  # a `jdp.metrics.sum` around it
        return mean

    return jax.tree_util.tree_map_with_path(combine, aux, is_leaf=_metrics.is_marker)


def keep_finite_stats(new: PyTree, old: PyTree, extra: dict) -> PyTree:
    """A skipped step's batch statistics: the new ones where finite (as flax)."""
    skipped = extra["skipped"] > 0

    def one(n, o):
        if not is_float(n):
            return n
        return lax.select(skipped & ~jnp.all(jnp.isfinite(n)), o, n)

    return jax.tree.map(one, new, old)


def normalise(out: Gradients, axis_name) -> tuple[jax.Array, PyTree]:
    """The loss metric and the gradients the sync piece averages.

    A `jdp.weighted` loss's gradients are scaled by `kept / kept_weight`, so that
    their mean over the replicas with finite gradients is the per-token mean.
    """
    if out.weight is None:
        return out.loss, out.grads
    _collectives.axis_size(axis_name, "jdp.weighted")
    # Summed in float32 at least: in a bfloat16 loss's dtype, 8 replicas' 1001
    # tokens each came to 8000.
    dtype = _metrics.sum_dtype(out.loss.dtype)
    weight = out.weight.astype(dtype)
    valid = _sync.finite(out.grads).astype(dtype)
    total, weight, kept_weight, kept = lax.psum(
        (out.loss.astype(dtype), weight, valid * weight, valid), axis_name
    )
    scale = _metrics.ratio(kept, kept_weight)
    grads = jax.tree.map(
        lambda g: g * scale.astype(g.dtype) if is_float(g) else g, out.grads
    )
    loss = _metrics.ratio(total, jnp.where(kept_weight > 0, weight, 0))
    return loss.astype(out.loss.dtype), grads


def kept_loss(out: Gradients, loss: jax.Array, extra: dict, axis_name):
    """`(loss, extra)`: the loss over the replicas a piece kept (`_sync.KEPT`)."""
    if _sync.KEPT not in extra:
        return loss, extra
    extra = dict(extra)
    share = extra.pop(_sync.KEPT)
    kept = share > 0
    if out.weight is None:
        kept_loss = jnp.where(kept, loss * share.astype(loss.dtype), 0)
        return kept_loss.astype(loss.dtype), extra
    dtype = _metrics.sum_dtype(out.loss.dtype)
    both = (out.loss.astype(dtype), out.weight.astype(dtype))
    total, weight = lax.psum([jnp.where(kept, x, 0) for x in both], axis_name)
    return _metrics.ratio(total, weight).astype(out.loss.dtype), extra


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
        "division by 0, or train in float32/bfloat16.", RuntimeWarning, stacklevel=2,
    )  # fmt: skip


def warn_if_collapsed(scale, axis_name) -> None:
    """A host warning (from replica 0, on the steps it happens) for a dead scale."""
    collapsed = (lax.axis_index(axis_name) == 0) & (scale < COLLAPSED_SCALE)
    report = lambda s: jax.debug.callback(_report_collapse, s)  # noqa: E731
    lax.cond(collapsed, report, lambda s: None, scale)


def check_loss_scaling(rows: bool, microbatches: int) -> None:
    if rows:
        raise ValueError(
            "A state with a `dynamic_scale` (loss scaling) needs dense gradients, "
            "but this step's sync piece takes tables' gradients as sparse rows "
            "(`jdp.sparse.rows()`): train the tables without loss scaling, or "
            "use `jdp.all_reduce()` for dense table gradients."
        )
    if microbatches != 1:
        raise ValueError(
            "A state with a `dynamic_scale` (loss scaling) cannot be combined with "
            "`microbatches`: accumulate in float32 instead, or drop the scaler."
        )


def scaled(scale):
    """`value_and_grad` through a flax `DynamicScale`, without its `axis_name`."""

    def value_and_grad(fun, *, has_aux):
        grad_fn = scale.value_and_grad(fun, has_aux=has_aux)
        return lambda *args: grad_fn(*args)[2:]  # after the new scale and its verdict

    return value_and_grad


def next_scale(scale, finite: jax.Array):
    """The `DynamicScale` after a step, by flax's rule and the agreed `finite`."""
    # The gradient of `x * c` is `c`: finite exactly when `finite`.
    c = jnp.where(finite, 0.0, jnp.nan).astype(jnp.float32)
    return scale.value_and_grad(lambda x: x * c)(jnp.float32(0.0))[0]


def _described(x: Any) -> str:
    if isinstance(x, (tuple, list, dict)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a value of shape {jnp.shape(x)}"


def _check_loss(loss: Any, has_aux: bool) -> None:
    """A clear error unless `loss` is one floating-point number."""
    want = "one floating-point number: the mean loss over this replica's examples"
    if isinstance(loss, (tuple, list, dict)):
        hint = (
            " If it returns `(loss, aux)`, pass `has_aux=True` to "
            "`jdp.make_train_step`."
            if not has_aux and isinstance(loss, (tuple, list))
            else " Return the loss first and the rest as `aux` (`has_aux=True`)."
        )
        raise TypeError(
            f"`loss_fn` must return {want}; it returned a {type(loss).__name__} "
            f"of {len(loss)}.{hint}"
        )
    shape, dtype = jnp.shape(loss), jnp.result_type(loss)
    if shape:
        raise TypeError(
            f"`loss_fn` must return {want}; it returned an array of shape "
            f"{shape}. A per-example loss (PyTorch's `reduction='none'`): reduce "
            "it with `jnp.mean(...)`, or with `jdp.weighted(losses.sum(), "
            "num_examples)` where replicas count their examples unequally."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        fix = (
            "A complex loss has no direction of descent: return a real one, e.g. "
            "`jnp.mean(jnp.abs(err) ** 2)`."
            if jnp.issubdtype(dtype, jnp.complexfloating)
            else "Compute it in floating point, e.g. `x.astype(jnp.float32)`."
        )
        raise TypeError(
            f"`loss_fn` must return {want}; it returned a value of dtype {dtype}. "
            + fix
        )


def _with_stats(out: Any, has_aux: bool, old: PyTree) -> tuple[Any, PyTree, Any]:
    """`(loss, new batch_stats, aux)` of a `loss_fn(params, batch_stats, batch)`.

    The new statistics take the state's containers where their paths agree (a
    flax `FrozenDict` state and the plain dict `model.apply` returns).
    """
    form = (
        "`(loss, (new_batch_stats, aux))`" if has_aux else "`(loss, new_batch_stats)`"
    )
    start = f"`loss_fn(params, batch_stats, batch)` must return {form}"
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f"{start}; it returned {_described(out)}.")
    loss, rest = out
    if has_aux and not (isinstance(rest, (tuple, list)) and len(rest) == 2):
        raise TypeError(
            f"{start} (`has_aux=True`); its second item is {_described(rest)}, not "
            "`(new_batch_stats, aux)`."
        )
    new, aux = rest if has_aux else (rest, None)
    if jax.tree.structure(new) == jax.tree.structure(old):
        return loss, new, aux
    paths = [[keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
             for t in (old, new)]  # fmt: skip
    if paths[0] == paths[1]:
        return (
            loss,
            jax.tree.unflatten(jax.tree.structure(old), jax.tree.leaves(new)),
            aux,
        )
    missing = [p for p in paths[0] if p not in paths[1]]
    extra = [p for p in paths[1] if p not in paths[0]]
    hint = (
        " it returns `(loss, (new_batch_stats, aux))`: pass `has_aux=True`; or"
        if not has_aux and isinstance(new, (tuple, list)) and len(new) == 2
        else ""
    )
    raise TypeError(
        f"{start}, the new statistics shaped as the state's `batch_stats`. In "
        f"the state, not returned:{format_problems(missing) or ' none'}\n"
        f"Returned, not in the state:{format_problems(extra) or ' none'}\nFix:"
        f"{hint} return `updates['batch_stats']` of `model.apply(..., "
        "mutable=['batch_stats'])`."
    )


def loss_and_grads(
    value_and_grad, loss_fn, state, batch, *, has_aux, kwargs
) -> Gradients:
    """One replica's `loss_fn`, differentiated, as `Gradients`."""
    with_stats = getattr(state, "batch_stats", None) is not None

    def split(params, *rest):
        # The other arguments rebuilt inside: a flax NNX `Variable` refuses
        # updates from another trace level.
        out = loss_fn(params, *jax.tree.map(lambda x: x, rest), **kwargs)
        if with_stats:
            loss, new_stats, aux = _with_stats(out, has_aux, state.batch_stats)
        else:
            if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    "`jdp.make_train_step(..., has_aux=True)`: `loss_fn` must "
                    f"return `(loss, aux)`; it returned {_described(out)}."
                )
            (loss, aux), new_stats = (out if has_aux else (out, None)), None
        weight = None
        if isinstance(loss, _metrics.Weighted):
            loss, weight = loss.total, lax.stop_gradient(loss.weight)
        _check_loss(loss, has_aux)
        return loss, (weight, aux, new_stats)

    args = (state.batch_stats, batch) if with_stats else (batch,)
    grad_fn = value_and_grad(split, has_aux=True)
    (loss, (weight, aux, new_stats)), grads = grad_fn(state.params, *args)
    return Gradients(loss, weight, aux, new_stats, grads)
