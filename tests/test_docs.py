"""The documentation in `docs/` and `README.md`: complete, and its code runs.

- Every public name (`jdp.__all__` and the public subpackages' `__all__`) has an
  entry in the API reference (`docs/api/*.md`), and every entry is public.
- Every fenced code block carries a language. The ```python blocks of a page run,
  in order and in one namespace (a page reads as one session), in a fresh process
  with 8 simulated CPU devices; a block whose first line is `# file: NAME.py` is
  written to NAME.py instead (a script the page then runs, e.g. with
  `python -m jdp.launch`). Blocks that are not Python (shell commands, sbatch
  scripts, program output) carry their own tag and are not run.
- The messages the troubleshooting page is keyed by are jdp's own messages.

None of this builds the site (`make docs` does, with warnings as errors).
"""

import ast
import importlib
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ["jdp", "jdp.checkpoint", "jdp.distributed", "jdp.launch", "jdp.metrics"]
PACKAGES += ["jdp.sparse", "jdp.wire"]
# Languages of blocks that are deliberately not run.
NOT_RUN = {"bash", "console", "text", "diff", "toml", "yaml", "json", "ini"}
FENCE = re.compile(r"^(```+|~~~+)(.*)$")
AUTODOC = re.compile(
    r"^\s*\.\. auto(?:function|class|exception|data|method)::\s+([\w.]+)", re.M
)


def pages():
    """README.md and every markdown page of the docs (not the built site)."""
    found = [ROOT / "README.md"]
    found += sorted(
        p
        for p in DOCS.rglob("*.md")
        if "_build" not in p.parts and "notebooks" not in p.relative_to(DOCS).parts
    )
    return found


def blocks(path):
    """(language, first line number, source) of each fenced block of `path`."""
    found = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        body = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].startswith(fence) and not lines[j].strip(fence[0]).strip()
        ):
            body.append(lines[j])
            j += 1
        found.append((info, i + 2, "\n".join(body) + "\n"))
        i = j + 1
    return found


def rel(path):
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------- API reference


def public_names():
    names = set()
    for package in PACKAGES:
        module = importlib.import_module(package)
        names |= {f"{package}.{name}" for name in module.__all__}
    return names


def documented_names():
    names = set()
    for page in (DOCS / "api").glob("*.md"):
        names |= set(AUTODOC.findall(page.read_text()))
    return names


def test_every_public_name_has_an_api_entry():
    missing = sorted(public_names() - documented_names())
    assert not missing, (
        f"public names without an entry in docs/api/*.md: {missing}; add an "
        "`.. autofunction::` (or autoclass, autoexception) for each"
    )


def test_every_api_entry_is_public():
    stale = sorted(documented_names() - public_names())
    assert not stale, f"docs/api/*.md documents names that are not public: {stale}"


def test_every_subpackage_has_an_api_page():
    for package in PACKAGES:
        assert (DOCS / "api" / f"{package.removeprefix('jdp.')}.md").exists()


# ------------------------------------------------------------------ code blocks


def test_every_block_has_a_language():
    untagged = [
        f"{rel(page)}:{line}"
        for page in pages()
        for info, line, _ in blocks(page)
        if not info
    ]
    assert not untagged, (
        f"code blocks without a language (tag them python to run them, or "
        f"text/bash to say they are not run): {untagged}"
    )


def test_no_unknown_languages():
    unknown = [
        f"{rel(page)}:{line}: {info}"
        for page in pages()
        for info, line, _ in blocks(page)
        if info
        and not info.startswith("{")
        and info.split()[0] not in NOT_RUN | {"python"}
    ]
    assert not unknown, f"blocks neither run nor in NOT_RUN: {unknown}"


RUNNER = textwrap.dedent(
    """
    import pathlib, sys, traceback
    namespace = {"__name__": "__main__"}
    for path, line, source in BLOCKS:
        first = source.splitlines()[0] if source.strip() else ""
        if first.startswith("# file: "):
            pathlib.Path(first.removeprefix("# file: ").strip()).write_text(source)
            continue
        print(f"--- block at {path}:{line}", flush=True)
        code = compile("\\n" * (line - 1) + source, path, "exec")
        exec(code, namespace)
    print("--- all blocks ran", flush=True)
    """
)


def python_pages():
    return [
        p
        for p in pages()
        if any(info.split()[:1] == ["python"] for info, _, _ in blocks(p))
    ]


