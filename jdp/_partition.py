"""`jdp.partition`: a sync piece per label of the params, like `optax.partition`."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jdp import _collectives, _coordination, _replica_parts, _sync, _transforms
from jdp._tree import PyTree, keystr
from jdp.sparse._lookup import densify, is_rows

#: Labels whose leaves are synchronised without a `jdp.Sync` piece.
BROADCAST = "broadcast"
PER_REPLICA = "per_replica"
_MODES = (BROADCAST, PER_REPLICA)

#: Seconds every process waits for the others' labels at the first trace.
AGREE_TIMEOUT_S = 120.0

#: Traces of a partition's update per set of devices, in each process.
_traces: dict[tuple[int, ...], itertools.count] = {}


def partition(
    labels: PyTree | Callable[[PyTree], PyTree], pieces: Mapping[str, _sync.Sync | str]
) -> _sync.Sync:
    """A sync piece per label of the params, as `optax.multi_transform` for optimizers.

    Each label's piece syncs its part of the gradients, then the optimizer is
    applied once to the whole tree. Besides a `jdp.Sync`, a label's piece may be
    `"per_replica"` (never synced; left out of the divergence guard, saved per
    replica) or `"broadcast"` (replica 0's gradients everywhere). See the Sync
    guide (docs/guides/sync.md).

    Args:
      labels: A pytree of label strings with the params' structure (or a
        prefix of it), or a function `params -> labels`, as for
        `optax.multi_transform`.
      pieces: `{label: piece}` for every label that occurs. Labels sharing one
        piece object are one group (named by its labels joined with "+").

    Returns:
      A `jdp.Sync` whose state maps each group whose piece keeps state to that
      state; a piece's metrics come back as `"<group>/<name>"`.

    Raises:
      TypeError: If `pieces` is not a mapping of str labels to pieces.
      ValueError: If `pieces` is empty; at trace time, if a leaf's label has no
        piece, the labels do not fit the params, or the processes label a leaf
        differently.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> params = {"adapter": jnp.zeros(2), "w": jnp.zeros(2)}
      >>> labels = {"adapter": "local", "w": "dense"}
      >>> pieces = {"local": "per_replica", "dense": jdp.all_reduce()}
      >>> sync = jdp.partition(labels, pieces)
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch * (params["w"] + params["adapter"]) - 1.0) ** 2)
      >>> tx = optax.sgd(0.1)
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=sync))
      >>> state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
      >>> state, metrics = step(state, step.shard(jnp.arange(16.0).reshape(8, 2)))
      >>> [jdp.replicas_in_sync(state.params[k]) for k in ("w", "adapter")]
      [True, False]
    """
    pieces = _check_pieces(pieces)

    def groups(grads, params):
        """`(key, piece, part of grads, part of params)` of every label group."""
        leaf_labels = _leaf_labels(_labels_of(labels, params), params, pieces)
        params_flat, treedef = jax.tree_util.tree_flatten(params)
        flat = treedef.flatten_up_to(grads)  # a table's sparse rows: one leaf
        out = []
        for group in _groups(pieces, {label for _, label in leaf_labels}):
            mine = [label in group for _, label in leaf_labels]
            part, part_params = (
                treedef.unflatten(
                    [x if m else None for x, m in zip(xs, mine, strict=True)]
                )
                for xs in (flat, params_flat)
            )
            out.append(("+".join(group), pieces[group[0]], part, part_params, mine))
        return leaf_labels, treedef, out

    def init(params):
        _, _, found = groups(params, params)
        states = {
            key: piece.init(part_params)
            for key, piece, _, part_params, _ in found
            if isinstance(piece, _sync.Sync) and piece.init is not None
        }
        return states or None

    def update(grads, state, params, axis_name):
        leaf_labels, treedef, found = groups(grads, params)
        agree_across_processes(leaf_labels)
        synced = treedef.flatten_up_to(grads)
        new_state = dict(state or {})
        metrics: dict[str, jax.Array] = {}
        for key, piece, part, part_params, mine in found:
            if piece == PER_REPLICA:
                done = part
            elif piece == BROADCAST:
                done = _collectives.broadcast(part, root=0, axis_name=axis_name)
            else:
                if not isinstance(piece, _sync.TakesRows):  # tables' rows densified
                    part = jax.tree.map(
                        lambda g, p: densify(g, p) if is_rows(g) else g, part,
                        part_params, is_leaf=is_rows,
                    )  # fmt: skip
                done, new, extra = piece.update(
                    part, new_state.get(key), part_params, axis_name
                )
                if key in new_state:
                    new_state[key] = new
                extra.pop(_sync.KEPT, None)  # the loss is every replica's here
                metrics.update({f"{key}/{name}": v for name, v in extra.items()})
            done = treedef.flatten_up_to(done)
            synced = [d if m else s for s, d, m in zip(synced, done, mine, strict=True)]
        return treedef.unflatten(synced), (new_state or state), metrics

    # "per_replica" leaves are meant to differ; `jdp.local()` ones are left
    # for the optimizer to sync.
    averages = all(isinstance(p, str) or p.averages for p in pieces.values())
    differ = any(map(_differs, pieces.values()))
    must_agree = _agreed(labels, pieces) if differ else None
    rows = any(isinstance(p, _sync.TakesRows) for p in pieces.values())
    kind = _sync.TakesRows if rows else _sync.Sync
    return kind(init, update, averages=averages, must_agree=must_agree)


def _check_pieces(pieces: Any) -> dict[str, _sync.Sync | str]:
    if not isinstance(pieces, Mapping):
        raise TypeError(
            "`jdp.partition`: `pieces` must be a mapping `{label: piece}`, e.g. "
            "`{'dense': jdp.all_reduce(), 'embed': jdp.local()}`; got "
            f"{type(pieces).__name__}."
        )
    if not pieces:
        raise ValueError("`jdp.partition`: `pieces` is empty; give one per label.")
    for label, piece in pieces.items():
        if not isinstance(label, str):
            raise TypeError(
                f"`jdp.partition`: labels must be str; got {label!r} "
                f"({type(label).__name__})."
            )
        if not isinstance(piece, _sync.Sync) and piece not in _MODES:
            got = repr(piece) if isinstance(piece, str) else type(piece).__name__
            raise TypeError(
                f"`jdp.partition`: the piece of label {label!r} must be a "
                f"`jdp.Sync` (e.g. `jdp.all_reduce()`, `jdp.local()`) or one of "
                f"{_MODES}; got {got}."
            )
    return dict(pieces)


def _groups(pieces, used) -> list[tuple[str, ...]]:
    """The used labels, grouped by piece object (one sync per group), in order."""
    groups: dict[int, list[str]] = {}
    for label in sorted(used):
        groups.setdefault(id(pieces[label]), []).append(label)
    return [tuple(g) for g in groups.values()]


def _labels_of(labels, params) -> PyTree:
    return labels(params) if callable(labels) else labels


def _leaf_labels(tree, grads, pieces) -> list[tuple[str, str]]:
    """`(path, label)` of every leaf of `grads`, checked against `pieces`."""
    try:
        full = jax.tree.broadcast(tree, grads)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "`jdp.partition`: `labels` must have the params' structure, or a "
            "prefix of it (as for `optax.multi_transform`), one label string a "
            f"leaf or subtree; they do not match: {e}"
        ) from None
    paths = jax.tree_util.tree_flatten_with_path(grads)[0]
    found = jax.tree_util.tree_leaves(full)
    out = [(keystr(p), lbl) for (p, _), lbl in zip(paths, found, strict=True)]
    for path, label in out:
        if label not in pieces:
            raise ValueError(
                f"`jdp.partition`: leaf {path} is labelled {label!r}, which has "
                f"no piece; the pieces are for {sorted(pieces)}. Add "
                f"`{label!r}: jdp.all_reduce()` (or the piece it needs)."
            )
    return out


def differing_labels(values: Mapping[int, str]) -> str | None:
    """The error naming the first leaf the processes label differently, or None.

    `values` is `{process: JSON list of [path, label] pairs}`.
    """
    lists = {p: [tuple(x) for x in json.loads(v)] for p, v in sorted(values.items())}
    none = ("<none>", "<none>")
    for row in itertools.zip_longest(*lists.values(), fillvalue=none):
        seen = dict(zip(lists, row, strict=True))
        if len(set(seen.values())) > 1:
            leaf = next(path for path, _ in seen.values() if path != "<none>")
            named = ", ".join(
                f"{lbl!r} on process {p}"
                + ("" if path == leaf else f" (whose leaf is {path})")
                for p, (path, lbl) in seen.items()
            )
            return (
                f"`jdp.partition`: the processes label the params differently: leaf "
                f"{leaf} is labelled {named}. Every process must give every leaf the "
                "same label (the label decides which collectives the step runs; "
                "different labels would hang the step). Build the labels from the "
                "params' structure (e.g. a function of the path), not from anything "
                "that differs between processes."
            )
    return None


def agree_across_processes(leaf_labels: list[tuple[str, str]], *, client: Any = None,
                           process: int | None = None,
                           processes: list[int] | None = None) -> None:  # fmt: skip
    """Compares this process's `(path, label)` pairs with every other's.

    Through the coordination service (or `client`, for tests); nothing to do in
    one process. Among the processes of the step's devices (the live ones under
    `jdp.distributed.live`), the n-th trace on those devices meets the others' n-th.
    """
    process = jax.process_index() if process is None else process
    devices = _collectives.traced_devices()
    if processes is None:  # the processes of the step's devices
        processes = sorted({d.process_index for d in devices or jax.devices()})
    if len(processes) == 1 or (client is None and _coordination.client() is None):
        return
    values = _coordination.exchange(
        _next_key(devices), json.dumps(leaf_labels), process=process,
        processes=processes, timeout_s=AGREE_TIMEOUT_S, client=client,
    )  # fmt: skip
    if missing := sorted(set(processes) - values.keys()):
        raise TimeoutError(
            f"`jdp.partition`: processes {missing} did not publish their labels "
            f"within {AGREE_TIMEOUT_S:.0f} s of process {process} tracing the "
            "step; every process must run the same step."
        )
    if (message := differing_labels(values)) is not None:
        raise ValueError(message)


def _next_key(devices: tuple | None) -> str:
    """The store key of this process's next trace on `devices` (None: any)."""
    ids = tuple(d.id for d in devices) if devices else ()
    count = next(_traces.setdefault(ids, itertools.count()))
    where = hashlib.sha256(repr(ids).encode()).hexdigest()[:16] if ids else "all"
    return f"jdp/partition/{where}/{count}"


def _differs(piece) -> bool:
    """Whether a label's leaves may differ between replicas (left unsynced)."""
    return piece == PER_REPLICA or not getattr(piece, "averages", True)


def _agreed(labels, pieces) -> Callable[[PyTree], PyTree]:
    """`must_agree`: the state less the labels that may differ between replicas."""
    differ = {label for label, piece in pieces.items() if _differs(piece)}

    def must_agree(state):
        if not hasattr(state, "replace"):
            return None
        full = jax.tree.broadcast(_labels_of(labels, state.params), state.params)
        params = jax.tree.map(
            lambda lbl, p: None if lbl in differ else p, full, state.params
        )
        agreed = lambda label, x: _replica_parts.agreed(x) if label in differ else x  # noqa: E731
        opt_state = _transforms.map_label_states(state.opt_state, agreed)
        if opt_state is None:  # not an `optax.multi_transform`: the whole state
            opt_state = _replica_parts.agreed(state.opt_state)
        sync_state = _replica_parts.map_declared(state.sync_state, lambda path, x: x)
        return state.replace(params=params, opt_state=opt_state, sync_state=sync_state)

    return must_agree
