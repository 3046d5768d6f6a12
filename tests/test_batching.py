"""`step.shard`: what a batch must be, and the errors that say so."""

import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdp
from jdp.distributed import _batch_agreement


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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_bfloat16_and_float8_leaves_are_placed(backend, dtype):
    """They were refused as "strings or Python objects" (NumPy's kind "V")."""
    step = echo_step(backend)
    x = np.arange(8, dtype=np.float32).reshape(4, 2).astype(dtype)
    for batch in (step.shard({"x": x}), step.shard({"x": x}, pad=True)[0]):
        assert batch["x"].dtype == dtype
        np.testing.assert_array_equal(np.asarray(batch["x"]).reshape(4, 2), x)


def test_prng_key_leaves_are_named_with_the_fix():
    step = echo_step("shard_map")
    keys = jax.random.split(jax.random.key(0), 4)
    with pytest.raises(TypeError, match=r"\['k'\] holds PRNG keys.*key_data"):
        step.shard({"x": np.zeros((4, 1)), "k": keys})


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


# -- the cross-process check (`_batch_agreement._ProcessCheck`) over an in-memory
#    store, threads standing in for processes; the real thing runs in
#    tests/multiprocess/test_multihost.py and test_shard_check.py ---------------


class FakeStore:
    """The few calls of the coordination service's key-value store that jdp uses."""

    def __init__(self):
        self.data = {}
        self.lock = threading.Lock()
        self.longest = 0  # the longest value written so far

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
            self.store.longest = max(self.store.longest, len(value))

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


def run_processes(
    scripts, *, steps=True, timeout_s=10.0, jitter=None, slow=None, join_s=60.0
):
    """Runs one check per script, each on its own thread ("process").

    A script lists, per `shard` call, a row (compared when it changes), `("pad",
    row)` (compared on every call), or "fail" (a call that failed its own checks).
    With `steps`, every process waits for the others after each call, as a step's
    collective would (a process whose batch did not change goes on into it); a
    check waits at most `timeout_s` for the others; process `slow` sleeps before
    each call. Returns, per process and call, None (nothing to report), ("ok",
    call), ("bad", call) (a confirmed disagreement), ("timeout", call) (the wait
    ran out) or ("late", earlier call) (reported by another process); the checks,
    their request logs (with the log's length after each call) and the store.
    """
    store, n = FakeStore(), len(scripts)
    logs = [[] for _ in scripts]
    checks = [
        _batch_agreement._ProcessCheck(
            client=store.client(logs[i]), process=(i, n), timeout_s=timeout_s
        )
        for i in range(n)
    ]
    barrier = threading.Barrier(n, timeout=join_s) if steps else None
    outcomes = [[] for _ in scripts]
    lengths = [[] for _ in scripts]
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
                    found = checks[i].check(item[1] if need else item, need_sizes=need)
                    outcomes[i].append(_outcome(found, call))
                    if outcomes[i][-1] and outcomes[i][-1][0] != "ok":
                        checks[i].forget_last()  # as `_check_process_batches` does
                lengths[i].append(len(logs[i]))
                if barrier is not None:
                    barrier.wait()
        except BaseException as e:  # reported by the test
            errors.append(e)
            if barrier is not None:
                barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_s
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), "the processes deadlocked"
    assert not errors, errors
    return outcomes, checks, (logs, lengths), store


def _outcome(found, call):
    if found is None:
        return None
    if found.call < call:
        return ("late", found.call)
    if found.unconfirmed:
        return ("timeout", call)
    return ("bad" if _batch_agreement.mismatch(found.rows.values()) else "ok", call)


A, B, C = row(8), row(6), row(4)


def test_a_process_whose_batch_did_not_change_sends_nothing_and_goes_on():
    """Process 1's batch shrinks at call 3, process 0's does not: process 0 goes
    into the step; process 1 waits for it to confirm, in vain, and raises."""
    start = time.monotonic()
    outcomes, checks, _, _ = run_processes([[A] * 6, [A, A, A, B, A, A]], timeout_s=0.3)
    assert outcomes[0] == [("ok", 0), None, None, None, None, None]
    # After the error process 1 publishes again: process 0's row agrees.
    assert outcomes[1] == [("ok", 0), None, None, ("timeout", 3), ("ok", 4), None]
    assert 0.3 <= time.monotonic() - start < 10
    assert checks[0].waits == 1 and checks[1].waits == 3


