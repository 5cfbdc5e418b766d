"""``gradsync.env.env_number``: the one reader of numeric environment variables, and its three users (the parameter
server and its workers, ``gradsync plan``'s limits, the input-file bounds of ``gradsync.paths``) reading alike."""

from __future__ import annotations

import pytest

from gradsync.env import env_number
from gradsync.errors import GradsyncError, TopologyError
from gradsync.paths import MAX_INPUT_DEPTH, MAX_INPUT_DEPTH_ENV, MAX_INPUT_VALUES_ENV, parse_json

VAR = "GRADSYNC_TEST_NUMBER"


@pytest.mark.parametrize("text", [None, "", "   "])
def test_unset_empty_or_blank_is_the_default(monkeypatch: pytest.MonkeyPatch, text: str | None) -> None:
    if text is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, text)
    assert env_number(VAR, 7, int) == 7 and env_number(VAR, 2.5, float) == 2.5


def test_values_are_read_as_the_kind_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, " 12 ")
    assert env_number(VAR, 8, int) == 12 and type(env_number(VAR, 8, int)) is int
    assert env_number(VAR, 1.0, float) == 12.0
    monkeypatch.setenv(VAR, "1e3")
    assert env_number(VAR, 1.0, float) == 1000.0


def test_a_bad_value_names_the_variable_and_a_value_that_would_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "1.5")
    # an integer example is written out in full (``:g`` would write 2e+06, which int() refuses)
    with pytest.raises(GradsyncError, match=rf"^{VAR}='1.5' is not an integer; unset it or set e.g. {VAR}=2000000$"):
        env_number(VAR, 2_000_000, int)
    monkeypatch.setenv(VAR, "soon")
    with pytest.raises(GradsyncError, match=rf"^{VAR}='soon' is not a number; unset it or set e.g. {VAR}=0.5$"):
        env_number(VAR, 0.5, float)


def test_the_callers_error_type_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader's own error (the CLI prints it as one line, exit 2) whatever variable it read."""
    monkeypatch.setenv(VAR, "x")
    with pytest.raises(TopologyError, match=VAR):
        env_number(VAR, 1, int, TopologyError)


def test_the_input_bounds_read_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """gradsync.paths: the same reading and message, plus its own range (a bound of at least 1)."""
    deep = "[" * 3 + "]" * 3
    monkeypatch.setenv(MAX_INPUT_DEPTH_ENV, "two")
    with pytest.raises(TopologyError, match=rf"{MAX_INPUT_DEPTH_ENV}='two' is not an integer; unset it or set e.g. "
                                            rf"{MAX_INPUT_DEPTH_ENV}={MAX_INPUT_DEPTH}"):
        parse_json(deep, "topology file", TopologyError)
    monkeypatch.setenv(MAX_INPUT_DEPTH_ENV, "0")
    with pytest.raises(TopologyError, match=rf"{MAX_INPUT_DEPTH_ENV}=0 must be >= 1; unset it or set e.g."):
        parse_json(deep, "topology file", TopologyError)
    monkeypatch.setenv(MAX_INPUT_DEPTH_ENV, "  ")  # blank: the default
    monkeypatch.setenv(MAX_INPUT_VALUES_ENV, "")
    assert parse_json(deep, "topology file", TopologyError) == [[[]]]
