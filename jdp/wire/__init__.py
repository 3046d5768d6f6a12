"""Wire formats for compressed gradient exchanges: `jdp.all_reduce(wire=...)`.

Each format says what the exchange sends per gradient value. `bf16()` halves
the bytes of float32; `int8()` and `fp8()` send one byte per value plus one
float32 scale per block, about a quarter. Pair the 8-bit formats with
`error_feedback=True`, which adds what quantisation dropped back the next step.

Example:
  >>> import jdp
  >>> sync = jdp.all_reduce(wire=jdp.wire.int8(block_size=256), error_feedback=True)
"""

from jdp._wire import Wire, WireState, bf16, fp8, int8

__all__ = ["Wire", "WireState", "bf16", "fp8", "int8"]
