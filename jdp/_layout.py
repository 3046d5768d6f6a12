"""Private: the replica layout, the one module that knows how state is laid out.

jdp keeps one copy of the state per replica on both backends. A *logical* pytree
(one copy: what the user writes, `step.unreplicate` returns and checkpoints save)
becomes a *replicated* pytree whose every array leaf has a leading replica axis of
size `num_replicas`, sharded over every axis of the mesh:
`NamedSharding(mesh, P(axis_name))`, with `axis_name` the mesh's one axis name or
the tuple of both names of a `(hosts, devices per host)` mesh.

A pytree node can lay its leaves out differently by subclassing `CustomLayout`
(e.g. ZeRO's sharded optimizer state, where replica `r` holds only slice `r`).
Every conversion here (`logical_copy`, `logical_like`, `place_like`, `agreed`)
asks such a node to convert itself, so the rest of jdp never needs to know which
custom layouts exist.

Typed PRNG keys are placed as their key data and wrapped back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import _jax_compat
from jdp._tree import format_problems, keystr, repeated_paths
from jdp._validate import describe as describe_value

PyTree = Any
AxisName = str | tuple[str, ...]

SHARED_VARIABLE_MSG = (
    "`step.replicate`: the state holds one flax NNX `Variable` at two paths, "
    "{first} and {second} (a weight shared between modules, e.g. tied "
    "embeddings). Passed as a pytree, each path would become its own array and "
    "the first update would silently untie them. Split the modules instead: "
    "`graphdef, state = nnx.split((model, optimizer))`, replicate `state` and "
    "`nnx.merge(graphdef, state)` in the step; `nnx.split` keeps one copy of a "
    "shared weight and `nnx.merge` shares it again."
)

ALREADY_REPLICATED_MSG = (
    "`step.replicate`: every array leaf of the tree is already replicated (a "
    "leading replica axis sharded over a mesh of {num} devices); replicating it "
    "again would give every replica the whole stack. Pass it to the step as it "
    "is, or re-place one copy with `step.replicate(other_step.unreplicate(tree))`."
)
#: Turns an abstract logical state into its abstract per-replica layout.
StateLayout = Callable[[PyTree, int], PyTree]


NOT_REPLICATED_MSG = (
    "`step`: the state passed in was not replicated by this step's `step.replicate` "
    "(or was replicated for another backend or device set). Expected every array "
    "leaf to hold one copy per replica: a leading axis of size num_replicas={num} "
    "sharded over mesh axis {axis!r} of this step's devices. Offending leaves:{probs}\n"
    "Fix: `state = step.replicate(state)` before the first call (to move a state "
    "from another `Parallel`, use `step.replicate(other.unreplicate(state))`)."
)

DONATED_MSG = (
    "`step`: the {what} passed in was donated to an earlier step, which deleted "
    "its buffers (`donate_state=True`). Deleted leaves:{probs}\nFix: continue "
    "with the state that step returned (`state, metrics = step(state, batch)`), "
    "or pass `donate_state=False` to `jdp.parallelize` to keep the old one."
)

STATE_CHANGED_MSG = (
    "`step`: the step returned a state whose structure, shapes or dtypes differ "
    "from the state it received (shapes per replica):{probs}\nEvery later call "
    "would compile again and train in the new types. Fix: return the state as it "
    "came in, e.g. cast updated leaves back (`new.astype(old.dtype)`); to change "
    "the state on purpose, do it outside the step and `step.replicate` it."
)

# -- meshes and shardings ---------------------------------------------------------


def host_groups(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """`devices` grouped by process (host), in process order, order kept within."""
    groups: dict[int, list[jax.Device]] = {}
    for d in devices:
        groups.setdefault(d.process_index, []).append(d)
    return [groups[p] for p in sorted(groups)]


def mesh_for(devices: Any, axis_name: Any) -> Mesh:
    """The mesh of `jdp.parallelize(devices=..., axis_name=...)`, checked.

    `devices` is None (every device), a sequence of devices (1-D), or a 2-D
    array or nested list of devices whose rows stand for hosts: a
    `(hosts, devices per host)` mesh in one process too, named by the two
    names of `axis_name`.

    Raises:
      ValueError: If `devices` is empty, lists a device twice, is not 1-D or
        2-D (or its rows differ in length), is 2-D with one axis name,
        `axis_name` is not one name or two distinct names, or, with several
        processes, the processes hold different numbers of `devices` (or a row
        of a 2-D layout holds devices of several processes).
      TypeError: If `axis_name` is neither a str nor a tuple, or an entry of
        `devices` is not a device.
    """
    grid = None if devices is None else _device_grid(devices)
    if grid is not None and grid.ndim == 2:
        return _grid_mesh(grid, axis_name)
    devices = list(_jax_compat.devices() if grid is None else grid)
    if not devices:
        raise ValueError("`devices` is empty; pass at least one device (or None).")
    if len(set(devices)) != len(devices):
        raise ValueError(f"`devices` lists a device twice: {devices}.")
    axis_name = _check_axis_name(axis_name)
    _check_devices_per_process(devices)
    return make_mesh(devices, axis_name)


def _device_grid(devices: Any) -> np.ndarray:
    """`devices` as a 1-D or 2-D object array of devices, checked."""
    if isinstance(devices, np.ndarray):
        grid = devices
    else:
        rows = list(devices)
        nested = [isinstance(r, (list, tuple, np.ndarray)) for r in rows]
        if rows and any(nested):
            if not all(nested) or len({len(r) for r in rows}) != 1:
                lengths = [
                    len(r) if n else "a device"
                    for r, n in zip(rows, nested, strict=True)
                ]
                raise ValueError(
                    "`devices`: a 2-D layout needs rows (hosts) of equal length, "
                    f"each a list of devices; got rows of {lengths}. Pass e.g. "
                    "`np.array(jax.devices()[:4]).reshape(2, 2)`."
                )
            grid = np.empty((len(rows), len(rows[0])), dtype=object)
            for i, row in enumerate(rows):
                for j, d in enumerate(row):
                    grid[i, j] = d
        else:
            grid = np.empty(len(rows), dtype=object)
            grid[:] = rows if rows else []
    if grid.ndim not in (1, 2):
        raise ValueError(
            "`devices` must be a sequence of devices (1-D) or a 2-D array of "
            "devices whose rows stand for hosts; got an array of shape "
            f"{grid.shape} ({grid.ndim}-D). Reshape it, e.g. "
            "`np.array(devices).reshape(hosts, -1)`."
        )
    bad = [d for d in grid.flat if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(
            f"`devices` must hold `jax.Device`s (e.g. from `jax.devices()`); got "
            f"{describe_value(bad[0])}."
        )
    return grid


def _grid_mesh(grid: np.ndarray, axis_name: Any) -> Mesh:
    """The `(hosts, devices per host)` mesh of a 2-D `devices=` layout, checked."""
    if grid.size == 0:
        raise ValueError("`devices` is empty; pass at least one device (or None).")
    flat = list(grid.flat)
    if len(set(flat)) != len(flat):
        raise ValueError(f"`devices` lists a device twice: {flat}.")
    names = _check_axis_name(axis_name)
    if isinstance(names, str):
        raise ValueError(
            f"`devices` is a 2-D layout of shape {grid.shape} (hosts, devices per "
            f"host), which needs two axis names, e.g. `axis_name=('host', "
            f"'device')`; got axis_name={axis_name!r}. Pass a 1-D list of "
            "devices for a flat mesh."
        )
    if jax.process_count() > 1:
        _check_devices_per_process(flat)
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

    With two names, row h holds process h's devices (every process must hold the
    same number of `devices`); the replica order (row-major) is the 1-D mesh's
    order when `devices` are listed process by process, as `jax.devices()` lists
    them.
    """
    if isinstance(axis_name, str):
        return Mesh(np.asarray(devices, dtype=object), (axis_name,))
    return Mesh(np.asarray(host_groups(devices), dtype=object), tuple(axis_name))


