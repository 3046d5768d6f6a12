"""`jdp._allocator`: glibc's thresholds in the processes jdp's entry points start."""

import os
import subprocess
import sys

import pytest

from jdp import _allocator
from jdp.launch import _setup

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION")


def test_the_launchers_processes_get_the_thresholds():
    env = _setup.process_env(
        {"PATH": "/bin"}, process_id=0, num_processes=2, port=1, devices_per_process=1
    )
    if sys.platform.startswith("linux"):
        for name in _allocator.GLIBC_VARIABLES:
            assert env[name] == str(2**30)
    assert env["PATH"] == "/bin"


@pytest.mark.parametrize(
    "base",
    [
        {"JDP_DEFAULT_MALLOC": "1"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
    ],
    ids=["opt-out", "own-mmap", "own-trim"],
)
def test_a_users_own_setting_is_kept(base):
    env = _setup.process_env(
        base, process_id=0, num_processes=2, port=1, devices_per_process=1
    )
    for name in _allocator.GLIBC_VARIABLES:
        assert env.get(name) == base.get(name)


TUNE = "from jdp import _allocator; print(_allocator.tune())"


@pytest.mark.skipif(not GLIBC, reason="glibc only")
@pytest.mark.parametrize(
    "extra, expected",
    [
        ({}, "True"),
        ({"JDP_DEFAULT_MALLOC": "1"}, "False"),
        ({"JDP_DEFAULT_MALLOC": "0"}, "True"),
    ],
    ids=["default", "opt-out", "zero"],
)
def test_tune_sets_the_thresholds_unless_told_not_to(extra, expected):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("JDP_DEFAULT_MALLOC", None)
    proc = subprocess.run(
        [sys.executable, "-c", TUNE],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
