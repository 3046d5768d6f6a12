"""What a train step checks before it runs: the piece, the axes, the state."""

from __future__ import annotations

import dataclasses
import warnings

import jax

from jdp import _collectives, _jax_compat, _replica_parts, _sync, _transforms
from jdp._tree import PyTree, format_problems, is_float, keystr

AVERAGED_TWICE_MSG = (
    "`{api}`: the optimizer averages the gradients across replicas itself "
    "(`jdp.zero` reduce-scatters them), and so does the sync piece. Give the "
    "optimizer each replica's own gradients: `jdp.make_train_step(loss_fn, "
    "jdp.zero(tx), sync=jdp.local())`."
)


def check_piece(sync, tx, state, axis, api) -> None:
    """A `jdp.Sync`'s checks against the state and the optimizer (traced)."""
    if sync.averages and _sync.syncs_gradients(state.opt_state):
        raise ValueError(AVERAGED_TWICE_MSG.format(api=api))
    check_sync_state(state, sync, api)
    if sync.averages:
        _check_axes(sync, tx, state, axis, api)
    else:
        optimizer = _optimizer_trace(tx, state)  # one trace for both checks
        _warn_if_never_synced(sync, optimizer, state, axis)
        _check_no_collective_under_local_branch(optimizer, axis, api)


LOCAL_BRANCH_MSG = (
    "`{api}`: the optimizer decides on each replica's own gradients whether to run "
    "a part that communicates ({found}), as `optax.apply_if_finite` around "
    "`jdp.sync_gradients()`, `jdp.bmuf` or `jdp.zero` does: a replica whose "
    "gradients are not finite would skip the collective the others wait in, and "
    "the job would hang until XLA aborts it. Decide after the sync, e.g. "
    "`optax.chain(jdp.sync_gradients(), optax.apply_if_finite(tx, ...))` or "
    "`jdp.bmuf(optax.apply_if_finite(inner, ...), ...)`; or pass "
    "`skip_nonfinite=True` to `jdp.make_train_step`, which skips such a step on "
    "every replica at once."
)


def _check_no_collective_under_local_branch(optimizer, axis, api) -> None:
    """Refuses an optimizer that branches on local gradients around a collective.

    `optimizer`: `_optimizer_trace`'s, whose inputs are the (local) gradients;
    the optimizer state and the params it closes over are taken as agreed.
    """
    axes = _axes(axis)
    if not axes:
        return
    local = [True] * len(optimizer.jaxpr.invars)
    found = _jax_compat.collectives_under_local_branches(optimizer, local, axes)
    if found:
        raise ValueError(LOCAL_BRANCH_MSG.format(api=api, found=", ".join(found)))


def _warn_if_never_synced(sync, optimizer, state, axis) -> None:
    """Warns when replicas train on their own gradients and nothing syncs them."""
    num = _collectives.axis_size(axis, "jdp.make_train_step")
    if num < 2 or _replica_parts.trains_locally(state.opt_state):
        return
    if _moving_axes(optimizer):
        return
    if not _piece_syncs_every_leaf(sync, state, axis):  # a partition's unused label
        warnings.warn(
            "The sync piece leaves each replica its own gradients (`jdp.local()`, "
            "or a `jdp.partition` label), and this optimizer never communicates "
            "(no `jdp.bmuf`, no `jdp.sync_gradients`): the "
            f"{num} replicas train {num} different models. Use "
            "`sync=jdp.all_reduce()` for synchronous training, an optimizer that "
            "syncs (`jdp.bmuf(tx, sync_period=...)`), or, in a `jdp.partition`, "
            "the label `'per_replica'` where different models are meant.",
            UserWarning,
            stacklevel=3,
        )


def _piece_syncs_every_leaf(sync, state, axis) -> bool:
    """Whether every gradient the piece returns agrees across replicas (traced)."""
    update = _piece_update(sync, state, axis)
    closed = _traced(lambda g: update(g)[0], state.params)
    local = [True] * len(closed.jaxpr.invars)
    return not any(_jax_compat.local_outputs(closed, local, _axes(axis)))


def _piece_update(sync, state, axis):
    """`grads -> sync.update(grads, ...)` with the state's (or a new) piece state."""
    held = getattr(state, "sync_state", None)
    piece_state = sync.initial_state(state.params) if held is None else held
    return lambda g: sync.update(g, piece_state, state.params, axis)


AVERAGES_WITH_BMUF_MSG = (
    "`{api}` averages gradients across replicas, but the optimizer contains "
    "`jdp.bmuf`, which trains each replica on its own gradients and syncs the "
    "models itself (the sync piece averages over {piece}; the optimizer syncs "
    "over {bmuf}). Use `sync=jdp.local()`; or, on a host mesh, hierarchical local "
    "SGD: `sync=jdp.all_reduce(axis_name='device')` with `jdp.bmuf(inner, "
    "sync_period=..., axis_name='host')`."
)


