import hashlib
import json
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jdp
from jdp import _export, _layout


class SmallCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        return nn.Dense(3)(x)


MODEL = SmallCNN()
IMAGE = (6, 6, 1)


def apply_fn(variables, x):
    return MODEL.apply(variables, x, train=False)


def loss_fn(params, batch_stats, batch):
    logits, updates = MODEL.apply(
        {"params": params, "batch_stats": batch_stats},
        batch["x"],
        train=True,
        mutable=["batch_stats"],
    )
    labels = jax.nn.one_hot(batch["y"], 3)
    loss = optax.softmax_cross_entropy(logits, labels).mean()
    return loss, updates["batch_stats"]


def images(n, seed):
    return np.random.default_rng(seed).normal(size=(n,) + IMAGE).astype(np.float32)


@pytest.fixture(scope="module")
def trained():
    """A CNN with BatchNorm trained 3 steps on 8 replicas; its replicated variables."""
    variables = MODEL.init(jax.random.key(0), jnp.zeros((1,) + IMAGE))
    tx = optax.sgd(0.1)
    state = jdp.TrainState.create(
        params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
    )
    step = jdp.parallelize(jdp.make_train_step(loss_fn, tx))
    state = step.replicate(state)
    rng = np.random.default_rng(1)
    for i in range(3):
        batch = {"x": images(32, i) + 0.5, "y": rng.integers(0, 3, size=32)}
        state, _ = step(state, step.shard(batch))
    replicated = {"params": state.params, "batch_stats": state.batch_stats}
    return step, replicated


@pytest.fixture(scope="module")
def blob(trained):
    _, replicated = trained
    return jdp.export_predictor(apply_fn, replicated, (images(2, 0),))


def test_batch_stats_were_trained_and_synced(trained):
    step, replicated = trained
    jdp.assert_replicas_in_sync(replicated)
    init = MODEL.init(jax.random.key(0), jnp.zeros((1,) + IMAGE))["batch_stats"]
    got = step.unreplicate(replicated)["batch_stats"]
    assert not np.allclose(got["BatchNorm_0"]["mean"], init["BatchNorm_0"]["mean"])


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_predictor_matches_apply_on_replica_0(trained, blob, batch_size):
    step, replicated = trained
    predict = jdp.load_predictor(blob)
    x = images(batch_size, 10 + batch_size)
    expected = apply_fn(step.unreplicate(replicated), x)
    got = predict(x)
    assert got.shape == (batch_size, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_predictor_knows_its_inputs_and_platforms(blob):
    predict = jdp.load_predictor(blob)
    assert predict.input_specs == ("float32[batch, 6, 6, 1]",)
    assert predict.platforms == ("cpu", "cuda")
    assert predict.metadata["jax"] == jax.__version__
    assert "float32[batch, 6, 6, 1]" in repr(predict)


def test_replica_0_is_exported_not_the_stack(trained):
    """Replicas differ here on purpose: the export must use replica 0's values."""
    step, replicated = trained
    one = step.unreplicate(replicated)
    shifted = jax.tree.map(lambda x: x + 1.0, one)
    stacked = jax.tree.map(
        lambda a, b: jnp.stack([a] + [b] * (step.num_replicas - 1)), one, shifted
    )
    stacked = jax.tree.map(lambda x: jax.device_put(x, step.sharding), stacked)
    predict = jdp.load_predictor(
        jdp.export_predictor(apply_fn, stacked, (images(2, 0),))
    )
    x = images(5, 3)
    np.testing.assert_allclose(predict(x), apply_fn(one, x), rtol=1e-5, atol=1e-6)
    assert not np.allclose(predict(x), apply_fn(shifted, x), atol=1e-3)


def test_plain_params_are_not_unreplicated():
    """A plain leaf whose leading size equals the device count keeps that axis."""
    n = jax.device_count()
    params = {"w": jnp.arange(n * 2.0).reshape(n, 2)}
    predict = jdp.load_predictor(
        jdp.export_predictor(
            lambda p, x: x @ p["w"], params, (np.ones((1, n), np.float32),)
        )
    )
    x = np.ones((3, n), np.float32)
    np.testing.assert_allclose(predict(x), x @ np.asarray(params["w"]))


def test_own_data_sharded_params_with_replicated_false():
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    n = jax.device_count()
    w = jax.device_put(
        jnp.arange(n * 2.0).reshape(n, 2), NamedSharding(mesh, P("data"))
    )
    assert _layout.is_replicated(w)  # ambiguous layout: the flag decides
    blob = jdp.export_predictor(
        lambda p, x: x @ p, w, (np.ones((1, n), np.float32),), replicated=False
    )
    x = np.ones((3, n), np.float32)
    np.testing.assert_allclose(jdp.load_predictor(blob)(x), x @ np.asarray(w))


def test_mixed_replicated_and_plain_params_is_an_error(trained):
    _, replicated = trained
    mixed = {"model": replicated, "extra": jnp.ones(3)}
    with pytest.raises(
        ValueError, match=r"(?s)some parameter leaves are replicated.*'extra'"
    ):
        jdp.export_predictor(lambda v, x: x, mixed, (images(1, 0),))


def test_replicated_true_needs_a_replica_axis():
    # The array is named; the scalar beside it is the same on every replica.
    with pytest.raises(ValueError, match=r"(?s)replicated=True.*\['a'\]: float32"):
        jdp.export_predictor(
            lambda p, x: x, {"a": jnp.ones(2), "b": 1.0}, (np.ones(2),), replicated=True
        )


def test_save_and_load_in_a_process_without_the_model_code(trained, tmp_path):
    step, replicated = trained
    path = tmp_path / "model.jdppred"
    jdp.save_predictor(path, apply_fn, replicated, (images(2, 0),), platforms=("cpu",))
    x = images(7, 4)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import jdp
        predict = jdp.load_predictor(sys.argv[1])
        x = np.load(sys.argv[2])
        np.save(sys.argv[3], np.asarray(predict(x)))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = tmp_path / "y.npy"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp_path / "x.npy"), str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    expected = apply_fn(step.unreplicate(replicated), x)
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-5, atol=1e-6)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".jdp")] == []


