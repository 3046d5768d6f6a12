"""`step.shard`: what a batch must be, and the errors that say so."""

import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdp
from jdp import _batching


def echo_step(backend, num=4):
    return jdp.parallelize(
        lambda s, b: (s, {"n": jnp.sum(jnp.ones_like(b["x"]))}),
        backend=backend,
        devices=jax.devices()[:num],
    )


def test_leaves_with_different_numbers_of_examples_are_refused(backend):
    step = echo_step(backend)
    with pytest.raises(
        ValueError, match=r"different numbers of examples.*\['x'\]: 16, \['y'\]: 8"
    ):
        step.shard({"x": np.zeros((16, 3)), "y": np.zeros((8,))})


def test_an_empty_batch_is_refused(backend):
    step = echo_step(backend)
    match = r"the batch is empty \(\['x'\]: shape \(0, 3\), \['y'\]: shape \(0,\)\)"
    with pytest.raises(ValueError, match=match):
        step.shard({"x": np.zeros((0, 3)), "y": np.zeros((0,))})
    with pytest.raises(ValueError, match=match):
        step.shard({"x": np.zeros((0, 3)), "y": np.zeros((0,))}, pad=True)


def test_padded_rows_hold_zeros_for_ids_and_the_last_example_for_floats():
    """An evaluation that weights tokens by `inputs > 0` counts no padded copy."""
    step = echo_step("shard_map")
    tokens = np.array([[3, 4, 0], [5, 0, 0], [6, 7, 8]], np.int32)
    x = np.arange(9.0, dtype=np.float32).reshape(3, 3)
    batch, mask = step.shard({"tokens": tokens, "x": x}, pad=True)
    got = np.asarray(batch["tokens"])
    assert got.shape[0] == 4 and int((got > 0).sum()) == int((tokens > 0).sum())
    np.testing.assert_array_equal(
        np.asarray(batch["x"])[3:], np.repeat(x[-1:], got.shape[0] - 3, 0)
    )
    assert np.asarray(mask).reshape(-1).tolist() == [True] * 3 + [False] * (
        got.shape[0] - 3
    )


def test_int64_values_that_do_not_fit_int32_are_refused():
    step = echo_step("shard_map")
    ids = np.array([1, 2, 3, 2**32 + 3], np.int64)
    with pytest.raises(
        ValueError, match=r"\['ids'\] holds int64 values such as 4294967299.*int32"
    ):
        step.shard({"x": np.zeros((4, 1)), "ids": ids})
    # Values that fit are converted, as JAX would.
    placed = step.shard({"x": np.zeros((4, 1)), "ids": ids[:3].repeat(4)[:4]})
    assert placed["ids"].dtype == jnp.int32


def test_string_leaves_are_a_type_error_naming_the_leaf():
    step = echo_step("shard_map")
    with pytest.raises(TypeError, match=r"batch leaf \['name'\] holds <U5 values"):
        step.shard({"x": np.zeros((4, 1)), "name": np.array(["alpha"] * 4)})


def test_a_pmap_batch_is_refused_by_a_shard_map_step_and_back():
    pmap_step, smap_step = echo_step("pmap"), echo_step("shard_map")
    state = smap_step.replicate({})
    global_batch = {"x": np.ones((8, 3), np.float32)}
    with pytest.raises(ValueError, match=r"(?s)of a 'pmap' step.*extra axis.*\['x'\]"):
        smap_step(state, pmap_step.shard(global_batch))
    with pytest.raises(ValueError, match=r"of a 'shard_map' step, but this step"):
        pmap_step(pmap_step.replicate({}), smap_step.shard(global_batch))
    # Each step's own batch runs, and counts every example once.
    _, metrics = smap_step(state, smap_step.shard(global_batch))
    assert float(metrics["n"]) == 2 * 3


def test_a_hand_placed_batch_without_the_replica_axis_is_refused_by_pmap():
    step = echo_step("pmap")
    x = jax.device_put(np.ones((8, 3), np.float32), step.sharding)
    with pytest.raises(ValueError, match=r"\['x'\]: shape \(8, 3\), expected \(4, "):
        step(step.replicate({}), {"x": x})


