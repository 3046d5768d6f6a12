"""Private: `jdp.distributed.live`, a train step that survives a lost process.

See `live`, and the Live recovery guide (docs/guides/live.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

from jdp import _collectives, _coordination, _jax_compat, _layout, _metrics
from jdp._parallel import Parallel, parallelize
from jdp._train_step import TrainStep
from jdp._tree import PyTree

_log = logging.getLogger("jdp.distributed")

API = "jdp.distributed.live"


_KEYS = "jdp/live/"
#: How often a process whose mesh lacks a process reads the join keys, at most.
_READ_S = 0.2


def _ids(devices: Sequence[jax.Device]) -> str:
    return ",".join(str(d.id) for d in devices)


class LiveStep:
    """A train step over the devices of the live processes (see `live`)."""

    def __init__(
        self,
        train_step: Callable[[PyTree, PyTree], tuple[PyTree, dict]],
        devices: Sequence[jax.Device],
        max_retries: int,
    ):
        self._train_step = train_step
        self._devices = list(devices)
        self._max_retries = max_retries
        self._store = _coordination.store()
        self._parallel: Parallel | None = None
        self._marked: str | None = None  # the last order recorded as used
        #: `_on_mesh`'s programs (`_heal_replicas`, `_sum_replicas`), by function.
        self._helpers: dict[Callable, Parallel] = {}
        #: `{process: join key value}` of the replacements already healed.
        self._joins: dict[int, str] = {}
        #: While the mesh lacks a process, rounds wait for its members only until all
        #: saw a join key (written by a replacement reaching its first round).
        self._admit = False
        #: Whether this process saw one since the mesh formed, and when it reads next.
        self._seen, self._next_read = False, 0.0
        #: Steps completed through this object.
        self.position = 0
        #: How many times the set of replicas changed after the first mesh.
        self.membership_changes = 0

    @property
    def num_replicas(self) -> int:
        """Replicas of the current mesh (one per live device)."""
        return 0 if self._parallel is None else self._parallel.num_replicas

    @property
    def devices(self) -> list[jax.Device]:
        """The devices of the current mesh, in replica order."""
        return [] if self._parallel is None else list(self._parallel.mesh.devices.flat)

    def replicate(self, state: PyTree) -> PyTree:
        """Places one logical copy of `state` on every live device.

        At the start every process must pass the same `state` (e.g. built from
        the same seed, or restored from the same checkpoint): nothing is
        broadcast, so that no collective spans a process that may already be
        gone. In a replacement, a process started while the others train,
        `state` only gives the structure: it joins them at their next step and
        receives their whole state from a live replica, and `position` becomes
        theirs.
        """
        joining = self._value("running") == "1"
        if joining:  # the others see this key inside the round it joins them in
            key = f"{_KEYS}join/{jax.process_index()}"
            self._store.put(key, f"{time.time_ns()}-{os.getpid()}")
        for attempt in self._attempts():
            with attempt:
                with multihost_utils.live_devices(self._devices) as live:
                    self._form(live)
                    host = jax.tree.map(_layout.host_value, state)
                    placed = _layout.place_copies(state, host, self._parallel.sharding)
                    if joining:
                        self._joins.update(self._joins_new(live))
                        placed = self._relayout(placed, lambda x: x, holds=False)
                        placed = self._heal(placed)
            if attempt.ok:
                return placed
        raise AssertionError("unreachable")  # `_attempts` raises when tries run out

    def __call__(self, state: PyTree, batch: PyTree) -> tuple[PyTree, dict]:
        """One step on `batch`, the global batch (the same on every process).

        Returns:
          `(state, metrics)` as the wrapped step does, on the current mesh.

        Raises:
          RuntimeError: After `max_retries` failed attempts at one step.
        """
        failed = False
        for attempt in self._attempts():
            healed, admit, found = False, self._admit, {}
            with attempt:
                with multihost_utils.live_devices(self._barrier()) as live:
                    # After a failed round every process re-forms, on a new device
                    # order even for the same devices (a timed-out collective's
                    # connections stay broken), and heals a join not healed yet.
                    mine = _ids(sorted(self.devices, key=lambda d: d.id))
                    changed = failed or _ids(live) != mine
                    # A replacement shows as a failed round (its incarnation is
                    # new) or as a new device: only then is the store read.
                    found = self._joins_new(live) if changed else {}
                    if changed:
                        state = self._reform(live, state)
                    if found:  # a round of its own: every process heals
                        state = jax.block_until_ready(self._heal(state))
                        healed = True
                    else:
                        inputs = (self._place(batch), self._replicas(self._saw_join()))
                        state_out, (metrics, seen) = self._parallel(state, inputs)
                        out = jax.block_until_ready((state_out, metrics))
                        admit = admit or int(seen) == self.num_replicas
            failed = not attempt.ok
            self._joins.update(found if attempt.ok else {})
            if attempt.ok and not healed:
                self._admit = admit
                self.position += 1
                if self.position == 1:
                    self._store.put(f"{_KEYS}running", "1")
                return out
        raise AssertionError("unreachable")  # `_attempts` raises when tries run out

    def _attempts(self):
        """Context managers, one per try, until the caller stops or too many fail."""
        failures: list[str] = []
        while True:
            yield _Attempt(self, failures)
            if len(failures) > self._max_retries:
                raise RuntimeError(
                    f"`{API}`: the step failed {len(failures)} times in a row; the "
                    f"last failure: {failures[-1]}"
                )

    def _value(self, key: str) -> str | None:
        try:
            return self._store.get(_KEYS + key)
        except Exception:  # noqa: BLE001 - the store raises for a missing key
            return None

    def _joins_new(self, devices: Sequence[jax.Device]) -> dict[int, str]:
        """`{process: join key value}` of `devices`' processes not healed since.

        Read for a round's live devices, all processes read the same: the barrier
        released every process of the round after they had written their keys.
        """
        processes = {d.process_index for d in devices}
        prefix = f"{_KEYS}join/"
        joins = _coordination.by_number(self._store.entries(prefix), prefix)
        return {
            p: v for p, v in joins.items() if p in processes and self._joins.get(p) != v
        }

    def _barrier(self) -> list[jax.Device]:
        """The devices whose processes a round waits for (see `_admit`)."""
        if self._parallel is None or self._admit:
            return self._devices
        members = {d.process_index for d in self.devices}
        return [d for d in self._devices if d.process_index in members]

    def _saw_join(self) -> bool:
        """Whether this process saw a join key of a process the mesh lacks.

        Read at most every `_READ_S` seconds, and kept once seen: the step sums
        it over the replicas with its metrics, and all agree to admit the
        replacement when the sum is the replica count.
        """
        if self._seen or time.monotonic() < self._next_read:
            return self._seen
        if missing := set(self._devices) - set(self.devices):
            self._next_read = time.monotonic() + _READ_S
            self._seen = bool(self._joins_new(missing))
        return self._seen

    def _heal(self, state: PyTree) -> PyTree:
        """Every replica behind the most advanced one gets its whole state.

        The replicas exchange how many steps they completed (a replacement:
        -1); the first of the most advanced sends its state to the others.
        """
        state, metrics = self._on_mesh(_heal_replicas, state, self.position)
        self.position = int(metrics["position"])
        return state

    def _total(self, tree: PyTree) -> PyTree:
        """Per-replica arrays summed over the current mesh (every replica: the sum)."""
        return self._on_mesh(_sum_replicas, tree, 0)[0]

    def _on_mesh(self, fn, tree: PyTree, value: int) -> tuple[PyTree, dict]:
        """`fn(tree, value)` per replica on the current mesh (compiled once a mesh)."""
        step = self._helpers.get(fn)
        if step is None or step.devices != self._parallel.devices:
            step = parallelize(fn, devices=self.devices, donate_state=False)
            self._helpers[fn] = step
        return step(tree, self._replicas(value))

    def _replicas(self, value: int) -> jax.Array:
        """`value` on every replica of the current mesh, an int32 per replica."""
        return jax.make_array_from_callback(
            (self.num_replicas,),
            self._parallel.sharding,
            lambda index: np.full((1,), value, np.int32),
        )

    def _form(self, live: Sequence[jax.Device]) -> None:
        """A mesh over `live`, in a device order no earlier mesh of the job used.

        The CPU collectives cache their connections by the ordered device list,
        and a list used before a failure does not work again; the orders used
        are kept in the coordination service's store, which a replacement reads.
        """
        used = set(self._store.entries(f"{_KEYS}used/").values())
        ordered = sorted(live, key=lambda d: d.id)
        order = next(
            (o for o in itertools.permutations(ordered) if _ids(o) not in used),
            ordered,
        )
        if self._parallel is not None:
            self.membership_changes += 1
        self._admit, self._seen = False, False
        self._parallel = parallelize(
            _metrics_last(self._train_step), devices=list(order), donate_state=False
        )
        _log.info("%s: %d replicas, devices %s", API, len(order), _ids(order))

    def _mark_used(self) -> None:
        """Records the current device order as used, once per order.

        Called after a round, so that every process has chosen its order (read
        the store) before any records it.
        """
        ids = _ids(self.devices)
        if self._parallel is not None and ids != self._marked:
            self._store.put(f"{_KEYS}used/{ids}", ids)
            self._marked = ids

    def _reform(self, live: Sequence[jax.Device], state: PyTree) -> PyTree:
        """`state` rewrapped for a mesh over `live`: each device keeps its replica."""
        self._form(live)
        sharding = self._parallel.sharding
        mine = [d for d in self.devices if d.process_index == jax.process_index()]

        def rewrap(x):
            if not isinstance(x, jax.Array):
                return x
            held = {s.device: s.data for s in x.addressable_shards}
            return jax.make_array_from_single_device_arrays(
                (self.num_replicas,) + x.shape[1:], sharding, [held[d] for d in mine]
            )

        return self._relayout(state, rewrap, holds=True)

    def _relayout(self, state: PyTree, rewrap, holds: bool) -> PyTree:
        """`state` on the current mesh, each custom layout (ZeRO's) re-laid out."""

        def one(x):
            if _layout.is_custom(x):
                return x.relayout(rewrap, self._parallel.sharding, holds, self._total)
            return rewrap(x)

        return jax.tree.map(one, state, is_leaf=_layout.is_custom)

    def _place(self, batch: PyTree) -> PyTree:
        """This process's replicas' rows of the global `batch`, placed."""
        n = self.num_replicas
        sharding = self._parallel.sharding

        def place(path, x):
            x = np.asarray(x)
            if x.ndim == 0 or x.shape[0] % n:
                raise ValueError(
                    f"`{API}`: batch leaf {jax.tree_util.keystr(path)} has "
                    f"{x.shape[0] if x.ndim else 0} examples, which the {n} live "
                    "replicas cannot share equally. Give a global batch whose "
                    "size every replica count that may remain divides (e.g. a "
                    "multiple of 12 for up to 4 processes)."
                )
            return jax.make_array_from_callback(x.shape, sharding, x.__getitem__)

        return jax.tree_util.tree_map_with_path(place, batch)


def _metrics_last(train_step):
    """`train_step` on `(batch, seen)`, its metrics reduced after every collective.

    See `_collectives.last`: without it a process whose peer died mid-step can
    abort (process 0 with the coordination service, from 4 processes on). The
    metrics become `(metrics, the sum of seen over the replicas)`.
    """

    def step(state, inputs):
        batch, seen = inputs
        new_state, metrics = train_step(state, batch)
        seen = _metrics.sum(jnp.sum(seen))  # shape (1,) per replica
        return new_state, _collectives.last((metrics, seen), new_state)

    if isinstance(train_step, TrainStep):
        return dataclasses.replace(train_step, step_fn=step)
    return step


def _heal_replicas(state: PyTree, position: jax.Array) -> tuple[PyTree, dict]:
    """Per replica: the state of the first most advanced replica, if behind it."""
    everyone = lax.all_gather(position[0], _collectives.resolve_axis(None))
    source = jnp.argmax(everyone)
    behind = position[0] < everyone[source]

    def pick(new, old):
        if jnp.issubdtype(old.dtype, jax.dtypes.prng_key):
            data = pick(jax.random.key_data(new), jax.random.key_data(old))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))
        return jnp.where(behind, new, old)

    def heal(tree):  # ZeRO's slices: `_relayout` gave every replica its own
        return jax.tree.map(pick, _collectives.broadcast(tree, root=source), tree)

    return _layout.map_agreed(heal, state), {"position": everyone[source]}


