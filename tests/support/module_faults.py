"""A live module's refit made to fail part-way, where the tests of the live-module receiver need it."""

from __future__ import annotations

from collections.abc import Callable

from flows.receive import placement


def fail_mid_apply(monkeypatch, kind: str, fail_at: int, module_cls: type, reloaded: Callable[[str], bool]) -> dict:
    """Make the ``fail_at``-th slot write (``kind`` "direct": one tensor per bucket) or the
    ``fail_at``-th loader call that reloads a tensor ``reloaded`` names (``kind`` "overwrite") raise
    ``RuntimeError``; returns the counter of those calls (``calls["n"]``), to prove the fault landed."""
    calls = {"n": 0}
    if kind == "direct":
        real = placement._xor_slot

        def flaky(slot, scratch):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise RuntimeError("device error while writing a slot")
            return real(slot, scratch)

        monkeypatch.setattr(placement, "_xor_slot", flaky)
        monkeypatch.setattr(placement.xor_into_module, "__defaults__", (1,))  # one tensor per bucket
    else:
        real_load = module_cls.load_weights

        def flaky_load(self, weights):
            weights = list(weights)
            if any(reloaded(n) for n, _ in weights):
                calls["n"] += 1
                if calls["n"] == fail_at:
                    raise RuntimeError("loader failed")
            return real_load(self, weights)

        monkeypatch.setattr(module_cls, "load_weights", flaky_load)
    return calls
