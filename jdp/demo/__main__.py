"""`python -m jdp.demo`: see `jdp.demo` and `python -m jdp.demo --help`."""

import sys

from jdp.demo._cli import main

if __name__ == "__main__":
    sys.exit(main())