def _sum_replicas(tree: PyTree, unused: jax.Array) -> tuple[PyTree, dict]:
    del unused
    return lax.psum(tree, _collectives.resolve_axis(None)), {}


class _Attempt:
    """One try of a `LiveStep` round: a failure is logged and recorded, not raised."""

    def __init__(self, step: LiveStep, failures: list[str]):
        self._step, self._failures = step, failures
        self.ok = False

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        self._step._mark_used()
        if error is None:
            self.ok = True
            return False
        if (
            not isinstance(error, Exception)
            or isinstance(error, ValueError)
            and (API in str(error))
        ):
            return False  # interrupts, and this module's own input errors
        self._failures.append(f"{type(error).__name__}: {error}")
        _log.warning(
            "%s: the step failed on every live process (%s); it runs again on the "
            "live devices.",
            API,
            self._failures[-1][:200],
        )
        return True


def live(
    train_step: Callable[[PyTree, PyTree], tuple[PyTree, dict]],
    *,
    devices: Sequence[jax.Device] | None = None,
    max_retries: int = 3,
) -> LiveStep:
    """`train_step` on the live processes: a lost process does not stop the others.

    Each call runs the step inside JAX's `multihost_utils.live_devices`. When a
    process dies (not process 0, which hosts JAX's coordination service), the
    step in flight fails on every survivor alike; they form a new mesh over the
    live devices and run the same step again, on the same global batch split
    over fewer replicas. Each device keeps its own replica of the state, so
    nothing is read from a checkpoint; the step does not donate its state. A
    replacement process (same process id, same script) started while they train
    joins them at a step boundary: its `step.replicate` receives their state.

    It needs JAX's fault tolerance, set up before `jdp.distributed.initialize`:
    `jax.config.update("jax_enable_recoverability", True)`, `fail_fast=False`,
    a short `heartbeat_timeout_s` and, on CPU,
    `XLA_FLAGS=--xla_cpu_collective_timeout_seconds=N`. The Live recovery guide
    (docs/guides/live.md) gives what each setting costs and what is tested.
    With JAX's persistent compilation cache on, it makes the keys of CPU
    programs the same in every process and device order (as on GPU), so that a
    re-formed mesh's step is a cache read.

    Args:
      train_step: A per-replica step, e.g. from `jdp.make_train_step`. Under
        `jdp.zero` the slices of a process that died restart from the
        optimizer's initial value; the others are sliced anew.
      devices: The devices to train on (default: all of every process).
      max_retries: How many membership changes one step may meet before it
        gives up.

    Returns:
      A `LiveStep`: `state = step.replicate(state)`, then `state, metrics =
      step(state, global_batch)` with the same global batch on every process.

    Raises:
      RuntimeError: If JAX's fault tolerance is off or the distributed runtime
        is not initialized.
    """
    if _coordination.store() is None:
        raise RuntimeError(
            f"`{API}` trains across processes: call `jdp.distributed.initialize` "
            "first (with `fail_fast=False`)."
        )
    if not jax.config.jax_enable_recoverability:
        raise RuntimeError(
            f"`{API}` needs JAX's fault tolerance: call "
            '`jax.config.update("jax_enable_recoverability", True)` before '
            "`jdp.distributed.initialize(..., fail_fast=False)`."
        )
    _jax_compat.share_cpu_cache_entries()
    return LiveStep(
        train_step, jax.devices() if devices is None else devices, max_retries
    )