def _check_axis_name(axis_name: Any) -> AxisName:
    """One axis name, or two for a `(hosts, devices per host)` mesh."""
    if isinstance(axis_name, str) and axis_name:
        return axis_name
    if not isinstance(axis_name, (str, tuple, list)):
        raise TypeError(
            "`axis_name` must be a str, e.g. 'data', or a tuple of two, e.g. "
            f"('host', 'device'); got {describe_value(axis_name)}."
        )
    names = tuple(axis_name)
    if len(names) == 1 and isinstance(names[0], str) and names[0]:
        return names[0]
    if (
        len(names) != 2
        or len(set(names)) != 2
        or not all(isinstance(n, str) and n for n in names)
    ):
        raise ValueError(
            "`axis_name` must be one name, e.g. 'data', or the two names of a "
            f"(hosts, devices per host) mesh, e.g. ('host', 'device'); got "
            f"{axis_name!r}."
        )
    return names


def _check_devices_per_process(devices: Sequence[jax.Device]) -> None:
    """With several processes, each must hold the same number (>= 1) of `devices`."""
    if jax.process_count() == 1:
        return
    counts = {p: 0 for p in range(jax.process_count())}
    for d in devices:
        counts[d.process_index] += 1
    if len(set(counts.values())) != 1 or counts[0] == 0:
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


