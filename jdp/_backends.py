"""Private: the only module that calls `jax.pmap` / `jax.shard_map` or builds a Mesh.

Both backends run the same per-replica body on a 1-D mesh of the chosen devices
(`"shard_map"` also on a 2-D `(host, device)` mesh, whose replica axis is the tuple
of both mesh axes) and use the same state layout: every state leaf carries a
leading replica axis, placed with `NamedSharding(mesh, P(axis_name))`. They differ
only in how they see it:

- `"shard_map"`: `jax.jit(jax.shard_map(body))`; the body's blocks keep a size-1
  replica axis, which this module removes on the way in and restores on the way out;
  the batch stays `(B, ...)`, sharded on its leading axis. A donating training step
  runs on a concatenated view of the same buffers instead, so that XLA updates the
  donated state in place (see `_DonatingShardMapStep`).
- `"pmap"`: `jax.pmap(body)`, which is rank-reducing; the batch is laid out as
  `(num_replicas, B / num_replicas, ...)`, the layout pmap users know.

`check_vma=False` gives `shard_map` pmap's semantics: the per-replica state is
varying along the axis, so gradients of it are never summed implicitly (the
`check_vma=True` pitfall, where a `P()` parameter's gradient arrives pre-summed and a
`pmean` on top multiplies it by the device count, cannot occur).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Backend = Literal["pmap", "shard_map"]
BACKENDS = ("pmap", "shard_map")


def make_mesh(devices: Sequence[jax.Device], axis_name: str) -> Mesh:
    """A 1-D mesh over `devices`; pmap's outputs live on the same mesh (same name)."""
    return Mesh(np.asarray(devices, dtype=object), (axis_name,))