def test_padding_still_gives_a_mask_for_a_short_batch(backend):
    step = echo_step(backend)
    batch, mask = step.shard({"x": np.ones((6, 3), np.float32)}, pad=True)
    assert int(np.asarray(mask).sum()) == 6
    assert np.asarray(mask).size == 8


def test_pad_to_gives_the_last_short_batch_the_full_shape(backend):
    step = echo_step(backend)
    full, _ = step.shard({"x": np.ones((16, 3), np.float32)}, pad=True, pad_to=16)
    short, mask = step.shard({"x": np.ones((5, 3), np.float32)}, pad=True, pad_to=16)
    assert short["x"].shape == full["x"].shape
    assert int(np.asarray(mask).sum()) == 5
    with pytest.raises(ValueError, match=r"`pad_to=10` must be a multiple of"):
        step.shard({"x": np.ones((5, 3))}, pad=True, pad_to=10)
    with pytest.raises(ValueError, match=r"needs `pad=True`"):
        step.shard({"x": np.ones((8, 3))}, pad_to=16)
    with pytest.raises(ValueError, match=r"holds 20 examples.*more than `pad_to`"):
        step.shard({"x": np.ones((20, 3))}, pad=True, pad_to=16)


def test_prefetch_yields_every_batch_placed_and_in_order(backend):
    step = jdp.parallelize(
        lambda s, b: {"first": jdp.metrics.gather(b["x"][:1])},
        backend=backend,
        devices=jax.devices()[:4],
    )
    state = step.replicate({})
    batches = [{"x": np.full((8, 2), i, np.float32)} for i in range(5)]
    seen = [step(state, b)["first"][0, 0] for b in step.prefetch(iter(batches))]
    assert [float(v) for v in seen] == [0.0, 1.0, 2.0, 3.0, 4.0]
    padded = list(step.prefetch([{"x": np.ones((6, 2), np.float32)}], pad=True))
    ((batch, mask),) = padded
    assert int(np.asarray(mask).sum()) == 6


def test_prefetch_raises_the_loader_error_where_the_batch_would_be():
    step = echo_step("shard_map")

    def loader():
        yield {"x": np.ones((8, 2), np.float32)}
        raise OSError("disk gone")

    it = step.prefetch(loader())
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)


def test_prefetch_stops_its_thread_when_the_loop_ends():
    import threading

    step = echo_step("shard_map")
    endless = ({"x": np.ones((8, 2), np.float32)} for _ in iter(int, 1))
    it = step.prefetch(endless, size=2)
    next(it)
    it.close()
    for _ in range(50):
        if not any(t.name == "jdp-prefetch" for t in threading.enumerate()):
            break
        threading.Event().wait(0.05)
    assert not any(t.name == "jdp-prefetch" for t in threading.enumerate())


def test_flax_prefetch_to_device_batches_are_refused_by_a_shard_map_step():
    from flax import jax_utils

    step = echo_step("shard_map", num=8)
    batches = [{"x": np.ones((8, 4, 3), np.float32)}]  # (devices, per device, ...)
    (prefetched,) = list(jax_utils.prefetch_to_device(iter(batches), 1))
    with pytest.raises(ValueError, match=r"(?s)prefetch_to_device.*step\.prefetch"):
        step(step.replicate({}), prefetched)
    # The pmap backend takes that layout.
    pmap_step = echo_step("pmap", num=8)
    _, metrics = pmap_step(pmap_step.replicate({}), prefetched)
    assert float(metrics["n"]) == 4 * 3


def test_a_batch_from_flax_common_utils_shard_gets_a_hint(backend):
    """The flax pmap recipe's `common_utils.shard` adds a device axis; the error
    says to leave it out. A plain unplaced batch gets no such hint."""
    from flax.training import common_utils

    step = echo_step(backend, num=8)
    state = step.replicate({})
    batch = {"x": np.ones((16, 3), np.float32), "y": np.zeros(16, np.int32)}
    with pytest.raises(
        ValueError,
        match=r"(?s)\['x'\]: a ndarray of shape \(8, 2, 3\).*leading axis of 8, the "
        r"number of local devices.*common_utils\.shard",
    ):
        step(state, common_utils.shard(batch))
    with pytest.raises(ValueError, match=r"not placed") as info:
        step(state, batch)
    assert "common_utils" not in str(info.value)