# -- leaves ---------------------------------------------------------------------


def is_key(x: Any) -> bool:
    """Whether `x` (an array or a `ShapeDtypeStruct`) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl(x: Any) -> str:
    """The PRNG implementation name of typed keys (an array or an abstract value)."""
    if isinstance(x, jax.Array):
        return str(jax.random.key_impl(x))
    return _jax_compat.key_impl_name(x.dtype)


def host_value(x: Any) -> np.ndarray:
    """A leaf as a NumPy array in the dtype JAX would give it (keys: their data)."""
    if is_key(x):
        return np.asarray(jax.device_get(jax.random.key_data(x)))
    if isinstance(x, jax.Array):
        return np.asarray(jax.device_get(x))
    arr = np.asarray(x)
    return arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype of a leaf (keys keep their key dtype)."""
    if is_key(x):
        return jax.eval_shape(lambda: x)
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def describe(x: Any) -> str:
    """A leaf's shape and placement, for error messages."""
    if isinstance(x, jax.Array) and x.is_deleted():
        return f"shape {x.shape}, deleted (its buffers were donated to a step)"
    if isinstance(x, jax.Array):
        return f"shape {x.shape} with sharding {x.sharding}"
    return f"a {type(x).__name__} of shape {np.shape(x)} (not a placed jax.Array)"


# -- custom layouts ---------------------------------------------------------------


class CustomLayout:
    """A pytree node that lays its leaves out in its own way across replicas.

    The default layout gives every replica a full copy. A subclass (a pytree node,
    e.g. a flax `struct.PyTreeNode`) that holds something else per replica (a
    slice) says how to convert between that and one logical copy.
    """

    def logical(self) -> PyTree:
        """One logical copy of the replicated node (arrays, or abstract values)."""
        raise NotImplementedError

    def place(self, host_value: PyTree, place_leaf: Callable[[Any, Any], Any]):
        """This node's layout holding `host_value` (one logical copy).

        `self` is abstract (`jax.ShapeDtypeStruct`s with the replica axis and a
        sharding); `place_leaf(value, ref)` places a leaf every replica holds
        whole.
        """
        raise NotImplementedError

    def agreed(self):
        """The node with the leaves that differ between replicas replaced by None."""
        raise NotImplementedError

    def with_agreed(self, agreed):
        """The inverse of `agreed`: this node with its agreed leaves from `agreed`."""
        raise NotImplementedError


def is_custom(x: Any) -> bool:
    """Whether `x` is a `CustomLayout` node (an `is_leaf` for tree maps)."""
    return isinstance(x, CustomLayout)


# -- logical <-> replicated ---------------------------------------------------------


def logical_copy(tree: PyTree) -> PyTree:
    """One logical copy of a replicated pytree: replica 0's value of every leaf.

    Array leaves with a leading replica axis give this process's first replica
    (`addressable_shards[0]`, no gather); custom layouts convert themselves; other
    leaves pass through. What `step.unreplicate` returns and checkpoints save.
    """

    def first(x):
        if is_custom(x):
            return x.logical()
        if isinstance(x, jax.Array) and x.ndim >= 1:
            data = x.addressable_shards[0].data
            return data.reshape(data.shape[1:])
        return x

    return jax.tree.map(first, tree, is_leaf=is_custom)


def _without_replica_axis(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype") and len(x.shape) >= 1:
        return jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype)
    return x


