"""`jdp.check_equivalence`: does a parallel train step take one device's step?"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import jax
import numpy as np

from jdp import _collectives, _loss, _parallel, _train_step
from jdp._tree import PyTree, format_problems, is_float, keystr

OnMismatch = Literal["warn", "raise"]

#: The default largest relative gap: float32 reorderings differ by about 1e-6,
#: the mistakes checked for by percents or more.
RTOL = 1e-3

#: A leaf's gap is relative to its gradient's norm, but at least this fraction
#: of the whole gradient's norm (a leaf zero in exact arithmetic holds rounding).
FLOOR = 1e-2

CAUSES = (
    "Likely causes:\n"
    "- a loss divided by a count that differs between replicas (a mean over the "
    "real tokens of a padded batch, `jnp.sum(loss * w) / jnp.sum(w)`, as in flax's "
    "lm1b example; 0 / 0 on a replica that holds only padding): return "
    "`jdp.weighted(jnp.sum(loss * w), jnp.sum(w))` instead, and the step divides "
    "once by the global count;\n"
    "- BatchNorm without `axis_name` (each replica normalises with its own "
    "statistics): give it the step's axis, e.g. `nn.BatchNorm(..., "
    "axis_name={axis!r})`, or accept per-replica statistics on purpose;\n"
    "- a sum over the batch instead of a mean (the average over replicas of sums "
    "is 1/num_replicas of the global sum): use a mean, or `jdp.weighted`;\n"
    "- randomness that differs between the two (dropout): check a step whose "
    "loss is deterministic (dropout rate 0)."
)


def check_equivalence(
    step: _parallel.Parallel,
    state: PyTree,
    batch: PyTree,
    *,
    on_mismatch: OnMismatch = "warn",
    rtol: float = RTOL,
) -> float:
    """Checks that a parallel train step takes one device's step on the global batch.

    Compares, leaf by leaf, the replicas' averaged gradient (what
    `jdp.all_reduce()` applies) with one device's gradient of the same loss on
    the whole global batch, both from replica 0's state. Call it once, on the
    first batch, with dropout off; it changes nothing. See the Padding guide
    (docs/guides/padding.md) for the mistakes it catches.

    Args:
      step: A `jdp.parallelize`d step made by `jdp.make_train_step`.
      state: The replicated state, as passed to `step`; replica 0's is used
        (also between the syncs of `jdp.bmuf`, where replicas differ).
      batch: A batch placed by `step.shard`.
      on_mismatch: `"warn"` (default): a `RuntimeWarning`; `"raise"`: a
        `ValueError`. Either names the leaves, their gaps and the likely causes.
      rtol: The largest relative gap allowed (`1e-3`). A leaf's gap is the norm
        of `parallel - one device` over its one-device gradient's norm, or over
        `1e-2` of the whole gradient's norm if that is larger.

    Returns:
      The largest relative gap over the leaves (`inf` where the parallel
      gradient is not finite and one device's is).

    Raises:
      TypeError: If `step` is not a `jdp.parallelize`d `jdp.make_train_step`.
      ValueError: If `on_mismatch` or `rtol` is invalid; with
        `on_mismatch="raise"`, if the gradients differ by more than `rtol`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jdp
      >>> def loss_fn(params, batch):                  # lm1b's per-token mean
      ...     w = batch["w"]
      ...     return jnp.sum((batch["x"] * params["a"]) ** 2 * w) / jnp.sum(w)
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, optax.sgd(0.1)),
      ...                        devices=jax.devices()[:2])
      >>> state = step.replicate(
      ...     jdp.TrainState.create(params={"a": 1.0}, tx=optax.sgd(0.1)))
      >>> batch = step.shard({"x": np.arange(8.0), "w": np.array([1.0] * 6 + [0] * 2)})
      >>> gap = jdp.check_equivalence(step, state, batch, on_mismatch="raise")
      Traceback (most recent call last):
      ...
      ValueError: ...jdp.weighted...
    """
    if on_mismatch not in ("warn", "raise"):
        raise ValueError(
            f"`on_mismatch` must be 'warn' or 'raise'; got {on_mismatch!r}."
        )
    if not (isinstance(rtol, (int, float)) and rtol > 0):
        raise ValueError(f"`rtol` must be a positive number; got {rtol!r}.")
    spec = getattr(getattr(step, "train_step", None), "loss", None)
    if not isinstance(step, _parallel.Parallel) or spec is None:
        kind = type(step).__name__
        if isinstance(step, _parallel.Parallel):
            kind += f" of {type(step.train_step).__name__}"
        raise TypeError(
            "`jdp.check_equivalence` needs the step `jdp.parallelize` returned for "
            "a `jdp.make_train_step(loss_fn, ...)`, whose loss it can run again; "
            f"got {kind}. For a step of your own, compare its gradients with "
            "`jax.grad` of the loss on the whole batch yourself."
        )
    step._check_state(state)
    step._check_batch(batch)
    # Only what the loss reads: no optimizer state (ZeRO lays it out its own way).
    fields = ("opt_state", "sync_state", "dynamic_scale")
    unset = {f: None for f in fields if getattr(state, f, None) is not None}
    # Every replica from replica 0's state (between `jdp.bmuf` syncs they differ).
    bare = step.broadcast(state.replace(**unset))
    replicas = _parallel.Parallel(
        # A forward-only step: its metrics, averaged over replicas, are the result.
        functools.partial(_loss_and_grads, spec, microbatches=spec.microbatches),
        mesh=step.mesh, backend=step.backend, donate_state=False, check_sync=None,
    )  # fmt: skip
    got = replicas(bare, batch)
    stacked = step.backend == "pmap"
    one = functools.partial(_one_device, spec, step.axis_name, stacked=stacked)
    with _collectives.bound_axis(step.axis_name):
        want = jax.jit(one)(bare, batch)
    gap, problems = _compare(got["grads"], want["grads"], rtol)
    if not np.isfinite(got["loss"]) and np.isfinite(want["loss"]):
        problems.insert(0, "the loss: not finite on the replicas (a 0 / 0?)")
        gap = np.inf
    if problems:
        message = (
            "`jdp.check_equivalence`: the replicas' averaged gradient differs from "
            "one device's gradient on the same global batch, so this step trains "
            f"another model than one device would (largest relative gap {gap:.2g}, "
            f"tolerance {rtol:.2g}; loss {float(got['loss']):.6g} averaged over "
            f"the {step.num_replicas} replicas, {float(want['loss']):.6g} on one "
            f"device):{format_problems(problems)}\n"
            + CAUSES.format(axis=step.axis_name)
        )
        if on_mismatch == "raise":
            raise ValueError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return gap


def _loss_and_grads(spec: _train_step.LossSpec, state, batch, microbatches: int):
    """`{"loss", "grads"}` as the step normalises them; `rng` and `step` the state's."""
    axis = _collectives.resolve_axis(spec.axis_name)
    # The step's check that a loss taking `rng` has a state with one.
    _loss.loss_kwargs(state, spec.keywords, axis, "jdp.check_equivalence")
    kwargs = {k: getattr(state, k) for k in spec.keywords}  # "rng", "step"
    out = _loss.gradients(
        jax.value_and_grad, spec.loss_fn, state, batch, has_aux=spec.has_aux,
        microbatches=microbatches, loss_kwargs=lambda part: kwargs,
    )  # fmt: skip
    loss, grads = _loss.normalise(out, axis)
    return {"loss": loss, "grads": grads}


