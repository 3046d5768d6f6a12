"""Private: the replica-divergence guard of `jdp.parallelize(..., check_sync=K)`.

After the first call and then every K-th call, `Parallel` fingerprints every
leaf that replicas must agree on (a hash of its bits), in a program of its own,
and compares the replicas; over several processes `Guard` first checks that
every process passed the same `check_sync`.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jdp import _coordination, _progress, _replica_parts
from jdp._layout import compare_replicas, is_key, mesh_axis
from jdp._tree import PyTree, as_real, keystr

# The start and end every divergence message shares.
_DIVERGED = (
    "`jdp.parallelize(..., check_sync=...)`: the replicas' states diverged during "
    "step call {call}: {leaf} differs between replica 0 and replica {replica} "
    "({count} of {total} checked leaves differ"
)
_RESET = (
    " The state the step returned is `error.state`; `step.broadcast(error.state)` "
    "resets every replica to replica 0."
)

DIVERGED_MSG = (
    _DIVERGED
    + "{more}). A synchronous step keeps every replica identical, so the step "
    "most likely does not average its gradients (or syncs computed state on one "
    "replica only): use `jdp.make_train_step`, or `jdp.all_reduce_gradients` / "
    "`jdp.sync_gradients` and `jdp.sync_batch_stats` in your own step. For "
    "deliberately local training (local SGD, your own model averaging) pass "
    "`check_sync=None` to `jdp.parallelize`." + _RESET
)

LOCAL_MSG = (
    _DIVERGED + "{more}). The state holds an optimizer that trains each replica on its "
    "own gradients (`jdp.bmuf`): between syncs the params and the optimizer state "
    "shaped like them may differ, but everything else must be equal on every "
    "replica (the global model, step counters, hyper-parameters, other state). "
    "Compute such parts from values every replica shares, not from the replica's "
    "own batch or `lax.axis_index`, or average them (`lax.pmean`); for a part "
    "that differs by design, pass `check_sync=None` to `jdp.parallelize`." + _RESET
)

METRICS_MSG = (
    _DIVERGED + ", all of them flax NNX metric accumulators). Each replica's metrics "
    "(an `nnx.MultiMetric` in the state, as in the NNX tutorial) counted only its "
    "own examples. Update them with every replica's values, e.g. "
    "`metrics.update(loss=lax.pmean(loss, {axis}), logits=lax.all_gather(logits, "
    "{axis}, tiled=True), labels=lax.all_gather(labels, {axis}, tiled=True))`, so "
    "that every replica counts the global batch; or keep them out of the state "
    "and update them on the host from what the step returns "
    "(`jdp.metrics.gather(logits)`)." + _RESET
)

KEYS_MSG = (
    _DIVERGED + ", all of them PRNG keys). Each replica stored a key of its own "
    "back into the state (`jdp.replica_key(state.rng)`, or a key folded with "
    "`lax.axis_index`), so the state's key differs between replicas. Keep the "
    "state's key the same on every replica and make per-replica keys for the draws "
    "only: `rng, sub = jax.random.split(state.rng)`, store `rng`, draw with "
    "`jdp.replica_key(sub)`." + _RESET
)

BATCH_STATS_MSG = (
    _DIVERGED + ", all of them BatchNorm statistics). Each replica normalised with the "
    "statistics of its own examples. Give BatchNorm the replica axis, "
    "`axis_name={axis}` (flax `nn.BatchNorm` or `nnx.BatchNorm`), so that every "
    "replica uses the global batch's statistics, or average them after the update "
    "with `jdp.sync_batch_stats` (`jdp.make_train_step` does this for a state's "
    "`batch_stats`)." + _RESET
)


DIFFERENT_CHECK_SYNC_MSG = (
    "`jdp.parallelize(..., check_sync=...)`: the processes passed different "
    "values of `check_sync` to this step: {values}. The check is a collective "
    "across the processes that runs on some step calls only (the first, then "
    "every `check_sync`-th), so with different values the processes would run "
    "different programs at those calls and wait for each other forever. Pass "
    "the same `check_sync` on every process. (Steps are matched across processes "
    "by the order in which each process builds them over the same devices: this "
    "is the {nth} step over these devices built in each process.)"
)

MISSING_CHECK_SYNC_MSG = (
    "`jdp.parallelize(..., check_sync=...)`: at its first call of this step, "
    "process {me} waited {timeout:g} s for {who} to make its first call of the "
    "same step (the {nth} step over these devices built in each process) "
    "and compare `check_sync`, in vain. Every process must build the same steps, "
    "in the same order, and call each of them."
)

#: Seconds a process waits, at its first call of a step over several processes,
#: for the other processes' `check_sync` (see `Guard`).
AGREE_TIMEOUT_S = 300.0

# Steps over several processes built so far in this process, per ordered device
# list: numbers them, the same on every process that builds its steps over those
# devices in the same order (a process that joins later builds fewer before).
_multi_process_guards: dict[str, itertools.count] = {}


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10)
    return f"{n}{suffix or 'th'}"


class ReplicaDivergenceError(RuntimeError):
    """Replicas of a synchronous step's state hold different values.

    Raised by a `jdp.parallelize` step (`check_sync`) after the call that made
    them differ.

    Attributes:
      state: The replicated state that call returned (continue from it, or
        reset it with `step.broadcast(error.state)`).
      leaf: The path of the first leaf whose replicas differ, e.g.
        `.params['dense']['kernel']`.
      replica: A replica whose copy of that leaf differs from replica 0's.
    """

    def __init__(self, message: str, *, state: PyTree, leaf: str, replica: int):
        super().__init__(message)
        self.state, self.leaf, self.replica = state, leaf, replica


def _bits(x: jax.Array) -> jax.Array:
    """`x` as unsigned integers of its own width (keys: their key data)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    x = as_real(x)
    # 64-bit and complex leaves become pairs of 32-bit words (a trailing axis).
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
    return lax.bitcast_convert_type(x, unsigned[min(jnp.dtype(x.dtype).itemsize, 4)])


