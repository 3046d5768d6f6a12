"""Private: the only module that calls `jax.pmap` / `jax.shard_map`.

Both backends run the same per-replica body and use the same state layout
(`jdp._layout`): every state leaf carries a leading replica axis sharded over the
mesh. They differ only in how they see it:

- `"shard_map"`: `jax.jit(jax.shard_map(body))`; the body's blocks keep a size-1
  replica axis, which this module removes on the way in and restores on the way out;
  the batch stays `(B, ...)`, sharded on its leading axis. A donating training step
  runs on a concatenated view of the same buffers instead, so that XLA updates the
  donated state in place (see `_DonatingShardMapStep`). Works on 1-D and 2-D meshes.
- `"pmap"`: `jax.pmap(body)`, which is rank-reducing; the batch is laid out as
  `(num_replicas, B / num_replicas, ...)`, the layout pmap users know. 1-D only.

A backend offers three things (`Backend`): build a step, build a map over the
replicas, and place a batch leaf. A built `Step` decides once, by tracing, whether
the body returns a state: a forward-only step never donates its input.

`check_vma=False` gives `shard_map` pmap's semantics: the per-replica state is
varying along the axis, so gradients of it are never summed implicitly (the
`check_vma=True` pitfall, where a `P()` parameter's gradient arrives pre-summed and a
`pmean` on top multiplies it by the device count, cannot occur).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp._layout import mesh_axis, replica_sharding
from jdp._tree import format_problems, keystr, repeated_paths

PyTree = Any
BackendName = Literal["pmap", "shard_map"]
BACKENDS = ("pmap", "shard_map")
Body = Callable[[Any, Any], tuple[Any, Any]]

SHARED_LEAVES_MSG = (
    "`step`: the state holds the same array in more than one leaf, and a step that "
    "donates its state (`donate_state=True`) cannot hand one buffer to XLA twice. "
    "Shared leaves:{probs}\nFix: keep one copy of a tied array in the state (and "
    "look it up in both places in your step), give each leaf its own array "
    "(`step.replicate` does), or pass `donate_state=False` to `jdp.parallelize`."
)

_DONATION_WARNING = "Some donated buffers were not usable"


def _squeeze(x):
    return x.reshape(x.shape[1:])


def _expand(x):
    return x.reshape((1,) + x.shape)


def _apply(leaves: list, idx: list[int], fn) -> bool:
    """Replaces `leaves[i]` for `i` in `idx` by `fn(list of them)`; whether any."""
    if idx:
        for i, y in zip(idx, fn([leaves[i] for i in idx]), strict=True):
            leaves[i] = y
    return bool(idx)


def check_distinct(state: PyTree) -> None:
    """Refuses a state that holds one array in two leaves (it cannot be donated).

    Donating one buffer twice crashes the process (PjRt rejects it, then jax
    segfaults).
    """
    leaves = jax.tree.leaves(state)
    if len({id(x) for x in leaves}) == len(leaves):
        return
    probs = [
        f"{later} is the same array as {first}"
        for first, later in repeated_paths(state)
    ]
    raise ValueError(SHARED_LEAVES_MSG.format(probs=format_problems(probs)))


class Step:
    """A built step: `(replicated state, placed batch) -> (state or None, metrics)`.

    `train` donates its state argument (when asked to), `forward` never does;
    both are called as `run(state, batch, *, returned, flat) -> (new_state or
    None, metrics, new leaves or None)` and lowered as `lower(state, batch)`.
    Whether the body returns a state is decided once, by tracing `train` (the
    trace is the one the first call uses), so that a forward-only step runs
    `forward` and never deletes its input.

    On simulated CPU devices one step is kept in flight: XLA:CPU runs every
    device's program on one thread pool, and with several steps queued the
    devices' threads can block in different steps' collective rendezvous and
    never meet (XLA aborts after 40 s). Waiting for the previous step before
    dispatching the next costs about one dispatch latency per step.
    """

    def __init__(self, train, forward, *, donate: bool, out_state, mesh: Mesh):
        self._train = train
        self._forward = forward
        self._donate = donate
        self._trace_out_state = out_state
        self.returns_state: bool | None = None
        #: The abstract state a donating train step returns (known before its
        #: first call, from the trace), or None.
        self.out_state: Any = None
        devices = list(mesh.devices.flat)
        self._throttle = len(devices) > 1 and all(d.platform == "cpu" for d in devices)
        self._in_flight: list[jax.Array] = []

    def _pick(self, state, batch, *, returned: bool = False):
        if not self._donate:
            return self._forward
        if self.returns_state is None:
            self.out_state = self._trace_out_state(state, batch)
            self.returns_state = self.out_state is not None
        if not self.returns_state:
            return self._forward
        if not returned:
            check_distinct(state)
        return self._train

    def __call__(self, state, batch, *, before=None, returned: bool = False, flat=None):
        """Runs the step; `before(state, out_state)` first, once, when known early.

        `returned`: the caller knows `state` is what the last call returned (no
        leaf deleted since): no two of its leaves are one array, so donating it
        needs no check, and its layout is the one the last call saw. `flat`:
        `jax.tree.flatten(state)`, if the caller has it.

        Returns:
          `(new_state, metrics, out_leaves)`: `out_leaves` is the new state's
          leaves when the step flattened it anyway, else None.
        """
        first = self.returns_state is None
        fn = self._pick(state, batch, returned=returned)
        if before is not None and first and self.out_state is not None:
            before(state, self.out_state)
        if self._throttle:
            self._wait_for_previous_step()
        new_state, metrics, out_leaves = fn.run(
            state, batch, returned=returned, flat=flat
        )
        if self.returns_state is None:
            self.returns_state = new_state is not None
        if self._throttle:
            pending = jax.tree.leaves(metrics)
            if not pending:
                out = jax.tree.leaves(new_state) if out_leaves is None else out_leaves
                pending = out[:1]
            self._in_flight = pending
        return new_state, metrics, out_leaves

    def _wait_for_previous_step(self) -> None:
        pending = [x for x in self._in_flight if not x.is_deleted()]
        self._in_flight = []
        try:
            jax.block_until_ready(pending)
        except jax.errors.JaxRuntimeError:
            pass  # the failed step's outputs raise for whoever reads them

    def lower(self, state, batch) -> jax.stages.Lowered:
        """Lowers what a call with these arguments runs."""
        fn = self._pick(state, batch)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DONATION_WARNING)
            return fn.lower(state, batch)


class Returned:
    """Weak references to the leaves of the state a step last returned.

    A state whose leaves are exactly those arrays, none of them deleted (by a
    donating call of another step, or by hand), was laid out by the step itself:
    it needs none of the per-leaf placement checks, which cost about 1.5 us a
    leaf on every call. A forward-only step, which never donates, remembers the
    state it last checked instead: an evaluation loop passes the same state
    call after call. Weak references keep no state alive.
    """

    def __init__(self):
        self._refs: list[weakref.ref] | None = None

    def remember(self, leaves: list[Any]) -> None:
        """Remembers the leaves of a state: returned, or checked (forward-only)."""
        try:
            self._refs = [weakref.ref(x) for x in leaves]
        except TypeError:  # a leaf that takes no weak reference
            self._refs = None

    def holds(self, leaves: list[Any]) -> bool:
        """Whether `leaves` (of a state) are those remembered, none deleted."""
        refs = self._refs
        if refs is None:
            return False
        return (
            len(leaves) == len(refs)
            and all(r() is x for r, x in zip(refs, leaves, strict=True))
            and not any(x.is_deleted() for x in leaves)
        )


class Backend:
    """How a step runs on a mesh: build a step or a map, place a batch leaf."""

    name: BackendName

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.axis_name = mesh_axis(mesh)
        self.sharding = replica_sharding(mesh)

    def build_step(self, body: Body, *, donate: bool) -> Step:
        """Compiles-on-call `body(state, batch) -> (state | None, metrics)` per replica.

        The built step takes (replicated state, placed batch) and returns
        (replicated state or None, metrics replicated as one value).
        """
        raise NotImplementedError

    def build_map(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Runs `fn(tree) -> tree` per replica on a replicated tree (no donation)."""
        raise NotImplementedError

    def place_batch_leaf(self, x: np.ndarray) -> jax.Array:
        """Places one process-local batch leaf (leading axis: examples)."""
        raise NotImplementedError

    def batch_problems(self, batch: PyTree) -> list[str]:
        """Leaves of a placed batch whose shapes do not fit this backend."""
        return []


