"""Shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import os
import re


def set_devices(n: int) -> None:
    """Simulates `n` CPU devices; must run before JAX is first imported."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+",
        "",
        os.environ.get("XLA_FLAGS", ""),
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"


def mlp_loss(params, batch):
    """Mean squared error of a ReLU MLP given as a list of `{"w", "b"}` layers."""
    import jax
    import jax.numpy as jnp

    x = batch["x"]
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - batch["y"]) ** 2)