def _check_axes(sync, tx, state, axis, api) -> None:
    """An averaging piece's axes, against the step's and the optimizer's.

    Every step axis the piece does not average over must be synced by the
    optimizer; beside `jdp.bmuf` the piece must leave it one (hierarchical SGD).
    """
    local = _replica_parts.trains_locally(state.opt_state)
    step_axes = _axes(axis)
    if len(step_axes) < 2:
        if local:  # a flat mesh: no axis left for `jdp.bmuf`
            raise _beside_bmuf(api, step_axes, "the same axis")
        return
    update = _piece_update(sync, state, axis)
    piece = _moving_axes(_traced(lambda g: update(g)[:2], state.params))
    rest = step_axes - piece
    if local:
        optimizer = _optimizer_axes(tx, state)
        # The optimizer syncs exactly the axes the piece leaves (not those too:
        # its default block momentum would count the piece's replicas).
        if piece and rest and rest <= optimizer and not optimizer & piece:
            return
        raise _beside_bmuf(api, piece, _names(optimizer))
    # A piece that moves nothing at all is left to the divergence guard.
    if not piece or not rest or rest <= _optimizer_axes(tx, state):
        return
    raise ValueError(
        f"`{api}`: the sync piece averages the gradients over {_names(piece)} "
        f"only, of the step's axes {_names(step_axes)}, and nothing syncs "
        f"{_names(rest)}: the replicas along {_names(rest)} (on a host mesh, the "
        "hosts) are never synced and would train models of their own. Average "
        "over every axis (`jdp.all_reduce()`: by default the step's axes), or "
        "let `jdp.bmuf` sync the others, hierarchical local SGD: "
        f"`jdp.bmuf(inner, sync_period=..., axis_name={sorted(rest)[0]!r})` "
        "with this piece."
    )


def _beside_bmuf(api, piece, bmuf: str) -> ValueError:
    message = AVERAGES_WITH_BMUF_MSG.format(api=api, piece=_names(piece), bmuf=bmuf)
    return ValueError(message)


def _traced(fn, params):
    """`fn` traced on gradients shaped like `params` (its floating leaves)."""
    grads = jax.tree.map(lambda p: p if is_float(p) else None, params)
    return jax.make_jaxpr(fn)(grads)


def _optimizer_trace(tx, state):
    """The optimizer's update traced on gradients shaped like the params."""
    update = lambda g: _transforms.update(tx, g, state.opt_state, state.params)  # noqa: E731
    return _traced(update, state.params)


def _optimizer_axes(tx, state) -> set[str]:
    """The mesh axes over which optimizer `tx` moves values (traced only)."""
    return _moving_axes(_optimizer_trace(tx, state))


def _names(axes) -> str:
    return ", ".join(repr(a) for a in sorted(axes)) or "no axis"


def _axes(axis) -> set[str]:
    """The mesh axis names in `axis` (a name or a tuple; positional axes dropped)."""
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    return {a for a in axes if isinstance(a, str)}


def _moving_axes(closed) -> set[str]:
    """The mesh axes over which a traced function moves values.

    Scalar integers and booleans (an agreed verdict) do not count.
    """
    found: set[str] = set()

    def values(v) -> bool:
        dtype = getattr(v.aval, "dtype", None)
        if dtype is None or dtype == jax.numpy.bool_:
            return False
        return jax.numpy.issubdtype(dtype, jax.numpy.inexact) or v.aval.size > 1

    for eqn in _jax_compat.equations(closed):
        axes = _jax_compat.collective_axes(eqn)
        if axes and any(values(v) for v in eqn.outvars):
            found.update(_axes(axes))
    return found


#: The state fields a train step reads and writes.
KNOWN_FIELDS = (
    "step", "params", "opt_state", "batch_stats", "skipped_steps", "dynamic_scale",
    "rng", "sync_state",
)  # fmt: skip


def check_train_state(state: PyTree, api: str) -> None:
    """Refuses what is not a train state (`params`, `opt_state`, `step`, `replace`)."""
    needed = ("params", "opt_state", "step", "replace")
    if all(hasattr(state, name) for name in needed):
        return
    if isinstance(state, dict):
        got = f"a dict with keys {sorted(map(str, state))}"
    else:
        got = f"a {type(state).__name__}"
    raise TypeError(
        f"The step of `{api}` takes a train state (`params`, `opt_state`, `step`): "
        f"a `jdp.TrainState`, or flax's `TrainState`; got {got}. Fix: `state = "
        "step.replicate(jdp.TrainState.create(params=params, tx=tx))`."
    )


