"""Private: the only module that calls `jax.pmap` / `jax.shard_map` or builds a Mesh.

Both backends run the same per-replica body on a 1-D mesh of the chosen devices
(`"shard_map"` also on a 2-D `(host, device)` mesh, whose replica axis is the tuple
of both mesh axes) and use the same state layout: every state leaf carries a
leading replica axis, placed with `NamedSharding(mesh, P(axis_name))`. They differ
only in how they see it:

- `"shard_map"`: `jax.jit(jax.shard_map(body))`; the body's blocks keep a size-1
  replica axis, which this module removes on the way in and restores on the way out;
  the batch stays `(B, ...)`, sharded on its leading axis.
- `"pmap"`: `jax.pmap(body)`, which is rank-reducing; the batch is laid out as
  `(num_replicas, B / num_replicas, ...)`, the layout pmap users know.

`check_vma=False` gives `shard_map` pmap's semantics: the per-replica state is
varying along the axis, so gradients of it are never summed implicitly (the
`check_vma=True` pitfall, where a `P()` parameter's gradient arrives pre-summed and a
`pmean` on top multiplies it by the device count, cannot occur).
"""

from __future__ import annotations

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

    def block_body(state, batch):
        new_state, metrics = body(jax.tree.map(_squeeze, state), batch)
        return jax.tree.map(_expand, new_state), metrics

    mapped = jax.shard_map(
        block_body,
        mesh=mesh,
        in_specs=(P(axis_name), P(axis_name)),
        out_specs=(P(axis_name), P()),
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=donate_argnums)


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
