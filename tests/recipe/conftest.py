"""Fixtures shared by the tiny-run tests (test_train_tiny*.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """One directory for the tiny run's generated model, checkpoint and data (TINY_ASSETS): the first run
    builds it (deterministic, verl_patches/rigs/tiny/assets.py), later runs of the session reuse it and only read it."""
    return tmp_path_factory.mktemp("tiny_assets") / "assets"
