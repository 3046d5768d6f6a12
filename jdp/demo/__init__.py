"""The demo: data-parallel training of a small CNN on real data, end to end.

Run it as `python -m jdp.demo` (or `make demo`); `--help` lists the options, and
docs/demo.md describes the run. Its modules are private: it is a program.
"""

__all__: list[str] = []
