"""The import graph of `jdp/ARCHITECTURE.md`: no module imports a layer above it."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jdp"

LAYERS = {
    # The bottom of the foundation (layer 0): its other modules may import it.
    "jdp._jax_compat": -1,
    "jdp._version": 0,
    "jdp._progress": 0,
    "jdp._tree": 0,
    "jdp._validate": 0,
    "jdp._hlo": 0,
    "jdp._buckets": 0,
    "jdp._coordination": 0,
    "jdp._replica_parts": 0,
    "jdp._allocator": 0,
    "jdp._layout": 1,
    "jdp._layout._mesh": 1,
    "jdp._layout._keys": 1,
    "jdp._layout._custom": 1,
    "jdp._layout._agreed": 1,
    "jdp._layout._place": 1,
    "jdp._layout._state_checks": 1,
    "jdp._collectives": 2,
    "jdp._backends": 2,
    "jdp._batching": 2,
    "jdp._metrics": 2,
    "jdp._wire": 2,
    "jdp.metrics": 3,
    "jdp._transforms": 3,
    "jdp._bmuf": 3,
    "jdp._zero": 3,
    "jdp._checks": 3,
    "jdp._divergence": 3,
    "jdp.sparse._lookup": 3,
    "jdp.sparse._gather": 3,
    "jdp.sparse._optim": 3,
    "jdp._sync": 4,
    "jdp.sparse._train_step": 5,
    "jdp._train_state": 5,
    "jdp._loss": 5,
    "jdp._step_checks": 5,
    "jdp._parallel": 5,
    "jdp._partition": 5,
    "jdp._powersgd": 5,
    "jdp._train_step": 6,
    "jdp.sparse": 6,
    "jdp.wire": 6,
    "jdp._equivalence": 7,
    "jdp._export": 7,
    "jdp.checkpoint": 7,
    "jdp.checkpoint._format": 7,
    "jdp.checkpoint._integrity": 7,
    "jdp.checkpoint._damage": 7,
    "jdp.checkpoint._extra": 7,
    "jdp.distributed": 7,
    "jdp.launch": 8,
    "jdp": 9,
    "jdp.demo": 10,
}


def module_name(path: pathlib.Path) -> str:
    parts = ("jdp",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(name: str) -> int:
    """A module's layer: its own entry, else its closest listed package's."""
    while name not in LAYERS:
        name = name.rpartition(".")[0]
    return LAYERS[name]


def package(name: str) -> str:
    return name.rpartition(".")[0] if name.count(".") >= 2 else name


def jdp_imports(path: pathlib.Path) -> set[str]:
    """Every jdp module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jdp"}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] != "jdp":
                continue
            for alias in node.names:  # `from jdp import _zero` imports jdp._zero
                sub = f"{node.module}.{alias.name}"
                found.add(
                    sub
                    if (ROOT.parent / sub.replace(".", "/")).exists()
                    or (ROOT.parent / f"{sub.replace('.', '/')}.py").exists()
                    else node.module
                )
    return found


MODULES = sorted(ROOT.rglob("*.py"))


def test_every_module_has_a_layer():
    unlisted = [module_name(p) for p in MODULES if module_name(p) not in LAYERS]
    # Modules inside a listed subpackage take its layer; private top-level ones
    # must be listed.
    assert [m for m in unlisted if m.count(".") == 1] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_module_imports_a_layer_above_its_own(path):
    me = module_name(path)
    bad = []
    for other in jdp_imports(path):
        if other == me or other.startswith(me + "."):
            continue  # a package importing its own submodules
        same_package = package(other) == package(me) and package(me) != me
        if layer(other) > layer(me) or (layer(other) == layer(me) and not same_package):
            bad.append(f"{other} (layer {layer(other)})")
    assert not bad, f"{me} (layer {layer(me)}) imports {bad}"


def _calls(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return sorted(
        module_name(p)
        for p in MODULES
        if any(
            rx.search(line)
            for line in p.read_text().splitlines()
            if not line.lstrip().startswith("#")
        )
    )


def test_only_the_backends_call_pmap_or_shard_map():
    assert _calls(r"\bjax\.(pmap|shard_map)\(") == ["jdp._backends"]


def test_only_distributed_calls_jax_distributed():
    assert _calls(r"\bjax\.distributed\.") == ["jdp.distributed._runtime"]


def test_only_jax_compat_imports_private_jax():
    assert _calls(r"\b(from|import) jax\._src\b") == ["jdp._jax_compat"]


def test_only_jax_compat_reads_private_attributes_of_jax_objects():
    # `dtype._impl` (a key's PRNG implementation), `jaxpr.eqns` and `eqn.params`
    # (primitive parameters have no public schema): `_jax_compat.key_impl_name`,
    # `_jax_compat.equations` and `_jax_compat.collective_axes` read them.
    assert _calls(r"\._impl\b|\.eqns\b|\beqn\.params\b|jaxprs_in_params") == [
        "jdp._jax_compat"
    ]


def test_only_jax_compat_matches_jax_error_text():
    # JAX's, gRPC's and gloo's messages (no error types of their own): each
    # pattern is one constant or `is_*` function in `_jax_compat`.
    texts = r"by peer|detected fatal errors|another task died"
    assert _calls(texts) == ["jdp._jax_compat"]


def test_every_coordination_store_protocol_goes_through_one_module():
    # `_coordination.Store`: the one caller of the store's `key_value_*` methods
    # (`_jax_compat` names them in the docstring of the client it reaches).
    assert _calls(r"\bkey_value_\w+\(") == ["jdp._coordination"]


# `jdp._bmuf`'s modules, in the order of its docstring: each imports only those
# before it, so there is no import loop between them.
BMUF_ORDER = [
    "_state",
    "_outer",
    "_options",
    "_fragments",
    "_average",
    "_drop",
    "_update",
    "_block",
    "_streaming",
    "_deferred",
    "_api",
    "__init__",
]


def test_bmuf_modules_import_only_those_before_them():
    package = ROOT / "_bmuf"
    assert sorted(p.stem for p in package.glob("*.py")) == sorted(BMUF_ORDER)
    for i, name in enumerate(BMUF_ORDER):
        before = {f"jdp._bmuf.{m}" for m in BMUF_ORDER[:i]}
        inside = {m for m in jdp_imports(package / f"{name}.py") if "_bmuf." in m}
        assert inside <= before, (name, sorted(inside - before))


@pytest.mark.parametrize(
    "path", sorted((ROOT / "_bmuf").glob("*.py")), ids=lambda p: p.name
)
def test_no_bmuf_module_exceeds_400_lines(path):
    assert len(path.read_text().splitlines()) <= 400


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_module_exceeds_700_lines_nor_a_class_400(path):
    # One responsibility a module: a file that outgrows this is split, not
    # allowed to grow (jdp/ARCHITECTURE.md).
    text = path.read_text()
    assert len(text.splitlines()) <= 700
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= 400, node.name
