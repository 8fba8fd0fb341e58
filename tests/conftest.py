"""Shared fixtures: an isolated cache per test; the servers live in tests/servers.py."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Publisher baselines and receiver mirrors go under the test's own tmp dir."""
    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "dcr-cache"))


pytest_plugins = ["tests.support.servers", "tests.support.fault_report"]
