"""A tiny tensor-parallel + FSDP2 trainer for the multi-process test (run by torch.multiprocessing).

Ranks 0..1 (gloo, CPU) hold: a column-parallel ``up_proj`` and a row-parallel ``down_proj`` (FP32
master shards, canonical BF16: cast conversion), an FSDP2 ``fully_shard`` ``lm_head`` (DTensor
``Shard(0)``, 7 rows over 2 ranks: uneven), and a replicated norm kept as ``w - 1`` (canonical
``w`` in BF16: offset conversion). After every AdamW step each rank publishes its own shards; then
the test gathers the canonical checkpoint independently (all_gather / full_tensor) and rank 0
compares a receiver's state file with it, raw bytes.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

H, F, V = 6, 10, 7
UP, DOWN, HEAD, NORM = "model.mlp.up_proj.weight", "model.mlp.down_proj.weight", "lm_head.weight", "model.norm.weight"


def worker(rank: int, world: int, port: int, root: str, cache: str, out: str, steps: int, dcp_steps=()) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _train(rank, world, root, cache, out, steps, tuple(dcp_steps))
    finally:
        dist.destroy_process_group()


def _train(rank, world, root, cache, out, steps, dcp_steps):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", category=FutureWarning)
    from torch.distributed.nn.functional import all_reduce

    from dcr_core.conversion import cast, offset
    from dcr_core.shard_spec import replicate, split
    from flows import run_publish, run_receive
    from flows.options import PublishOptions
    from flows.publish.shards import Shard, ShardedSource, dtensor_pieces
    from tests.support.helpers import read_state

    torch.manual_seed(0)  # the same full init on every rank, then each keeps its shard
    up_full, down_full = torch.randn(F, H) * 0.3, torch.randn(H, F) * 0.3
    f = F // world
    up = torch.nn.Parameter(up_full[rank * f:(rank + 1) * f].clone())  # column parallel
    down = torch.nn.Parameter(down_full[:, rank * f:(rank + 1) * f].clone())  # row parallel
    norm = torch.nn.Parameter(torch.zeros(H))  # stored as w - 1
    head = torch.nn.Linear(H, V, bias=False)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(head, mesh=mesh)
    opt = torch.optim.AdamW([up, down, norm, *head.parameters()], lr=3e-3)
    opts = PublishOptions(chunk_bytes=16, cache_dir=cache, io_workers=2)

    def source():
        return ShardedSource([
            Shard("up", up, split(UP, (F, H), {0: (rank, world)}), cast(torch.bfloat16)),
            Shard("down", down, split(DOWN, (H, F), {1: (rank, world)}), cast(torch.bfloat16)),
            Shard("norm", norm, replicate(NORM, (H,), rank), offset(1.0, torch.bfloat16)),
            Shard("head", head.weight, dtensor_pieces(HEAD, head.weight)),
        ])

    def gathered() -> dict[str, torch.Tensor]:
        ups = [torch.empty_like(up.data) for _ in range(world)]
        downs = [torch.empty_like(down.data) for _ in range(world)]
        dist.all_gather(ups, up.data.contiguous())
        dist.all_gather(downs, down.data.contiguous())
        return {
            UP: torch.cat(ups, 0).to(torch.bfloat16),
            DOWN: torch.cat(downs, 1).to(torch.bfloat16),
            NORM: (norm.data.float() + 1.0).to(torch.bfloat16),
            HEAD: head.weight.full_tensor().detach().clone(),
        }

    report = []
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step:
            x = torch.randn(4, H, generator=gen)
            h = torch.nn.functional.gelu((x * (1 + norm)) @ up.t())
            z = all_reduce(h @ down.t())  # row-parallel output, summed over TP ranks
            loss = head(z).logsumexp(-1).mean()
            loss.backward()
            # the norm feeds the column-parallel layer: its gradient is the sum over TP ranks
            # (Megatron's copy-to-TP-region backward), which keeps the replicas identical
            dist.all_reduce(norm.grad)
            opt.step()
            opt.zero_grad()
        res = run_publish(root, source(), step, options=opts)
        want = gathered()
        if rank == 0:
            state = os.path.join(os.path.dirname(out), "receiver.safetensors")
            run_receive(root, "r0", state)
            got = read_state(state)
            diff = sorted(
                n for n, t in want.items()
                if n not in got or got[n].dtype != t.dtype or tuple(got[n].shape) != tuple(t.shape)
                or got[n].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
                != t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            )
            report.append({"step": step, "kind": res.kind, "names": sorted(got), "differ": diff,
                           "changed": res.summary.get("elements_changed")})
        if step in dcp_steps:
            _save_dcp(os.path.join(os.path.dirname(out), f"dcp-{step}"), mesh, up, down, norm, head, rank, world)
        dist.barrier()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(report, fh)


def _save_dcp(path, mesh, up, down, norm, head, rank, world) -> None:
    """A DCP checkpoint of the FP32 training state (TP shards as DTensors, FSDP2 head, replicated
    norm), and (rank 0) the canonical FP32 tensors gathered independently, for comparison."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    from tests.support.helpers import write_safetensors

    state = {"model": {
        UP: DTensor.from_local(up.data, mesh, [Shard(0)], run_check=False),
        DOWN: DTensor.from_local(down.data, mesh, [Shard(1)], run_check=False),
        NORM: norm.data,
        HEAD: head.weight.data,
    }, "extra": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path)
    ups = [torch.empty_like(up.data) for _ in range(world)]
    downs = [torch.empty_like(down.data) for _ in range(world)]
    dist.all_gather(ups, up.data.contiguous())
    dist.all_gather(downs, down.data.contiguous())
    want = {UP: torch.cat(ups, 0), DOWN: torch.cat(downs, 1), NORM: norm.data.clone(),
            HEAD: head.weight.full_tensor().detach().clone()}
    if rank == 0:
        write_safetensors(path + ".safetensors", want)
