"""Which layers each checkpoint tensor lands in, learned from the model's own ``load_weights`` (a
vLLM-style loader: SGLang's models use the same ``weight_loader`` convention).

vLLM (0.32) reloads weights layer by layer (``vllm.model_executor.model_loader.reload``): a layer
(a module that owns parameters) is processed once every element of its parameters has been loaded,
and a layer that received only some of them is processed with the rest uninitialised. Fused layers
(``qkv_proj`` from q, k and v; ``gate_up_proj``; a MoE layer's experts) therefore need every
checkpoint tensor that feeds them, changed or not. This module finds, per checkpoint tensor, the
layers it feeds, so a refit reloads exactly the layers its changes touch, each whole.

How: every parameter's ``weight_loader`` (vLLM's convention: model loaders call
``param.weight_loader(param, tensor, ...)``) is swapped for a recorder that writes nothing, and
``model.load_weights`` runs once per checkpoint name on a meta tensor (no data at all). Recorded
owners are that name's layers. A loader that fails on the probe, or writes without a
``weight_loader`` (a meta tensor cannot be copied into real storage, so it fails too), maps its name
to every layer: the refit is then a full reload, never a partial one. Nothing live is written.

The same probe says which names are loaded *directly*: one plain ``weight_loader(param, tensor)``
call (no shard id, no other argument) into a parameter of the name's own shape (the engine's dtype
may differ: the loader's copy converts). Only such a name can be patched in place
(``flows.receive.param_patch`` decides whether it is).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from dcr_core.bits import torch_dtype

ALL = "*"  # the name may feed any layer: reload everything
_MISSING = object()


@dataclass(frozen=True)
class LayerMap:
    """Per checkpoint name, the (qualified) names of the layers it feeds; ``ALL`` when unknown."""

    schema: tuple
    layers: dict[str, frozenset[str]]
    direct: dict[str, str] = field(default_factory=dict)  # name -> "module.attr" it is copied into whole

    def layers_of(self, names: Iterable[str]) -> set[str]:
        return set().union(*(self.layers[n] for n in names)) - {ALL}

    def reload_set(self, changed: Iterable[str]) -> list[str] | None:
        """The names to reload so that every layer a changed name feeds gets all of its inputs,
        in layer order; None when that is everything (a full reload)."""
        touched: set[str] = set()
        for n in changed:
            owners = self.layers.get(n, frozenset({ALL}))
            if ALL in owners:
                return None
            touched |= owners
        names = [n for n, owners in self.layers.items() if owners & touched]
        if any(ALL in self.layers[n] for n in names):
            return None
        order = {layer: i for i, layer in enumerate(sorted(touched))}
        return sorted(names, key=lambda n: (min(order[x] for x in self.layers[n] & touched), n))


class _Recorder:
    def __init__(self, owner: str, param_name: str, calls: list[tuple[str, str | None]]):
        self.owner = owner
        self.param_name = param_name
        self.calls = calls
        self.__name__ = "dcr_probe_loader"

    def __call__(self, *args, **kwargs):
        plain = len(args) == 2 and not kwargs  # weight_loader(param, tensor): no shard, no expert id
        self.calls.append((self.owner, self.param_name if plain else None))
        return True if "return_success" in kwargs else None  # MoE loaders ask whether the expert matched


def probe_layers(model: torch.nn.Module, schema: Iterable[tuple[str, str, tuple[int, ...]]]) -> LayerMap:
    """Map every (name, dtype, shape) of the checkpoint schema to the layers it feeds."""
    schema = tuple(sorted((n, d, tuple(s)) for n, d, s in schema))
    first = {pid: held_by[0][0] for pid, held_by in owners(model).items()}
    params = dict(model.named_parameters())
    calls: list[tuple[str, str | None]] = []
    saved = [(p, getattr(p, "weight_loader", _MISSING)) for p in params.values()]
    layers: dict[str, frozenset[str]] = {}
    direct: dict[str, str] = {}
    try:
        for pname, p in params.items():
            p.weight_loader = _Recorder(first[id(p)], pname, calls)
        for name, dtype, shape in schema:
            calls.clear()
            probe = torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
            try:
                model.load_weights(iter([(name, probe)]))
            except Exception:  # noqa: BLE001 - unknown placement: the conservative answer is "everything"
                layers[name] = frozenset({ALL})
                continue
            layers[name] = frozenset(owner for owner, _ in calls)
            if len(calls) == 1 and calls[0][1] is not None:
                if tuple(params[calls[0][1]].shape) == shape:
                    direct[name] = calls[0][1]
    finally:
        for p, loader in saved:
            if loader is _MISSING:
                delattr(p, "weight_loader")
            else:
                p.weight_loader = loader
    return LayerMap(schema, layers, direct)



def owners(model: torch.nn.Module) -> dict[int, list[tuple[str, torch.nn.Module]]]:
    """id(parameter) -> every (name, module) that holds it, in ``named_modules`` order (tied
    parameters have more than one)."""
    out: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None and all(m is not mod for _, m in out.get(id(p), [])):
                out.setdefault(id(p), []).append((mod_name, mod))
    return out


def tied_followers(model: torch.nn.Module, layers: set[str] | None) -> list[tuple[str, torch.nn.Module]]:
    """Modules that share a parameter with a reloaded layer (``layers``; None: all) without being it:
    a tied ``lm_head``, say. vLLM's reload processes a shared parameter in its first owner only
    (a documented limitation of vLLM 0.32's layerwise reload), so a kernel such a module built from
    it (its repacked ``cpu_linear`` on CPU) still computes with the old weights until processed."""
    out: dict[int, tuple[str, torch.nn.Module]] = {}
    for held_by in owners(model).values():
        first, rest = held_by[0], held_by[1:]
        if rest and (layers is None or first[0] in layers):
            for name, mod in rest:
                if layers is None or name not in layers:
                    out.setdefault(id(mod), (name, mod))
    return list(out.values())
