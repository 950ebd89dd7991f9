"""The one duration parser: the runner's options, the job spec and chat commands use it."""

from __future__ import annotations

import pytest

from runner.duration import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("10m", 600.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("45", 45.0),
        (45, 45.0),
        (2.5, 2.5),
        (" 10M ", 600.0),
        ("1h 30m", 5400.0),
        ("0s", 0.0),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["soon", "10x", "", "-5", "-1m", "m10", True, [1], None, "inf", "1e3", "٣m", 10**400],
)
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_a_unit_can_be_required() -> None:
    assert parse_duration("30m", unit_required=True) == 1800.0
    with pytest.raises(ValueError, match="duration"):
        parse_duration("30", unit_required=True)


def test_the_error_quotes_long_input_cut_short() -> None:
    with pytest.raises(ValueError) as info:
        parse_duration("x" * 100_000)
    assert len(str(info.value)) < 200
    assert "100000 characters" in str(info.value)