def logical_like(tree: PyTree) -> PyTree:
    """Shapes and dtypes of one logical copy of a replicated pytree; reads no data.

    What `logical_copy(tree)` would return, as `jax.ShapeDtypeStruct`s: the target
    structure for restoring a checkpoint into `tree`'s layout.
    """

    def one(x):
        if is_custom(x):
            return jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x
            ).logical()
        return _without_replica_axis(x)

    return jax.tree.map(one, tree, is_leaf=is_custom)


def _place_leaf(x: Any, ref: Any) -> jax.Array:
    """One logical leaf placed like `ref` (replica axis, sharding), once per replica."""
    if is_key(ref):  # typed PRNG keys: place their data, then wrap it
        data = host_value(x)
        shape = tuple(ref.shape) + data.shape[len(ref.shape) - 1 :]
        view = np.broadcast_to(data, shape)
        placed = jax.make_array_from_callback(shape, ref.sharding, view.__getitem__)
        return jax.random.wrap_key_data(placed, impl=key_impl(ref))
    x = host_value(x).astype(ref.dtype, copy=False)
    view = np.broadcast_to(x, ref.shape)  # no copy until a device takes a slice
    return jax.make_array_from_callback(ref.shape, ref.sharding, view.__getitem__)


def place_like(host_tree: PyTree, like: PyTree) -> PyTree:
    """Replicates one logical copy into the layout of `like` (undoes `logical_copy`).

    Args:
      host_tree: One copy of every leaf (NumPy or JAX arrays) without replica axis.
      like: A replicated pytree of the same structure: `jax.Array`s or
        `jax.ShapeDtypeStruct`s whose `shape` has the leading replica axis and
        whose `sharding` says where the replicas live.

    Returns:
      `jax.Array`s shaped and placed like `like`, every replica equal to
      `host_tree` (custom layouts: each replica its part).
    """

    def place(ref, x):
        if is_custom(ref):
            return ref.place(x, _place_leaf)
        return _place_leaf(x, ref)

    return jax.tree.map(place, like, host_tree, is_leaf=is_custom)


def replicate(
    tree: PyTree, mesh: Mesh, *, state_layout: StateLayout | None = None
) -> PyTree:
    """Gives every replica of `mesh` a copy of `tree` (process 0's, across processes).

    Args:
      tree: One logical copy: any pytree of arrays, scalars or typed PRNG keys.
      mesh: The step's mesh.
      state_layout: Optional; maps the abstract logical state and the replica
        count to the abstract per-replica state (a custom layout, e.g. ZeRO's).

    Returns:
      The replicated pytree.
    """
    shared = shared_variables(tree)
    if shared:
        raise ValueError(
            SHARED_VARIABLE_MSG.format(first=shared[0][0], second=shared[0][1])
        )
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if arrays and all(x.ndim >= 1 and is_replicated(x) for x in arrays):
        raise ValueError(
            ALREADY_REPLICATED_MSG.format(num=arrays[0].sharding.mesh.size)
        )
    host = jax.tree.map(host_value, tree)  # PRNG keys as their key data
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        host = multihost_utils.broadcast_one_to_all(host)
    shapes = jax.tree.map(abstract, tree)
    num = mesh.size
    if state_layout is not None:
        shapes = state_layout(shapes, num)
    sharding = replica_sharding(mesh)
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((num,) + x.shape, x.dtype, sharding=sharding),
        shapes,
    )
    return place_like(host, like)


def shared_variables(tree: PyTree) -> list[tuple[str, str]]:
    """Pairs of paths at which `tree` holds one flax NNX `Variable` twice.

    A weight shared between modules (tied embeddings) is one `Variable` reached
    from two attributes. Flattened as a pytree (modules passed to JAX directly),
    each path becomes its own array and the tie is lost; `nnx.split` keeps one.
    """
    nnx = sys.modules.get("flax.nnx")  # no NNX objects unless it was imported
    if nnx is None:
        return []
    return repeated_paths(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def is_replicated(x: Any) -> bool:
    """Whether a leaf has the layout `replicate` gives (on a 1-D or a 2-D mesh)."""
    if not isinstance(x, jax.Array) or x.ndim < 1:
        return False
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        return False
    return x.shape[0] == sharding.mesh.size and sharding.is_equivalent_to(
        replica_sharding(sharding.mesh), x.ndim
    )


def misplaced(
    tree: PyTree, sharding: NamedSharding, *, leading: int | None
) -> list[str]:
    """Leaves that are not live arrays sharded by `sharding` (with `leading` rows)."""

    def placed(x):
        return (
            isinstance(x, jax.Array)
            and not x.is_deleted()
            and x.ndim >= 1
            and (leading is None or x.shape[0] == leading)
            and (
                x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim)
            )
        )

    if all(map(placed, jax.tree.leaves(tree))):  # the per-call fast path
        return []
    return [
        f"{keystr(path)}: {describe(x)}"
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if not placed(x)
    ]