def test_a_change_that_disagrees_with_another_change_is_raised_at_once():
    start = time.monotonic()
    outcomes, _, _, _ = run_processes([[A, A, C, A], [A, A, B, A]], timeout_s=30)
    assert outcomes[0][2] == outcomes[1][2] == ("bad", 2)
    assert outcomes[0][3] == outcomes[1][3] == ("ok", 3)
    assert time.monotonic() - start < 10  # nobody waited for the time limit


def test_a_process_that_reached_the_call_is_seen_to_disagree_without_a_timeout():
    """Process 0 runs ahead (no step) and publishes a later change: process 1,
    whose batch changed at call 3, reads process 0's row there and raises."""
    start = time.monotonic()
    outcomes, _, _, _ = run_processes(
        [[A] * 6 + [C], [A, A, A, B, B, B, B]], steps=False, slow=1, timeout_s=30
    )
    assert outcomes[1][3] == ("bad", 3)
    assert time.monotonic() - start < 10


def test_processes_changing_at_the_same_call_at_different_times_agree():
    """No step between calls: processes drift apart, change at the same calls at
    different times, and never raise a false alarm (the one ahead waits)."""
    for seed in range(6):
        rng = random.Random(seed)
        scripts = [[A] * 10 + [B] * 5 + [A] * 10 for _ in range(3)]
        outcomes, checks, _, _ = run_processes(
            scripts, steps=False, jitter=rng, slow=seed % 3
        )
        for seen in outcomes:
            assert [o for o in seen if o] == [("ok", 0), ("ok", 10), ("ok", 15)]


def _random_scripts(rng, processes=3, calls=25):
    """A common script of A/B/C with some steady runs, and short runs where
    one process passes another batch."""
    common = [A]
    for _ in range(calls - 1):
        common.append(common[-1] if rng.random() < 0.75 else rng.choice([A, B, C]))
    scripts = [list(common) for _ in range(processes)]
    for _ in range(3):
        p, at = rng.randrange(processes), rng.randrange(calls)
        for c in range(at, min(at + rng.randint(1, 3), calls)):
            scripts[p][c] = rng.choice([A, B, C])
    return scripts


@pytest.mark.parametrize("steps", [True, False], ids=["steps", "no-steps"])
def test_every_disagreement_is_raised_by_a_process_whose_batch_changed(steps):
    """Random scripts over 3 processes, with a step after each call or none (the
    processes drift apart): no false alarm, the first call of every run of
    disagreeing calls is raised there by a process that compared (also after
    earlier errors, the processes going on), and nobody waits forever."""
    for seed in range(8):
        rng = random.Random(seed)
        scripts = _random_scripts(rng)
        calls = len(scripts[0])
        outcomes, _, _, _ = run_processes(
            scripts, steps=steps, jitter=rng, timeout_s=0.5
        )
        disagree = [len({s[c] for s in scripts}) > 1 for c in range(calls)]
        raised = set()
        for p, seen in enumerate(outcomes):
            for c, o in enumerate(seen):
                if o and o[0] in ("bad", "timeout"):
                    # No false alarm: each error is at a call where rows differ.
                    assert disagree[c], (seed, p, c, seen)
                    raised.add(c)
        for c in range(calls):
            if disagree[c] and (c == 0 or not disagree[c - 1]):
                assert c in raised, (seed, c, scripts, outcomes)


def test_a_steady_loop_makes_no_request_at_all():
    outcomes, checks, (logs, lengths), _ = run_processes(
        [[A] * 50, [A] * 50], steps=False
    )
    for check, log, length in zip(checks, logs, lengths, strict=True):
        assert check.waits == 1  # the first call
        assert log[:2] == ["set", "dir_get"]
        assert length[1:] == [length[0]] * 49  # nothing after the first call
    assert all(seen[1:] == [None] * 49 for seen in outcomes)


def test_padding_to_the_largest_batch_compares_every_call():
    sizes = [[8, 8, 3], [5, 8, 8], [2, 2, 2]]
    scripts = [[("pad", row(s, pad=1)) for s in mine] for mine in sizes]
    outcomes, checks, _, _ = run_processes(scripts, steps=False)
    assert all(seen == [("ok", 0), ("ok", 1), ("ok", 2)] for seen in outcomes)
    assert all(check.waits == 3 for check in checks)


