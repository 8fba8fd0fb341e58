"""What a live model holds, as bytes (an engine's, a torch module's): the parameters and buffers of
its modules, the tensors it keeps beside them, and what its opaque repacked kernels compute.

After loading, an engine may move weights out of ``named_parameters``: on CPU, vLLM 0.32 repacks
every linear layer's weight into a oneDNN (or sgl) handle reached only through ``layer.cpu_linear``,
and the parameter left behind has shape ``(0,)``. Such a handle holds a pointer, not bytes DCR can
read. So the engine's state is described by:

- every parameter and buffer of every module (``recurse=False``, tied tensors once per owner);
- tensors a module keeps as plain attributes, and tensors captured by the closures of its callable
  attributes (a packed weight of the sgl path, say), except the KV cache (``kv_cache``: requests'
  state, not weights);
- for every module with a ``cpu_linear`` kernel (vLLM's CPU linear layers): its output for a fixed
  input. ``kernel_probe`` uses one fixed pseudo-random row (one pass over the weights, like
  hashing them; ``flows.receive.held_digests`` hashes it); ``readback`` uses the identity matrix,
  which returns every weight through the kernel itself (``W^T`` row by row, bias added): byte-equal
  readbacks of two engines mean their packed kernels compute with the same weights.

Opaque handle objects (a pointer differs from engine to engine) are left out; the kernels' outputs
stand for them. Nothing here imports vLLM: it reads the model the engine passes to its workers,
and describes a live torch module (``flows.receive.module``) the same way (``held_digests``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import blake3
import numpy as np
import torch

SKIPPED_ATTRS = frozenset({"kv_cache"})  # the KV cache: requests' state, not weights
PROBE_SEED = 20261201


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``t`` (any dtype), row-major, as a uint8 array (no copy for a contiguous CPU
    tensor; hashers read it through the buffer protocol)."""
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)


def _hasher() -> blake3.blake3:
    return blake3.blake3(max_threads=blake3.blake3.AUTO)  # every core


def _closure_tensors(fn) -> Iterator[tuple[str, torch.Tensor]]:
    cells = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    for var, cell in zip(names, cells):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, torch.Tensor):
            yield var, v


def module_tensors(prefix: str, mod: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for the weight-like tensors ``mod`` holds itself (not its submodules')."""
    for table in (mod._parameters, mod._buffers):
        for attr, t in table.items():
            if t is not None:
                yield f"{prefix}{attr}", t
    for attr, v in vars(mod).items():
        if attr in SKIPPED_ATTRS or attr in ("_parameters", "_buffers", "_modules"):
            continue
        if isinstance(v, torch.Tensor):
            yield f"{prefix}<attr>{attr}", v
        elif callable(v) and not isinstance(v, torch.nn.Module):
            for var, t in _closure_tensors(v):
                yield f"{prefix}<closure>{attr}.{var}", t


def tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight-like tensor the model holds (see the module docstring)."""
    for mod_name, mod in model.named_modules():
        yield from module_tensors(f"{mod_name}." if mod_name else "", mod)


def has_kernel(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` computes through vLLM's CPU linear kernel (a repacked copy of its weight)."""
    return callable(vars(mod).get("cpu_linear")) and isinstance(getattr(mod, "input_size_per_partition", None), int)


def _kernel_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for mod_name, mod in model.named_modules():
        if has_kernel(mod):
            yield mod_name, mod


def _kernel_dtype(mod: torch.nn.Module) -> torch.dtype:
    dtype = getattr(mod, "params_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()


@torch.inference_mode()
def kernel_output(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the module's CPU linear kernel computes for ``x`` (rows of ``input_size_per_partition``)."""
    return mod.cpu_linear(x, mod.weight, getattr(mod, "bias", None))


def kernel_probe(mod: torch.nn.Module) -> torch.Tensor:
    """What the module's CPU linear kernel computes for one fixed pseudo-random row: one pass over
    its weights, like hashing them (``held_digests`` hashes it)."""
    return kernel_output(mod, _probe_row(mod.input_size_per_partition, _kernel_dtype(mod)))


@functools.lru_cache(maxsize=64)
def _probe_row(k: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixed pseudo-random input row of ``k`` elements (kernels only read it)."""
    g = torch.Generator().manual_seed(PROBE_SEED + k)
    return torch.randn(1, k, generator=g, dtype=torch.float32).to(dtype)


@torch.inference_mode()
def readback(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every CPU kernel's output for the identity matrix: its weights, read through the kernel."""
    out = {}
    for name, mod in _kernel_modules(model):
        k = mod.input_size_per_partition
        eye = torch.eye(k, dtype=_kernel_dtype(mod))
        out[f"{name}<kernel>"] = raw_bytes(kernel_output(mod, eye))
    return out


def dump(model: torch.nn.Module, with_readback: bool = True) -> dict[str, tuple[str, tuple, str]]:
    """name -> (dtype, shape, BLAKE3 of the raw bytes) for everything the engine holds, kernel
    readbacks included: two engines hold the same bits when their dumps are equal."""
    out = {n: (str(t.dtype), tuple(t.shape), _hasher().update(raw_bytes(t)).hexdigest()) for n, t in tensors(model)}
    if with_readback:
        out.update({n: ("readback", (), _hasher().update(b).hexdigest()) for n, b in readback(model).items()})
    return out
