"""Update generators for ``dcr bench``: (old, new) pairs of canonical BF16 checkpoints."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from dcr_bench.models.demo_lm import DEFAULT_LR, DemoLM, ModelConfig, canonical, train_step

# BF16 bit patterns of the special values planted in synthetic updates.
_NAN_OLD, _NAN_NEW = 0x7FC1, 0x7FC3  # two quiet NaNs that differ only in their payload
_NEG_ZERO, _POS_INF = 0x8000, 0x7F80
_MAX_FINITE = 0x7F7F  # largest finite BF16 magnitude: ulp steps never turn a weight into inf/NaN


def synthetic_shapes(n_params: int) -> list[tuple[str, tuple[int, ...]]]:
    """A few Llama-like tensors (two decoder layers plus an embedding) holding exactly ``n_params``."""
    hidden = 64 * max(1, round(math.sqrt(n_params / 40) / 64))
    inter = 64 * max(1, round(8 * hidden / 3 / 64))
    kv = max(1, hidden // 4)
    layer = [
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.gate_proj.weight", (inter, hidden)),
        ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)),
    ]
    per_layer = sum(math.prod(s) for _, s in layer)
    layers = min(2, n_params // (2 * per_layer))  # keep at least half of the budget for the embedding
    shapes = [(f"model.layers.{i}.{n}", s) for i in range(layers) for n, s in layer]
    rest = n_params - layers * per_layer
    rows, tail = divmod(rest, hidden)
    if rows:
        shapes.insert(0, ("model.embed_tokens.weight", (rows, hidden)))
    if tail:
        shapes.append(("model.norm.weight", (tail,)))
    return shapes


def _step_ulps(bits: np.ndarray, idx: np.ndarray, rng: np.random.Generator, max_ulps: int) -> None:
    """Move ``bits[idx]`` by 1..max_ulps ulps up or down, keeping the sign (an integer step on the magnitude)."""
    b = bits[idx]
    sign, mag = b & 0x8000, (b & 0x7FFF).astype(np.int32)
    step = rng.integers(1, max_ulps + 1, size=idx.size, dtype=np.int32)
    step *= rng.choice(np.array([-1, 1], dtype=np.int32), size=idx.size)
    moved = mag + step
    # Reflect steps that would cross zero or leave the finite range, so every chosen element changes.
    bad = (moved < 0) | (moved > _MAX_FINITE)
    moved[bad] = mag[bad] - step[bad]
    bits[idx] = sign | moved.astype(np.uint16)


def _as_bf16(bits: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(shape)


def synthetic(
    n_params: int, change_rate: float, seed: int = 0, max_ulps: int = 3
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Weights ~N(0, 0.02) in BF16 and a copy with about ``change_rate`` of them moved by small ulp steps.

    A handful of special values ride along (a NaN payload change, a +0.0 -> -0.0 flip, a weight
    turned into +inf) so codecs are exercised on bits no float arithmetic would produce."""
    if not 0.0 <= change_rate <= 1.0:
        raise ValueError(f"change_rate must be within 0..1, got {change_rate}")
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed + 1)
    old, new = {}, {}
    for i, (name, shape) in enumerate(synthetic_shapes(n_params)):
        base = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        obits = base.reshape(-1).view(torch.int16).numpy().view(np.uint16).copy()
        nbits = obits.copy()
        idx = np.flatnonzero(rng.random(obits.size, dtype=np.float32) < change_rate)
        _step_ulps(nbits, idx, rng, max_ulps)
        if i == 0 and obits.size >= 4:
            nbits[:4] = obits[:4]  # the specials replace whatever was drawn there
            obits[0], nbits[0] = _NAN_OLD, _NAN_NEW
            obits[1], nbits[1] = 0x0000, _NEG_ZERO
            nbits[2] = _POS_INF
            obits[3] = nbits[3] = 0xFF80  # -inf, unchanged
        old[name], new[name] = _as_bf16(obits, shape), _as_bf16(nbits, shape)
    return old, new


def param_count(c: ModelConfig) -> int:
    """Parameters of ``DemoLM(c)`` (the checkpoint also holds one small FP32 buffer per model)."""
    hd = c.hidden // c.heads
    attn = 2 * c.hidden * c.heads * hd + 2 * c.hidden * c.kv_heads * hd
    per_layer = attn + 3 * c.hidden * c.intermediate + 2 * c.hidden
    return 2 * c.vocab * c.hidden + c.layers * per_layer + c.hidden


