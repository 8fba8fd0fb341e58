"""Shared fixtures: an isolated cache per test; the servers live in tests/servers.py."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Module- and session-scoped fixtures publish too: their baselines go under the run's temp
    directory, never into the user's own cache (~/.cache/dcr)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DCR_CACHE_DIR", str(tmp_path_factory.mktemp("dcr-cache")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Publisher baselines and receiver mirrors go under the test's own tmp dir."""
    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "dcr-cache"))


pytest_plugins = ["tests.support.servers", "tests.support.fault_report"]