def check_known_fields(state: PyTree, api: str) -> None:
    """Refuses a dataclass state's field (with arrays) that the step never updates."""
    if not dataclasses.is_dataclass(state):
        return
    if unknown := [
        f.name
        for f in dataclasses.fields(state)
        if f.metadata.get("pytree_node", True)
        and f.name not in KNOWN_FIELDS
        and jax.tree.leaves(getattr(state, f.name))
    ]:
        name = unknown[0]
        raise ValueError(
            f"`{api}` updates a state's {', '.join(f'`{k}`' for k in KNOWN_FIELDS)}; "
            f"this {type(state).__name__} also has {', '.join(map(repr, unknown))}, "
            "which the step would leave unchanged at every step. Update it in a "
            "step of your own around this one, e.g. `def step(state, batch): new, "
            f"metrics = train_step(state.replace({name}=None), batch); return "
            f"new.replace({name}=...), metrics`, or remove it from the state."
        )


def check_sync_state(state: PyTree, sync: _sync.Sync, api: str) -> None:
    """A piece that keeps state needs the state's `sync_state`, and only it does."""
    held = getattr(state, "sync_state", None)
    want = None if sync.init is None else jax.eval_shape(sync.init, state.params)
    keeps = bool(jax.tree.leaves(want))
    if keeps and held is None:
        raise ValueError(
            f"`{api}`: this sync piece keeps state of its own (error buffers, "
            "low-rank factors) in the train state's `sync_state`, which this "
            f"{type(state).__name__} does not hold (None or no such field). Create "
            "the state with the piece: `jdp.TrainState.create(params=..., tx=..., "
            "sync=sync)`, passing the same `sync` as to `jdp.make_train_step`."
        )
    if not keeps and jax.tree.leaves(held):
        raise ValueError(
            f"`{api}`: the state holds a `sync_state` (made for a sync piece that "
            "keeps state, e.g. `jdp.all_reduce(error_feedback=True)`), but this "
            "step's sync piece keeps none, so it would be carried along unchanged. "
            "Use the same piece for `jdp.TrainState.create(..., sync=...)` and "
            "`jdp.make_train_step(..., sync=...)`."
        )
    # Another piece's state has another type; for the same type made for other
    # params, the piece's own checks say more.
    held, want = jax.tree.structure(held), jax.tree.structure(want)
    if keeps and _kind(held) != _kind(want) and held != want:
        raise TypeError(
            f"`{api}`: the state's `sync_state` was made by another sync piece: it "
            f"holds {_kind(held)}, where this step's piece keeps {_kind(want)}. "
            "Create the state with the same piece as the step: `jdp.TrainState."
            "create(params=..., tx=..., sync=sync)`, passing the `sync` given to "
            "`jdp.make_train_step`."
        )


def _kind(tree: jax.tree_util.PyTreeDef) -> str:
    """A sync piece's state for a message: its type, e.g. "a PowerSGDState"."""
    node = tree.node_data()
    kind = getattr(node[0], "__name__", None) if node else None
    return f"a {kind}" if kind else f"a tree of structure {tree}"


def check_trainable(params: PyTree, api: str) -> None:
    """Gradients need floating-point params: name the leaves that are not."""
    if bad := [
        f"{keystr(path)}: {jax.numpy.result_type(x)}"
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if not is_float(x)
    ]:
        raise TypeError(
            f"`{api}`: the state's params must be floating-point (they are "
            f"differentiated), but these leaves are not:{format_problems(bad)}\n"
            "Fix: keep integer state (counters, ids) and PRNG keys out of `params`, "
            "e.g. in `batch_stats` or another field of the state." + _nnx_hint(params)
        )


def _nnx_hint(params: PyTree) -> str:
    """How to split a flax NNX model, when `params` holds NNX `Variable`s."""
    from flax import nnx  # only on this error path

    def is_variable(x):
        return isinstance(x, nnx.Variable)

    if not any(map(is_variable, jax.tree.leaves(params, is_leaf=is_variable))):
        return ""
    return (
        "\nWith flax NNX, train the `nnx.Param`s and carry the rest (BatchNorm "
        "statistics, RNG streams) as batch statistics: `graphdef, params, rest = "
        "nnx.split(model, nnx.Param, ...)`, `jdp.TrainState.create(params=params, "
        "batch_stats=rest, tx=tx)`, and a `loss_fn(params, rest, batch)` that "
        "`nnx.merge`s them and returns `(loss, nnx.state(model, "
        "nnx.Not(nnx.Param)))`."
    )
