"""`jdp.parallelize` and the `Parallel` step object it returns."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _backends, _collectives, _hlo
from jdp._tree import format_problems, keystr

PyTree = Any

NOT_REPLICATED_MSG = (
    "`step`: the state passed in was not replicated by this step's `step.replicate` "
    "(or was replicated for another backend or device set). Expected every array "
    "leaf to hold one copy per replica: a leading axis of size num_replicas={num} "
    "sharded over mesh axis {axis!r} of this step's devices. Offending leaves:{probs}\n"
    "Fix: `state = step.replicate(state)` before the first call (to move a state "
    "from another `Parallel`, use `step.replicate(other.unreplicate(state))`)."
)

NOT_SHARDED_MSG = (
    "`step`: the batch passed in was not placed by this step's `step.shard`. "
    "Offending leaves:{probs}\nFix: `step(state, step.shard(global_batch))`."
)

_DONATION_WARNING = "Some donated buffers were not usable"


def _describe(x: Any) -> str:
    if isinstance(x, jax.Array):
        return f"shape {x.shape} with sharding {x.sharding}"
    return f"a {type(x).__name__} of shape {np.shape(x)} (not a placed jax.Array)"


def _host_value(x: Any) -> np.ndarray:
    """A leaf as a NumPy array in the dtype JAX would give it."""
    if isinstance(x, jax.Array):
        return np.asarray(jax.device_get(x))
    arr = np.asarray(x)
    return arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)


class Parallel:
    """A per-replica step run on every device; made by `jdp.parallelize`.

    Call it as `step(state, batch) -> (state, metrics)` (or `-> metrics` for a
    forward-only step) with a state made by `step.replicate` and a batch made by
    `step.shard`. It also carries the helpers that know its backend and devices.

    Attributes:
      backend: `"shard_map"` or `"pmap"`.
      axis_name: Name of the replica axis bound inside the step.
      devices: The devices, one replica each, in mesh order.
      mesh: The 1-D `jax.sharding.Mesh` over `devices`.
      num_replicas: `len(devices)`.
    """

    def __init__(
        self,
        train_step: Callable[[PyTree, PyTree], Any],
        *,
        devices: Sequence[jax.Device],
        backend: _backends.Backend,
        axis_name: str,
        donate_state: bool,
    ):
        self.train_step = train_step
        self.backend = backend
        self.axis_name = axis_name
        self.devices = tuple(devices)
        self.num_replicas = len(self.devices)
        self.mesh = _backends.make_mesh(self.devices, axis_name)
        self.donate_state = donate_state
        self._sharding = _backends.replica_sharding(self.mesh, axis_name)
        self._local_devices = [
            d for d in self.devices if d.process_index == jax.process_index()
        ]
        self._forward_only: bool | None = None
        self._fn = _backends.build_step(
            self._body,
            backend=backend,
            mesh=self.mesh,
            axis_name=axis_name,
            donate=donate_state,
        )
        functools.update_wrapper(self, train_step, updated=())

    # -- the step ---------------------------------------------------------------

    def _body(self, state, batch):
        out = self.train_step(state, batch)
        if isinstance(out, tuple) and len(out) == 2:
            new_state, metrics = out
            self._forward_only = False
        elif isinstance(out, dict):
            new_state, metrics = None, out
            self._forward_only = True
        else:
            raise TypeError(
                "The step given to `jdp.parallelize` must return `(state, metrics)` "
                "(a training step) or a dict of metrics (a forward-only step); got "
                f"{type(out).__name__}."
            )
        return new_state, jax.tree.map(self._average_metric, metrics)

    def _average_metric(self, m):
        m = jnp.asarray(m)
        if not jnp.issubdtype(m.dtype, jnp.inexact):
            m = m.astype(jnp.result_type(float))  # integer counts average to floats
        return lax.pmean(m, self.axis_name)

    def __call__(self, state: PyTree, batch: PyTree):
        """Runs one step on every replica.

        Args:
          state: Replicated state from `step.replicate` (or a previous call).
          batch: Global batch placed by `step.shard`.

        Returns:
          `(new_state, metrics)`, with `metrics` averaged over replicas (one value
          each); or only `metrics` for a forward-only step.

        Raises:
          ValueError: If `state` or `batch` was not placed for this step.
        """
        self._check_state(state)
        self._check_batch(batch)
        if self._forward_only is False:
            new_state, metrics = self._fn(state, batch)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_DONATION_WARNING)
                new_state, metrics = self._fn(state, batch)
        if self._forward_only:
            return metrics
        return new_state, metrics

    def _check_state(self, state: PyTree) -> None:
        probs = []
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            if (
                isinstance(x, jax.Array)
                and x.ndim >= 1
                and x.shape[0] == self.num_replicas
                and (
                    x.sharding == self._sharding
                    or x.sharding.is_equivalent_to(self._sharding, x.ndim)
                )
            ):
                continue
            probs.append(f"{keystr(path)}: {_describe(x)}")
        if probs:
            raise ValueError(
                NOT_REPLICATED_MSG.format(
                    num=self.num_replicas,
                    axis=self.axis_name,
                    probs=format_problems(probs),
                )
            )

    def _check_batch(self, batch: PyTree) -> None:
        probs = []
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if (
                isinstance(x, jax.Array)
                and x.ndim >= 1
                and (
                    x.sharding == self._sharding
                    or x.sharding.is_equivalent_to(self._sharding, x.ndim)
                )
            ):
                continue
            probs.append(f"{keystr(path)}: {_describe(x)}")
        if probs:
            raise ValueError(NOT_SHARDED_MSG.format(probs=format_problems(probs)))

    # -- placement helpers ------------------------------------------------------

    @property
    def sharding(self) -> jax.sharding.NamedSharding:
        """The `NamedSharding` of replicated state and of sharded batches."""
        return self._sharding

    def replicate(self, tree: PyTree) -> PyTree:
        """Gives every replica a copy of `tree` (the initial parameter sync).

        Each array leaf of the result has a leading replica axis of size
        `num_replicas`, sharded over the mesh, on both backends. With several
        processes, process 0's value is broadcast to every process first (the
        seed's `_AddDistributedParameterSync`).

        Args:
          tree: Any pytree of arrays or scalars (params, a `jdp.TrainState`, ...).

        Returns:
          The replicated pytree, ready for `step(state, batch)`.

        Example:
          >>> import jax, jax.numpy as jnp, jdp
          >>> step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:4])
          >>> step.replicate({"w": jnp.ones(3)})["w"].shape
          (4, 3)
        """
        host = jax.tree.map(_host_value, tree)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            host = multihost_utils.broadcast_one_to_all(host)
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (self.num_replicas,) + x.shape, x.dtype, sharding=self._sharding
            ),
            host,
        )
        return place_like(host, like)

    def unreplicate(self, tree: PyTree) -> PyTree:
        """Returns one replica's copy of a replicated pytree (replica 0 on process 0).

        Reads `x.addressable_shards[0].data` (no gather of every replica, unlike
        `x[0]`). Non-array leaves are returned as they are.

        Args:
          tree: A pytree replicated by this step (e.g. the state it returned).

        Returns:
          The pytree without its replica axis, on one device.
        """
        return logical_copy(tree)

    def shard(self, batch: PyTree, *, pad: bool = False):
        """Splits a global batch across replicas along every leaf's leading axis.

        With several processes, `batch` is this process's share (each process loads
        its own slice, like Caffe2's shards).

        Args:
          batch: Pytree of arrays whose leading axis is the example axis.
          pad: If True, pad the batch (repeating its last example) to a multiple of
            the replica count and also return a boolean mask, True for real
            examples. Weigh per-example metrics by it, e.g. return
            `{"correct": jnp.sum(ok * mask), "count": jnp.sum(mask)}` and divide
            the two averaged metrics: the ratio is then exact.

        Returns:
          The placed batch, or `(batch, mask)` when `pad` is True.

        Raises:
          ValueError: If a leaf's leading size is not divisible by the replica count
            (and `pad` is False), a leaf is a scalar, or leaves disagree on the batch
            size when padding.
        """
        num_local = len(self._local_devices)
        flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
        if not flat:
            raise ValueError("`step.shard`: the batch has no array leaves.")
        host = [(path, _host_value(x)) for path, x in flat]
        for path, x in host:
            if x.ndim == 0:
                raise ValueError(
                    f"`step.shard`: leaf {keystr(path)} is a scalar; every batch leaf "
                    "needs a leading example axis to split across "
                    f"num_replicas={self.num_replicas}."
                )
        mask = None
        if pad:
            sizes = {x.shape[0] for _, x in host}
            if len(sizes) != 1:
                listed = ", ".join(f"{keystr(p)}: {x.shape[0]}" for p, x in host[:5])
                raise ValueError(
                    "`step.shard(pad=True)`: all leaves must share one leading batch "
                    f"size to be padded; got {listed}."
                )
            size = sizes.pop()
            padded = max(num_local, math.ceil(size / num_local) * num_local)
            extra = padded - size
            if extra:
                if size == 0:
                    raise ValueError("`step.shard(pad=True)`: the batch is empty.")
                host = [
                    (p, np.concatenate([x, np.repeat(x[-1:], extra, axis=0)]))
                    for p, x in host
                ]
            mask = np.arange(padded) < size
        else:
            for path, x in host:
                if x.shape[0] % num_local:
                    raise ValueError(
                        f"`step.shard`: leaf {keystr(path)} has leading size "
                        f"{x.shape[0]}, which is not divisible by "
                        f"num_replicas={num_local}"
                        + (" local replicas" if num_local != self.num_replicas else "")
                        + f". Use a batch that is a multiple of {num_local}, or call "
                        "`step.shard(batch, pad=True)` to pad it and get a mask."
                    )
        leaves = [self._place_batch_leaf(x) for _, x in host]
        placed = jax.tree_util.tree_unflatten(treedef, leaves)
        if pad:
            return placed, self._place_batch_leaf(mask)
        return placed

    def _place_batch_leaf(self, x: np.ndarray) -> jax.Array:
        if self.backend == "pmap":
            num_local = len(self._local_devices)
            x = x.reshape((num_local, x.shape[0] // num_local) + x.shape[1:])
        return jax.make_array_from_process_local_data(self._sharding, x)

    def broadcast(self, tree: PyTree, *, root: int = 0) -> PyTree:
        """Gives every replica replica `root`'s value of a replicated pytree.

        The outside-a-step form of `jdp.broadcast` (Caffe2's
        `FinalizeAfterCheckpoint`): use it after loading or editing one replica.

        Args:
          tree: A pytree replicated by this step.
          root: The replica whose value wins.

        Returns:
          The pytree, replicated, with every replica equal to replica `root`.
        """
        fn = _backends.build_map(
            functools.partial(
                _collectives.broadcast, root=root, axis_name=self.axis_name
            ),
            backend=self.backend,
            mesh=self.mesh,
            axis_name=self.axis_name,
        )
        self._check_state(tree)
        return fn(tree)

    # -- introspection ----------------------------------------------------------

    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        """Lowers the step for these arguments (see `jax.stages.Lowered`)."""
        self._check_state(state)
        self._check_batch(batch)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DONATION_WARNING)
            return self._fn.lower(state, batch)

    def collectives(
        self,
        state: PyTree,
        batch: PyTree,
        *,
        stage: Literal["compiled", "lowered"] = "compiled",
    ) -> list[_hlo.Collective]:
        """Lists what one step communicates, read from XLA's HLO.

        Args:
          state: Replicated state, as for a call.
          batch: Sharded batch, as for a call.
          stage: `"compiled"` (default) reads the optimised module: what really
            runs, after XLA has combined collectives (on CPU a step's all-reduces
            become one) and chosen their types (XLA:CPU computes a bf16 all-reduce
            in f32). `"lowered"` reads the module as jdp and your step issued it:
            one entry per `psum`, in the wire dtype you asked for.

        Returns:
          One `jdp.Collective` per collective, in program order, with kind, dtype,
          bytes, replica groups and whether it sits inside a conditional branch.

        Example:
          >>> import jax, jax.numpy as jnp, jdp
          >>> def step_fn(state, batch):
          ...     return state, {"s": batch.sum()}
          >>> step = jdp.parallelize(step_fn, devices=jax.devices()[:2])
          >>> ops = step.collectives(step.replicate({}), step.shard(jnp.ones(4)))
          >>> [(c.kind, c.dtype, c.bytes) for c in ops]
          [('all-reduce', 'f32', 4)]
        """
        lowered = self.lower(state, batch)
        if stage == "compiled":
            text = lowered.compile().as_text()
        elif stage == "lowered":
            text = lowered.as_text(dialect="hlo")
        else:
            raise ValueError(f"`stage` must be 'compiled' or 'lowered', got {stage!r}.")
        return _hlo.parse_collectives(text)

    def __repr__(self) -> str:
        return (
            f"Parallel({getattr(self.train_step, '__name__', 'step')}, "
            f"backend={self.backend!r}, num_replicas={self.num_replicas}, "
            f"axis_name={self.axis_name!r})"
        )


def parallelize(
    train_step: Callable[[PyTree, PyTree], Any],
    *,
    devices: Sequence[jax.Device] | None = None,
    backend: _backends.Backend = "shard_map",
    axis_name: str = "data",
    donate_state: bool = True,
) -> Parallel:
    """Runs a per-replica training step on every device: synchronous data parallelism.

    `train_step(state, batch) -> (state, metrics)` is written for ONE replica and
    sees that replica's state and its slice of the batch; collectives over
    `axis_name` (`jdp.all_reduce_gradients`, `lax.pmean`, ...) are bound inside it.
    This is Caffe2's `Parallelize_GPU` / PyTorch DDP, as a function transform. A
    step that returns only a dict of metrics is forward-only (evaluation).

    The state keeps one copy per replica on both backends (a leading replica axis,
    sharded over the mesh), so replicas may differ between syncs (BMUF) and
    `jdp.replicas_in_sync` can compare them. Metrics come back averaged over the
    replicas.

    Args:
      train_step: Pure per-replica function `(state, batch) -> (state, metrics)`,
        or `(state, batch) -> metrics` for a forward-only step.
      devices: Devices to run on, one replica each. `None` (default) means every
        device: all local devices, or all global devices after
        `jdp.distributed.initialize`.
      backend: `"shard_map"` (default; `jax.jit` over `jax.shard_map`) or
        `"pmap"` (`jax.pmap`). Both give the same numbers.
      axis_name: Name of the replica axis inside the step (`"data"`).
      donate_state: Donate the input state's buffers to the output (default), so
        a step holds one copy of params and optimizer state, not two. The state
        you pass in is deleted by the call; use the returned one.

    Returns:
      A `jdp.Parallel`, callable as `step(state, batch)`, with `replicate`,
      `unreplicate`, `shard`, `broadcast`, `collectives` and `lower`.

    Raises:
      ValueError: If `backend` is unknown or `devices` is empty.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> tx = optax.sgd(0.1)
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)
      >>> step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
      >>> state = step.replicate(jdp.TrainState.create(params={"w": 0.0}, tx=tx))
      >>> batch = step.shard({"x": jnp.ones(16), "y": 2 * jnp.ones(16)})
      >>> for _ in range(50):
      ...     state, metrics = step(state, batch)
      >>> round(float(step.unreplicate(state).params["w"]), 3)
      2.0
    """
    if backend not in _backends.BACKENDS:
        raise ValueError(
            f"`backend` must be one of {_backends.BACKENDS}; got {backend!r}."
        )
    if devices is None:
        devices = jax.devices()
    devices = list(devices)
    if not devices:
        raise ValueError("`devices` is empty; pass at least one device (or None).")
    if len(set(devices)) != len(devices):
        raise ValueError(f"`devices` lists a device twice: {devices}.")
    return Parallel(
        train_step,
        devices=devices,
        backend=backend,
        axis_name=axis_name,
        donate_state=donate_state,
    )


def logical_copy(tree: PyTree) -> PyTree:
    """One logical copy of a replicated pytree: replica 0's value of every leaf.

    The inverse of `place_like`; what `step.unreplicate` returns and what
    checkpoints save. Array leaves with a leading replica axis give this process's
    first replica (`addressable_shards[0]`, no gather); other leaves pass through.
    """

    def first(x):
        if isinstance(x, jax.Array) and x.ndim >= 1:
            data = x.addressable_shards[0].data
            return data.reshape(data.shape[1:])
        return x

    return jax.tree.map(first, tree)


def place_like(host_tree: PyTree, like: PyTree) -> PyTree:
    """Replicates one logical copy into the layout of `like` (undoes `logical_copy`).

    Args:
      host_tree: One copy of every leaf (NumPy or JAX arrays) without replica axis.
      like: A replicated pytree of the same structure: `jax.Array`s or
        `jax.ShapeDtypeStruct`s whose `shape` has the leading replica axis and
        whose `sharding` says where the replicas live.

    Returns:
      `jax.Array`s shaped and placed like `like`, every replica equal to
      `host_tree`.
    """

    def place(x, ref):
        x = _host_value(x).astype(ref.dtype, copy=False)
        view = np.broadcast_to(x, ref.shape)  # no copy until a device takes a slice
        return jax.make_array_from_callback(ref.shape, ref.sharding, view.__getitem__)

    return jax.tree.map(place, host_tree, like)
