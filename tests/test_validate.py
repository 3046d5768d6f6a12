"""jdp._validate: the shared argument checks (TypeError for a type, ValueError for a
value, both naming the argument)."""

import numpy as np
import pytest

from jdp import _validate


@pytest.mark.parametrize("value", [1, 2, 10**12])
def test_positive_int_returns_the_value(value):
    assert _validate.positive_int("n", value) == value


def test_positive_int_accepts_none_only_if_allowed():
    assert _validate.positive_int("n", None, allow_none=True) is None
    with pytest.raises(
        TypeError, match=r"^`n` must be an int >= 1, got None \(a NoneType\)\.$"
    ):
        _validate.positive_int("n", None)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("2", r"'2' \(a str\)"),
        (2.0, r"2\.0 \(a float\)"),
        (True, r"True \(a bool\)"),
        (np.int64(2), r".*2.* \(an int64\)"),
        ([1], r"\[1\] \(a list\)"),
    ],
    ids=["str", "float", "bool", "numpy", "list"],
)
def test_positive_int_rejects_other_types_with_a_type_error(value, shown):
    with pytest.raises(
        TypeError, match=rf"^`num_processes` must be an int >= 1, got {shown}\.$"
    ):
        _validate.positive_int("num_processes", value)


@pytest.mark.parametrize("value", [0, -3])
def test_positive_int_rejects_small_ints_with_a_value_error(value):
    with pytest.raises(
        ValueError, match=rf"^`num_processes` must be an int >= 1, got {value}\.$"
    ):
        _validate.positive_int("num_processes", value)


def test_positive_int_shows_the_note():
    with pytest.raises(
        ValueError, match=r"^`sync_period` must be an int >= 1 \(steps\), got 0\.$"
    ):
        _validate.positive_int("sync_period", 0, note="steps")
    with pytest.raises(TypeError, match=r"int >= 1 \(or None\), got 'a' \(a str\)"):
        _validate.positive_int("n", "a", allow_none=True, note="or None")


def test_non_negative_int():
    assert _validate.non_negative_int("k", 0) == 0
    assert _validate.non_negative_int("k", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"^`k` must be an int >= 0, got -1\.$"):
        _validate.non_negative_int("k", -1)
    with pytest.raises(TypeError, match=r"^`k` must be an int >= 0, got False"):
        _validate.non_negative_int("k", False)


def test_index():
    assert _validate.index("i", 0, 2, size_name="n") == 0
    assert _validate.index("i", 1, 2, size_name="n") == 1
    for bad in (-1, 2):
        with pytest.raises(
            ValueError, match=rf"^`i` must be an int in \[0, n=2\), got {bad}\.$"
        ):
            _validate.index("i", bad, 2, size_name="n")
    with pytest.raises(TypeError, match=r"^`i` must be an int in \[0, n=2\), got '1'"):
        _validate.index("i", "1", 2, size_name="n")


def test_describe_uses_the_right_article():
    assert _validate.describe("x") == "'x' (a str)"
    assert _validate.describe(3) == "3 (an int)"
    assert _validate.describe(None) == "None (a NoneType)"