def _fingerprints(leaves: list[jax.Array]) -> jax.Array:
    """`(num_leaves, num_replicas)` 32-bit hashes, per leaf and replica.

    The wrapping sum of each element's bits mixed with its position
    (MurmurHash3's finaliser), so permuted values and changes that cancel in a
    plain sum show too; differing states collide with probability ~2**-32.
    """
    rows = []
    for x in leaves:
        bits = _bits(x).reshape(x.shape[0], -1).astype(jnp.uint32)
        position = lax.broadcasted_iota(jnp.uint32, bits.shape, 1)
        h = bits ^ (position * jnp.uint32(0x9E3779B9))
        h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
        h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
        h = h ^ (h >> 16)
        rows.append(jnp.sum(h, axis=1, dtype=jnp.uint32))
    return jnp.stack(rows)


def _all_of_kind(tree: PyTree, leaves: list[str], kind: str) -> bool:
    """Whether every diverging leaf is a "metric" accumulator or a "batch_stat"."""
    prefixes = []
    if kind == "batch_stat":  # linen's collection, or a `jdp.TrainState` field
        prefixes += ["['batch_stats']", ".batch_stats"]
    nnx = sys.modules.get("flax.nnx")  # no NNX variables unless it was imported
    if nnx is not None:
        cls = nnx.metrics.MetricState if kind == "metric" else nnx.BatchStat
        is_kind = lambda x: isinstance(x, cls)  # noqa: E731
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_kind)[0]
        prefixes += [keystr(path) for path, x in flat if is_kind(x)]
    return all(any(p.startswith(m) for m in prefixes) for p in leaves)


def _all_keys(tree: PyTree, leaves: list[str]) -> bool:
    """Whether every diverging leaf is a typed PRNG key."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    keys = {keystr(path) for path, x in flat if is_key(x)}
    return all(p in keys for p in leaves)


def check(tree: PyTree, mesh: Mesh, *, state: PyTree, call: int) -> None:
    """Raises `ReplicaDivergenceError`, naming a likely cause, if replicas differ."""
    paths, prints = compare_replicas(_fingerprints, tree)
    if not paths:
        return
    prints = np.asarray(prints)
    differ = prints != prints[:, :1]
    bad = np.flatnonzero(differ.any(axis=1))
    if not bad.size:
        return
    leaves = [paths[i] for i in bad]
    replica = int(np.flatnonzero(differ[int(bad[0])])[0])
    if _all_of_kind(tree, leaves, "metric"):
        template = METRICS_MSG
    elif _all_of_kind(tree, leaves, "batch_stat"):
        template = BATCH_STATS_MSG
    elif _all_keys(tree, leaves):
        template = KEYS_MSG
    elif _replica_parts.trains_locally(state):
        template = LOCAL_MSG
    else:
        template = DIVERGED_MSG
    message = template.format(
        call=call, leaf=leaves[0], replica=replica, count=len(leaves), total=len(paths),
        axis=repr(mesh_axis(mesh)),
        more="" if len(leaves) == 1 else "; the first is named",
    )  # fmt: skip
    raise ReplicaDivergenceError(message, state=state, leaf=leaves[0], replica=replica)


class Guard:
    """`check_sync`: compares the replicas' agreed state at call 1 and every `every`."""

    def __init__(self, every: int | None, agreed: Callable, mesh: Mesh):
        self.every = every if mesh.size > 1 else None
        self.agreed, self.mesh = agreed, mesh
        processes = sorted({d.process_index for d in mesh.devices.flat})
        # The processes to compare `check_sync` with (None: done, or just one).
        self._processes = processes if len(processes) > 1 else None
        self._devices = ",".join(str(d.id) for d in mesh.devices.flat)
        counter = _multi_process_guards.setdefault(self._devices, itertools.count())
        self._number = next(counter) if self._processes else None
        self._requested = every
        self._error: str | None = None  # the message of differing values

    def due(self, calls: int) -> bool:
        if self._processes is not None or self._error is not None:
            self._agree()
        return self.every is not None and (calls == 1 or calls % self.every == 0)

    def _agree(self, client: Any = None) -> None:
        """Compares `check_sync` with the other processes once; raises if they differ.

        `client` replaces the coordination service's key-value store in tests.
        """
        if self._error is not None:
            raise ValueError(self._error)
        processes, self._processes = self._processes, None
        if client is None and _coordination.client() is None:
            return  # not joined through `jax.distributed`: nothing to compare with
        me = jax.process_index()
        nth = _ordinal(self._number + 1)
        values = _coordination.exchange(
            f"jdp/check_sync/{self._devices}/{self._number}", repr(self._requested),
            process=me, processes=processes, timeout_s=AGREE_TIMEOUT_S, client=client,
        )  # fmt: skip
        if missing := [p for p in processes if p not in values]:
            who = _progress.process_list(missing)
            raise TimeoutError(MISSING_CHECK_SYNC_MSG.format(
                me=me, timeout=AGREE_TIMEOUT_S, who=who, nth=nth
            ))  # fmt: skip
        if len(set(values.values())) > 1:
            listed = ", ".join(f"process {p}: {values[p]}" for p in processes)
            self._error = DIFFERENT_CHECK_SYNC_MSG.format(values=listed, nth=nth)
            raise ValueError(self._error)

    def __call__(self, state: PyTree, *, call: int) -> None:
        check(self.agreed(state), self.mesh, state=state, call=call)
