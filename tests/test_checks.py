import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdp


def replicated(step, tree):
    return jax.tree.map(lambda x: jax.device_put(x, step.sharding), tree)


@pytest.fixture
def step():
    return jdp.parallelize(lambda s, b: (s, {}), devices=jax.devices()[:4])


def test_in_sync_after_replicate(step):
    state = step.replicate({"w": jnp.ones((2, 3)), "n": 1, "nan": jnp.array([np.nan])})
    assert jdp.replicas_in_sync(state)
    jdp.assert_replicas_in_sync(state)


def test_divergence_names_leaf_replica_and_difference(step):
    w = np.ones((4, 3), np.float32)
    w[2, 1] += 0.5
    state = replicated(step, {"params": {"w": w, "b": np.zeros((4, 2), np.float32)}})
    assert not jdp.replicas_in_sync(state)
    with pytest.raises(
        AssertionError,
        match=r"\['params'\]\['w'\]: replica 2 differs from replica 0 by up to 0\.5",
    ):
        jdp.assert_replicas_in_sync(state)
    assert jdp.replicas_in_sync(state, atol=0.5)


def test_integer_and_nan_divergence(step):
    counts = np.array([1, 1, 1, 2], np.int32)
    nans = np.array([[np.nan], [np.nan], [1.0], [np.nan]], np.float32)
    state = replicated(step, {"count": counts, "x": nans})
    with pytest.raises(
        AssertionError, match=r"(?s)\['count'\]: replica 3.*\['x'\]: replica 2.*inf"
    ):
        jdp.assert_replicas_in_sync(state)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.complex64])
def test_infinities_zeros_and_subnormals(step, dtype):
    """A leaf holding an infinity on replica 0 was in sync whatever its other
    values (inf - inf is NaN, which hid the differences); so were subnormal
    values, whose difference the CPU flushes to zero."""
    real = np.float32 if dtype is np.complex64 else dtype
    inf, tiny = np.inf, float(jnp.finfo(real).smallest_subnormal)
    rows = {
        "same": [[inf, -0.0, np.nan, tiny]] * 3 + [[inf, 0.0, np.nan, tiny]],
        "finite": [[inf, 1.0]] * 3 + [[inf, 2.0]],
        "sign": [[inf]] * 2 + [[-inf]] + [[inf]],
        "subnormal": [[tiny]] * 3 + [[3 * tiny]],
    }
    tree = {k: np.array(v, dtype) for k, v in rows.items()}
    assert tree["subnormal"][3, 0] != tree["subnormal"][0, 0] != 0
    with pytest.raises(AssertionError, match=r"out of sync in 3 leaves") as caught:
        jdp.assert_replicas_in_sync(replicated(step, tree))
    message = str(caught.value)
    assert "['finite']: replica 3 differs from replica 0 by up to 1\n" in message
    assert "['sign']: replica 2 differs from replica 0 by up to inf" in message
    assert "['subnormal']: replica 3" in message and "['same']" not in message
    assert not jdp.replicas_in_sync(replicated(step, {"f": tree["finite"]}))
    assert jdp.replicas_in_sync(replicated(step, {"s": tree["same"]}))


def test_lists_at_most_five_leaves(step):
    tree = {f"l{i}": np.arange(4, dtype=np.float32) for i in range(7)}
    with pytest.raises(AssertionError, match=r"7 leaves.*\n(.*\n){5}.*and 2 more"):
        jdp.assert_replicas_in_sync(replicated(step, tree))


def test_repeated_checks_compile_once(step):
    from helpers import CompileCounter

    state = step.replicate({"w": jnp.ones((2, 3)), "b": jnp.zeros(3)})
    assert jdp.replicas_in_sync(state)
    with CompileCounter() as again:
        for _ in range(3):
            assert jdp.replicas_in_sync(state)
    assert again.count == 0
