"""ddp and zero1 replayed with torch's own DistributedDataParallel and ZeroRedundancyOptimizer, as the runtime runs
them (shardscope.runtime.engines.TorchDDP): fp32 parameters, autocast around forward and the loss under mixed
precision, the reducer's gradient buckets, and ZeroRedundancyOptimizer's shard of the optimizer state and its
parameter broadcasts after the step. Nothing here is modelled: torch's classes run on the fake tensors."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardscope.core.engines.pytorch import runs_on_ddp
from shardscope.specs import Scenario
from shardscope.trace.compat import ddp_on_fake_tensors, rebuild_ddp_buckets
from shardscope.trace.setup import COMPUTE_DTYPES
from shardscope.trace.tracker import StepRecorder

# DDP rebuilds its buckets at the second forward (in gradient-ready order) and allocates them anew, so its steady
# state is the third step, as in the runtime (shardscope.validate.runner runs steps >= 3 for the same reason).
DDP_STEPS = 3


def uses_ddp(scenario: Scenario) -> bool:
    """ddp and zero1 run on DistributedDataParallel (zero1 with ZeroRedundancyOptimizer), as in the runtime."""
    return runs_on_ddp(scenario)


def materialise(root: nn.Module) -> None:
    """root.to_empty() on the fake device, with weights shared between modules (tied embeddings) shared again.

    to_empty gives every module a new Parameter when the tensor type changes (meta to fake), so a tied lm_head came
    out as one more tensor (tests/trace/test_ddp.py counts it once). fully_shard keeps the tie itself; a plain
    module, as DDP wraps it, does not.
    """
    names_by_param: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    root.to_empty(device="cpu")
    for first, *aliases in names_by_param.values():
        shared = root.get_parameter(first)
        for alias in aliases:
            module_name, _, attribute = alias.rpartition(".")
            setattr(root.get_submodule(module_name), attribute, shared)


def wrap_ddp(root: nn.Module, recorder: StepRecorder) -> nn.Module:
    """DistributedDataParallel over root's (fake, materialised) parameters, its buckets counted as buffers.

    The reducer's built-in all-reduce hook hands back the fake process group's empty result (None), which the
    reducer rejects; the hook registered instead is the same all-reduce written with DDP's comm-hook API (average
    in place, all-reduce the bucket, return it), so the collectives and buckets are DDP's own.
    """
    from torch.nn.parallel import DistributedDataParallel

    with ddp_on_fake_tensors():
        ddp = DistributedDataParallel(root)
    world = dist.get_world_size()

    # Unannotated: register_comm_hook rejects annotations other than dist.GradBucket and Future[Tensor] themselves,
    # and under `from __future__ import annotations` every annotation is a string.
    def all_reduce_hook(_state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        # The buckets live in the reducer (C++), allocated at construction and at the rebuild, where the tracker
        # does not count them; they are labelled the first time backward hands one out. The rebuilt buckets are
        # handed out in step 2's backward and reused after, so the measured step counts them from its start, once:
        # the reducer allocates no second bucket in backward (measured: a dispatch mode over a gloo run's backward
        # sees no new gradient-sized storage; the bucket it does see is the one DDP rebuilt in step 2's forward).
        recorder.label([buffer], "buffers")
        buffer.div_(world)
        dist.all_reduce(buffer)
        done = torch.futures.Future()  # type: ignore[var-annotated]
        done.set_result(buffer)
        return done

    ddp.register_comm_hook(None, all_reduce_hook)
    return ddp


def before_forward(model: nn.Module, recorder: StepRecorder) -> None:
    """DDP's bucket rebuild, done here (uncounted, like setup) so that DDP's own forward finds it done."""
    if not hasattr(model, "reducer"):
        return
    phase = recorder.phase
    recorder.phase = "setup"
    try:
        rebuild_ddp_buckets(model)
    finally:
        recorder.phase = phase


def forward_context(scenario: Scenario) -> contextlib.AbstractContextManager[Any]:
    """Autocast around forward and the loss for ddp and zero1 under mixed precision, as TorchDDP.autocast."""
    compute = COMPUTE_DTYPES.get(scenario.training.precision)
    if compute is None or not uses_ddp(scenario):
        return contextlib.nullcontext()
    return torch.autocast(device_type="cpu", dtype=compute)