def test_padding_with_pad_to_sends_nothing_when_only_the_sizes_change():
    scripts = [
        [row(s, pad=1, pad_to=32) for s in mine] for mine in [[8, 8, 3], [5] * 3]
    ]
    outcomes, checks, _, _ = run_processes(scripts)
    assert outcomes == [[("ok", 0), None, None]] * 2
    assert all(check.waits == 1 for check in checks)


def test_records_stay_small():
    """Each record drops the changes every process is past: a long padded loop
    (a change every call) and many changes keep the values short."""
    sizes = [[8, 5] * 100, [3] * 200]
    scripts = [[("pad", row(s, pad=1)) for s in mine] for mine in sizes]
    run_processes(scripts, steps=False)
    scripts = [[A, B] * 50 for _ in range(2)]
    _, _, _, store = run_processes(scripts, steps=False)
    assert store.longest < 200


def test_a_call_that_fails_its_own_checks_still_counts():
    outcomes, _, _, _ = run_processes([[A, "fail", A, B], [A, A, A, B]])
    # Process 0 publishes again after the failed call; both agree at call 3.
    assert outcomes[0] == [("ok", 0), None, ("ok", 2), ("ok", 3)]
    assert outcomes[1] == [("ok", 0), None, None, ("ok", 3)]


def test_a_first_call_does_not_wait_past_the_limit_for_a_process_yet_to_start():
    """The process that comes later compares with this one's first record."""
    store, logs = FakeStore(), [[], []]
    p0, p1 = (
        _batch_agreement._ProcessCheck(
            client=store.client(logs[i]), process=(i, 2), timeout_s=0.1
        )
        for i in range(2)
    )
    assert _outcome(p0.check(A, need_sizes=False), 0) == ("ok", 0)
    assert p0.check(A, need_sizes=False) is None
    assert _outcome(p1.check(B, need_sizes=False), 0) == ("bad", 0)
    # A later change waits for the others (in vain: process 1 makes no call 2).
    found = p0.check(C, need_sizes=False)
    assert found.unconfirmed == {1: 0} and found.rows == {0: C, 1: B}


def test_late_tells_how_far_this_process_got_and_reads_what_others_found():
    """Process 1's batch changed, process 0's did not: process 0 sends nothing,
    until it asks `late`, which lets process 1 see its row and raise."""
    store, logs = FakeStore(), [[], []]
    p0, p1 = (
        _batch_agreement._ProcessCheck(client=store.client(logs[i]), process=(i, 2))
        for i in range(2)
    )
    results = {}

    def second():
        results[1] = [p1.check(A, need_sizes=False), p1.check(B, need_sizes=False)]

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    assert p0.check(A, need_sizes=False).call == 0
    assert p0.check(A, need_sizes=False) is None
    deadline = time.monotonic() + 10
    while p0.late is None and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.join(10)
    assert results[1][1] == _batch_agreement.Found(
        1, {0: A, 1: B}, {}, results[1][1][3]
    )
    assert p0.late == _batch_agreement.Found(1, {0: A, 1: B}, {})
    assert p0.check(A, need_sizes=False) == _batch_agreement.Found(1, {0: A, 1: B}, {})
    assert p0.late is None


def test_the_time_limit_comes_from_the_environment(monkeypatch):
    check = _batch_agreement._ProcessCheck(process=(0, 2))
    monkeypatch.delenv("JDP_SHARD_CHECK_TIMEOUT", raising=False)
    assert check.timeout_s() == 60
    monkeypatch.setenv("JDP_SHARD_CHECK_TIMEOUT", "2.5")
    assert check.timeout_s() == 2.5
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv("JDP_SHARD_CHECK_TIMEOUT", bad)
        with pytest.raises(
            ValueError, match="JDP_SHARD_CHECK_TIMEOUT=.*seconds above 0"
        ):
            check.timeout_s()


