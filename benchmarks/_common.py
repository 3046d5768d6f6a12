"""Shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import os
import re
import statistics
import time


def set_devices(n: int) -> None:
    """Simulates `n` CPU devices; must run before JAX is first imported."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+",
        "",
        os.environ.get("XLA_FLAGS", ""),
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"


def pin_to_core(pin: bool) -> None:
    """Pins this process of a `jdp.launch` job to one core (by its rank), if `pin`."""
    if pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        rank = int(os.environ.get("JDP_PROCESS_ID", "0"))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def median_ms(fn, steps: int, warmup: int) -> float:
    """Median wall time of `steps` calls of `fn` after `warmup` untimed ones, in ms."""
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def square_mlp(width: int, depth: int, key):
    """`depth` random `width` x `width` layers `{"w", "b"}` (for `mlp_loss`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    params = []
    for _ in range(depth):
        key, sub = jax.random.split(key)
        params.append(
            {
                "w": jax.random.normal(sub, (width, width)) / np.sqrt(width),
                "b": jnp.zeros(width),
            }
        )
    return params


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


def normal_mlp(sizes, seed: int) -> list:
    """An MLP's layers `{"w", "b"}`: `w` normal / sqrt(fan-in), `b` zero (NumPy)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.normal(size=(m, k)) / np.sqrt(m)).astype(np.float32),
            "b": np.zeros(k, np.float32),
        }
        for m, k in zip(sizes[:-1], sizes[1:], strict=True)
    ]


def tanh_mlp(params, x):
    """Logits of a tanh MLP given as a list of `{"w", "b"}` layers."""
    import jax.numpy as jnp

    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


def raw_psum(num_params: int):
    """A call that sums a flat f32 buffer of `num_params` over every device and waits.

    The buffer is each device's own (sharded along the one mesh axis of every
    device of every process), so the call is one all-reduce of `num_params`
    floats: what the transport alone costs.
    """
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    local = np.ones((jax.local_device_count(), num_params), np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
    psum = jax.jit(
        jax.shard_map(
            lambda v: lax.psum(v, "data"),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    return lambda: jax.block_until_ready(psum(x))