def make_backend(name: BackendName, mesh: Mesh) -> Backend:
    """The backend called `name` on `mesh`."""
    return {"pmap": _Pmap, "shard_map": _ShardMap}[name](mesh)


# -- pmap --------------------------------------------------------------------------


class _TreeStep:
    """A step called on the state as a tree (`jax.pmap` flattens it itself)."""

    def __init__(self, fn):
        self._fn = fn
        self.lower = fn.lower

    def run(self, state, batch, *, returned: bool = False, flat=None):
        """`(new_state or None, metrics, None)`: the new leaves are not at hand."""
        del returned, flat
        new_state, metrics = self._fn(state, batch)
        return new_state, metrics, None


class _Pmap(Backend):
    name = "pmap"

    def _pmap(self, fn, **kwargs):
        return jax.pmap(
            fn,
            axis_name=self.axis_name,
            devices=list(self.mesh.devices.flat),
            **kwargs,
        )

    def _global(self, fn, *, mapped_outputs=None, replace=None):
        """Keeps pmap's replicated outputs global when there are several processes.

        With several processes `jax.pmap` returns host-local arrays (each process
        sees its own replicas). jdp's layout is one global array over the mesh on
        both backends, so the mapped outputs are rewrapped as global arrays (no
        copy).
        """
        if jax.process_count() == 1:
            return fn
        from jax.experimental import multihost_utils

        mapped_outputs = mapped_outputs or (lambda out: out)
        replace = replace or (lambda out, tree: tree)

        def call(*args):
            out = fn(*args)
            tree = multihost_utils.host_local_array_to_global_array(
                mapped_outputs(out), self.mesh, P(self.axis_name)
            )
            return replace(out, tree)

        call.lower = fn.lower
        return call

    def build_step(self, body: Body, *, donate: bool) -> Step:
        def build(donate_argnums):
            return self._pmap(
                body,
                # Both arguments on axis 0, said as `0`: pmap's fast path (a
                # tuple costs a per-leaf broadcast of the axes on every call).
                in_axes=0,
                out_axes=(0, None),
                donate_argnums=donate_argnums,
            )

        def global_step(fn):
            return self._global(
                fn,
                mapped_outputs=lambda out: out[0],
                replace=lambda out, state: (state, out[1]),
            )

        forward = build(())
        train = build((0,)) if donate else forward

        num_local = len(self.mesh.local_devices)

        def out_state(state, batch):
            # pmap shares this trace with its first call. With several processes
            # pmap takes each process's own replicas: trace with their shapes.
            if jax.process_count() > 1:
                state, batch = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct((num_local,) + x.shape[1:], x.dtype),
                    (state, batch),
                )
            out = jax.eval_shape(train, state, batch)[0]
            n = self.mesh.size
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((n,) + x.shape[1:], x.dtype), out
            )

        return Step(
            _TreeStep(global_step(train)),
            _TreeStep(global_step(forward)),
            donate=donate,
            out_state=out_state,
            mesh=self.mesh,
        )

    def build_map(self, fn):
        return self._global(self._pmap(fn))

    def place_batch_leaf(self, x: np.ndarray) -> jax.Array:
        num_local = len(self.mesh.local_devices)
        x = x.reshape((num_local, x.shape[0] // num_local) + x.shape[1:])
        return jax.make_array_from_process_local_data(self.sharding, x)

    def batch_problems(self, batch: PyTree) -> list[str]:
        n = self.mesh.size
        return [
            f"{keystr(path)}: shape {x.shape}, expected ({n}, examples per "
            "replica, ...)"
            for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
            if x.shape[0] != n
        ]


# -- shard_map ---------------------------------------------------------------------


class _ShardMap(Backend):
    name = "shard_map"

    def _map_step(self, body, block_in, block_out):
        def block_body(state, batch):
            new_state, metrics = body(jax.tree.map(block_in, state), batch)
            return jax.tree.map(block_out, new_state), metrics

        return jax.shard_map(
            block_body,
            mesh=self.mesh,
            in_specs=(P(self.axis_name), P(self.axis_name)),
            out_specs=(P(self.axis_name), P()),
            check_vma=False,
        )

    def build_step(self, body: Body, *, donate: bool) -> Step:
        stacked = _flat_step(self._map_step(body, _squeeze, _expand), donate=False)
        forward = _PlaceEmptyLeaves(stacked, self.sharding)
        if not donate:
            return Step(forward, forward, donate=False, out_state=None, mesh=self.mesh)
        core = _flat_step(self._map_step(body, _block_in, _block_out), donate=True)
        train = _DonatingShardMapStep(core, mesh=self.mesh, sharding=self.sharding)
        return Step(
            train, forward, donate=True, out_state=train.out_state, mesh=self.mesh
        )

    def build_map(self, fn):
        def block_fn(tree):
            return jax.tree.map(_expand, fn(jax.tree.map(_squeeze, tree)))

        return jax.jit(
            jax.shard_map(
                block_fn,
                mesh=self.mesh,
                in_specs=P(self.axis_name),
                out_specs=P(self.axis_name),
                check_vma=False,
            )
        )

    def place_batch_leaf(self, x: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.sharding, x)

    def batch_problems(self, batch: PyTree) -> list[str]:
        # Placed by hand for another mesh axis name: most likely flax's
        # `prefetch_to_device`, which lays batches out for pmap as (devices,
        # examples per device, ...); this step would see (1, examples, ...).
        names = tuple(self.mesh.axis_names)
        return [
            f"{keystr(path)}: shape {x.shape} on a mesh with axis names "
            f"{tuple(x.sharding.mesh.axis_names)} (this step's: {names}), the "
            "pmap layout of flax's `prefetch_to_device`"
            for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
            if isinstance(x.sharding, NamedSharding)
            and tuple(x.sharding.mesh.axis_names) != names
        ]


def _place_empty_leaves(
    out: list, sharding: NamedSharding, idx: list[int] | None = None
) -> list[int]:
    """Gives the zero-size leaves of `out` the replica sharding, in place.

    jit returns them replicated. `idx`: their indices, if known (a step's
    outputs keep their layout from call to call). Returns the indices.
    """
    if idx is None:
        idx = [i for i, x in enumerate(out) if x.size == 0 and x.sharding != sharding]
    _apply(out, idx, lambda xs: jax.device_put(xs, sharding))
    return idx


class _PlaceEmptyLeaves:
    """A jitted shard_map step, not donating, on the state's leaves.

    Its empty state leaves keep the replica sharding (jit returns them
    replicated); see `_flat_step` for why it takes leaves.
    """

    def __init__(self, fn, sharding: NamedSharding):
        self._fn = fn
        self._sharding = sharding

    def run(self, state, batch, *, returned: bool = False, flat=None):
        """`(new_state or None, metrics, new leaves or None)`; `flat` as in `Step`."""
        del returned  # nothing is donated: the state's layout is checked anyway
        leaves, treedef = flat if flat is not None else jax.tree.flatten(state)
        out, metrics = self._fn(list(leaves), batch, treedef)
        if out is None:
            return None, metrics, None
        out = list(out)
        _place_empty_leaves(out, self._sharding)
        return jax.tree.unflatten(treedef, out), metrics, out

    def lower(self, state, batch) -> jax.stages.Lowered:
        leaves, treedef = jax.tree.flatten(state)
        return self._fn.lower(leaves, batch, treedef)


# -- the donating shard_map step ---------------------------------------------------
#
# With the replica axis in every block, a donated step updates `(1, ...)` buffers
# through `(...)`-shaped computations. XLA:CPU cannot update a buffer in place
# through the bitcast between the two, so it copies every updated leaf (16 whole
# copies for a 4-layer MLP with momentum, about 20% of its step time). The
# donating step therefore runs on a *concatenated* view of the state: a leaf of
# per-replica shape `(d0, d1, ...)` is viewed as `(N * d0, d1, ...)`, whose block
# on each device is exactly the replica's shape. The views are made by two tiny
# donated jits whose reshapes are bitcasts of the same buffers (no copy, no
# collective); the caller only ever sees the `(N, ...)` layout.
#
# Leaves whose per-replica shape is `()`, starts with 0 or 1 (their view would be
# ambiguous, or lose its sharding), or holds under `VIEW_MIN_BYTES` keep the
# stacked layout and are squeezed in the block as before. The rules below are
# exact inverses, without side information ("viewable": see `_viewable`):
#   view:      (N, d0, ...) -> (N * d0, ...)        when viewable (else unchanged)
#   block in:  (1, ...) -> squeezed                 (else the replica's shape)
#   block out: unchanged when viewable              (else expanded to (1, ...))
#   unview:    (N * d0, ...) -> (N, d0, ...)        when the leading size is not N


# Leaves smaller than this (per replica) stay stacked: XLA's copy of a small leaf
# costs less than dispatching its buffers through the two views.
VIEW_MIN_BYTES = 1 << 16


def _viewable(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether a leaf of per-replica `shape` runs on the concatenated view."""
    return (
        len(shape) >= 1
        and shape[0] > 1
        and math.prod(shape) * itemsize >= VIEW_MIN_BYTES
    )


def _needs_view(x) -> bool:
    return _viewable(x.shape[1:], x.dtype.itemsize)


def _view_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0] * shape[1],) + tuple(shape[2:])


def _block_in(x):
    return x.reshape(x.shape[1:]) if x.shape[0] == 1 else x


def _block_out(x):
    return x if _viewable(x.shape, x.dtype.itemsize) else _expand(x)


def _flat_step(mapped, *, donate: bool):
    """`jit(mapped)` on leaves: `(leaves, batch, treedef) -> (leaves, metrics)`.

    The caller has the state's leaves already (it checks them) and needs the new
    state's (to unview them, and to recognise the state on the next call). Given
    and returning leaves, jit flattens and rebuilds nothing but a list: for flax
    NNX modules, whose flatten and unflatten run in Python, that saves two
    traversals of the modules a call. `treedef` is static, and the new state has
    that structure too (the step's body refuses another while tracing:
    `jdp._layout.check_same_structure`); a forward-only step returns None for it.
    """

    def flat(leaves, batch, treedef):
        new_state, metrics = mapped(jax.tree.unflatten(treedef, leaves), batch)
        if new_state is None:  # forward-only: found when tracing, never run
            return None, metrics
        return jax.tree.leaves(new_state), metrics

    return jax.jit(flat, static_argnums=2, donate_argnums=0 if donate else ())


class _DonatingShardMapStep:
    """A donating `jit(shard_map(body))` step that updates the state in place.

    Calls run three executables: a view of the state's buffers as concatenated
    blocks (donated, a bitcast), `core`, the step on that view (donated, called
    on the state's leaves: see `_flat_step`), and the view back (donated, a
    bitcast).
    """

    def __init__(self, core, *, mesh: Mesh, sharding: NamedSharding):
        self._core = core
        self._picked: tuple[list[int], list[int], list[int]] | None = None
        self._n = n = mesh.size
        self._sharding = sharding
        self._view = jax.jit(
            lambda xs: [x.reshape(_view_shape(x.shape)) for x in xs],
            donate_argnums=0,
            out_shardings=sharding,
        )
        self._unview = jax.jit(
            lambda xs: [x.reshape((n, x.shape[0] // n) + x.shape[1:]) for x in xs],
            donate_argnums=0,
            out_shardings=sharding,
        )

    def _trace(self, state, batch):
        """The trace of the step on the view of `state`, and `state`'s treedef."""

        def spec(x):
            shape = _view_shape(x.shape) if _needs_view(x) else x.shape
            return jax.ShapeDtypeStruct(
                shape,
                x.dtype,
                sharding=self._sharding,
                weak_type=getattr(x, "weak_type", False),
            )

        leaves, treedef = jax.tree.flatten(state)
        specs = [spec(x) for x in leaves]
        return self._core.trace(specs, batch, treedef), treedef

    def out_state(self, state, batch):
        """Traces the step (the trace its first call reuses): its abstract state.

        None for a step that returns no state; shapes in the caller's `(N, ...)`
        layout.
        """
        traced, treedef = self._trace(state, batch)
        if traced.out_info[0] is None:
            return None
        n = self._n
        out = [
            jax.ShapeDtypeStruct(
                x.shape if x.shape[0] == n else (n, x.shape[0] // n) + x.shape[1:],
                x.dtype,
            )
            for x in traced.out_info[0]
        ]
        return jax.tree.unflatten(treedef, out)

    def run(self, state, batch, *, returned: bool = False, flat=None):
        """Runs the step on the view of `state`: `(new_state, metrics, leaves)`.

        `returned`: `state` is what the last call returned (same shapes, same
        program), so the leaves to view, unview and re-place are the ones the
        last call picked; finding them again costs about 1 us a leaf. `flat`:
        `jax.tree.flatten(state)`, if the caller has it. `leaves` are the new
        state's.
        """
        cached = self._picked if returned else None
        leaves, treedef = flat if flat is not None else jax.tree.flatten(state)
        leaves = list(leaves)
        if cached:
            view_idx = cached[0]
        else:
            view_idx = [i for i, x in enumerate(leaves) if _needs_view(x)]
        _apply(leaves, view_idx, self._view)
        out, metrics = self._core(leaves, batch, treedef)
        out = list(out)
        if cached:
            unview_idx, empty_idx = cached[1:]
        else:
            unview_idx = [i for i, x in enumerate(out) if x.shape[0] != self._n]
            empty_idx = None
        _apply(out, unview_idx, self._unview)
        empty_idx = _place_empty_leaves(out, self._sharding, empty_idx)
        self._picked = (view_idx, unview_idx, empty_idx)
        return jax.tree.unflatten(treedef, out), metrics, out

    def lower(self, state, batch) -> jax.stages.Lowered:
        """Lowers the step on the view these arguments give."""
        return self._trace(state, batch)[0].lower()