def test_truncated_file_is_a_clear_error(blob, tmp_path):
    path = tmp_path / "cut.jdppred"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match=r"cut.jdppred.* is truncated: \d+ bytes"):
        jdp.load_predictor(path)
    with pytest.raises(ValueError, match="is truncated: 20 bytes, shorter than"):
        jdp.load_predictor(blob[:20])


@pytest.mark.parametrize("where", [30, 60, -5], ids=["header", "metadata", "payload"])
def test_corrupted_bytes_are_a_clear_error(blob, where):
    bad = bytearray(blob)
    bad[where] ^= 0xFF
    with pytest.raises(ValueError, match="is corrupted: its SHA-256 checksum"):
        jdp.load_predictor(bytes(bad))


def test_other_damage_is_a_clear_error(blob):
    with pytest.raises(ValueError, match="not a jdp predictor: it starts with"):
        jdp.load_predictor(b"PK\x03\x04" + blob[4:])
    with pytest.raises(ValueError, match="not a jdp predictor"):
        jdp.load_predictor(b"hello")
    with pytest.raises(ValueError, match="3 unexpected trailing bytes"):
        jdp.load_predictor(blob + b"abc")
    newer = bytearray(blob)
    newer[8:12] = (_export.FORMAT_VERSION + 1).to_bytes(4, "little")
    with pytest.raises(ValueError, match="format version 2; this jdp reads version 1"):
        jdp.load_predictor(bytes(newer))


