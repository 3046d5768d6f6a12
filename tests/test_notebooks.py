"""The notebooks run top to bottom in a fresh kernel, so they cannot rot.

The kernel is this interpreter (`sys.executable`, i.e. the project's virtual
environment), declared through a kernelspec written to a temporary directory: an
installed "python3" kernelspec may point at another Python.
"""

import json
import pathlib
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "jdp-tests"
CELL_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernels")
    spec = root / KERNEL
    spec.mkdir()
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "jdp tests", "language": "python"})
    )
    return [str(root)]


def execute(name, kernel_dirs, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    km = KernelManager(
        kernel_name=KERNEL,
        kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs),
    )
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's cwd
    )
    client.execute()
    return nb


def outputs(nb):
    """Text each code cell printed, as one string per cell."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif "text/plain" in out.get("data", {}):
                parts.append(out.data["text/plain"])
        texts.append("".join(parts))
    return texts


def images(nb):
    return sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        for out in cell.get("outputs", [])
    )


@pytest.mark.parametrize(
    "name",
    [
        "01_quickstart.ipynb",
        "02_bmuf_vs_sync.ipynb",
        "03_checkpoint_and_export.ipynb",
        "04_nnx.ipynb",
    ],
)
def test_committed_with_their_outputs(name):
    """A reader browsing the repository sees what each cell printed and drew;
    the test above runs them again, so the outputs cannot hide a failure."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any(c.outputs for c in code), f"{name}: run it and commit its outputs"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{name}: committed with an error output"
    # The device count is set before JAX starts: in the first code cell, above
    # any `import jax`.
    first = code[0].source
    assert "--xla_force_host_platform_device_count=8" in first
    assert (
        first.index('os.environ["XLA_FLAGS"]')
        < re.search(r"^import jax", first, re.M).start()
    )
    # Public API only.
    assert not any(re.search(r"jdp\._[a-z]", c.source) for c in code)


@pytest.mark.slow
def test_quickstart(kernel_dirs, tmp_path):
    nb = execute("01_quickstart.ipynb", kernel_dirs, tmp_path)
    text = outputs(nb)
    assert "8 cpu devices" in text[0]
    assert images(nb) >= 1
    joined = "\n".join(text)
    assert "same parameters as the single-device run" in joined
    assert "in sync: True" in joined
    assert "replicas are out of sync" in joined
    assert "the replicas' states diverged during step call 1" in joined
    # Section 6: accumulation gives the whole batch's params; exact eval counts.
    gap = float(re.search(r"microbatches=2: largest difference .* (\S+)\n", joined)[1])
    assert gap < 1e-3, gap
    assert "skipped steps: 0" in joined
    assert re.search(r"evaluated (\d+) of \1 test images", joined), joined[-300:]


@pytest.mark.slow
def test_bmuf_vs_sync(kernel_dirs, tmp_path):
    nb = execute("02_bmuf_vs_sync.ipynb", kernel_dirs, tmp_path)
    text = outputs(nb)
    table = next(t for t in text if t.startswith("variant"))
    # One row per variant, with its measured bytes per step relative to sync SGD.
    rows = {line[:31].strip(): line[31:].split() for line in table.splitlines()[1:]}
    assert rows["sync SGD"][1] == "1.0x"
    assert rows["BMUF K=16, bm=0.875"][1] == "16.0x"
    assert len(rows) == 7
    assert text[-1].strip() == "checked"  # the notebook's own checks of its claims
    assert images(nb) >= 1


@pytest.mark.slow
def test_checkpoint_and_export(kernel_dirs, tmp_path):
    nb = execute("03_checkpoint_and_export.ipynb", kernel_dirs, tmp_path)
    joined = "\n".join(outputs(nb))
    assert "saved from 8 replicas" in joined
    assert "restored w: (4, 64, 128)" in joined
    assert "every one of the 4 replicas holds exactly the saved state" in joined
    fresh = re.search(r"fresh process: (\[.*\])", joined).group(1)
    here = re.search(r"this notebook: (\[.*\])", joined).group(1)
    assert fresh == here
    assert images(nb) >= 1


@pytest.mark.slow
def test_nnx_notebook(kernel_dirs, tmp_path):
    nb = execute("04_nnx.ipynb", kernel_dirs, tmp_path)
    text = outputs(nb)
    assert "8 cpu devices" in text[0]
    joined = "\n".join(text)
    # 8 replicas take the same steps as one device, up to float rounding: compared
    # after a few steps, relative to each array's largest value (float32 rounds to
    # about 1e-7 of it; later steps amplify the rounding differently on each CPU).
    gap = re.search(r"largest difference from single-device training.*: (\S+)", joined)
    assert float(gap[1]) < 1e-4
    loss_gap = re.search(r"largest difference of the losses.*: (\S+)", joined)
    assert float(loss_gap[1]) < 1e-5
    # Every replica its own dropout masks, the same on every run.
    masks = re.findall(r"^replica \d: ([#.]+)$", joined, re.M)
    assert len(masks) == 8 and len(set(masks)) == 8
    assert "8 different masks on 8 replicas" in joined
    assert "the same masks on a second run: True" in joined
    # Exact counts over a padded test set.
    correct, count = map(int, re.search(r"test accuracy: (\d+)/(\d+)", joined).groups())
    assert count == 360 and correct / count > 0.9
    assert "the same count as an evaluation on one device: True" in joined
    assert "restored step 100" in joined
    assert "the resumed run equals the uninterrupted run bit for bit: True" in joined
    assert images(nb) >= 1