def host_groups(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """`devices` grouped by process (host), in process order, order kept within."""
    groups: dict[int, list[jax.Device]] = {}
    for d in devices:
        groups.setdefault(d.process_index, []).append(d)
    return [groups[p] for p in sorted(groups)]


def make_host_mesh(devices: Sequence[jax.Device], axis_names: tuple[str, str]) -> Mesh:
    """A 2-D `(hosts, devices per host)` mesh: row h holds process h's devices.

    Every process must hold the same number of `devices` (checked by the caller).
    The replica order (row-major) is the 1-D mesh's order when `devices` are
    listed process by process, as `jax.devices()` lists them.
    """
    return Mesh(np.asarray(host_groups(devices), dtype=object), tuple(axis_names))


def replica_sharding(mesh: Mesh, axis_name: str | tuple[str, ...]) -> NamedSharding:
    """Sharding of replicated state (and of batches): leading axis over the mesh."""
    return NamedSharding(mesh, P(axis_name))


def _squeeze(x):
    return x.reshape(x.shape[1:])


def _expand(x):
    return x.reshape((1,) + x.shape)


def _global_outputs(
    fn, mesh: Mesh, axis_name, *, mapped_outputs=None, replace=None
) -> Callable:
    """Keeps pmap's replicated outputs global when there are several processes.

    With several processes `jax.pmap` returns host-local arrays (each process
    sees its own replicas). jdp's layout is one global array over the mesh on both
    backends, so the mapped outputs are rewrapped as global arrays (no copy).
    """
    if jax.process_count() == 1:
        return fn
    from jax.experimental import multihost_utils

    mapped_outputs = mapped_outputs or (lambda out: out)
    replace = replace or (lambda out, tree: tree)

    def call(*args):
        out = fn(*args)
        tree = multihost_utils.host_local_array_to_global_array(
            mapped_outputs(out), mesh, P(axis_name)
        )
        return replace(out, tree)

    call.lower = fn.lower
    return call


def build_step(
    body: Callable[[Any, Any], tuple[Any, Any]],
    *,
    backend: Backend,
    mesh: Mesh,
    axis_name: str,
    donate: bool,
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Compiles-on-call `body(state, batch) -> (state | None, metrics)` per replica.

    Returns a function of (replicated state, sharded batch) returning (replicated
    state or None, metrics replicated as one value).
    """
    donate_argnums = (0,) if donate else ()
    if backend == "pmap":
        return _global_outputs(
            jax.pmap(
                body,
                axis_name=axis_name,
                in_axes=(0, 0),
                out_axes=(0, None),
                devices=list(mesh.devices.flat),
                donate_argnums=donate_argnums,
            ),
            mesh,
            axis_name,
            mapped_outputs=lambda out: out[0],
            replace=lambda out, state: (state, out[1]),
        )

    def shard_map_step(block_in, block_out, donate_argnums):
        def block_body(state, batch):
            new_state, metrics = body(jax.tree.map(block_in, state), batch)
            return jax.tree.map(block_out, new_state), metrics

        mapped = jax.shard_map(
            block_body,
            mesh=mesh,
            in_specs=(P(axis_name), P(axis_name)),
            out_specs=(P(axis_name), P()),
            check_vma=False,
        )
        return jax.jit(mapped, donate_argnums=donate_argnums)

    stacked = shard_map_step(_squeeze, _expand, ())
    sharding = replica_sharding(mesh, axis_name)
    if donate:
        core = shard_map_step(_block_in, _block_out, (0,))
        return _DonatingShardMapStep(core, stacked, mesh=mesh, sharding=sharding)

    def call(state, batch):
        new_state, metrics = stacked(state, batch)
        return _place_empty_leaves(new_state, sharding), metrics

    call.lower = stacked.lower
    return call


def _place_empty_leaves(tree, sharding: NamedSharding):
    """Gives zero-size outputs the replica sharding (jit returns them replicated)."""
    return _map_some(
        lambda xs: jax.device_put(xs, sharding),
        lambda x: x.size == 0 and x.sharding != sharding,
        tree,
    )


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


def _map_some(fn, pick, tree):
    """`tree` with the leaves `pick` selects replaced by `fn(list of them)`."""
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, x in enumerate(leaves) if pick(x)]
    if idx:
        for i, y in zip(idx, fn([leaves[i] for i in idx]), strict=True):
            leaves[i] = y
    return jax.tree.unflatten(treedef, leaves)


def _block_in(x):
    return x.reshape(x.shape[1:]) if x.shape[0] == 1 else x


def _block_out(x):
    return x if _viewable(x.shape, x.dtype.itemsize) else _expand(x)


class _DonatingShardMapStep:
    """A donating `jit(shard_map(body))` step that updates the state in place.

    Calls run three executables: a view of the state's buffers as concatenated
    blocks (donated, a bitcast), `core`, the step on that view (donated), and the
    view back (donated, a bitcast). A step that returns no state (forward-only)
    never donates: it runs `stacked`, the step on the stacked layout.
    """

    def __init__(self, core, stacked, *, mesh: Mesh, sharding: NamedSharding):
        self._core = core
        self._stacked = stacked
        self._n = mesh.size
        self._sharding = sharding
        n = self._n
        self._view = jax.jit(
            lambda xs: [x.reshape(_view_shape(x.shape)) for x in xs],
            donate_argnums=0,
            out_shardings=self._sharding,
        )
        self._unview = jax.jit(
            lambda xs: [x.reshape((n, x.shape[0] // n) + x.shape[1:]) for x in xs],
            donate_argnums=0,
            out_shardings=self._sharding,
        )
        self._returns_state: bool | None = None

    def _view_specs(self, state):
        def spec(x):
            shape = _view_shape(x.shape) if _needs_view(x) else x.shape
            return jax.ShapeDtypeStruct(
                shape,
                x.dtype,
                sharding=self._sharding,
                weak_type=getattr(x, "weak_type", False),
            )

        return jax.tree.map(spec, state)

    def _trace(self, state, batch):
        traced = self._core.trace(self._view_specs(state), batch)
        self._returns_state = traced.out_info[0] is not None
        return traced

    def __call__(self, state, batch):
        if self._returns_state is None:
            self._trace(state, batch)
        if not self._returns_state:
            return self._stacked(state, batch)
        view = _map_some(self._view, _needs_view, state)
        new_state, metrics = self._core(view, batch)
        new_state = _map_some(self._unview, lambda x: x.shape[0] != self._n, new_state)
        return _place_empty_leaves(new_state, self._sharding), metrics

    def lower(self, state, batch) -> jax.stages.Lowered:
        """Lowers the step these arguments run (on the view, for a train step)."""
        traced = self._trace(state, batch)
        if not self._returns_state:
            return self._stacked.lower(state, batch)
        return traced.lower()


def build_map(
    fn: Callable[[Any], Any], *, backend: Backend, mesh: Mesh, axis_name: str
) -> Callable[[Any], Any]:
    """Runs `fn(tree) -> tree` per replica on a replicated tree (no donation)."""
    if backend == "pmap":
        return _global_outputs(
            jax.pmap(fn, axis_name=axis_name, devices=list(mesh.devices.flat)),
            mesh,
            axis_name,
        )

    def block_fn(tree):
        return jax.tree.map(_expand, fn(jax.tree.map(_squeeze, tree)))

    return jax.jit(
        jax.shard_map(
            block_fn,
            mesh=mesh,
            in_specs=P(axis_name),
            out_specs=P(axis_name),
            check_vma=False,
        )
    )