def run_blocks(path, tmp_path, timeout=280):
    code = [
        (rel(path), line, source)
        for info, line, source in blocks(path)
        if info.split()[:1] == ["python"]
    ]
    script = f"BLOCKS = {code!r}\n" + RUNNER
    env = dict(os.environ)
    env["XLA_FLAGS"] = os.environ["XLA_FLAGS"]  # conftest.py's: 8 devices
    env["JAX_PLATFORMS"] = "cpu"
    env["MPLBACKEND"] = "Agg"
    env.pop("JDP_COORDINATOR_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{rel(path)}: a code block failed:\n{output[-6000:]}"
    assert "--- all blocks ran" in proc.stdout
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("path", python_pages(), ids=[rel(p) for p in python_pages()])
def test_python_blocks_run(path, tmp_path):
    run_blocks(path, tmp_path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multihost_script_runs_under_the_launcher(tmp_path):
    """The many-hosts page's train.py, started as its launcher command says."""
    page = DOCS / "guides" / "multihost.md"
    scripts = [
        source
        for info, _, source in blocks(page)
        if info == "python" and source.startswith("# file: train.py")
    ]
    assert len(scripts) == 1
    (tmp_path / "train.py").write_text(scripts[0])
    command = next(
        line
        for info, _, source in blocks(page)
        if info == "bash"
        for line in source.splitlines()
        if line.startswith("python -m jdp.launch")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JDP_")}
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, *command.split()[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for index in (0, 1):
        line = f"[{index}] jax.process_index()={index} jax.device_count()=4 loss="
        assert line in proc.stdout, proc.stdout[-3000:]


def test_pages_with_python_are_found():
    names = {rel(p) for p in python_pages()}
    assert "README.md" in names
    assert "docs/getting_started.md" in names


# ---------------------------------------------------------------- other checks


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)


def jdp_strings():
    """Every string constant in jdp's sources, whitespace collapsed.

    Adjacent literals are one constant to the parser; an f-string's
    placeholders become "...".
    """
    texts = []
    for path in (ROOT / "jdp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                texts.append(
                    "".join(
                        v.value if isinstance(v, ast.Constant) else "..."
                        for v in node.values
                    )
                )
    return [" ".join(t.split()) for t in texts]


def quoted_messages():
    """Headings of the troubleshooting page that quote a jdp message."""
    text = (DOCS / "troubleshooting.md").read_text()
    return re.findall(r'^#{2,4} "(.+)"$', text, re.M)


def without_code(text):
    """`text` without its backquoted spans (names a message may fill in)."""
    return " ".join(re.sub(r"`[^`]*`", " ", text).split())


def test_troubleshooting_quotes_jdp_messages():
    messages = quoted_messages()
    assert len(messages) >= 8
    texts = jdp_strings()
    strings = " ".join(texts)
    # Each string on its own: one with an odd number of backquotes must not
    # shift the pairs of all the others.
    bare = " ".join(without_code(t) for t in texts)
    for message in messages:
        # "..." stands for what the message fills in (names, numbers).
        for part in message.split("..."):
            part = " ".join(part.split())
            if part.strip() and part not in strings:
                # A backquoted name may be a placeholder in the code (`{api}`).
                assert without_code(part) in bare, (
                    f"troubleshooting.md quotes {message!r}, but {part!r} is not "
                    "in any of jdp's messages"
                )


def test_every_docs_page_is_markdown_or_known():
    allowed = {".md", ".py", ".gitignore"}
    for path in DOCS.rglob("*"):
        if path.is_file() and "_build" not in path.parts:
            if "notebooks" in path.relative_to(DOCS).parts:
                continue  # copied from ../notebooks by the build (ignored)
            assert path.suffix in allowed or path.name == ".gitignore", path


def test_cuda_extras_and_their_drivers_are_documented():
    """`jdp[cuda12]` for older drivers, `jdp[cuda13]` (and `cuda`) for newer."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for version in (12, 13):
        (requirement,) = extras[f"cuda{version}"]
        assert requirement.startswith(f"jax[cuda{version}]"), requirement
    assert extras["cuda"] == extras["cuda13"]
    page = (DOCS / "installation.md").read_text()
    assert "| `cuda13` (also `cuda`) | `jax[cuda13]`, CUDA 13 | 580 or newer |" in page
    assert "| `cuda12` | `jax[cuda12]`, CUDA 12 | 525 or newer |" in page
