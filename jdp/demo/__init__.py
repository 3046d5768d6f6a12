"""The main job: data-parallel training of a small CNN on real data, end to end.

Run it as `python -m jdp.demo` (or `make demo`); `python -m jdp.demo --help` lists
the options. It trains a flax CNN with BatchNorm on scikit-learn's bundled 8x8
digits (no download) on every local device, with synchronous SGD, BMUF or ZeRO, and
writes `metrics.json` and a loss/accuracy plot. On a CPU-only machine it simulates
8 devices.

The modules of this package are private: the demo is a program, not a library.
"""

__all__: list[str] = []
