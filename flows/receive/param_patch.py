"""Changed elements written in place into an engine's layers that keep the checkpoint's layout
(described here for vLLM, the engine DCR adapts today).

A layer keeps the checkpoint's layout when nothing vLLM does after loading turns its weights into
something else. DCR patches a checkpoint name in place only when all of this holds:

- the model's loader copies the name whole: one plain ``weight_loader(param, tensor)`` call into a
  parameter of the same shape (``LayerMap.direct``, learned by the layer probe), converted to the
  engine's dtype by the copy where they differ (a BF16 checkpoint in a float32 engine);
- every tensor the module holds is such a parameter (no buffer, no tensor kept beside them, no
  tensor in a closure), it has no CPU kernel (a repacked copy of its weight), and no other module
  holds the parameter (on CPU, a tied ``lm_head`` computes with a packed copy);
- on every refit, before anything is written, the parameter's bytes equal the held step's tensor
  of the name (the mirror's) converted as the loader's copy converts it (``Tensor.to``, the same
  conversion kernel as ``copy_``): the layout is proved again on the data, not assumed.

On CPU (vLLM 0.32) that is the RMSNorm weights: every linear layer, and the embedding (vLLM packs a
copy of it in case the head is tied), carries a kernel. On a GPU an unsharded, unpadded embedding
or head has no such copy and would qualify too (not run here: no GPU).

For such a name a refit needs no reload: the elements that differ between the engine's parameter
and the target step (converted the same way) are found while the engine serves (``prepare``), as
integer views of the raw bits (NaN payloads and signed zeros compare as bits), and written in the
pause with one indexed copy (``apply``); the old values are kept, so ``undo`` puts them back
exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from flows.receive import layer_probe, live_tensors

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Patch:
    name: str  # the checkpoint name
    module: str  # the module holding the parameter
    param: torch.Tensor  # the parameter's data
    index: torch.Tensor  # flat element indices that differ (int64, on the parameter's device)
    new: torch.Tensor  # the target step's elements there, as integers of the element's width
    old: torch.Tensor  # the engine's elements there before the patch

    @property
    def elements(self) -> int:
        return int(self.index.numel())


def candidates(model: torch.nn.Module, layer_map: layer_probe.LayerMap) -> dict[str, str]:
    """Checkpoint name -> the parameter ("module.attr") it is copied into, for the names this engine
    can take patched in place (the structural conditions of the module docstring; the data condition
    is checked by ``prepare``)."""
    params = dict(model.named_parameters())
    held_by = layer_probe.owners(model)
    direct = set(layer_map.direct.values())
    out: dict[str, str] = {}
    for name, pname in layer_map.direct.items():
        mod_name, _, _ = pname.rpartition(".")
        p = params[pname]
        mod = model.get_submodule(mod_name)
        if layer_map.layers.get(name) != frozenset({mod_name}) or len(held_by[id(p)]) != 1:
            continue
        if live_tensors.has_kernel(mod) or not p.is_contiguous() or p.element_size() not in _INT:
            continue
        own = [n for n, _ in live_tensors.module_tensors(f"{mod_name}." if mod_name else "", mod)]
        if all(n in direct for n in own):
            out[name] = pname
    return out


def split(changed: Iterable[str], patchable: dict[str, str], layer_map: layer_probe.LayerMap
          ) -> tuple[list[str], list[str] | None]:
    """(names to patch, names to reload; None: everything) for a change: a patchable name whose
    module a reload touches anyway is reloaded with it."""
    changed = list(changed)
    reload = layer_map.reload_set([n for n in changed if n not in patchable])
    if reload is None:
        return [], None
    reloaded = layer_map.layers_of(reload)
    return sorted(n for n in changed if n in patchable and module_of(patchable[n]) not in reloaded), reload


def module_of(pname: str) -> str:
    return pname.rpartition(".")[0]


def _elements(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of its element width, flat (a copy on the host)."""
    return t.detach().cpu().contiguous().view(-1).view(_INT[t.element_size()])


def prepare(model: torch.nn.Module, patchable: dict[str, str], names: list[str], held, target
            ) -> list[Patch] | None:
    """The patches for ``names`` (``held(name)``/``target(name)``: the held and the target step's
    tensor in the checkpoint's dtype), or None when a parameter does not hold the held step's values
    (its layout is not the checkpoint's after all: the caller reloads those layers instead). Reads
    the model only."""
    params = dict(model.named_parameters())
    out = []
    for name in names:
        pname = patchable[name]
        p = params[pname].data
        current = _elements(p)
        if not torch.equal(current, _elements(held(name).to(p.dtype))):
            return None
        new = _elements(target(name).to(p.dtype))
        if new.shape != current.shape:
            return None
        index = torch.nonzero(current != new).reshape(-1)
        dev = p.device
        out.append(Patch(name, module_of(pname), p, index.to(dev), new[index].to(dev), current[index].to(dev)))
    return out


@torch.inference_mode()
def apply(patches: list[Patch]) -> int:
    """Write every patch's new elements (the pause); returns the number of elements written."""
    for pt in patches:
        pt.param.view(-1).view(_INT[pt.param.element_size()])[pt.index] = pt.new
    return sum(pt.elements for pt in patches)


@torch.inference_mode()
def undo(patches: list[Patch]) -> None:
    """Put every patch's old elements back."""
    for pt in patches:
        pt.param.view(-1).view(_INT[pt.param.element_size()])[pt.index] = pt.old