def test_a_signature_is_in_force_from_its_change_until_the_next():
    changes = [(0, (8, 8, 1, 0, 1, 0)), (5, (6, 6, 1, 0, 1, 0))]
    assert _batch_agreement.row_at(changes, 0) == changes[0][1]
    assert _batch_agreement.row_at(changes, 4) == changes[0][1]
    assert _batch_agreement.row_at(changes, 5) == changes[1][1]
    assert _batch_agreement.row_at(changes, 99) == changes[1][1]
    assert _batch_agreement.row_at(changes, -1) is None


def test_published_rows_round_trip_through_their_text_form():
    entries = [(0, (8, 8, 12345, 0, 4, 0)), (17, (6, 6, 12345, 1, 4, 64))]
    assert _batch_agreement._decode(_batch_agreement._encode(entries)) == entries
    assert _batch_agreement._decode(_batch_agreement._encode([])) == []


def test_processes_agree_on_sizes_unless_they_pad():
    assert _batch_agreement.mismatch([A, A]) is None
    assert _batch_agreement.mismatch([A, B]) == "sizes"
    assert _batch_agreement.mismatch([A, row(8, layout=9)]) == "layout"
    assert _batch_agreement.mismatch([A, row(8, pad=1)]) == "pad"
    assert _batch_agreement.mismatch([row(8, pad=1), row(5, pad=1)]) is None
    assert (
        _batch_agreement.mismatch([row(8, pad=1, pad_to=16), row(8, pad=1)]) == "pad_to"
    )
    assert (
        _batch_agreement.mismatch([(8, 8, 7, 0, 1, 0), (6, 8, 7, 0, 1, 0)]) == "sizes"
    )
    assert _batch_agreement.signature(row(8, pad=1)) == _batch_agreement.signature(
        row(5, pad=1)
    )
    assert _batch_agreement.signature(A) != _batch_agreement.signature(B)


def test_different_pad_to_is_named_with_each_process():
    host = [("x", np.ones((8, 3), np.float32))]
    found = _batch_agreement.Found(
        3, {0: row(8, pad=1, pad_to=16), 1: row(8, pad=1, pad_to=32)}, {}
    )
    with pytest.raises(
        ValueError,
        match=r"^`step.shard`: the processes called `step.shard` with different "
        r"`pad_to` \(process 0: pad_to=16, process 1: pad_to=32\)",
    ):
        _batch_agreement._compare_processes(found, host, num_local=2)
    found = _batch_agreement.Found(
        4, {0: row(8, pad=1, pad_to=16), 1: row(8, pad=1)}, {}
    )
    with pytest.raises(
        ValueError,
        match=r"at an earlier call \(call 4 of `step.shard` on this process\), the "
        r"processes called `step.shard` with different `pad_to` \(process 0: "
        r"pad_to=16, process 1: pad_to=None\)",
    ):
        _batch_agreement._compare_processes(found, host, num_local=2, late=True)
    found = _batch_agreement.Found(5, {0: row(8, pad=1), 1: row(5, pad=1)}, {})
    assert _batch_agreement._compare_processes(found, host, num_local=2) == 8


def test_a_wait_that_ran_out_names_both_processes_and_both_batches():
    host = [("x", np.ones((6, 3), np.float32))]
    found = _batch_agreement.Found(7, {0: B, 1: A}, {1: 2}, waited_s=60.0)
    with pytest.raises(ValueError) as info:
        _batch_agreement._compare_processes(found, host, num_local=2, timeout_s=60.0)
    message = str(info.value)
    assert message.startswith(
        "`step.shard`: at call 7 of `step.shard` the batch of this process "
        "(process 0) changed to 6 examples, pad=False, pad_to=None, layout "
        "checksum 00000007, while process 1 passes 8 examples, pad=False, "
        "pad_to=None, layout checksum 00000007 (since its call 2), and passed no "
        "other batch in the 60 s this process waited: the processes passed local "
        "batches of different sizes"
    ), message
    assert "got process 0: 6, process 1: 8 examples" in message
    assert message.endswith(
        "give it more time with the environment variable JDP_SHARD_CHECK_TIMEOUT.)"
    )
    found = _batch_agreement.Found(7, {0: B}, {1: None}, waited_s=60.0)
    with pytest.raises(
        ValueError,
        match=r"process 1 has passed no batch yet.*"
        r"every process must call `step.shard` as often",
    ):
        _batch_agreement._compare_processes(found, host, num_local=2, timeout_s=60.0)
