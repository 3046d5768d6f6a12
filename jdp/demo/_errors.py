"""Private: the demo's errors.

A module of its own so that `_cli` and `_train` both import it without importing
each other.
"""


class UsageError(Exception):
    """A bad argument found after start-up: printed as one line, exit code 2."""
