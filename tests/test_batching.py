"""`step.shard`: what a batch must be, and the errors that say so."""

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
    with pytest.raises(ValueError, match=r"the batch is empty \(leading size 0\)"):
        step.shard({"x": np.zeros((0, 3)), "y": np.zeros((0,))})


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


# -- the cross-process check's bookkeeping (pure: the protocol runs in
#    tests/multiprocess/test_multihost.py) --------------------------------------


def test_a_signature_is_in_force_from_its_change_until_the_next():
    changes = [(0, (8, 8, 1, 0, 1)), (5, (6, 6, 1, 0, 1))]
    assert _batching.row_at(changes, 0) == changes[0][1]
    assert _batching.row_at(changes, 4) == changes[0][1]
    assert _batching.row_at(changes, 5) == changes[1][1]
    assert _batching.row_at(changes, 99) == changes[1][1]
    assert _batching.row_at(changes, -1) is None


def test_published_changes_round_trip_through_their_text_form():
    changes = [(0, (8, 8, 12345, 0, 4)), (17, (6, 6, 12345, 1, 4))]
    value = _batching._encode(17, 2, changes)
    assert _batching._decode(value) == (17, 2, changes)
    assert _batching._decode(_batching._encode(3, 0, [])) == (3, 0, [])


def test_processes_agree_on_sizes_unless_they_pad():
    row = (8, 8, 7, 0, 1)
    assert _batching.rows_agree([row, row])
    assert not _batching.rows_agree([row, (6, 6, 7, 0, 1)])  # sizes
    assert not _batching.rows_agree([row, (8, 8, 9, 0, 1)])  # layout
    assert not _batching.rows_agree([row, (8, 8, 7, 1, 1)])  # pad on one only
    assert _batching.rows_agree([(8, 8, 7, 1, 1), (5, 5, 7, 1, 1)])


def test_a_disagreement_is_found_at_any_process_change_in_the_range():
    steady = [(0, (8, 8, 7, 0, 1))]
    short_last = [(0, (8, 8, 7, 0, 1)), (9, (6, 6, 7, 0, 1)), (10, (8, 8, 7, 0, 1))]
    find = _batching.first_disagreement
    assert find([steady, short_last], -1, 8) is None  # not reached yet
    call, rows = find([steady, short_last], -1, 12)
    assert call == 9 and rows == [(8, 8, 7, 0, 1), (6, 6, 7, 0, 1)]
    assert find([steady, short_last], 9, 12) is None  # call 9 already verified
    # A process skips the calls it compared itself.
    assert find([steady, short_last], -1, 12, skip={9, 10}) is None
