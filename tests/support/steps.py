"""Fault injection at the steps of a pipeline: replace one step of a step table for a test."""

from __future__ import annotations

import dataclasses
import functools

from flows.steps import StepTable


def patch_step(monkeypatch, table: type[StepTable], key: str, around) -> None:
    """Run ``around(real, *args, **kwargs)`` instead of step ``key`` of ``table`` (a crash before
    or after the real step, a wait at a barrier, a spy); undone with ``monkeypatch``."""
    step = table.steps()[key]

    @functools.wraps(step.fn)
    def patched(*args, **kwargs):
        return around(step.fn, *args, **kwargs)

    monkeypatch.setattr(table, key, dataclasses.replace(step, fn=patched))
