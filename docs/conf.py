"""Sphinx configuration of the jdp documentation (`make docs` builds it).

Why these tools: Sphinx with MyST markdown, myst-nb and autodoc + napoleon is
what the JAX libraries a jdp user already reads (optax, flax, orbax) build
their documentation with, so the pages look and link as theirs do. The pages
are markdown (the README's sections moved here as they were), the notebooks
in `notebooks/` are executed during the build (an error in a cell fails it),
and the API reference is read from the Google-style docstrings that
`tests/test_docstrings.py` already runs as doctests.
"""

import os
import pathlib
import re
import shutil

# autodoc imports jdp, and the notebooks set this themselves; the same 8
# simulated CPU devices as the tests, in case anything touches a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from docutils import nodes  # noqa: E402
from sphinx import addnodes  # noqa: E402

import jdp  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOKS = HERE.parent / "notebooks"

project = "jdp"
author = "the jdp authors"
copyright = "the jdp authors, Apache-2.0"  # noqa: A001
release = jdp.__version__
version = release

extensions = [
    "myst_nb",  # markdown pages (MyST) and executed notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style docstrings
]

exclude_patterns = ["_build", "README.md", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# MyST: heading anchors for links like `guides/sync.md#which-sync-when`.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# myst-nb: run every notebook during the build; a cell that raises fails it.
# "cache" re-runs a notebook only when its code changed (jupyter-cache under
# _build/); a fresh clone runs them all.
nb_execution_mode = "cache"
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 600  # seconds per cell
nb_execution_in_temp = True  # files a notebook writes go to a temporary folder
nb_merge_streams = True

# autodoc + napoleon.
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the Args sections say what each one is
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as a field list, not duplicate objects
napoleon_use_rtype = False
autosummary_generate = False

html_theme = "sphinx_book_theme"
html_title = f"jdp {release}"
default_role = "jdp-code"  # see _code_role
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_static_path: list[str] = []
html_show_sourcelink = False


def _copy_notebooks() -> None:
    """Copies `notebooks/*.ipynb` into the source tree (Sphinx reads only there)."""
    target = HERE / "notebooks"
    target.mkdir(exist_ok=True)
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        dest = target / nb.name
        if not dest.exists() or dest.read_bytes() != nb.read_bytes():
            shutil.copyfile(nb, dest)  # unchanged files keep their time stamp


_copy_notebooks()

_IDENTIFIER = re.compile(r"^[A-Za-z_][\w.]*$")


def _code_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """Docstrings write code in single backticks (as markdown does).

    A plain dotted name (`jdp.parallelize`, `step.shard`) becomes a
    cross-reference where it names a documented object (and stays plain code
    where it does not); anything else is inline code.
    """
    text = text.strip()
    if _IDENTIFIER.match(text):
        target = text[:-2] if text.endswith("()") else text
        ref = addnodes.pending_xref(
            rawtext,
            refdomain="py",
            reftype="obj",
            reftarget=target,
            refexplicit=False,
            refwarn=False,
        )
        ref += nodes.literal(rawtext, text, classes=["xref", "py", "py-obj"])
        return [ref], []
    return [nodes.literal(rawtext, text)], []


def setup(app):
    """Registers the docstrings' single-backtick role as the default role."""
    app.add_role("jdp-code", _code_role)
