"""`jdp.parallelize` and the `Parallel` step object it returns."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from jdp import (
    _backends,
    _batching,
    _collectives,
    _divergence,
    _hlo,
    _jax_compat,
    _layout,
    _metrics,
    _progress,
    _replica_parts,
    _transforms,
    _validate,
)
from jdp._tree import PyTree

UNBOUND_AXIS_MSG = (
    "The step uses a collective over an axis that is not bound ({error}); "
    "`jdp.parallelize` binds the replica axis {axis!r}. Fix: use {axis!r} in the "
    "step (e.g. `jdp.make_train_step(..., axis_name={axis!r})`), or pass the "
    "step's axis name to `jdp.parallelize(..., axis_name=...)` (e.g. the "
    "`axis_name='batch'` of a flax BatchNorm)."
)

BAD_OUTPUT_MSG = (
    "The step given to `jdp.parallelize` must return `(state, metrics)` (a training "
    "step) or a dict of metrics (a forward-only step); got {got}."
)


class Parallel(_hlo.Introspection):
    """A per-replica step run on every device; made by `jdp.parallelize`.

    Call it as `step(state, batch) -> (state, metrics)` (or `-> metrics` for a
    forward-only step) with a state made by `step.replicate` and a batch made by
    `step.shard`. It also carries the helpers that know its backend and devices.

    Attributes:
      backend: `"shard_map"` or `"pmap"`.
      axis_name: Name of the replica axis bound inside the step (for a 2-D host
        mesh, the tuple of both mesh axis names).
      devices: The devices, one replica each, in mesh order.
      mesh: The `jax.sharding.Mesh` over `devices`: 1-D, or `(hosts, devices per
        host)` when `axis_name` names two axes.
      num_replicas: `len(devices)`.
      donate_state: Whether a training step donates the state passed in.
    """

    def __init__(self, train_step: Callable[[PyTree, PyTree], Any], *,
                 mesh: jax.sharding.Mesh, backend: _backends.BackendName,
                 donate_state: bool, check_sync: int | None = None):  # fmt: skip
        self.train_step = train_step
        self.mesh = mesh
        self._backend = _backends.make_backend(backend, self.mesh)
        self.backend = backend
        self.axis_name = self._backend.axis_name
        self.devices = tuple(self.mesh.devices.flat)
        self.num_replicas = len(self.devices)
        self.donate_state = donate_state
        self._step = self._backend.build_step(self._body, donate=donate_state)
        self._broadcasts: dict[int, Callable[[PyTree], PyTree]] = {}
        # What replicas must agree on: what the step declares, else all but the
        # parts the state's own nodes declare per-replica.
        agreed = getattr(train_step, "must_agree", None) or _own_step_agrees
        self._sync_check = _divergence.Guard(check_sync, agreed, self.mesh)
        self._returned = _backends.Returned()
        self._calls = 0
        functools.update_wrapper(self, train_step, updated=())

    def _body(self, state, batch):
        # Before a step that changes its state in place (NNX modules) has run.
        received = jax.tree.structure(state)
        try:
            with _collectives.bound_axis(self.axis_name, self.devices) as totals:
                out = self.train_step(state, batch)
        except NameError as e:
            if not _jax_compat.is_unbound_axis_error(e):
                raise
            raise RuntimeError(
                UNBOUND_AXIS_MSG.format(error=e, axis=self.axis_name)
            ) from e
        if isinstance(out, tuple) and len(out) == 2:
            new_state, metrics = out
        elif isinstance(out, dict):
            new_state, metrics = None, out
        else:
            raise TypeError(BAD_OUTPUT_MSG.format(got=type(out).__name__))
        if new_state is not None:
            _metrics.check_no_markers(new_state)
            _layout.check_same_structure(received, new_state)
        return new_state, _metrics.reduce_metrics(metrics, self.axis_name, totals)

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
        # The state the last call returned needs no placement checks.
        flat = jax.tree.flatten(state)
        if not (returned := self._returned.holds(flat[0])):
            _check_not_traced(flat[0], jax.tree.leaves(batch))
            self._check_state(state)
        self._check_batch(batch)
        _progress.beat()  # progress, for the stall check of `python -m jdp.launch`
        new_state, metrics, leaves = self._step(
            state, batch, before=_layout.check_unchanged, returned=returned, flat=flat
        )
        if not self._step.returns_state:
            if not returned:  # never donated: an evaluation loop passes it again
                self._returned.remember(flat[0])
            return metrics
        if self._step.new_layout:  # a new state or batch layout: checked once
            _layout.check_unchanged(state, new_state)
        self._returned.remember(leaves or jax.tree.leaves(new_state))
        self._calls += 1
        if self._sync_check.due(self._calls):
            self._sync_check(new_state, call=self._calls)
        return new_state, metrics

    @property
    def sharding(self) -> jax.sharding.NamedSharding:
        """The `NamedSharding` of replicated state and of sharded batches."""
        return self._backend.sharding

    def replicate(self, tree: PyTree) -> PyTree:
        """Gives every replica a copy of `tree` (the initial parameter sync).

        Each array leaf gets a leading replica axis of size `num_replicas`,
        sharded over the mesh; a node with a layout of its own (`jdp.zero`'s
        optimizer state) is laid out its way. With several processes, process
        0's value wins.

        Args:
          tree: Any pytree of arrays, scalars or typed PRNG keys (params, a
            `jdp.TrainState`, flax NNX modules and `nnx.Optimizer`, ...).

        Returns:
          The replicated pytree, ready for `step(state, batch)`.

        Raises:
          ValueError: If `tree` is already replicated, or holds one flax NNX
            `Variable` at two paths (a shared weight, which a pytree would split
            in two: use `nnx.split`).

        Example:
          >>> import jax, jax.numpy as jnp, jdp
          >>> step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:4])
          >>> step.replicate({"w": jnp.ones(3)})["w"].shape
          (4, 3)
        """
        return _layout.replicate(tree, self.mesh)

    def unreplicate(self, tree: PyTree) -> PyTree:
        """Returns this process's first replica of a replicated pytree (no gather).

        Args:
          tree: A pytree replicated by this step (e.g. the state it returned).

        Returns:
          The pytree without its replica axis, on one device (non-array leaves
          as they are).
        """
        _layout.check_not_deleted(tree, "step.unreplicate")
        _layout.check_unreplicable(tree)
        return _layout.logical_copy(tree)

    def shard(self, batch: PyTree, *, pad: bool = False, pad_to: int | None = None):
        """Splits a global batch across replicas along every leaf's leading axis.

        With several processes, `batch` is this process's share and the
        processes' batches must agree; see the multi-host guide
        (docs/guides/multihost.md).

        Args:
          batch: Pytree of arrays whose leading axis is the example axis.
          pad: If True, pad the batch to a multiple of the replica count and
            also return a mask, True for real examples (see the padding guide).
          pad_to: With `pad=True`, pad to this global batch size instead (a
            multiple of the replica count), so a short last batch compiles no
            new program.

        Returns:
          The placed batch, or `(batch, mask)` when `pad` is True.

        Raises:
          ValueError: If the batch is empty, a leaf is a scalar, the leaves
            disagree on the batch size, it is not divisible by the replica count
            (without `pad`), or the processes' batches differ.
          TypeError: If a leaf holds strings or Python objects.
        """
        _progress.beat()  # its cross-process size check waits for the others
        return _batching.shard(batch, pad=pad, pad_to=pad_to, backend=self._backend)

    def prefetch(
        self,
        batches: Iterable[PyTree],
        *,
        size: int = 2,
        pad: bool = False,
        pad_to: int | None = None,
    ) -> Iterator[PyTree]:
        """Yields `step.shard(batch)` for every batch, up to `size` batches ahead.

        The loader's errors are raised where its batch would have been yielded.

        Args:
          batches: Any iterable of global batches (or of this process's shares).
          size: How many placed batches to hold ahead (2).
          pad: As for `step.shard`; each item is then `(batch, mask)`.
          pad_to: As for `step.shard`.

        Returns:
          An iterator of placed batches.

        Example:
          >>> import jax, numpy as np, jdp
          >>> count = lambda state, batch: {"n": jdp.metrics.sum(batch.sum())}
          >>> step = jdp.parallelize(count, devices=jax.devices()[:2])
          >>> state = step.replicate({})
          >>> data = (np.ones(4, np.float32) * i for i in range(3))
          >>> [float(step(state, b)["n"]) for b in step.prefetch(data)]
          [0.0, 4.0, 8.0]
        """
        place = functools.partial(self.shard, pad=pad, pad_to=pad_to)
        return _batching.prefetch(batches, size=size, place=place)

    def broadcast(self, tree: PyTree, *, root: int = 0) -> PyTree:
        """Gives every replica replica `root`'s value of a replicated pytree.

        The outside-a-step form of `jdp.broadcast`. Parts that differ between
        replicas by design (ZeRO's slices, the fields a state declares per
        replica, such as error-feedback buffers) are left as they are.

        Args:
          tree: A pytree replicated by this step.
          root: The replica whose value wins.

        Returns:
          The pytree, replicated, with every replica equal to replica `root`.
        """
        self._check_state(tree)
        if root not in self._broadcasts:  # one compiled map per root, not per call
            bcast = functools.partial(
                _collectives.broadcast, root=root, axis_name=self.axis_name
            )
            self._broadcasts[root] = self._backend.build_map(bcast)
        # Declared per-replica fields (error-feedback buffers) are each replica's.
        shared = _replica_parts.without_local(tree)
        out = _layout.map_agreed(self._broadcasts[root], shared)
        return _replica_parts.with_local_of(out, tree)

    # -- introspection (`collectives` and `memory_analysis` come from `_hlo`) ----

    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        """Lowers the step for these arguments (see `jax.stages.Lowered`)."""
        self._check_state(state)
        self._check_batch(batch)
        return self._step.lower(state, batch)

    def _check_state(self, state: PyTree) -> None:
        _layout.check_replicated(state, self.sharding, axis_name=self.axis_name)

    def _check_batch(self, batch: PyTree) -> None:
        _batching.check_placed(batch, self._backend)

    def __repr__(self) -> str:
        return (
            f"Parallel({getattr(self.train_step, '__name__', 'step')}, "
            f"backend={self.backend!r}, num_replicas={self.num_replicas}, "
            f"axis_name={self.axis_name!r})"
        )


def _own_step_agrees(state: PyTree) -> PyTree:
    """What the replicas of a step of one's own must agree on.

    All but the parts the state's nodes declare per replica, and what an
    `optax.MultiSteps` accumulated: around `jdp.sync_gradients` (or `jdp.zero`)
    those are each replica's own gradients until the micro-step that updates.
    """
    agree = _replica_parts.must_agree(state)
    return _transforms.without_accumulated(agree, stop_at=_layout.is_custom)


def _check_not_traced(*trees: list) -> None:
    """Refuses tracers: a step is called from Python, not inside `jax.jit`."""
    if any(isinstance(x, jax.core.Tracer) for t in trees for x in t):
        raise TypeError(
            "A `jdp.Parallel` step was called inside a traced function (`jax.jit`, "
            "`jax.lax.scan`, `jax.grad`, ...): it compiles and places its own "
            "program across the devices, and runs from Python. Call it outside, "
            "e.g. `for batch in batches: state, metrics = step(state, batch)`; to "
            "run several steps in one program, loop inside the step function "
            "(`jax.lax.scan` over microbatches, or `make_train_step(..., "
            "microbatches=k)`)."
        )


def parallelize(
    train_step: Callable[[PyTree, PyTree], Any],
    *,
    devices: Sequence[jax.Device] | Sequence[Sequence[jax.Device]] | None = None,
    backend: _backends.BackendName = "shard_map",
    axis_name: _layout.AxisName = "data",
    donate_state: bool = True,
    check_sync: int | None = 100,
) -> Parallel:
    """Runs a per-replica training step on every device: synchronous data parallelism.

    `train_step(state, batch) -> (state, metrics)` is written for ONE replica (its
    state and its slice of the batch), with collectives over `axis_name` bound
    inside it. The state keeps one copy per replica; metrics come back averaged
    over the replicas. See Concepts (docs/concepts.md).

    Args:
      train_step: Pure per-replica function `(state, batch) -> (state, metrics)`,
        or `(state, batch) -> metrics` for a forward-only step.
      devices: Devices to run on, one replica each; `None` (default): every
        device of every process. A 2-D array lays them out as a `(hosts,
        devices per host)` mesh (one row per process) and needs two axis names.
      backend: `"shard_map"` (default; `jax.jit` over `jax.shard_map`) or
        `"pmap"` (`jax.pmap`). Both give the same numbers.
      axis_name: Name of the replica axis inside the step (`"data"`). Two
        names, e.g. `("host", "device")`, make a 2-D host mesh (`"shard_map"`
        only; see the multi-host guide, docs/guides/multihost.md).
      donate_state: Donate the input state's buffers to the output (default):
        the state passed in is deleted by the call. A forward-only step never
        donates.
      check_sync: Every `check_sync` calls (100) and after the first, raise
        `jdp.ReplicaDivergenceError` if replicas that must agree differ. None
        turns the guard off.

    Returns:
      A `jdp.Parallel`, callable as `step(state, batch)`.

    Raises:
      ValueError: If `backend` is unknown, `check_sync` is not positive,
        `axis_name` is not one name or two distinct names (two need
        `"shard_map"`), `devices` is empty, repeats a device or is not 1-D or
        2-D (2-D needs two names), or the processes hold different numbers of
        `devices` (or a 2-D row spans processes).
      TypeError: If `axis_name`, `devices` or `check_sync` has the wrong type.

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
    _validate.positive_int("check_sync", check_sync, allow_none=True)
    mesh = _layout.mesh_for(devices, axis_name)
    if len(mesh.axis_names) == 2 and backend != "shard_map":
        raise ValueError(
            f"`axis_name={mesh.axis_names!r}` (a 2-D host mesh) needs "
            f"backend='shard_map' (pmap maps over one axis only); got "
            f"backend={backend!r}."
        )
    return Parallel(
        train_step, mesh=mesh, backend=backend, donate_state=donate_state,
        check_sync=check_sync,
    )  # fmt: skip