# -- the cross-process check (`_batching._ProcessCheck`) over an in-memory
#    store, threads standing in for processes; the real thing runs in
#    tests/multiprocess/test_multihost.py and test_shard_check.py ---------------


class FakeStore:
    """The few calls of the coordination service's key-value store that jdp uses."""

    def __init__(self):
        self.data = {}
        self.lock = threading.Lock()
        self.most = 0  # the largest counter value so far

    def client(self, log):
        """A client of this store that appends the name of each request to `log`."""
        return FakeClient(self, log)


class FakeClient:
    def __init__(self, store, log):
        self.store, self.log = store, log

    def key_value_set(self, key, value, allow_overwrite=False):
        self.log.append("set")
        with self.store.lock:
            assert allow_overwrite or key not in self.store.data
            self.store.data[key] = value

    def key_value_increment(self, key, increment):
        self.log.append("increment")
        with self.store.lock:
            value = int(self.store.data.get(key, "0")) + increment
            # The service's counters are 32-bit (it fails to parse larger values).
            assert 0 <= value < 2**31, f"{key} would hold {value}"
            self.store.data[key] = str(value)
            self.store.most = max(self.store.most, value)
            return value

    def key_value_try_get(self, key):
        self.log.append("try_get")
        with self.store.lock:
            return self.store.data[key]

    def key_value_dir_get(self, prefix):
        self.log.append("dir_get")
        with self.store.lock:
            return [
                (k, v)
                for k, v in sorted(self.store.data.items())
                if k.startswith(prefix)
            ]


def row(size, layout=7, pad=0, pad_to=0):
    """A process's row: (fewest, most examples, layout, pad, local replicas, pad_to)."""
    return (size, size, layout, pad, 1, pad_to)


def run_processes(scripts, *, steps=True, timeout_s=30.0, jitter=None, slow=None):
    """Runs one check per script, each on its own thread ("process").

    A script lists, per `shard` call, a row (compared when it changes), `("pad",
    row)` (compared on every call), or "fail" (a call that failed its own checks).
    With `steps`, every process waits for the others after each call, as a step's
    collective would; process `slow` sleeps before each call. Returns, per process
    and call, None (nothing to report), ("ok", call), ("bad", call) or ("late",
    earlier call); and the checks, their request logs and the store.
    """
    store, n = FakeStore(), len(scripts)
    logs = [[] for _ in scripts]
    checks = [
        _batching._ProcessCheck(client=store.client(logs[i]), process=(i, n))
        for i in range(n)
    ]
    barrier = threading.Barrier(n, timeout=timeout_s) if steps else None
    outcomes = [[] for _ in scripts]
    errors = []

    def run(i):
        try:
            for call, item in enumerate(scripts[i]):
                if jitter is not None:
                    time.sleep(jitter.random() * 0.002)
                if i == slow:
                    time.sleep(0.005)
                if item == "fail":
                    checks[i].count_only()
                    outcomes[i].append(None)
                else:
                    need = isinstance(item[0], str)
                    answer = checks[i].check(item[1] if need else item, need_sizes=need)
                    outcomes[i].append(_outcome(answer, call))
                    if outcomes[i][-1] and outcomes[i][-1][0] != "ok":
                        checks[i].forget_last()  # as `_check_process_batches` does
                if barrier is not None:
                    barrier.wait()
        except BaseException as e:  # reported by the test
            errors.append(e)
            if barrier is not None:
                barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), "the processes deadlocked"
    assert not errors, errors
    return outcomes, checks, logs, store


def _outcome(answer, call):
    if answer is None:
        return None
    at, rows = answer
    if at < call:
        return ("late", at)
    return ("bad" if _batching.mismatch(rows) else "ok", at)


A, B = row(8), row(6)


