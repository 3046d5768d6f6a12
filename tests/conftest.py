"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import re

_flags = re.sub(
    r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
)
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
