"""The classic data-parallel lesson, made real: the pieces `shardscope.lesson` exposes, and its demo.

The demo trains a small MLP on N gloo processes with a minimal DDP, checks the hand-written all-reduce against a
single process, does an FSDP round trip (shard, all-gather, compare, free), and measures what each ZeRO stage keeps
for the demo's model. It runs under the same rules as every real run: death with the parent, a deadline, reaping.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardscope.measure.storage import storage_bytes
from shardscope.procs.functions import run_function
from shardscope.runtime.collectives import all_gather_single
from shardscope.runtime.trainer import broadcast_module


def init_process_group(
    rank: int, world_size: int, *, backend: str = "gloo", port: int = 29500, timeout: float = 60.0
) -> None:
    """Join a process group over TCP on localhost (every rank gives the same port)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))


def all_reduce_grads_(module: nn.Module) -> None:
    """Average every gradient across ranks in place: all-reduce (sum), then divide by the world size."""
    world = dist.get_world_size()
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(world)


class MinimalDDP(nn.Module):
    """The smallest correct DDP: broadcast rank 0's weights once, all-reduce each gradient as autograd makes it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        broadcast_module(module)
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._average)

    def _average(self, param: torch.Tensor) -> None:
        assert param.grad is not None
        dist.all_reduce(param.grad)
        param.grad.div_(dist.get_world_size())

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def fsdp_round_trip_sketch(module: nn.Module) -> bool:
    """Shard a flat copy of the parameters (padded to a multiple of the world size), all-gather the shards back,
    and check the result equals the original; the gathered buffer is freed afterwards. True on success."""
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    shard_numel = math.ceil(flat.numel() / world)
    padded = torch.zeros(shard_numel * world, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    shard = padded[rank * shard_numel : (rank + 1) * shard_numel].clone()
    del padded
    gathered = torch.empty(shard_numel * world, dtype=flat.dtype)
    all_gather_single(gathered, shard)
    ok = bool(torch.equal(gathered[: flat.numel()], flat))
    del gathered  # "free after use": only the shard stays
    return ok


def _mlp(in_dim: int, hidden: int, out_dim: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, out_dim)).double()


def _stage_bytes(module: nn.Module, stage: int) -> int:
    """Bytes this rank really allocates for params, grads and AdamW state under a ZeRO stage (flat, padded)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = sum(p.numel() for p in module.parameters())
    shard_numel = math.ceil(numel / world)
    whole = torch.zeros(shard_numel * world, dtype=torch.float64)
    mine = whole[rank * shard_numel : (rank + 1) * shard_numel].clone()
    params = mine if stage >= 3 else whole
    grads = torch.zeros_like(mine if stage >= 2 else whole)
    leaf = mine if stage >= 1 else whole
    optimizer = torch.optim.AdamW([leaf], foreach=False)
    leaf.grad = torch.zeros_like(leaf)
    optimizer.step()
    leaf.grad = None
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return storage_bytes([params]) + storage_bytes([grads]) + storage_bytes(state)


def _demo_rank(rank: int, world: int, port: int, options: dict[str, Any]) -> dict[str, Any]:
    """One rank of the demo; returns its report."""
    init_process_group(rank, world, backend=options["backend"], port=port, timeout=options["timeout"])
    in_dim, hidden, out_dim = options["in_dim"], options["hidden"], options["out_dim"]
    batch, seed = options["batch_size"], options["seed"]
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randn(batch * world, in_dim, generator=generator, dtype=torch.float64)
    targets = torch.randn(batch * world, out_dim, generator=generator, dtype=torch.float64)
    mine = slice(rank * batch, (rank + 1) * batch)

    # 1. the hand-written all-reduce gives the single-process gradient of the global batch
    single = _mlp(in_dim, hidden, out_dim, seed)
    nn.functional.mse_loss(single(inputs), targets).backward()
    local = _mlp(in_dim, hidden, out_dim, seed)
    nn.functional.mse_loss(local(inputs[mine]), targets[mine]).backward()
    all_reduce_grads_(local)
    manual_diff = max(
        float((a.grad - b.grad).abs().max())  # type: ignore[operator]
        for a, b in zip(local.parameters(), single.parameters(), strict=True)
    )

    # 2. MinimalDDP training from different starting weights on every rank
    model = MinimalDDP(_mlp(in_dim, hidden, out_dim, seed + 100 * rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=options["lr"])
    losses = []
    for _ in range(options["num_steps"]):
        loss = nn.functional.mse_loss(model(inputs[mine]), targets[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(float(mean_loss) / world)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    report = {
        "param_sum": float(flat.sum()),
        "max_param_diff_across_ranks": max(float((other - everyone[0]).abs().max()) for other in everyone),
        "losses": losses,
        "manual_all_reduce_max_diff_vs_single_process": manual_diff,
        "fsdp_round_trip_ok": fsdp_round_trip_sketch(model),
        "bytes_by_zero_stage": {f"zero{stage}" if stage else "ddp": _stage_bytes(model, stage) for stage in range(4)},
    }
    dist.barrier()
    dist.destroy_process_group()
    return report


def run_distributed_demo(
    world_size: int = 2,
    *,
    backend: str = "gloo",
    in_dim: int = 32,
    hidden: int = 16,
    out_dim: int = 4,
    batch_size: int = 8,
    num_steps: int = 6,
    lr: float = 0.05,
    seed: int = 0,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Run the lesson on world_size processes and return what every rank saw (see the module docstring)."""
    options = {
        "backend": backend,
        "in_dim": in_dim,
        "hidden": hidden,
        "out_dim": out_dim,
        "batch_size": batch_size,
        "num_steps": num_steps,
        "lr": lr,
        "seed": seed,
        "timeout": timeout,
    }
    reports = run_function(_demo_rank, world_size, options, timeout)
    sums = [reports[rank]["param_sum"] for rank in range(world_size)]
    return {
        "world_size": world_size,
        "backend": backend,
        "param_sum_per_rank": sums,
        "param_sum_spread": max(sums) - min(sums),
        "losses": reports[0]["losses"],
        "manual_all_reduce_max_diff_vs_single_process": max(
            r["manual_all_reduce_max_diff_vs_single_process"] for r in reports.values()
        ),
        "fsdp_round_trip_all_ranks_ok": all(r["fsdp_round_trip_ok"] for r in reports.values()),
        "max_param_diff_across_ranks": max(r["max_param_diff_across_ranks"] for r in reports.values()),
        "bytes_by_zero_stage_per_rank": [reports[rank]["bytes_by_zero_stage"] for rank in range(world_size)],
    }
