"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import re

_flags = re.sub(
    r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
)
# XLA:CPU's MLIR fusion emitters compile each fusion through a pipeline of its
# own, and cost a third of a test's compile time; without them XLA emits the same
# fusions the older way. The programs keep their collectives, copies and buffer
# sizes (what the tests read): `test_suite_setup.py` compares them with the default.
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
if FAST_COMPILE_FLAG.split("=")[0] not in _flags:
    _flags = f"{_flags} {FAST_COMPILE_FLAG}"
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles a few thousand small programs and runs most of them a few
# times: XLA's backend optimisations (LLVM's -O3) cost more than they save. They
# change no HLO (the passes that the tests read), only the machine code.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# No persistent compilation cache: on a fresh clone (CI) writing its thousands
# of entries costs more time than the few hits within one run save.

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8


def pytest_configure(config):
    if jax.default_backend() == "cpu" and jax.device_count() != NUM_DEVICES:
        raise pytest.UsageError(
            f"Expected {NUM_DEVICES} simulated CPU devices, "
            f"found {jax.device_count()}: "
            "something initialised JAX before tests/conftest.py set XLA_FLAGS."
        )


@pytest.fixture(params=["pmap", "shard_map"])
def backend(request):
    """Both execution backends of `jdp.parallelize`."""
    return request.param


@pytest.fixture(params=[1, 2, 4, 8], ids=lambda n: f"{n}dev")
def devices(request):
    """The first 1, 2, 4 or 8 simulated devices."""
    return jax.devices()[: request.param]


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A directory shared by this session's xdist workers (the session's own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