def check_replicated(
    state: PyTree, sharding: NamedSharding, *, axis_name: AxisName
) -> None:
    """Refuses a state not laid out by `replicate` for `sharding` (or deleted)."""
    num = sharding.mesh.size
    probs = misplaced(state, sharding, leading=num)
    if not probs:
        return
    gone = deleted(state)
    if gone:
        raise ValueError(DONATED_MSG.format(what="state", probs=format_problems(gone)))
    raise ValueError(
        NOT_REPLICATED_MSG.format(num=num, axis=axis_name, probs=format_problems(probs))
    )


def check_unchanged(before: PyTree, after: PyTree) -> None:
    """The state a step returns must be laid out as the one it received."""
    probs = changes(before, after)
    if probs:
        message = STATE_CHANGED_MSG.format(probs=format_problems(probs))
        raise TypeError(message + _low_precision_hint(probs))


def _low_precision_hint(probs: list[str]) -> str:
    """Why an optimizer state of float16 (bfloat16) params comes back float32."""
    widened = [
        p
        for p in probs
        if "opt_state" in p
        and ("float16[" in p or "bfloat16[" in p)
        and "-> float32" in p
    ]
    if not widened:
        return ""
    hint = (
        "\nThe optimizer state of low-precision params came back in float32: the "
        "optimizer computed its moments from float32 values (a float32 loss, or a "
        "loss scaler's float32 arithmetic), and optax keeps them in that dtype. "
        "Keep the params (and so the optimizer state) in float32 and cast them to "
        "float16 inside the loss: mixed precision with float32 master weights, as "
        "flax's examples do, which a loss scaler expects."
    )
    if all(".mu" in p for p in widened):
        hint += (
            " Or keep Adam's first moment (`mu`) in the params' dtype: "
            "`optax.adam(learning_rate, mu_dtype=jnp.float16)` (`optax.adamw` "
            "too)."
        )
    return hint


def deleted(tree: PyTree) -> list[str]:
    """Paths of the array leaves of `tree` whose buffers are deleted (donated)."""
    return [
        keystr(path)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(x, jax.Array) and x.is_deleted()
    ]


def check_same_structure(before: PyTree, after: PyTree) -> None:
    """The state a step returns must have the structure of the one it received.

    `before` may be the received state's structure (a `PyTreeDef`), taken before
    a step that changes the state in place ran.

    Checked while tracing the step (any layout, any call that compiles): the
    donating step rebuilds the new state with the input's structure.
    """
    probs = _structure_change(before, after)
    if probs:
        raise TypeError(STATE_CHANGED_MSG.format(probs=format_problems(probs)))


def _structure_change(before: PyTree, after: PyTree) -> list[str]:
    old, new = _structure(before), jax.tree.structure(after)
    if old == new:
        return []
    return [
        _first_change(old, new, "state") or f"the structure changed from {old} to {new}"
    ]


def _structure(tree: Any) -> Any:
    """`tree`'s structure (a `PyTreeDef` is taken as it is)."""
    if isinstance(tree, jax.tree_util.PyTreeDef):
        return tree
    return jax.tree.structure(tree)


def _child_names(treedef) -> list[str]:
    """Names of a node's children: a flax NNX object's attribute names, else indices."""
    data = treedef.node_data()
    aux = None if data is None else data[1]
    names = aux[0] if isinstance(aux, tuple) and aux else None
    if isinstance(names, tuple) and len(names) == len(treedef.children()):
        return [str(n) for n in names]
    return [f"[{i}]" for i in range(len(treedef.children()))]


