"""`jdp.partition`: a sync piece per label of the params, like `optax.partition`.

Each leaf of the params carries a label; each label has its own way to
synchronise its gradients: a `jdp.Sync` piece (`jdp.all_reduce()`,
`jdp.local()`), `"broadcast"` (replica 0's gradients on every replica) or
`"per_replica"` (never synced: the leaves differ between replicas by design).
The optimizer, an `optax.multi_transform` over the same labels, is applied once
to the whole tree, so its state is exactly what `multi_transform` makes
(`jdp.TrainState.create(params, tx)` works as it is).

Each label group's piece runs on its part of the gradients (the other leaves
None), with its own state, kept under the group in the partition's state.
`jdp.bmuf`'s block sync, under one label of `optax.multi_transform`, runs after
the update on the updated params of its label (as in `jdp.local()`), so the
replicas land on exactly the same bits after a sync.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jdp import _collectives, _coordination, _replica_parts, _sync, _transforms
from jdp._tree import keystr

PyTree = Any

#: Labels whose leaves are synchronised without a `jdp.Sync` piece.
BROADCAST = "broadcast"
PER_REPLICA = "per_replica"
_MODES = (BROADCAST, PER_REPLICA)

#: Seconds every process waits for the others' labels at the first trace.
AGREE_TIMEOUT_S = 120.0

_traces = itertools.count()

LABELS_DIFFER_MSG = (
    "`jdp.partition`: the processes label the params differently: leaf {leaf} "
    "is labelled {labels}. Every process must give every leaf the same label "
    "(the label decides which collectives the step runs; different labels would "
    "hang the step). Build the labels from the params' structure (e.g. a "
    "function of the path), not from anything that differs between processes."
)


def partition(
    labels: PyTree | Callable[[PyTree], PyTree],
    pieces: Mapping[str, _sync.Sync | str],
) -> _sync.Sync:
    """A sync piece per label of the params: some leaves all-reduced, others local.

    Like `optax.multi_transform` (`optax.partition`) for the optimizer:
    gradients are split by label, each label's piece synchronises its part,
    and the optimizer (an `optax.multi_transform` over the same labels, or any
    optimizer) is applied once to the whole tree. E.g. an embedding trained
    locally and averaged by `jdp.bmuf` every 16 steps while the dense layers
    are all-reduced every step:

        sync = jdp.partition(labels, {"dense": jdp.all_reduce(),
                                      "embed": jdp.local()})
        tx = optax.multi_transform(
            {"dense": adam, "embed": jdp.bmuf(adam, sync_period=16)}, labels)

    A label's value is any `jdp.Sync` (`jdp.all_reduce(...)`, `jdp.local()`,
    `jdp.powersgd(...)`, one of your own; a piece with state keeps it under the
    label, in the partition's state), or one of two names:

    - `"per_replica"`: never synced. Each replica trains its own copy (adapters,
      per-replica heads): the divergence guard does not compare these params
      (nor their optimizer state, under `optax.multi_transform`), and
      checkpoints save them with every replica.
    - `"broadcast"`: every replica applies replica 0's gradients
      (`jdp.broadcast`), so the leaves stay equal without an all-reduce.

    A `jdp.local()` label expects its part of the optimizer to sync itself (a
    `jdp.bmuf`); if the optimizer never communicates, the step warns, as for
    `jdp.local()` (`"per_replica"` says it is meant). Its params may differ
    between syncs: the divergence guard compares only what `jdp.bmuf` keeps in
    agreement.

    The labels are compared across processes when the step is first traced
    (through the coordination service): a leaf labelled differently on two
    processes fails there, naming the leaf, instead of hanging the step.

    Args:
      labels: A pytree of label strings with the params' structure (or a
        prefix of it), or a function `params -> labels`: the same as given to
        `optax.multi_transform`.
      pieces: `{label: piece}`: a `jdp.Sync`, `"per_replica"` or `"broadcast"`
        for every label that occurs. Labels that share one piece object are
        synchronised together (one bucketed all-reduce).

    Returns:
      A `jdp.Sync`, for `jdp.make_train_step(..., sync=...)`. Its state maps
      each group of labels whose piece keeps state to that state (labels that
      share a piece object are one group, named by its labels joined with
      "+"); None if no piece keeps any. A piece's metrics come back under
      `"<group>/<name>"`.

    Raises:
      TypeError: If `pieces` is not a mapping of str labels to pieces, or a
        piece is neither a `jdp.Sync` nor a known name.
      ValueError: If `pieces` is empty; at trace time, if a leaf's label has
        no piece, the labels are not a prefix of the params, or the processes
        label a leaf differently.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> params = {"embed": jnp.zeros((10, 2)), "head": jnp.zeros((2, 1))}
      >>> labels = {"embed": "embed", "head": "dense"}
      >>> def loss_fn(params, batch):
      ...     h = params["embed"][batch["ids"]].mean(axis=1)
      ...     return jnp.mean((h @ params["head"] - batch["y"]) ** 2)
      >>> adam = optax.adam(0.1)
      >>> tx = optax.multi_transform(
      ...     {"dense": adam, "embed": jdp.bmuf(adam, sync_period=4)}, labels)
      >>> sync = jdp.partition(labels, {"dense": jdp.all_reduce(),
      ...                               "embed": jdp.local()})
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, tx, sync=sync),
      ...                        devices=jax.devices()[:4])
      >>> state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
      >>> ids = jnp.arange(16).reshape(8, 2) % 10
      >>> batch = step.shard({"ids": ids, "y": jnp.ones((8, 1))})
      >>> for _ in range(4):
      ...     state, metrics = step(state, batch)
      >>> jdp.replicas_in_sync(state.params)  # the 4th step synced the embedding
      True
    """
    pieces = _check_pieces(pieces)

    def groups(grads, params):
        """`(key, piece, part of grads, part of params)` of every label group."""
        tree = _labels_of(labels, params)
        leaf_labels = _leaf_labels(tree, grads, pieces)
        flat, treedef = jax.tree_util.tree_flatten(grads)
        params_flat = treedef.flatten_up_to(params)
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
                done, new, extra = piece.update(
                    part, new_state.get(key), part_params, axis_name
                )
                if key in new_state:
                    new_state[key] = new
                extra.pop(_sync.KEPT, None)  # the loss is every replica's here
                metrics.update({f"{key}/{name}": v for name, v in extra.items()})
            done_flat = treedef.flatten_up_to(done)
            for i, m in enumerate(mine):
                if m:
                    synced[i] = done_flat[i]
        return treedef.unflatten(synced), (new_state or state), metrics

    # "per_replica" leaves are meant to differ; `jdp.local()` ones are left
    # for the optimizer to sync.
    averages = all(
        p in _MODES or (isinstance(p, _sync.Sync) and p.averages)
        for p in pieces.values()
    )
    differ = any(
        p == PER_REPLICA or (isinstance(p, _sync.Sync) and not p.averages)
        for p in pieces.values()
    )
    return _sync.Sync(
        init,
        update,
        averages=averages,
        must_agree=_agreed(labels, pieces) if differ else None,
    )


# -- construction --------------------------------------------------------------------


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
        if isinstance(piece, str):
            if piece not in _MODES:
                raise TypeError(
                    f"`jdp.partition`: the piece of label {label!r} is {piece!r}; "
                    f"a name must be one of {_MODES}, or give a `jdp.Sync` such "
                    "as `jdp.all_reduce()` or `jdp.local()`."
                )
            continue
        if not isinstance(piece, _sync.Sync):
            raise TypeError(
                f"`jdp.partition`: the piece of label {label!r} must be a "
                f"`jdp.Sync` (e.g. `jdp.all_reduce()`, `jdp.local()`) or one of "
                f"{_MODES}; got {type(piece).__name__}."
            )
    return dict(pieces)


def _groups(pieces, used) -> list[tuple[str, ...]]:
    """The used labels, grouped by piece object (one sync per group), in order."""
    groups: dict[int, list[str]] = {}
    for label in sorted(used):
        groups.setdefault(id(pieces[label]), []).append(label)
    return [tuple(g) for g in groups.values()]


# -- labels --------------------------------------------------------------------------


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
    """The error for processes' label lists that differ, or None if all agree.

    Args:
      values: `{process: labels}`, each a JSON list of `[path, label]` pairs
        (what every process publishes).

    Returns:
      A message naming the first leaf whose label differs (and each process's
      label of it), or None.
    """
    lists = {p: [tuple(x) for x in json.loads(v)] for p, v in sorted(values.items())}
    if len({json.dumps(v) for v in lists.values()}) <= 1:
        return None
    longest = max(len(v) for v in lists.values())
    for i in range(longest):
        seen = {
            p: (v[i] if i < len(v) else ("<none>", "<none>")) for p, v in lists.items()
        }
        if len(set(seen.values())) > 1:
            leaf = next(path for path, _ in seen.values() if path != "<none>")
            named = ", ".join(
                f"{lbl!r} on process {p}"
                + ("" if path == leaf else f" (whose leaf is {path})")
                for p, (path, lbl) in seen.items()
            )
            return LABELS_DIFFER_MSG.format(leaf=leaf, labels=named)
    return None  # pragma: no cover (lists that differ differ at some index)


def agree_across_processes(
    leaf_labels: list[tuple[str, str]],
    *,
    client: Any = None,
    process: int | None = None,
    processes: list[int] | None = None,
) -> None:
    """Compares the labels with every other process's (at trace time).

    Each process publishes its `(path, label)` pairs in the coordination
    service and reads the others' (nothing to do in one process, or without
    `jax.distributed`).

    Args:
      leaf_labels: This process's `(path, label)` of every leaf.
      client: A key-value store to use instead of the coordination service's
        client (for tests).
      process: This process's index (default: `jax.process_index()`).
      processes: The processes that compare (default: every process).

    Raises:
      ValueError: If another process labels a leaf differently (naming it).
      TimeoutError: If a process did not publish in time.
    """
    process = jax.process_index() if process is None else process
    processes = list(range(jax.process_count())) if processes is None else processes
    if len(processes) == 1:
        return
    if client is None and _coordination.client() is None:
        return
    number = next(_traces)
    values = _coordination.exchange(
        f"jdp/partition/{number}",
        json.dumps(leaf_labels),
        process=process,
        processes=processes,
        timeout_s=AGREE_TIMEOUT_S,
        client=client,
    )
    missing = sorted(set(processes) - values.keys())
    if missing:
        raise TimeoutError(
            f"`jdp.partition`: processes {missing} did not publish their labels "
            f"within {AGREE_TIMEOUT_S:.0f} s of process {process} tracing the "
            "step; every process must run the same step."
        )
    message = differing_labels(values)
    if message is not None:
        raise ValueError(message)


# -- the step ------------------------------------------------------------------------


# -- what replicas agree on ---------------------------------------------------------


def _agreed(labels, pieces) -> Callable[[PyTree], PyTree]:
    """`must_agree`: the state less the labels that may differ between replicas."""
    differ = {
        label
        for label, piece in pieces.items()
        if piece == PER_REPLICA
        or (isinstance(piece, _sync.Sync) and not piece.averages)
    }

    def must_agree(state):
        if not hasattr(state, "replace"):
            return None
        tree = _labels_of(labels, state.params)
        full = jax.tree.broadcast(tree, state.params)
        params = jax.tree.map(
            lambda lbl, p: None if lbl in differ else p, full, state.params
        )
        opt_state = _transforms.map_label_states(
            state.opt_state,
            lambda label, inner: (
                _replica_parts.agreed(inner) if label in differ else inner
            ),
        )
        if opt_state is None:  # not an `optax.multi_transform`: the whole state
            opt_state = _replica_parts.agreed(state.opt_state)
        return state.replace(
            params=params,
            opt_state=opt_state,
            sync_state=_replica_parts.less_local(state.sync_state),
        )

    return must_agree
