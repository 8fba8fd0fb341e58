"""Prefect flows of DCR: ``publish_refit`` and ``receive_refit`` (imported lazily: Prefect is slow to import)."""

from __future__ import annotations

__all__ = ["publish_refit", "receive_refit"]


def __getattr__(name: str):
    if name in __all__:
        from flows import prefect_flows

        return getattr(prefect_flows, name)
    raise AttributeError(name)