def config_for(n_params_target: int, seq_len: int = 32, batch: int = 4) -> ModelConfig:
    """A Llama-like ``ModelConfig`` of about ``n_params_target`` parameters with a typical depth/width ratio."""
    best, best_score = None, math.inf
    for hidden in (64, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096):
        heads = max(1, hidden // 64)
        kv = max(1, heads // 4)
        inter = 32 * max(1, round(8 * hidden / 3 / 32))
        # Embeddings get at most a quarter of the budget, as in real models of this size.
        vocab = min(8192, max(256, 64 * int(n_params_target / 8 / hidden / 64)))
        c = ModelConfig(vocab=vocab, hidden=hidden, layers=1, heads=heads, kv_heads=kv,
                        intermediate=inter, seq_len=seq_len, batch=batch)
        per_layer = param_count(ModelConfig(**{**c.__dict__, "layers": 2})) - param_count(c)
        layers = max(1, round((n_params_target - param_count(c) + per_layer) / per_layer))
        c = ModelConfig(**{**c.__dict__, "layers": layers})
        err = abs(param_count(c) - n_params_target) / n_params_target
        shape_penalty = abs(math.log2(layers / max(1.0, hidden / 64)))
        score = err + 0.1 * shape_penalty + (1.0 if err > 0.1 else 0.0)
        if score < best_score:
            best, best_score = c, score
    return best


class _CalibratedAdamW:
    """Wraps an AdamW so each ``step()`` picks its learning rate to move ``target`` of the BF16 weights.

    The step is linear in lr given the gradients (Adam's direction and decoupled weight decay both
    scale with lr), so one probe step gives the direction; the rate is then solved for on a sample
    and the real step is taken again from the saved parameters and optimizer state."""

    PROBE_LR = 1e-4
    SAMPLE = 1 << 21

    def __init__(self, opt: torch.optim.Optimizer, seed: int):
        self.opt, self.target, self.lr_used = opt, None, None
        self.params = [p for g in opt.param_groups for p in g["params"]]
        total = sum(p.numel() for p in self.params)
        gen = torch.Generator().manual_seed(seed)
        frac = min(1.0, self.SAMPLE / max(1, total))
        self.sample = [torch.randperm(p.numel(), generator=gen)[: max(1, int(p.numel() * frac))] for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.target is None:
            self.opt.step()
            self.lr_used = self.opt.param_groups[0]["lr"]
            return
        saved_state = copy.deepcopy(self.opt.state_dict())
        saved = [p.detach().clone() for p in self.params]
        self._set_lr(self.PROBE_LR)
        self.opt.step()
        w0 = torch.cat([s.reshape(-1)[i] for s, i in zip(saved, self.sample)])
        w1 = torch.cat([p.detach().reshape(-1)[i] for p, i in zip(self.params, self.sample)])
        lr = self._solve(w0, (w1 - w0) / self.PROBE_LR, self.target)
        with torch.no_grad():
            for p, s in zip(self.params, saved):
                p.copy_(s)
        self.opt.load_state_dict(saved_state)
        self._set_lr(lr)
        self.opt.step()
        self.lr_used = lr

    def _set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    @staticmethod
    def _solve(w0: torch.Tensor, direction: torch.Tensor, target: float) -> float:
        """The lr whose step changes ``target`` of the sampled BF16 weights (bisection in log lr)."""
        b0 = w0.to(torch.bfloat16).view(torch.int16)

        def rate(lr: float) -> float:
            return (w0 + lr * direction).to(torch.bfloat16).view(torch.int16).ne(b0).float().mean().item()

        lo, hi = math.log(1e-10), math.log(1e-1)
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate(math.exp(mid)) < target else (lo, mid)
        return math.exp(hi)


def adamw_steps(
    n_params_target: int,
    steps: int,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    target_rate: float | Sequence[float] | None = None,
    log: list | None = None,
) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Consecutive (old, new) canonical BF16 checkpoints of a small Llama-like model trained with AdamW.

    FP32 master weights, real AdamW steps on random tokens (``dcr_bench.demo``'s model and step). With
    ``target_rate`` (one rate, or one per step) each step's lr is chosen to change about that fraction
    of the BF16 weights; otherwise every step uses ``lr``. ``log``, if given, gets one dict per step."""
    rates = [target_rate] * steps if target_rate is None or isinstance(target_rate, float | int) else list(target_rate)
    if len(rates) != steps:
        raise ValueError(f"{len(rates)} target rates for {steps} steps")
    c = config_for(n_params_target)
    torch.manual_seed(seed)
    model = DemoLM(c)
    opt = _CalibratedAdamW(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01), seed + 2)
    gen = torch.Generator().manual_seed(seed + 1)
    old = canonical(model)
    for i, r in enumerate(rates):
        opt.target = None if r is None else float(r)
        opt._set_lr(lr)
        loss = train_step(model, opt, c, gen)
        new = canonical(model)
        if log is not None:
            log.append({"step": i + 1, "lr": opt.lr_used, "loss": loss, "target_rate": r,
                        "parameters": param_count(c), "config": dict(c.__dict__)})
        yield old, new
        old = new
