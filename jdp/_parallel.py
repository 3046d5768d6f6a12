"""`jdp.parallelize` and the `Parallel` step object it returns."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _backends, _collectives, _hlo, _zero
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

SHARED_LEAVES_MSG = (
    "`step`: the state holds the same array in more than one leaf, and a step that "
    "donates its state (`donate_state=True`) cannot hand one buffer to XLA twice. "
    "Shared leaves:{probs}\nFix: keep one copy of a tied array in the state (and "
    "look it up in both places in your step), give each leaf its own array "
    "(`step.replicate` does), or pass `donate_state=False` to `jdp.parallelize`."
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


def _is_key(x: Any) -> bool:
    """Whether `x` (an array or a `ShapeDtypeStruct`) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _host_value(x: Any) -> np.ndarray:
    """A leaf as a NumPy array in the dtype JAX would give it (keys: their data)."""
    if _is_key(x):
        return np.asarray(jax.device_get(jax.random.key_data(x)))
    if isinstance(x, jax.Array):
        return np.asarray(jax.device_get(x))
    arr = np.asarray(x)
    return arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """Per-device memory of one compiled step, from XLA (`step.memory_analysis`).

    Attributes:
      argument_bytes: Inputs held by one device: its replica of the state and its
        slice of the batch.
      output_bytes: Outputs of one device (new state, metrics).
      alias_bytes: Output bytes written into donated input buffers
        (`donate_state=True`); counted in both of the above but held once.
      temp_bytes: XLA's scratch space: activations, gradients, collective buffers.
      generated_code_bytes: Size of the compiled code.
      peak_bytes: Estimate of the step's peak, `argument + output - alias + temp`:
        an upper bound, since temporaries are not all live at once.
      xla_peak_bytes: XLA's own peak figure where it reports one, else None (on
        CPU it covers arguments and outputs but leaves out temporaries).
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    xla_peak_bytes: int | None

    @classmethod
    def from_xla(cls, stats: Any) -> MemoryAnalysis:
        """Reads a `jaxlib` `CompiledMemoryStats`."""
        arg = int(stats.argument_size_in_bytes)
        out = int(stats.output_size_in_bytes)
        alias = int(stats.alias_size_in_bytes)
        temp = int(stats.temp_size_in_bytes)
        peak = getattr(stats, "peak_memory_in_bytes", None)
        return cls(
            argument_bytes=arg,
            output_bytes=out,
            alias_bytes=alias,
            temp_bytes=temp,
            generated_code_bytes=int(stats.generated_code_size_in_bytes),
            peak_bytes=arg + out - alias + temp,
            xla_peak_bytes=int(peak) if peak else None,
        )


class Parallel:
    """A per-replica step run on every device; made by `jdp.parallelize`.

    Call it as `step(state, batch) -> (state, metrics)` (or `-> metrics` for a
    forward-only step) with a state made by `step.replicate` and a batch made by
    `step.shard`. It also carries the helpers that know its backend and devices.

    Attributes:
      backend: `"shard_map"` or `"pmap"`.
      axis_name: Name of the replica axis bound inside the step (with
        `mesh_shape`, the tuple of both mesh axis names).
      devices: The devices, one replica each, in mesh order.
      mesh: The `jax.sharding.Mesh` over `devices`: 1-D, or `(hosts, devices per
        host)` with `mesh_shape`.
      mesh_shape: The two mesh axis names given to `jdp.parallelize`, or None.
      num_replicas: `len(devices)`.
    """

    def __init__(
        self,
        train_step: Callable[[PyTree, PyTree], Any],
        *,
        devices: Sequence[jax.Device],
        backend: _backends.Backend,
        axis_name: str | tuple[str, ...],
        donate_state: bool,
        mesh_shape: tuple[str, str] | None = None,
    ):
        self.train_step = train_step
        self.backend = backend
        self.axis_name = axis_name
        self.mesh_shape = mesh_shape
        if mesh_shape is None:
            self.mesh = _backends.make_mesh(devices, axis_name)
        else:
            self.mesh = _backends.make_host_mesh(devices, mesh_shape)
        self.devices = tuple(self.mesh.devices.flat)
        self.num_replicas = len(self.devices)
        self.donate_state = donate_state
        self._sharding = _backends.replica_sharding(self.mesh, axis_name)
        self._local_devices = [
            d for d in self.devices if d.process_index == jax.process_index()
        ]
        self._forward_only: bool | None = None
        self._one_in_flight = self.num_replicas > 1 and all(
            d.platform == "cpu" for d in self.devices
        )
        self._in_flight: list[jax.Array] = []
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
        if self.donate_state and self._forward_only is not True:
            self._check_distinct(state)
        if self._one_in_flight:
            self._wait_for_previous_step()
        if self._forward_only is False:
            new_state, metrics = self._fn(state, batch)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_DONATION_WARNING)
                new_state, metrics = self._fn(state, batch)
        if self._one_in_flight:
            self._in_flight = jax.tree.leaves(metrics) or jax.tree.leaves(new_state)[:1]
        if self._forward_only:
            return metrics
        return new_state, metrics

    def _wait_for_previous_step(self) -> None:
        # XLA:CPU runs each simulated device's program on a shared thread pool.
        # With several steps queued, the devices' threads can block in different
        # steps' collective rendezvous and never meet (XLA aborts after 40 s:
        # "Expected N threads to join the rendezvous, but only N-1 arrived").
        # Waiting for the previous step before dispatching the next avoids it,
        # for about one dispatch latency per step.
        pending = [x for x in self._in_flight if not x.is_deleted()]
        self._in_flight = []
        try:
            jax.block_until_ready(pending)
        except jax.errors.JaxRuntimeError:
            pass  # the failed step's outputs raise for whoever reads them

    def _check_state(self, state: PyTree) -> None:
        probs = self._misplaced(state, leading=self.num_replicas)
        if probs:
            raise ValueError(
                NOT_REPLICATED_MSG.format(
                    num=self.num_replicas,
                    axis=self.axis_name,
                    probs=format_problems(probs),
                )
            )

    @staticmethod
    def _check_distinct(state: PyTree) -> None:
        # Donating one buffer twice crashes the process (PjRt rejects it, then
        # jax segfaults), so shared leaves are refused here.
        leaves = jax.tree.leaves(state)
        if len({id(x) for x in leaves}) == len(leaves):
            return
        first: dict[int, str] = {}
        probs = []
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            if id(x) in first:
                probs.append(f"{keystr(path)} is the same array as {first[id(x)]}")
            else:
                first[id(x)] = keystr(path)
        raise ValueError(SHARED_LEAVES_MSG.format(probs=format_problems(probs)))

    def _check_batch(self, batch: PyTree) -> None:
        probs = self._misplaced(batch, leading=None)
        if probs:
            raise ValueError(NOT_SHARDED_MSG.format(probs=format_problems(probs)))

    def _misplaced(self, tree: PyTree, *, leading: int | None) -> list[str]:
        """Leaves that are not arrays sharded by this step's replica sharding."""

        def placed(x):
            return (
                isinstance(x, jax.Array)
                and x.ndim >= 1
                and (leading is None or x.shape[0] == leading)
                and (
                    x.sharding == self._sharding
                    or x.sharding.is_equivalent_to(self._sharding, x.ndim)
                )
            )

        if all(map(placed, jax.tree.leaves(tree))):  # the per-call fast path
            return []
        return [
            f"{keystr(path)}: {_describe(x)}"
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if not placed(x)
        ]

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
        host = jax.tree.map(_host_value, tree)  # PRNG keys as their key data
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            host = multihost_utils.broadcast_one_to_all(host)
        abstract = jax.tree.map(
            lambda x, h: jax.eval_shape(lambda: x) if _is_key(x) else h,
            tree,
            jax.tree.map(lambda h: jax.ShapeDtypeStruct(h.shape, h.dtype), host),
        )
        layout = getattr(self.train_step, _zero.LAYOUT_HOOK, None)
        if layout is not None:  # e.g. a sharded optimizer state (ZeRO)
            abstract = layout(abstract, self.num_replicas)
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (self.num_replicas,) + x.shape, x.dtype, sharding=self._sharding
            ),
            abstract,
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
        its own slice, like Caffe2's shards and
        `jax.make_array_from_process_local_data`): the global batch is the
        processes' batches concatenated in process order. Every process must
        pass the same number of examples; to catch a mismatch
        (which would otherwise train on misaligned data without an error),
        `shard` compares the sizes across processes with one small all-gather
        per call.

        Args:
          batch: Pytree of arrays whose leading axis is the example axis.
          pad: If True, pad the batch (repeating its last example) to a multiple of
            the replica count (with several processes: to the largest process's
            padded batch) and also return a boolean mask, True for real
            examples. Weigh per-example metrics by it, e.g. return
            `{"correct": jnp.sum(ok * mask), "count": jnp.sum(mask)}` and divide
            the two averaged metrics: the ratio is then exact.

        Returns:
          The placed batch, or `(batch, mask)` when `pad` is True.

        Raises:
          ValueError: If a leaf's leading size is not divisible by the replica count
            (and `pad` is False), a leaf is a scalar, or leaves disagree on the batch
            size when padding; with several processes, if the processes' batches
            differ in size (and `pad` is False) or in structure, trailing shapes
            or dtypes.
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
        padded_everywhere = None
        if jax.process_count() > 1:
            padded_everywhere = self._check_process_batches(host, pad=pad)
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
            padded = padded_everywhere or _padded_size(size, num_local)
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
                        + (
                            f"num_replicas={num_local}"
                            if num_local == self.num_replicas
                            else f"this process's {num_local} replicas "
                            f"(num_replicas={self.num_replicas} over "
                            f"{jax.process_count()} processes)"
                        )
                        + f". Use a batch that is a multiple of {num_local}, or call "
                        "`step.shard(batch, pad=True)` to pad it and get a mask."
                    )
        leaves = [self._place_batch_leaf(x) for _, x in host]
        placed = jax.tree_util.tree_unflatten(treedef, leaves)
        if pad:
            return placed, self._place_batch_leaf(mask)
        return placed

    def _check_process_batches(self, host, *, pad: bool) -> int | None:
        """Compares this process's batch with the other processes' (one all-gather).

        Returns the padded per-process size every process uses when `pad`.
        """
        from jax.experimental import multihost_utils

        num_local = len(self._local_devices)
        rows = [x.shape[0] for _, x in host]
        layout = "|".join(f"{keystr(p)}:{x.shape[1:]}:{x.dtype}" for p, x in host)
        mine = np.array(
            [min(rows), max(rows), zlib.crc32(layout.encode()) & 0x7FFFFFFF], np.int32
        )
        every = np.asarray(multihost_utils.process_allgather(mine))
        if len(set(every[:, 2].tolist())) > 1:
            odd = [p for p in range(len(every)) if every[p, 2] != every[0, 2]]
            raise ValueError(
                "`step.shard`: the processes passed batches of different structure, "
                f"trailing shapes or dtypes (process {odd[0]} differs from process "
                f"0; this is process {jax.process_index()}, whose leaves are: "
                + ", ".join(f"{keystr(p)} {x.shape} {x.dtype}" for p, x in host[:5])
                + "). Every process must pass the same leaves with the same shapes "
                "(except the leading size) and dtypes."
            )
        if pad:
            return max(_padded_size(int(n), num_local) for n in every[:, 1])
        if every[:, :2].min() != every[:, :2].max():
            listed = ", ".join(
                f"process {p}: {lo}" + (f"-{hi}" if hi != lo else "")
                for p, (lo, hi) in enumerate(every[:, :2].tolist())
            )
            raise ValueError(
                "`step.shard`: with several processes every process must pass a "
                "local batch of the same size (its share of the global batch); got "
                f"{listed} examples. Give every process the same number of examples "
                "(e.g. drop the smaller last batch of an epoch), or call "
                "`step.shard(batch, pad=True)`, which pads every process to the "
                "largest local batch and returns a mask."
            )
        return None

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
        bcast = functools.partial(
            _collectives.broadcast, root=root, axis_name=self.axis_name
        )
        fn = _backends.build_map(
            functools.partial(_zero.map_unsliced, bcast),  # slices differ by design
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

    def memory_analysis(self, state: PyTree, batch: PyTree) -> MemoryAnalysis:
        """Per-device memory of one step, from XLA's analysis of the compiled step.

        Compiles the step for these arguments (nothing runs) and reads
        `Compiled.memory_analysis()`. Use it to compare `donate_state`, `remat`
        and `shard_optimizer_state` before committing to a run.

        Args:
          state: Replicated state, as for a call.
          batch: Sharded batch, as for a call.

        Returns:
          A `jdp.MemoryAnalysis` with argument, output, alias and temp bytes per
          device and a peak estimate.

        Raises:
          RuntimeError: If XLA reports no memory analysis on this platform.

        Example:
          >>> import jax, jax.numpy as jnp, jdp
          >>> step = jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:2])
          >>> mem = step.memory_analysis(
          ...     step.replicate({"w": jnp.zeros(256)}), step.shard(jnp.zeros(2))
          ... )
          >>> mem.argument_bytes >= 256 * 4, mem.alias_bytes == 256 * 4
          (True, True)
        """
        stats = self.lower(state, batch).compile().memory_analysis()
        if stats is None:
            raise RuntimeError(
                "`step.memory_analysis`: XLA reports no memory analysis for this "
                f"platform ({self.devices[0].platform})."
            )
        return MemoryAnalysis.from_xla(stats)

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
    axis_name: str | tuple[str, ...] = "data",
    donate_state: bool = True,
    mesh_shape: tuple[str, str] | None = None,
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
        you pass in is deleted by the call; use the returned one. Under
        `"shard_map"` the donated state is updated in place (leaves of 64 KiB
        and more per replica; see the README's "How it works"). A state that
        holds one array in two leaves is refused: it cannot be donated twice.
      mesh_shape: Two axis names, e.g. `("host", "device")`, for a 2-D mesh of
        `(processes, devices per process)` instead of the flat 1-D mesh
        (`"shard_map"` backend only). The replica axis inside the step is then
        the tuple of both names: pass it as `axis_name` to your step's
        collectives. `jdp.all_reduce_gradients` then reduces within each host
        first (a reduce-scatter), then across hosts (an all-reduce of a
        1/devices-per-host slice), then gathers within the host: Caffe2's
        NCCL-then-Gloo path, with the cross-host traffic of one device per host.
        The numbers equal the flat mesh's; the state keeps one copy per replica.

    Returns:
      A `jdp.Parallel`, callable as `step(state, batch)`, with `replicate`,
      `unreplicate`, `shard`, `broadcast`, `collectives` and `lower`.

    Raises:
      ValueError: If `backend` is unknown, `devices` is empty, `mesh_shape` is
        not two names (or used with pmap), or, with several processes, the
        processes hold different numbers of `devices`.

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
    if mesh_shape is not None:
        axis_name = _check_mesh_shape(mesh_shape, axis_name, backend)
        mesh_shape = tuple(mesh_shape)
    _check_devices_per_process(devices)
    return Parallel(
        train_step,
        devices=devices,
        backend=backend,
        axis_name=axis_name,
        donate_state=donate_state,
        mesh_shape=mesh_shape,
    )


def _check_mesh_shape(mesh_shape, axis_name, backend) -> tuple[str, str]:
    """Validates `mesh_shape`; returns the step's replica axis (both mesh axes)."""
    names = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else ()
    if (
        len(names) != 2
        or len(set(names)) != 2
        or not all(isinstance(n, str) and n for n in names)
    ):
        raise ValueError(
            "`mesh_shape` must name the two axes of a (hosts, devices per host) "
            f"mesh, e.g. ('host', 'device'); got {mesh_shape!r}."
        )
    if backend != "shard_map":
        raise ValueError(
            f"`mesh_shape={names!r}` needs backend='shard_map' (pmap maps over one "
            f"axis only); got backend={backend!r}."
        )
    if axis_name != "data" and tuple(np.atleast_1d(axis_name)) != names:
        raise ValueError(
            f"With `mesh_shape={names!r}` the step's replica axis is the tuple "
            f"{names!r} of both mesh axes; got axis_name={axis_name!r}. Leave "
            f"`axis_name` out and give {names!r} to the collectives in your step "
            f"(`jdp.make_train_step(..., axis_name={names!r})`)."
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


def _padded_size(size: int, num_local: int) -> int:
    """`size` rounded up to a multiple of `num_local` (at least `num_local`)."""
    return max(num_local, math.ceil(size / num_local) * num_local)


def logical_copy(tree: PyTree) -> PyTree:
    """One logical copy of a replicated pytree: replica 0's value of every leaf.

    The inverse of `place_like`; what `step.unreplicate` returns and what
    checkpoints save. Array leaves with a leading replica axis give this process's
    first replica (`addressable_shards[0]`, no gather); other leaves pass through.
    """

    def first(x):
        if _zero.is_sharded(x):  # ZeRO: gather the full optimizer state
            return _zero.logical(x)
        if isinstance(x, jax.Array) and x.ndim >= 1:
            data = x.addressable_shards[0].data
            return data.reshape(data.shape[1:])
        return x

    return jax.tree.map(first, tree, is_leaf=_zero.is_sharded)


def logical_like(tree: PyTree) -> PyTree:
    """Shapes and dtypes of one logical copy of a replicated pytree; reads no data.

    What `logical_copy(tree)` would return, as `jax.ShapeDtypeStruct`s: leaves with
    a leading replica axis (`jax.Array`s or `jax.ShapeDtypeStruct`s) lose it, and a
    sharded optimizer state (ZeRO) becomes the full optimizer state's structure and
    shapes. The target structure for restoring a checkpoint into `tree`'s layout.
    """

    def one(x):
        if _zero.is_sharded(x):
            return _zero.logical(
                jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
            )
        if hasattr(x, "shape") and hasattr(x, "dtype") and len(x.shape) >= 1:
            return jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype)
        return x

    return jax.tree.map(one, tree, is_leaf=_zero.is_sharded)


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
        if _is_key(ref):  # typed PRNG keys: place their data, then wrap it
            data = _host_value(x)
            shape = tuple(ref.shape) + data.shape[len(ref.shape) - 1 :]
            view = np.broadcast_to(data, shape)
            placed = jax.make_array_from_callback(shape, ref.sharding, view.__getitem__)
            return jax.random.wrap_key_data(placed, impl=ref.dtype._impl)
        x = _host_value(x).astype(ref.dtype, copy=False)
        view = np.broadcast_to(x, ref.shape)  # no copy until a device takes a slice
        return jax.make_array_from_callback(ref.shape, ref.sharding, view.__getitem__)

    def place_node(ref, x):
        if _zero.is_sharded(ref):  # ZeRO: each replica gets its slice
            return _zero.place(x, ref, place)
        return place(x, ref)

    return jax.tree.map(place_node, like, host_tree, is_leaf=_zero.is_sharded)
