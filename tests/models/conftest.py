"""Shared fixtures for the model tests: the digits data set, loaded once per module."""

from __future__ import annotations

import pytest

from gradsync.models.data import Digits, load_digits


@pytest.fixture(scope="module")
def digits() -> Digits:
    return load_digits()
