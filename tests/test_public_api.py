import ast
import inspect
import json
import pathlib
import re
import subprocess
import sys

import pytest

import jdp

ROOT = pathlib.Path(__file__).resolve().parents[1]

PUBLIC = sorted(jdp.__all__)


def test_public_names_are_pinned():
    # Changing the public surface is deliberate: update this list with it.
    assert PUBLIC == sorted(
        [
            "BMUFState",
            "BlockAverage",
            "Collective",
            "MemoryAnalysis",
            "Parallel",
            "PowerSGDState",
            "ReplicaDivergenceError",
            "Streaming",
            "Sync",
            "TrainState",
            "all_reduce",
            "all_reduce_gradients",
            "assert_replicas_in_sync",
            "block_momentum",
            "bmuf",
            "bmuf_global_params",
            "broadcast",
            "check_equivalence",
            "declare_per_replica",
            "export_predictor",
            "load_predictor",
            "local",
            "make_train_step",
            "parallelize",
            "partition",
            "powersgd",
            "replica_key",
            "replicas_in_sync",
            "save_predictor",
            "sync_batch_stats",
            "sync_gradients",
            "weighted",
            "zero",
        ]
    )


def test_import_jdp_leaves_orbax_to_jdp_checkpoint():
    """orbax is imported when `jdp.checkpoint` is first used, not by `import jdp`."""
    code = (
        "import sys, jdp; before = any(m.startswith('orbax') for m in sys.modules); "
        "manager = jdp.checkpoint.CheckpointManager; "
        "print(before, any(m.startswith('orbax') for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["False", "True"], out.stderr
    with pytest.raises(
        AttributeError, match="module 'jdp' has no attribute 'chekpoint'"
    ):
        jdp.chekpoint  # noqa: B018


def test_public_subpackages_are_pinned():
    import jdp.checkpoint
    import jdp.distributed
    import jdp.launch
    import jdp.sparse
    import jdp.wire

    assert sorted(jdp.wire.__all__) == ["Wire", "WireState", "bf16", "fp8", "int8"]
    assert jdp.checkpoint.__all__ == ["CheckpointCorruptedError", "CheckpointManager"]
    assert sorted(jdp.distributed.__all__) == [
        "LiveStep",
        "initialize",
        "is_initialized",
        "live",
        "shutdown",
    ]
    assert jdp.launch.__all__ == ["run"]
    assert jdp.metrics.__all__ == ["gather", "sum"]
    assert sorted(jdp.sparse.__all__) == sorted(
        [
            "AdagradRowState",
            "AdamRowState",
            "IdsOutOfRangeError",
            "IndexedRows",
            "MomentumRowState",
            "OptimizerState",
            "RowOptimizer",
            "SparseTransformation",
            "adagrad",
            "adam",
            "all_gather_rows",
            "combine_rows",
            "lookup",
            "momentum",
            "optimizer",
            "rows",
            "sgd",
            "value_and_grad",
        ]
    )
    for module in (
        jdp.checkpoint,
        jdp.distributed,
        jdp.launch,
        jdp.metrics,
        jdp.sparse,
        jdp.wire,
    ):
        for name in module.__all__:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name}"


def test_every_public_name_exists_and_is_documented():
    for name in PUBLIC:
        obj = getattr(jdp, name)
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, name


def test_make_train_step_takes_only_its_pieces():
    assert list(inspect.signature(jdp.make_train_step).parameters) == [
        "loss_fn",
        "tx",
        "sync",
        "has_aux",
        "microbatches",
        "axis_name",
        "skip_nonfinite",
        "batch_stats",
    ]
    default = inspect.signature(jdp.make_train_step).parameters["sync"].default
    assert isinstance(default, jdp.Sync) and default.averages
    for piece in (jdp.all_reduce(), jdp.local(), jdp.powersgd()):
        assert isinstance(piece, jdp.Sync)


def test_a_sync_piece_is_small_and_factories_take_few_options():
    # A piece is what it says about gradients: at most 4 fields, as optax's
    # transforms are two functions. No public factory grows past 10 options.
    assert len(jdp.Sync._fields) <= 4
    for name in jdp.__all__:
        obj = getattr(jdp, name)
        if inspect.isfunction(obj):
            assert len(inspect.signature(obj).parameters) <= 10, name


def test_bmuf_takes_at_most_8_options():
    # One outer path (`outer=`, the classical filter `jdp.block_momentum`), the
    # streaming schedule and the average as one value each.
    assert len(inspect.signature(jdp.bmuf).parameters) <= 8
    assert list(inspect.signature(jdp.bmuf).parameters) == [
        "inner",
        "sync_period",
        "outer",
        "warmup_steps",
        "inner_state_at_sync",
        "streaming",
        "average",
        "axis_name",
    ]
    assert len(jdp.__all__) <= 50


#: Option and function names removed since 0.1 (see CHANGELOG.md). None may come
#: back in the library's messages and docstrings, the notebooks or the README's code.
REMOVED = (
    "grad_sync",
    "shard_optimizer_state",
    "mesh_shape",
    "batch_stats_mode",
    "remat=",
    "sparse.make_train_step",
    "merge_after_update",
    "powersgd_transform",
    "sparse.partition",
)

#: Private functions an error message once told users about.
PRIVATE = ("place_like",)


def _library_strings():
    for path in sorted((ROOT / "jdp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node.value


def _error_messages():
    for path in sorted((ROOT / "jdp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for part in ast.walk(node.exc):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        yield f"{path.relative_to(ROOT)}:{part.lineno}", part.value


def test_no_error_message_names_a_private_function():
    found = [
        f"{where}: {name}"
        for where, text in _error_messages()
        for name in PRIVATE
        if name in text
    ]
    assert not found, found


def _notebook_sources():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            yield f"{path.relative_to(ROOT)} cell {i}", "".join(cell["source"])


def _readme_code():
    text = (ROOT / "README.md").read_text()
    for i, block in enumerate(re.findall(r"```\w*\n(.*?)```", text, re.S)):
        yield f"README.md code block {i}", block


def test_no_removed_option_name_comes_back():
    found = [
        f"{where}: {name}"
        for source in (_library_strings(), _notebook_sources(), _readme_code())
        for where, text in source
        for name in REMOVED
        if name in text
    ]
    assert not found, found


def test_one_module_recognises_each_optimizer_state_type():
    # Everything else asks the declarations (`jdp._replica_parts`) or the piece.
    bmuf = {"jdp/_bmuf/__init__.py", "jdp/_bmuf/_state.py", "jdp/_bmuf/_api.py"}
    owners = {"BMUFState": bmuf | {"jdp/__init__.py"}}
    owners["MultiStepsState"] = {"jdp/_transforms.py"}
    owners["PartitionState"] = {"jdp/_transforms.py"}
    owners["MaskedNode"] = {"jdp/_transforms.py"}
    for name, allowed in owners.items():
        users = {
            str(p.relative_to(ROOT))
            for p in (ROOT / "jdp").rglob("*.py")
            if name in p.read_text()
        }
        assert users <= allowed, (name, users - allowed)


def test_no_context_variable_passes_values_between_modules():
    # The one that stays binds `parallelize`'s axis name for jdp's in-step
    # functions (see jdp/ARCHITECTURE.md): user code sits between them.
    users = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "jdp").rglob("*.py")
        if "ContextVar(" in p.read_text()
    }
    assert users == {"jdp/_collectives.py"}
    assert (ROOT / "jdp/_collectives.py").read_text().count("ContextVar(") == 1
