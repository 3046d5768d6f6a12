"""Private: typed PRNG keys among the leaves, and each leaf's host and abstract value.

Keys are moved as their key data and wrapped back with `key_impl`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp import _jax_compat


def is_key(x: Any) -> bool:
    """Whether `x` (an array or a `ShapeDtypeStruct`) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl(x: Any) -> str:
    """The PRNG implementation name of typed keys (an array or an abstract value)."""
    if isinstance(x, jax.Array):
        return str(jax.random.key_impl(x))
    return _jax_compat.key_impl_name(x.dtype)


def host_value(x: Any) -> np.ndarray:
    """A leaf as a NumPy array in the dtype JAX would give it (keys: their data)."""
    if is_key(x):
        return np.asarray(jax.device_get(jax.random.key_data(x)))
    if isinstance(x, jax.Array):
        return np.asarray(jax.device_get(x))
    arr = np.asarray(x)
    return arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype of a leaf (keys keep their key dtype)."""
    if is_key(x):
        return jax.eval_shape(lambda: x)
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