def _first_change(old, new, path: str) -> str | None:
    """Where two pytree structures first differ, in words (None if not found).

    A flax NNX object keeps its Python attributes (counters, flags such as
    BatchNorm's `use_running_average`) as static data: a changed one is named
    with its old and new values.
    """
    od, nd = old.node_data(), new.node_data()
    if od is None or nd is None or od[0] is not nd[0]:
        return None
    if len(old.children()) != len(new.children()) or od[1] != nd[1]:
        static = _static_attributes(od[1]), _static_attributes(nd[1])
        changed = [
            f"`{path}.{k}`: {static[0][k]!r} -> {static[1].get(k)!r}"
            for k in static[0]
            if static[0][k] != static[1].get(k)
        ]
        if changed:
            return (
                f"a Python attribute of a {od[0].__name__} changed in the step, "
                f"{', '.join(changed)} (jdp returns the arrays a step computes, not "
                "its Python attributes; set them outside the step, e.g. "
                "`model.eval()` before the evaluation step is built, or keep a "
                "counter in an `nnx.Variable`)"
            )
        return None
    names = _child_names(old)
    for name, a, b in zip(names, old.children(), new.children(), strict=True):
        if a != b:
            return _first_change(a, b, f"{path}.{name}")
    return None


def _static_attributes(aux: Any) -> dict[str, Any]:
    """A flax NNX object's static attributes by name (empty for other nodes)."""
    if not (isinstance(aux, tuple) and len(aux) == 3):
        return {}
    names, values = aux[1], aux[2]
    if not (isinstance(names, tuple) and isinstance(values, tuple)):
        return {}
    if len(names) != len(values):
        return {}
    return {
        str(n): v
        for n, v in zip(names, values, strict=True)
        if not str(n).startswith("_pytree__")
    }


def changes(before: PyTree, after: PyTree) -> list[str]:
    """How `after` differs from `before` in structure, per-replica shapes or dtypes.

    Both are replicated pytrees (arrays or abstract values with the replica
    axis); shapes are reported per replica.
    """
    structure = _structure_change(before, after)
    if structure:
        return structure

    def kind(x):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape[1:])}"

    return [
        f"{keystr(path)}: {kind(a)} -> {kind(b)}"
        for (path, a), b in zip(
            jax.tree_util.tree_flatten_with_path(before)[0],
            jax.tree.leaves(after),
            strict=True,
        )
        if hasattr(a, "shape")
        and hasattr(b, "shape")
        and (tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype)
    ]


# -- what replicas agree on -------------------------------------------------------


def agreed(tree: PyTree) -> PyTree:
    """`tree` with the leaves that differ between replicas by design set to None.

    What replicas must agree on: `jdp.replicas_in_sync` compares it.
    """
    return jax.tree.map(
        lambda x: x.agreed() if is_custom(x) else x, tree, is_leaf=is_custom
    )


def replica_leaves(tree: PyTree) -> tuple[list[str], list[jax.Array], Mesh | None]:
    """The leaves of a replicated tree whose replicas can be compared.

    Array leaves with more than one replica and some data, without the parts of
    custom layouts that differ by design (`agreed`); typed PRNG keys as their key
    data. Used by every comparison of replicas (`replicas_in_sync`, `check_sync`,
    checkpoints of replicas that differ).

    Returns:
      `(paths, arrays, mesh)`: the leaves' `keystr` paths, the arrays, and, when
      some replicas live on other processes, the mesh over which a comparison's
      small result must be replicated so that every process can read it (else
      None).
    """
    paths, arrays = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(agreed(tree))[0]:
        if isinstance(x, jax.Array) and x.ndim >= 1 and x.shape[0] > 1 and x.size:
            paths.append(keystr(path))
            arrays.append(jax.random.key_data(x) if is_key(x) else x)
    mesh = None
    if not all(x.is_fully_addressable for x in arrays):
        mesh = arrays[0].sharding.mesh
    return paths, arrays, mesh


def map_agreed(fn: Callable[[PyTree], PyTree], tree: PyTree) -> PyTree:
    """Applies `fn` to `agreed(tree)`; the leaves held out come back unchanged."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_custom)
    done = jax.tree.flatten(fn(agreed(tree)), is_leaf=is_custom)[0]
    out = [
        old.with_agreed(new) if is_custom(old) else new
        for old, new in zip(leaves, done, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)
