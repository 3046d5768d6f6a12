"""Private: the step's mesh (1-D, or hosts by devices), its axis names and sharding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import _jax_compat
from jdp._validate import describe as describe_value

AxisName = str | tuple[str, ...]


def host_groups(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """`devices` grouped by process (host), in process order, order kept within."""
    groups: dict[int, list[jax.Device]] = {}
    for d in devices:
        groups.setdefault(d.process_index, []).append(d)
    return [groups[p] for p in sorted(groups)]


def mesh_for(devices: Any, axis_name: Any) -> Mesh:
    """The mesh of `jdp.parallelize(devices=..., axis_name=...)`, checked.

    `devices` is None (every device), a sequence of devices (1-D), or a 2-D
    array or nested list of devices whose rows stand for hosts, named by the
    two names of `axis_name`.
    """
    grid = None if devices is None else _device_grid(devices)
    if not (flat := list(_jax_compat.devices() if grid is None else grid.flat)):
        raise ValueError("`devices` is empty; pass at least one device (or None).")
    if len(set(flat)) != len(flat):
        raise ValueError(f"`devices` lists a device twice: {flat}.")
    names = _check_axis_name(axis_name)
    if grid is not None and grid.ndim == 2:
        return _grid_mesh(grid, names, axis_name)
    _check_devices_per_process(flat)
    return make_mesh(flat, names)


def _device_grid(devices: Any) -> np.ndarray:
    """`devices` as a 1-D or 2-D object array of devices, checked."""
    if isinstance(devices, np.ndarray):
        grid = devices
    else:
        rows = list(devices)
        nested = [isinstance(r, (list, tuple, np.ndarray)) for r in rows]
        if any(nested) and (not all(nested) or len({len(r) for r in rows}) != 1):
            lengths = [
                len(r) if n else "a device" for r, n in zip(rows, nested, strict=True)
            ]
            raise ValueError(
                "`devices`: a 2-D layout needs rows (hosts) of equal length, "
                f"each a list of devices; got rows of {lengths}. Pass e.g. "
                "`np.array(jax.devices()[:4]).reshape(2, 2)`."
            )
        shape = (len(rows), len(rows[0])) if any(nested) else (len(rows),)
        grid = np.empty(shape, dtype=object)
        grid[:] = [list(row) for row in rows] if any(nested) else rows
    if grid.ndim not in (1, 2):
        raise ValueError(
            "`devices` must be a sequence of devices (1-D) or a 2-D array of "
            "devices whose rows stand for hosts; got an array of shape "
            f"{grid.shape} ({grid.ndim}-D). Reshape it, e.g. "
            "`np.array(devices).reshape(hosts, -1)`."
        )
    if bad := [d for d in grid.flat if not isinstance(d, jax.Device)]:
        raise TypeError(
            f"`devices` must hold `jax.Device`s (e.g. from `jax.devices()`); got "
            f"{describe_value(bad[0])}."
        )
    return grid


def _grid_mesh(grid: np.ndarray, names: AxisName, axis_name: Any) -> Mesh:
    """The `(hosts, devices per host)` mesh of a 2-D `devices=` layout, checked."""
    if isinstance(names, str):
        raise ValueError(
            f"`devices` is a 2-D layout of shape {grid.shape} (hosts, devices per "
            f"host), which needs two axis names, e.g. `axis_name=('host', "
            f"'device')`; got axis_name={axis_name!r}. Pass a 1-D list of "
            "devices for a flat mesh."
        )
    if jax.process_count() > 1:
        _check_devices_per_process(list(grid.flat))
        for i, row in enumerate(grid):
            processes = sorted({d.process_index for d in row})
            if len(processes) != 1:
                raise ValueError(
                    f"`devices`: row {i} of the 2-D layout holds devices of "
                    f"processes {processes}; with several processes each row "
                    "stands for one host and must hold devices of one process "
                    "(e.g. `jax.local_devices()` of each)."
                )
        order = [row[0].process_index for row in grid]
        if order != sorted(order):
            raise ValueError(
                "`devices`: with several processes the rows of a 2-D layout must "
                f"be in process order; got rows of processes {order}."
            )
    return Mesh(grid, names)


def make_mesh(devices: Sequence[jax.Device], axis_name: AxisName) -> Mesh:
    """The mesh of a step: 1-D for a name, `(hosts, devices per host)` for two.

    With two names row h holds process h's devices, in the 1-D mesh's order.
    """
    if isinstance(axis_name, str):
        return Mesh(np.asarray(devices, dtype=object), (axis_name,))
    return Mesh(np.asarray(host_groups(devices), dtype=object), tuple(axis_name))


def _check_axis_name(axis_name: Any) -> AxisName:
    """One axis name, or two for a `(hosts, devices per host)` mesh."""
    if not isinstance(axis_name, (str, tuple, list)):
        raise TypeError(
            "`axis_name` must be a str, e.g. 'data', or a tuple of two, e.g. "
            f"('host', 'device'); got {describe_value(axis_name)}."
        )
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    named = all(isinstance(n, str) and n for n in names)
    if not named or len(names) not in (1, 2) or len(set(names)) != len(names):
        raise ValueError(
            "`axis_name` must be one name, e.g. 'data', or the two names of a "
            f"(hosts, devices per host) mesh, e.g. ('host', 'device'); got "
            f"{axis_name!r}."
        )
    return names[0] if len(names) == 1 else names


def _check_devices_per_process(devices: Sequence[jax.Device]) -> None:
    """With several processes, each must hold the same number (>= 1) of `devices`."""
    if jax.process_count() == 1:
        return
    counts = {p: 0 for p in range(jax.process_count())}
    for d in devices:
        counts[d.process_index] += 1
    if jax.config.jax_enable_recoverability:  # a lost process holds none
        counts = {p: n for p, n in counts.items() if n or p == jax.process_index()}
    if len(set(counts.values())) != 1 or counts[jax.process_index()] == 0:
        listed = ", ".join(f"process {p}: {n}" for p, n in counts.items())
        raise ValueError(
            "`devices`: with several processes every process must hold the same "
            f"number (at least 1) of the step's devices; got {listed}. Pass "
            "`devices=None` (all devices) or the same number of "
            "`jax.local_devices()` from every process."
        )


def mesh_axis(mesh: Mesh) -> AxisName:
    """The replica axis of `mesh`: its one axis name, or the tuple of all of them."""
    names = tuple(mesh.axis_names)
    return names[0] if len(names) == 1 else names


def replica_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of replicated state (and of batches): leading axis over the mesh."""
    return NamedSharding(mesh, P(mesh_axis(mesh)))
