"""Engines for DCR's engine receiver with no vLLM: their in-place reload is the model's own
``load_weights`` (as vLLM's layerwise reload is, for the whole layers the receiver passes).
``KernelEngine`` also rebuilds, for every linear layer it reloads, a kernel as vLLM's CPU backend
does: a new ``cpu_linear`` callable over an opaque handle that holds a packed copy of the weight
(not a tensor the module holds or a closure captures: only the kernel's output reads it)."""

from __future__ import annotations

import torch


class LoaderEngine:
    """``flows.receive.engine_model.EngineModel`` over a model with a vLLM-style ``load_weights``."""

    kind, rank, ranks = "loader", 0, 1

    def __init__(self, model):
        self.model = model

    def reload(self, weights, layers):
        self.model.load_weights(weights)

    def abandon_reload(self):
        pass  # no half-processed layers to put back


class Handle:
    """An opaque kernel handle (vLLM's oneDNN handle holds a pointer): its packed weights are
    reachable only through the kernel."""

    __slots__ = ("_packed",)

    def __init__(self, weight: torch.Tensor):
        self._packed = weight.detach().clone()

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self._packed, bias)


def repack(mod: torch.nn.Module, weight: torch.Tensor | None = None) -> None:
    """Build ``mod``'s kernel from its weight (or from ``weight``: a kernel that differs from the
    module's tensors), as a new callable, the way vLLM's ``dispatch_cpu_unquantized_gemm`` does."""
    handle = Handle(mod.weight if weight is None else weight)
    mod.input_size_per_partition = mod.weight.shape[1]
    mod.params_dtype = mod.weight.dtype
    mod.cpu_linear = lambda x, w, bias: handle.run(x, bias)


def linear_layers(model: torch.nn.Module, layers: set[str] | None = None) -> list[str]:
    """The linear layers (``...Linear`` modules) among ``layers`` (None: all)."""
    return [n for n, m in model.named_modules()
            if type(m).__name__.endswith("Linear") and (layers is None or n in layers)]


class KernelEngine(LoaderEngine):
    """A ``LoaderEngine`` whose linear layers compute through repacked kernels, rebuilt by every
    reload of their layer (``repack``)."""

    kind = "kernels"

    def __init__(self, model):
        super().__init__(model)
        for name in linear_layers(model):
            repack(model.get_submodule(name))

    def reload(self, weights, layers):
        self.model.load_weights(weights)
        for name in linear_layers(self.model, layers):
            repack(self.model.get_submodule(name))
