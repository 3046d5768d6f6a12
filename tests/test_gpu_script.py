"""`benchmarks/gpu.sh --cpu-dry-run` walks through every step of the GPU run on CPU.

The GPU run itself needs a CUDA machine; the dry run keeps its steps (overhead with
the GSPMD row, memory, BMUF, the demo, the copies) from rotting where no GPU is around.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_script_dry_run_writes_every_table(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--cpu-dry-run", str(out)],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=380,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "gpu.sh: done in" in log
    tables = {p.name: p.read_text() for p in out.iterdir()}
    assert set(tables) >= {
        "machine.txt",
        "overhead.txt",
        "memory.txt",
        "bmuf.txt",
        "demo.txt",
        "copies.txt",
        "dispatch.txt",
        "gpu.log",
    }
    assert "jax devices: 1 x cpu (cpu)" in tables["machine.txt"]
    assert "gspmd (jit, P() params)" in tables["overhead.txt"]
    assert "BMUF k=16" in tables["bmuf.txt"]
    assert "NNX modules, 300 leaves" in tables["dispatch.txt"]
    assert "| sync " in tables["demo.txt"]
    assert "| all_reduce, sgd | shard_map | none |" in tables["copies.txt"]
    assert "FAILED" not in tables["gpu.log"]


def test_gpu_script_rejects_a_missing_output_folder():
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "usage: benchmarks/gpu.sh [--cpu-dry-run] OUTDIR" in proc.stderr