def test_a_change_on_one_process_is_raised_there_at_once_and_next_call_elsewhere():
    outcomes, checks, _, _ = run_processes([[A] * 6, [A, A, A, B, A, A]])
    # Process 1 changed at call 3: it compares, and raises at once.
    assert outcomes[1] == [("ok", 0), None, None, ("bad", 3), ("ok", 4), None]
    # Process 0 did not: its next call raises what process 1 reported, then
    # compares again.
    assert outcomes[0] == [("ok", 0), None, None, None, ("late", 3), ("ok", 5)]
    assert checks[0].waits == 2 and checks[1].waits == 3


@pytest.mark.parametrize("wrap", [False, True], ids=["", "counts-wrap-around"])
def test_every_process_hears_of_the_disagreement_and_nobody_waits_forever(
    wrap, monkeypatch
):
    """Random scripts over 3 processes: every run of disagreeing calls is raised by
    every process (at its first call, or at the next one), and only those."""
    if wrap:  # counts modulo 16, every process compares every 4 calls
        monkeypatch.setattr(_batching, "_FLAG", 16)
        monkeypatch.setattr(_batching, "_REFRESH", 4)
    for seed in range(12):
        rng = random.Random(seed)
        scripts = [[A] for _ in range(3)]
        for script in scripts:
            for _ in range(24):
                script.append(script[-1] if rng.random() < 0.8 else rng.choice([A, B]))
        outcomes, _, _, _ = run_processes(scripts, jitter=rng)
        disagree = [len({s[c] for s in scripts}) > 1 for c in range(25)]
        for p, seen in enumerate(outcomes):
            raised = {c: o for c, o in enumerate(seen) if o and o[0] != "ok"}
            # No false alarm: each error names a call at which the rows differ.
            assert all(disagree[o[1]] for o in raised.values()), (seed, p, seen)
            for c in range(25):
                if disagree[c] and (c == 0 or not disagree[c - 1]):
                    assert c in raised or c + 1 in raised or c == 24, (seed, p, c)


def test_processes_running_apart_never_lose_track_of_each_other():
    """No step between calls: processes drift apart, and still agree."""
    for seed in range(8):
        rng = random.Random(seed)
        scripts = [[A] * 10 + [B] * 5 + [A] * 10 for _ in range(3)]
        outcomes, checks, _, _ = run_processes(scripts, steps=False, jitter=rng)
        for seen in outcomes:
            assert [o for o in seen if o] == [("ok", 0), ("ok", 10), ("ok", 15)]


def test_counts_that_wrap_around_still_tell_who_is_ahead(monkeypatch):
    """Counts modulo 16: a process far behind must not look ahead. The calls every
    process compares (every 4th here) keep the processes close enough."""
    monkeypatch.setattr(_batching, "_FLAG", 16)
    monkeypatch.setattr(_batching, "_REFRESH", 4)
    scripts = [[A] * 40 + [B] * 5 + [A] * 5 for _ in range(2)]
    outcomes, _, _, _ = run_processes(scripts, steps=False, slow=1)
    for seen in outcomes:
        assert [o for o in seen if o and o[1] % 4] == [("ok", 45)]
        assert all(o[0] == "ok" for o in seen if o)


def test_counters_stay_small_when_one_process_disagrees_again_and_again():
    """Process 1 disagrees at every call (and goes on after each error) while
    process 0 runs ahead: process 0's counter holds few flags at any time."""
    outcomes, _, _, store = run_processes([[A] * 300, [A] + [B] * 299], steps=False)
    assert outcomes[1][1:] == [("bad", c) for c in range(1, 300)]
    assert outcomes[0][0] == ("ok", 0)
    assert all(o is None or o[0] in ("late", "bad") for o in outcomes[0][1:])
    assert store.most < 3 * _batching._FLAG


def test_a_steady_loop_makes_one_request_a_call_and_never_waits():
    outcomes, checks, logs, _ = run_processes([[A] * 50, [A] * 50], steps=False)
    for check, log in zip(checks, logs, strict=True):
        assert check.waits == 1  # the first call
        first = len(log) - 49
        assert log[first:] == ["increment"] * 49