def test_wrong_input_shape_dtype_or_count_names_the_expected_shapes(blob):
    predict = jdp.load_predictor(blob)
    expected = r"Expected inputs: args\[0\]: float32\[batch, 6, 6, 1\]"
    with pytest.raises(ValueError, match=r"args\[0\]: got float32\[3, 6, 5, 1\]") as e:
        predict(np.zeros((3, 6, 5, 1), np.float32))
    assert "'batch' is the batch size" in str(e.value)
    with pytest.raises(ValueError, match=expected):
        predict(np.zeros((3, 6, 6, 1), np.int32))
    with pytest.raises(ValueError, match=r"(?s)called with 2 input\(s\).*" + expected):
        predict(images(2, 0), images(2, 0))
    with pytest.raises(ValueError, match=expected):
        predict(np.zeros((3, 36), np.float32))
    # A float64 NumPy array is what JAX would make of it: accepted as float32.
    assert predict(images(2, 0).astype(np.float64)).shape == (2, 3)


def test_several_inputs_share_the_batch_size():
    def fn(p, x, y):
        return {"sum": x.sum(axis=1) * p + y}

    predict = jdp.load_predictor(
        jdp.export_predictor(
            fn, 2.0, (np.ones((2, 3), np.float32), np.ones(2, np.float32))
        )
    )
    out = predict(np.ones((4, 3), np.float32), np.arange(4, dtype=np.float32))
    np.testing.assert_allclose(out["sum"], 6.0 + np.arange(4))
    with pytest.raises(ValueError, match=r"args\[1\]: got float32\[5\], expected"):
        predict(np.ones((4, 3), np.float32), np.ones(5, np.float32))
    with pytest.raises(ValueError, match="every input's leading axis is the batch"):
        jdp.export_predictor(fn, 2.0, (np.ones((2, 3)), np.ones(3)))


def test_fixed_shapes_without_batch_polymorphism():
    predict = jdp.load_predictor(
        jdp.export_predictor(
            lambda p, x: x + p,
            1.0,
            (np.ones((4, 2), np.float32),),
            batch_polymorphic=False,
        )
    )
    assert predict.input_specs == ("float32[4, 2]",)
    np.testing.assert_allclose(predict(np.zeros((4, 2), np.float32)), np.ones((4, 2)))
    with pytest.raises(ValueError, match=r"expected float32\[4, 2\]"):
        predict(np.zeros((5, 2), np.float32))


def test_platform_checks():
    x = (np.ones((1, 2), np.float32),)
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        jdp.export_predictor(lambda p, x: x, 0.0, x, platforms=("cpu", "metal"))
    cuda_only = jdp.export_predictor(lambda p, x: x * p, 2.0, x, platforms=("gpu",))
    with pytest.raises(ValueError, match=r"exported for platforms \('cuda',\).*'cpu'"):
        jdp.load_predictor(cuda_only)


def test_model_needing_a_concrete_batch_gets_a_hint():
    def needs_concrete_batch(p, x):
        return jnp.zeros(int(x.shape[0])) + p

    with pytest.raises(Exception, match="batch_polymorphic=False") as e:
        jdp.export_predictor(needs_concrete_batch, 1.0, (np.ones((2, 3)),))
    assert "symbolic" in str(e.value).lower()
    blob = jdp.export_predictor(
        needs_concrete_batch, 1.0, (np.ones((2, 3)),), batch_polymorphic=False
    )
    np.testing.assert_allclose(jdp.load_predictor(blob)(np.ones((2, 3))), [1.0, 1.0])


def test_text_inputs_are_a_type_error_naming_the_input(blob):
    predict = jdp.load_predictor(blob)
    expected = r"Expected inputs: args\[0\]: float32\[batch, 6, 6, 1\]"
    with pytest.raises(
        TypeError,
        match=r"(?s)args\[0\]: got a str of dtype <U3 and shape \(\), expected "
        r"float32\[batch, 6, 6, 1\].*" + expected + ".*token ids",
    ):
        predict("abc")
    with pytest.raises(
        TypeError, match=r"args\[0\]: got a numpy.ndarray of dtype <U1 and shape \(2,"
    ):
        predict(np.full((2,) + IMAGE, "a"))
    with pytest.raises(TypeError, match=r"args\[0\]: got a numpy.ndarray of dtype obj"):
        predict(np.array([object()] * 2, dtype=object))