def _one_device(spec: _train_step.LossSpec, axis_name, state, batch, *, stacked):
    """The loss's gradient on the whole global batch, replica 0's state, one replica.

    The replica axis is bound by `jax.vmap` over a leading axis of size 1 (one
    per axis name), so collectives in the loss see a single replica.
    """
    state = jax.tree.map(lambda x: x[0], state)  # replica 0 (a gather, once)
    if stacked:  # pmap's batch leaves: (replicas, examples per replica, ...)
        batch = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    fn = functools.partial(_loss_and_grads, spec, microbatches=1)
    for name in reversed(names):
        fn = jax.vmap(fn, axis_name=name)
    lead = (None,) * len(names)
    out = fn(*jax.tree.map(lambda x: x[lead], (state, batch)))
    return jax.tree.map(lambda x: x[(0,) * len(names)], out)


def _compare(got: PyTree, want: PyTree, rtol: float) -> tuple[float, list[str]]:
    """The largest relative gap, and a line per leaf beyond its tolerance."""
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    pairs = [
        (path, np.asarray(g, np.float64), np.asarray(w, np.float64), g.dtype)
        for (path, g), w in zip(flat_got, jax.tree.leaves(want), strict=True)
        if is_float(g)
    ]
    whole = np.sqrt(sum(float(np.sum(np.square(w))) for _, _, w, _ in pairs))
    gaps = []
    for path, g, w, dtype in pairs:
        tolerance = max(rtol, 8 * float(np.finfo(dtype).eps))
        if not np.isfinite(g).all():
            gap = np.inf if np.isfinite(w).all() else np.nan
        else:
            scale = max(float(np.linalg.norm(w)), FLOOR * whole)
            diff = float(np.linalg.norm(g - w))
            gap = diff / scale if scale > 0 else (np.inf if diff > 0 else 0.0)
        gaps.append((path, gap, tolerance))
    bad = sorted(
        (x for x in gaps if not x[1] <= x[2]), key=lambda x: -np.nan_to_num(x[1])
    )

    def problem(path, gap):
        if np.isfinite(gap):
            return f"{keystr(path)}: relative gap {gap:.2g}"
        nor = "" if gap == np.inf else ", nor on one device"
        return f"{keystr(path)}: not finite on the replicas{nor}"

    finite = [gap for _, gap, _ in gaps if not np.isnan(gap)]
    return max(finite, default=0.0), [problem(path, gap) for path, gap, _ in bad]