def test_padding_to_the_largest_batch_compares_every_call():
    sizes = [[8, 8, 3], [5, 8, 8], [2, 2, 2]]
    scripts = [[("pad", row(s, pad=1)) for s in mine] for mine in sizes]
    outcomes, checks, _, _ = run_processes(scripts, steps=False)
    assert all(seen == [("ok", 0), ("ok", 1), ("ok", 2)] for seen in outcomes)
    assert all(check.waits == 3 for check in checks)


def test_a_call_that_fails_its_own_checks_still_counts():
    outcomes, _, _, _ = run_processes([[A, "fail", A, B], [A, A, A, B]])
    # Process 0 compares again after the failed call; both agree at call 3.
    assert outcomes[0] == [("ok", 0), None, ("ok", 2), ("ok", 3)]
    assert outcomes[1] == [("ok", 0), None, None, ("ok", 3)]


def test_late_peeks_at_a_disagreement_without_a_call():
    store, logs = FakeStore(), [[], []]
    p0, p1 = (
        _batching._ProcessCheck(client=store.client(logs[i]), process=(i, 2))
        for i in range(2)
    )
    results = {}

    def second():
        results[1] = [p1.check(A, need_sizes=False), p1.check(B, need_sizes=False)]

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    assert p0.check(A, need_sizes=False)[0] == 0
    assert p0.check(A, need_sizes=False) is None
    thread.join(10)
    assert results[1][1] == (1, [A, B])
    assert p0.late == (1, [A, B])
    assert p0.check(A, need_sizes=False) == (1, [A, B])
    assert p0.late is None


def test_a_signature_is_in_force_from_its_change_until_the_next():
    changes = [(0, (8, 8, 1, 0, 1, 0)), (5, (6, 6, 1, 0, 1, 0))]
    assert _batching.row_at(changes, 0) == changes[0][1]
    assert _batching.row_at(changes, 4) == changes[0][1]
    assert _batching.row_at(changes, 5) == changes[1][1]
    assert _batching.row_at(changes, 99) == changes[1][1]
    assert _batching.row_at(changes, -1) is None


def test_published_rows_round_trip_through_their_text_form():
    entries = [(0, (8, 8, 12345, 0, 4, 0)), (17, (6, 6, 12345, 1, 4, 64))]
    assert _batching._decode(_batching._encode(entries)) == entries
    assert _batching._decode(_batching._encode([])) == []


def test_processes_agree_on_sizes_unless_they_pad():
    assert _batching.mismatch([A, A]) is None
    assert _batching.mismatch([A, B]) == "sizes"
    assert _batching.mismatch([A, row(8, layout=9)]) == "layout"
    assert _batching.mismatch([A, row(8, pad=1)]) == "pad"
    assert _batching.mismatch([row(8, pad=1), row(5, pad=1)]) is None
    assert _batching.mismatch([row(8, pad=1, pad_to=16), row(8, pad=1)]) == "pad_to"
    assert _batching.mismatch([(8, 8, 7, 0, 1, 0), (6, 8, 7, 0, 1, 0)]) == "sizes"


def test_different_pad_to_is_named_with_each_process():
    host = [("x", np.ones((8, 3), np.float32))]
    every = [row(8, pad=1, pad_to=16), row(8, pad=1, pad_to=32)]
    with pytest.raises(
        ValueError,
        match=r"different `pad_to` \(process 0: pad_to=16, process 1: pad_to=32\)",
    ):
        _batching._compare_processes(every, host, num_local=2, late=None)
    every = [row(8, pad=1, pad_to=16), row(8, pad=1)]
    with pytest.raises(
        ValueError,
        match=r"at an earlier call \(call 4 of `step.shard` on this process\), the "
        r"processes called `step.shard` with different `pad_to` \(process 0: "
        r"pad_to=16, process 1: pad_to=None\)",
    ):
        _batching._compare_processes(every, host, num_local=2, late=4)
    every = [row(8, pad=1), row(5, pad=1)]
    assert _batching._compare_processes(every, host, num_local=2, late=None) == 8