def test_text_in_a_nested_input_is_named_by_its_path():
    def fn(p, x, extra):
        return x * p + extra["bias"]

    x = np.ones((2, 3), np.float32)
    predict = jdp.load_predictor(
        jdp.export_predictor(fn, 2.0, (x, {"bias": np.ones(2, np.float32)[:, None]}))
    )
    with pytest.raises(
        TypeError,
        match=r"args\[1\]\['bias'\]: got a numpy.ndarray of dtype \|S1 and shape "
        r"\(2, 1\), expected float32\[batch, 1\]",
    ) as e:
        predict(x, {"bias": np.array([[b"a"], [b"b"]])})
    assert "args[0]" not in str(e.value).splitlines()[1]  # only the bad input listed
    np.testing.assert_allclose(predict(x, {"bias": np.zeros((2, 1))}), 2 * x)


def test_replicated_true_on_plain_params_names_the_leaf():
    n = jax.device_count()
    x = (np.ones((1, 3), np.float32),)
    fix = r".*Pass `replicated=False` for one plain copy"
    with pytest.raises(
        ValueError,
        match=r"(?s)replicated=True.*\['w'\]: float32\[3, 2\] placed by "
        r"SingleDeviceSharding" + fix,
    ):
        jdp.export_predictor(
            lambda p, x: x @ p["w"], {"w": jnp.ones((3, 2))}, x, replicated=True
        )
    # A leading axis of the device count is not enough: it must be laid out.
    with pytest.raises(ValueError, match=r"(?s)\['w'\]: float32\[8, 3, 2\]" + fix):
        jdp.export_predictor(
            lambda p, x: x @ p["w"][0], {"w": jnp.ones((n, 3, 2))}, x, replicated=True
        )
    half = Mesh(np.asarray(jax.devices()[: n // 2]), ("data",))
    sharded = jax.device_put(jnp.ones((n, 3, 2)), NamedSharding(half, P("data")))
    with pytest.raises(ValueError, match=r"\[0\]: float32\[8, 3, 2\] placed by Named"):
        jdp.export_predictor(
            lambda p, x: x @ p[0][0], [sharded, np.ones(2)], x, replicated=True
        )
    with pytest.raises(ValueError, match=r"\[1\]: a numpy.ndarray of shape \(2,\)"):
        jdp.export_predictor(
            lambda p, x: x @ p[0][0], [sharded, np.ones(2)], x, replicated=True
        )


def test_replicated_true_on_replicated_params_takes_replica_0():
    mesh = _layout.make_mesh(jax.devices(), "data")
    w = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    replicated = _layout.replicate({"w": w}, mesh)
    blob = jdp.export_predictor(
        lambda p, x: x @ p["w"],
        replicated,
        (np.ones((1, 3), np.float32),),
        replicated=True,
    )
    x = np.ones((4, 3), np.float32)
    np.testing.assert_allclose(jdp.load_predictor(blob)(x), x @ w)


def test_scalars_beside_replicated_params_are_taken_as_they_are():
    """A Python or NumPy scalar beside replicated params was refused: "every leaf
    must be laid out by `step.replicate`", for `replicated=True` not passed."""
    mesh = _layout.make_mesh(jax.devices(), "data")
    w = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    params = {"w": _layout.replicate({"w": w}, mesh)["w"], "t": 0.5, "s": np.int32(2)}
    blob = jdp.export_predictor(
        lambda p, x: x @ p["w"] * p["t"] * p["s"],
        params,
        (np.ones((1, 3), np.float32),),
    )
    x = np.ones((4, 3), np.float32)
    np.testing.assert_allclose(jdp.load_predictor(blob)(x), x @ w)


def test_a_saved_predictor_has_a_new_files_mode(tmp_path):
    """It was written 0600 (a temporary file's mode): another user's serving
    process could not read it."""
    mask = os.umask(0o027)
    try:
        jdp.save_predictor(
            tmp_path / "p.jdppred",
            lambda p, x: x @ p["w"],
            {"w": np.ones((3, 2), np.float32)},
            (np.ones((1, 3), np.float32),),
        )
        with open(tmp_path / "plain", "wb"):
            pass
    finally:
        os.umask(mask)
    assert (tmp_path / "p.jdppred").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "plain").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        (b"not json", "JSONDecodeError: Expecting value"),
        (b"\xff{}", "UnicodeDecodeError"),
        (b"[1, 2]", "expected a JSON object, got a JSON array"),
        (
            b'{"jdp": 1, "jax": "0.4", "platforms": [], "inputs": [], "outputs": []}',
            r"'jdp_format': missing.*'jdp': expected a JSON string, got a JSON "
            "number",
        ),
    ],
    ids=["not-json", "not-utf8", "not-an-object", "missing-and-wrong-keys"],
)
def test_bad_json_header_with_a_valid_checksum_is_a_clear_error(
    meta, problem, tmp_path
):
    path = tmp_path / "bad.jdppred"
    path.write_bytes(_export._pack(meta, b"payload"))
    with pytest.raises(
        ValueError,
        match=r"(?s)bad.jdppred' has a valid checksum but a bad JSON header.*"
        + problem,
    ):
        jdp.load_predictor(path)


