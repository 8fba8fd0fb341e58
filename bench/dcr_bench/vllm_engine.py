"""Starting vLLM engines on this kind of machine (CPU, float32 compute), for tests and the benchmark.

On CPU, vLLM 0.32 needs: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for an engine in this process (about
2 s to start instead of 18 s); ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache); float32 compute (its
BF16 kernels need CPU instructions that not every machine allows: SIGILL); and, for tensor
parallelism on one NUMA node, ``VLLM_CPU_OMP_THREADS_BIND`` with one core list per rank.
The checkpoint stays BF16; vLLM's loader casts it on the way in.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from flows.receive.vllm_refit import EXTENSION

PROMPTS = ([1, 2, 3, 4, 5], [17, 9, 301, 44], [7] * 12, [100, 200, 300, 400, 500, 6, 7, 8])


def configure(tensor_parallel: int = 1, kv_cache_gib: int = 1) -> None:
    """Set vLLM's CPU environment for engines started afterwards by this process."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    if tensor_parallel == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        cores = os.cpu_count() or 1
        per = max(1, cores // tensor_parallel)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{r * per}-{r * per + per - 1}" if per > 1 else str(min(r, cores - 1)) for r in range(tensor_parallel))


def start(model_dir: str, tensor_parallel: int = 1, max_model_len: int = 256, extension: bool = True, **kwargs):
    """A vLLM engine serving ``model_dir`` with DCR's worker extension."""
    configure(tensor_parallel)
    from vllm import LLM

    if extension:
        kwargs["worker_extension_cls"] = EXTENSION
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
               max_model_len=max_model_len, gpu_memory_utilization=0.1, tensor_parallel_size=tensor_parallel,
               seed=0, **kwargs)


@contextmanager
def serving(model_dir: str, tensor_parallel: int = 1, **kwargs) -> Iterator:
    """``start`` ... ``stop``, as a context manager."""
    llm = start(model_dir, tensor_parallel, **kwargs)
    try:
        yield llm
    finally:
        stop(llm)


def generate(llm, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = 16) -> list[list[int]]:
    """Greedy token ids for each prompt."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def stop(llm) -> None:
    """Shut the engine down and free its memory (one engine per process at a time is safest)."""
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm
    gc.collect()
