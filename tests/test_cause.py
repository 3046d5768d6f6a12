"""`jdp.launch._cause`: which failure the launcher names first, from tables."""

import pytest

from jdp.launch import _cause


@pytest.mark.parametrize(
    "failed, expected",
    [
        # (ended at, process, returncode) in the order they ended
        ([(0.0, 1, 1), (0.01, 0, -9)], [(0, -9), (1, 1)]),
        ([(0.0, 1, 1), (0.01, 0, -11)], [(0, -11), (1, 1)]),
        ([(0.0, 1, -6), (0.01, 0, -9)], [(0, -9), (1, -6)]),  # SIGABRT follows
        ([(0.0, 1, 1), (5.0, 0, -9)], [(1, 1), (0, -9)]),  # too late to be the cause
        ([(0.0, 1, 1), (0.01, 0, 2)], [(1, 1), (0, 2)]),
        ([(0.0, 1, -15), (0.01, 0, 1)], [(1, -15), (0, 1)]),
        ([(0.0, 2, -9), (0.01, 0, -9), (0.02, 1, 1)], [(2, -9), (0, -9), (1, 1)]),
    ],
)
def test_failures_are_told_cause_first(failed, expected):
    assert _cause.cause_first(failed) == expected


def test_a_failure_whose_peer_left_is_told_after_the_others():
    left = ["ValueError: UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error "
            "[127.0.0.1]:26527: Connection reset by peer"]  # fmt: skip
    tails = [left, ["on purpose"]]
    # Process 0's collective failed because process 1 left (status 3), though
    # the launcher saw process 0 end first.
    failed = [(0.0, 0, 1), (0.01, 1, 3)]
    assert _cause.cause_first(failed, tails) == [(1, 3), (0, 1)]
    assert _cause.cause_first(failed, [["other"], ["on purpose"]]) == [
        (0, 1),
        (1, 3),
    ]
    # Beyond `ENDING_WAIT_S` the order they ended stands.
    late = [(0.0, 0, 1), (5.0, 1, 3)]
    assert _cause.cause_first(late, tails) == [(0, 1), (1, 3)]
    # A SIGKILL still comes first.
    assert _cause.cause_first([(0.0, 0, 1), (0.01, 1, -9)], tails) == [
        (1, -9),
        (0, 1),
    ]


@pytest.mark.parametrize(
    "exits, failed_at, expected",
    [
        # (ended at, process, returncode): finished 1 s before the failure
        ([(9.0, 0, 0), (10.0, 1, 1)], 10.0, [(0, 1.0)]),
        # finished long before: the job went on without it, not the cause
        ([(1.0, 0, 0), (10.0, 1, 1)], 10.0, []),
        # seen to end just after the failure (the launcher's threads are late)
        ([(10.0, 1, 1), (11.5, 0, 0)], 10.0, [(0, -1.5)]),
        # seen to end well after it: it finished in spite of the failure
        ([(10.0, 1, 1), (13.0, 0, 0)], 10.0, []),
        # only finishes count
        ([(9.0, 0, 2), (10.0, 1, 1)], 10.0, []),
        ([(6.0, 2, 0), (9.0, 0, 0), (10.0, 1, 1)], 10.0, [(2, 4.0), (0, 1.0)]),
    ],
)
def test_processes_that_finished_just_before_a_failure(exits, failed_at, expected):
    assert _cause.finished_before(exits, failed_at) == expected


@pytest.mark.parametrize(
    "code, text",
    [
        (0, "exited with status 0"),
        (3, "exited with status 3"),
        (-9, "was killed by SIGKILL"),
        (-6, "was killed by SIGABRT"),
        (-15, "was killed by SIGTERM"),
        (-99, "was killed by signal 99"),
    ],
)
def test_describe_exit(code, text):
    assert _cause.describe_exit(code) == text