def test_expected_sha256_accepts_the_right_file(blob, tmp_path):
    path = tmp_path / "model.jdppred"
    path.write_bytes(blob)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    predict = jdp.load_predictor(path, expected_sha256=digest)
    assert predict.sha256 == digest
    assert jdp.load_predictor(blob, expected_sha256=digest.upper()).sha256 == digest
    assert jdp.load_predictor(blob).sha256 == digest


def test_expected_sha256_rejects_a_tampered_file_before_reading_it(blob, monkeypatch):
    digest = hashlib.sha256(blob).hexdigest()
    # A tampered file whose checksum was recomputed: the checksum alone accepts it.
    meta_len = _export._HEADER.unpack_from(blob)[2]
    meta = json.loads(blob[_export._HEADER.size :][:meta_len])
    meta["jdp"] = "0.0.0-tampered"
    tampered = _export._pack(
        json.dumps(meta).encode(), blob[_export._HEADER.size + meta_len :]
    )
    assert jdp.load_predictor(tampered).metadata["jdp"] == "0.0.0-tampered"
    bad = hashlib.sha256(tampered).hexdigest()
    with pytest.raises(
        ValueError, match=f"the data given has SHA-256 {bad}, expected {digest}"
    ):
        jdp.load_predictor(tampered, expected_sha256=digest)

    def unpack(*args):
        raise AssertionError("the data was read before its digest was checked")

    monkeypatch.setattr(_export, "_unpack", unpack)
    with pytest.raises(ValueError, match=f"has SHA-256 {bad}, expected {digest}"):
        jdp.load_predictor(tampered, expected_sha256=digest)


def test_expected_sha256_must_be_a_hex_digest(blob):
    raw = hashlib.sha256(blob).digest()
    with pytest.raises(TypeError, match=r"must be a str of 64 hex digits.*got a bytes"):
        jdp.load_predictor(blob, expected_sha256=raw)
    with pytest.raises(ValueError, match=r"must be 64 hex digits.*'abc' \(3 char"):
        jdp.load_predictor(blob, expected_sha256="abc")
    with pytest.raises(ValueError, match=r"must be 64 hex digits.*'g{64}'"):
        jdp.load_predictor(blob, expected_sha256="g" * 64)


def test_docs_say_the_checksum_is_not_a_signature():
    guide = os.path.join(os.path.dirname(__file__), "..", "docs", "guides", "export.md")
    with open(guide) as f:
        for doc in (f.read(), jdp.load_predictor.__doc__):
            assert "not a signature" in " ".join(doc.split())
            assert "expected_sha256" in doc
