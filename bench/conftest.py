"""The corpus the pytest-benchmark suites share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bench_data(tmp_path_factory) -> Path:
    """The same corpus `python -m bench` uses by default: this repo's .py files as bytes."""
    from bench.train_step import prepare_data

    return prepare_data("repo", tmp_path_factory.mktemp("bench"), 0)[0]
