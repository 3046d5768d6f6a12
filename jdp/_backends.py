"""Private: the only module that calls `jax.pmap` / `jax.shard_map`.

Both run the same per-replica body on a state with a leading replica axis. A
`shard_map` block keeps a size-1 replica axis (removed in the body, restored
after), and `check_vma=False` gives it pmap's semantics: no implicit gradient sums.
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
from jdp._tree import PyTree, format_problems, keystr, repeated_paths

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


def _apply(leaves: list, idx: list[int], fn) -> None:
    """Replaces `leaves[i]` for `i` in `idx` by `fn(list of them)`, in place."""
    if idx:
        for i, y in zip(idx, fn([leaves[i] for i in idx]), strict=True):
            leaves[i] = y


def _layout_of(flat) -> tuple:
    """A flattened pytree's structure and its leaves' shapes and dtypes."""
    leaves, treedef = flat
    return treedef, tuple(
        (x.shape, x.dtype) if hasattr(x, "dtype") else type(x) for x in leaves
    )


def check_distinct(state: PyTree) -> None:
    """Refuses a state that holds one array in two leaves: donating it would crash."""
    leaves = jax.tree.leaves(state)
    if len({id(x) for x in leaves}) == len(leaves):
        return
    pairs = repeated_paths(state)
    probs = [f"{later} is the same array as {first}" for first, later in pairs]
    raise ValueError(SHARED_LEAVES_MSG.format(probs=format_problems(probs)))


class Step:
    """A built step: `(replicated state, placed batch) -> (state or None, metrics)`.

    `train` donates its state (when asked to), `forward` never does; both have
    `run(state, batch, *, returned, flat)` and `lower`. Tracing `train` once tells
    whether the body returns a state; a forward-only step runs `forward`.

    On simulated CPU devices one step is kept in flight: with several queued, the
    devices' threads (one pool) can block in different steps' rendezvous forever.
    """

    def __init__(self, train, forward, *, donate: bool, out_state, mesh: Mesh):
        self._train, self._forward = train, forward
        self._donate, self._trace_out_state = donate, out_state
        self.returns_state: bool | None = None
        self.out_state: Any = None  # a donating step's, from the trace
        devices = list(mesh.devices.flat)
        self._throttle = len(devices) > 1 and all(d.platform == "cpu" for d in devices)
        self._in_flight: list[jax.Array] = []
        # The (state, batch) layouts called with, checked; the last call's.
        self._seen: set[tuple] = set()
        self._state_layout: tuple | None = None
        self._batch_layout: tuple | None = None
        self.new_layout = True  # whether the last call's layouts were new

    def _is_new(self, state, batch, returned: bool, flat) -> bool:
        """Whether this call's state and batch layouts are new (then recorded).

        A state the last call returned has that call's state layout (its layout
        was checked unchanged): with the last call's batch layout too, nothing is
        looked up (the state's layout, one entry a leaf, is not hashed a call).
        """
        batch_layout = _layout_of(jax.tree.flatten(batch))
        if returned and self._state_layout is not None:
            if batch_layout == self._batch_layout:
                return False
        else:
            self._state_layout = _layout_of(flat if flat else jax.tree.flatten(state))
        self._batch_layout = batch_layout
        key = (self._state_layout, batch_layout)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

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
        """`(new_state, metrics, its leaves or None)`.

        `before(state, out_state)` runs once, if the out state is known before the
        first call. `returned`: `state` is what the last call returned, none
        deleted. `flat`: `jax.tree.flatten(state)`, if at hand.
        """
        first = self.returns_state is None
        fn = self._pick(state, batch, returned=returned)
        self.new_layout = self._is_new(state, batch, returned, flat)
        if (
            before is not None
            and self._donate
            and fn is self._train
            and self.new_layout
        ):
            # Traced for these layouts before anything is donated: a batch the
            # step fails on, or a state it would change, leaves the state intact.
            out = self.out_state if first else self._trace_out_state(state, batch)
            before(state, out)
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
    """Weak references to the leaves of the state a step last returned (or checked).

    A state of exactly those arrays, none deleted, skips the per-leaf placement
    checks (about 1.5 us a leaf).
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
        if refs is None or len(leaves) != len(refs):
            return False
        same = all(r() is x for r, x in zip(refs, leaves, strict=True))
        return same and not any(x.is_deleted() for x in leaves)


class Backend:
    """How a step runs on a mesh.

    `build_step(body, *, donate) -> Step`, `body(state, batch) -> (state or None,
    metrics)` per replica; `build_map(fn)`, `fn(tree) -> tree` per replica (no
    donation); `place_batch_leaf(x)`, a process-local leaf (leading axis:
    examples); `batch_problems(batch)`, placed leaves whose shapes do not fit.
    """

    name: BackendName

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.axis_name = mesh_axis(mesh)
        self.sharding = replica_sharding(mesh)


def make_backend(name: BackendName, mesh: Mesh) -> Backend:
    """The backend called `name` on `mesh`."""
    return {"pmap": _Pmap, "shard_map": _ShardMap}[name](mesh)


def _with_leading(tree: PyTree, n: int) -> PyTree:
    """The abstract `tree` with a leading axis of size `n`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((n,) + x.shape[1:], x.dtype), tree
    )


class _TreeStep:
    """A step called on the state as a tree (`jax.pmap` flattens it itself)."""

    def __init__(self, fn, to_global):
        self._fn, self._to_global, self.lower = fn, to_global, fn.lower

    def run(self, state, batch, *, returned: bool = False, flat=None):
        """`(new_state or None, metrics, None)`: the new leaves are not at hand."""
        del returned, flat
        new_state, metrics = self._fn(state, batch)
        return self._to_global(new_state), metrics, None


class _Pmap(Backend):
    name = "pmap"

    def _pmap(self, fn, **kwargs):
        devices = list(self.mesh.devices.flat)
        return jax.pmap(fn, axis_name=self.axis_name, devices=devices, **kwargs)

    def _global(self, tree):
        """`jax.pmap`'s host-local outputs as global arrays over the mesh (no copy)."""
        if jax.process_count() == 1:
            return tree
        from jax.experimental import multihost_utils

        return multihost_utils.host_local_array_to_global_array(
            tree, self.mesh, P(self.axis_name)
        )

    def build_step(self, body: Body, *, donate: bool) -> Step:
        def build(donate_argnums):
            # Both arguments on axis 0, said as `0`: pmap's fast path (a tuple
            # costs a per-leaf broadcast of the axes on every call).
            return self._pmap(
                body, in_axes=0, out_axes=(0, None), donate_argnums=donate_argnums
            )

        forward = build(())
        train = build((0,)) if donate else forward
        num_local = len(self.mesh.local_devices)

        def out_state(state, batch):
            # pmap shares this trace with its first call; with several processes it
            # takes each process's own replicas.
            if jax.process_count() > 1:
                state, batch = _with_leading((state, batch), num_local)
            return _with_leading(jax.eval_shape(train, state, batch)[0], self.mesh.size)

        return Step(
            _TreeStep(train, self._global), _TreeStep(forward, self._global),
            donate=donate, out_state=out_state, mesh=self.mesh,
        )  # fmt: skip

    def build_map(self, fn):
        mapped = self._pmap(fn)
        return lambda tree: self._global(mapped(tree))

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


class _ShardMap(Backend):
    name = "shard_map"

    def _map_step(self, body, block_in, block_out):
        def block_body(state, batch):
            new_state, metrics = body(jax.tree.map(block_in, state), batch)
            return jax.tree.map(block_out, new_state), metrics

        spec = P(self.axis_name)
        return jax.shard_map(
            block_body, mesh=self.mesh, in_specs=(spec, spec), out_specs=(spec, P()),
            check_vma=False,
        )  # fmt: skip

    def build_step(self, body: Body, *, donate: bool) -> Step:
        stacked = _flat_step(self._map_step(body, _squeeze, _expand), donate=False)
        forward = _ShardMapStep(stacked, mesh=self.mesh, view=False)
        if not donate:
            return Step(forward, forward, donate=False, out_state=None, mesh=self.mesh)
        core = _flat_step(self._map_step(body, _block_in, _block_out), donate=True)
        train = _ShardMapStep(core, mesh=self.mesh, view=True)
        return Step(
            train, forward, donate=True, out_state=train.out_state, mesh=self.mesh
        )

    def build_map(self, fn):
        def block_fn(tree):
            return jax.tree.map(_expand, fn(jax.tree.map(_squeeze, tree)))

        spec = P(self.axis_name)
        mapped = jax.shard_map(
            block_fn, mesh=self.mesh, in_specs=spec, out_specs=spec, check_vma=False
        )
        return jax.jit(mapped)

    def place_batch_leaf(self, x: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.sharding, x)

    def batch_problems(self, batch: PyTree) -> list[str]:
        # Placed for another mesh axis name: most likely by flax's
        # `prefetch_to_device`, in pmap's layout.
        names = tuple(self.mesh.axis_names)
        return [
            f"{keystr(path)}: shape {x.shape} on a mesh with axis names "
            f"{tuple(x.sharding.mesh.axis_names)} (this step's: {names}), the "
            "pmap layout of flax's `prefetch_to_device`"
            for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
            if isinstance(x.sharding, NamedSharding)
            and tuple(x.sharding.mesh.axis_names) != names
        ]


# -- the shard_map step on leaves, donating on a view ------------------------------
#
# A donating step runs on a concatenated view of the state, updated in place (why:
# the performance guide): a per-replica `(d0, d1, ...)` leaf is viewed as
# `(N * d0, d1, ...)` by two donated jits of bitcasts. Leaves whose view would be
# ambiguous or lose its sharding (per-replica shape `()` or starting with 0 or 1),
# or under `VIEW_MIN_BYTES` per replica, stay stacked. The rules are exact inverses:
#   view:      (N, d0, ...) -> (N * d0, ...)        when viewable (else unchanged)
#   block in:  (1, ...) -> squeezed                 (else the replica's shape)
#   block out: unchanged when viewable              (else expanded to (1, ...))
#   unview:    (N * d0, ...) -> (N, d0, ...)        when the leading size is not N
VIEW_MIN_BYTES = 1 << 16


def _viewable(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether a leaf of per-replica `shape` runs on the concatenated view."""
    large = math.prod(shape) * itemsize >= VIEW_MIN_BYTES
    return len(shape) >= 1 and shape[0] > 1 and large


def _view_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0] * shape[1],) + tuple(shape[2:])


def _unview_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    return shape if shape[0] == n else (n, shape[0] // n) + tuple(shape[1:])


def _block_in(x):
    return x.reshape(x.shape[1:]) if x.shape[0] == 1 else x


def _block_out(x):
    return x if _viewable(x.shape, x.dtype.itemsize) else _expand(x)


def _flat_step(mapped, *, donate: bool):
    """`jit(mapped)` on leaves: `(leaves, batch, treedef) -> (leaves or None, metrics)`.

    The caller has the leaves anyway, and jit then flattens nothing but a list (two
    Python traversals saved for NNX modules).
    """

    def flat(leaves, batch, treedef):
        new_state, metrics = mapped(jax.tree.unflatten(treedef, leaves), batch)
        if new_state is None:  # forward-only: found when tracing, never run
            return None, metrics
        return jax.tree.leaves(new_state), metrics

    return jax.jit(flat, static_argnums=2, donate_argnums=0 if donate else ())


class _ShardMapStep:
    """A jitted shard_map step on the state's leaves (`_flat_step`).

    With `view` (a donating step), `core` runs on the state's view: view, step,
    unview. Its empty leaves get the replica sharding (jit replicates them).
    """

    def __init__(self, core, *, mesh: Mesh, view: bool):
        self._core, self._viewing = core, view
        self._picked: tuple[list[int], list[int], list[int]] | None = None
        self._n = n = mesh.size
        self._sharding = sharding = replica_sharding(mesh)

        def reshaped(shape_of):  # a donated jit of bitcasts
            fn = lambda xs: [x.reshape(shape_of(x.shape)) for x in xs]  # noqa: E731
            return jax.jit(fn, donate_argnums=0, out_shardings=sharding)

        self._view = reshaped(_view_shape)
        self._unview = reshaped(lambda shape: _unview_shape(shape, n))

    def _viewed(self, x) -> bool:
        return self._viewing and _viewable(x.shape[1:], x.dtype.itemsize)

    def _trace(self, state, batch):
        """The trace of the step on the view of `state`, and `state`'s treedef."""

        def spec(x):
            shape = _view_shape(x.shape) if self._viewed(x) else x.shape
            weak = getattr(x, "weak_type", False)
            return jax.ShapeDtypeStruct(
                shape, x.dtype, sharding=self._sharding, weak_type=weak
            )

        leaves, treedef = jax.tree.flatten(state)
        return self._core.trace([spec(x) for x in leaves], batch, treedef), treedef

    def out_state(self, state, batch):
        """The abstract state the step returns, `(N, ...)`, or None; from the trace."""
        traced, treedef = self._trace(state, batch)
        if traced.out_info[0] is None:
            return None
        out = [
            jax.ShapeDtypeStruct(_unview_shape(x.shape, self._n), x.dtype)
            for x in traced.out_info[0]
        ]
        return jax.tree.unflatten(treedef, out)

    def run(self, state, batch, *, returned: bool = False, flat=None):
        """`(new_state or None, metrics, its leaves or None)`; args as in `Step`.

        A `returned` state reuses the last call's picks of leaves (1 us a leaf).
        """
        leaves, treedef = flat if flat is not None else jax.tree.flatten(state)
        leaves = list(leaves)
        if picked := self._picked if returned else None:
            view_idx, unview_idx, empty_idx = picked
        else:
            view_idx = [i for i, x in enumerate(leaves) if self._viewed(x)]
        _apply(leaves, view_idx, self._view)
        out, metrics = self._core(leaves, batch, treedef)
        if out is None:  # forward-only
            return None, metrics, None
        out = list(out)
        if not picked:
            unview_idx = [i for i, x in enumerate(out) if x.shape[0] != self._n]
        _apply(out, unview_idx, self._unview)
        if not picked:
            sharding = self._sharding
            empty_idx = [
                i for i, x in enumerate(out) if x.size == 0 and x.sharding != sharding
            ]
        _apply(out, empty_idx, lambda xs: jax.device_put(xs, self._sharding))
        self._picked = (view_idx, unview_idx, empty_idx)
        return jax.tree.unflatten(treedef, out), metrics, out

    def lower(self, state, batch) -> jax.stages.Lowered:
        """Lowers the step on the view these arguments give."""
        return self._trace(state, batch)[0].lower()
