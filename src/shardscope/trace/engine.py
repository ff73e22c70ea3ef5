"""Replay training steps of rank 0 on fake tensors over a fake process group, in this process.

Run it through shardscope.trace.runner (one subprocess per scenario, with a time limit); this module is the
subprocess's body. The last of the steps is the steady state reported: the first one allocates optimizer state and
FSDP's persistent buffers.
"""

from __future__ import annotations

import gc
import pickle
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from shardscope.choices import checkpoint_every
from shardscope.core.allocator import replay
from shardscope.core.memory_snapshot import memory_snapshot
from shardscope.measure.storage import storage_bytes
from shardscope.specs import Scenario
from shardscope.trace.compat import (
    dtensor_shape_propagation,
    fake_tensor_mode,
    init_fake_process_group,
    require_torch,
    storage_resize_hook,
)
from shardscope.trace.ddp import DDP_STEPS, before_forward, forward_context, materialise, uses_ddp, wrap_ddp
from shardscope.trace.extrapolate import DepthTrace, extrapolate
from shardscope.trace.flops import attention_flops, flop_counter, module_flops
from shardscope.trace.request import TraceRequest
from shardscope.trace.result import FlopCount, ModuleRow, TraceResult
from shardscope.trace.setup import (
    TracedModel,
    TraceSetupError,
    apply_strategy,
    build_traced_model,
    make_optimizer,
    model_depth,
)
from shardscope.trace.tensor_parallel import loss_context, torch_model_parallel_refusal
from shardscope.trace.tracker import StepRecorder

Progress = Callable[[str], None]


def _units(root: nn.Module, blocks: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The blocks, and every module outside them that owns parameters directly, in forward order of creation."""
    block_ids = {id(block) for block in blocks}
    units: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in root.named_modules():
        if id(module) in block_ids:
            units.append((name, module))
            inside.update(id(sub) for sub in module.modules())
        elif id(module) not in inside and any(True for _ in module.parameters(recurse=False)):
            units.append((name or "(root)", module))
    return units


class _UnitWatch:
    """Hooks that tell the recorder where it is (for the peak moment) and what each unit's forward left alive."""

    def __init__(self, recorder: StepRecorder, units: list[tuple[str, nn.Module]], progress: Progress) -> None:
        self.recorder, self.progress = recorder, progress
        self.activations: dict[str, int] = {}
        self._before: dict[str, int] = {}
        self.handles = []
        for index, (name, module) in enumerate(units):
            self.handles.append(module.register_forward_pre_hook(self._pre(name, index, len(units))))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str, index: int, total: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            if self.recorder.phase == "forward":
                self.recorder.where = name
                self._before[name] = self.recorder.live["activations"]
                self.progress(f"forward {name} ({index + 1}/{total})")

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def set_where(_grad: torch.Tensor) -> None:
            self.recorder.where = name

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self.recorder.phase != "forward":
                return
            self.activations[name] = self.recorder.live["activations"] - self._before.get(name, 0)
            tensor = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                tensor = output[0]
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(set_where)

        return hook


def run_trace(request: TraceRequest, progress: Progress = lambda _text: None) -> TraceResult:
    """Trace rank 0 of the request's scenario; raises on a model that cannot run on fake tensors.

    A model deeper than request.traced_blocks is traced cut to traced_blocks - 1 and traced_blocks blocks, in this
    process, and extrapolated to its depth (shardscope.trace.extrapolate says why that is exact). Not ddp and zero1:
    DDP's buckets (25 MiB each) and ZeroRedundancyOptimizer's partition (largest tensors first, to the least loaded
    rank) do not grow by the same amount per block, so their models are traced whole; so are models under 'every:N'
    with N > 1, whose blocks are not identical (only every N-th is checkpointed).
    """
    started = time.monotonic()
    require_torch()
    if request.scenario.strategy.pp > 1:
        from shardscope.trace.pipeline import run_pipeline_trace

        return run_pipeline_trace(request, progress)
    refuse_model_parallel(request)
    init_fake_process_group(request.world_size)
    depth = model_depth(request)
    wanted = request.traced_blocks
    result: TraceResult | None = None
    identical_blocks = checkpoint_every(request.scenario.training.checkpointing) <= 1
    extrapolate_ok = identical_blocks and not uses_ddp(request.scenario) and not request.memory_snapshot
    if depth is not None and wanted and depth > wanted and extrapolate_ok:
        shallow = _trace_depth(request, wanted - 1, progress)
        deep = _trace_depth(request, wanted, progress)
        if shallow is not None and deep is not None:
            result = extrapolate(shallow, deep, depth)
    if result is None:
        full = _trace_depth(request, None, progress, flat=True)
        assert full is not None  # flat traces always return
        result = full.result
    return replace(result, elapsed_s=time.monotonic() - started)


def _trace_depth(
    request: TraceRequest, num_blocks: int | None, progress: Progress, flat: bool = False
) -> DepthTrace | None:
    """One trace of the model (cut to num_blocks blocks); None when its blocks are not named prefix0..prefixN-1,
    unless flat (then the result is returned without what extrapolation needs)."""
    scenario = request.scenario
    label = "" if num_blocks is None else f" ({num_blocks} blocks)"
    progress(f"building the model on the meta device{label}")
    gc.collect()  # the previous depth's model and its FSDP reference cycles must not be freed mid-step
    traced = build_traced_model(request, num_blocks)
    prefix = _block_prefix(traced)
    if prefix is None and not flat:
        return None
    engine = apply_strategy(traced, scenario)
    recorder = StepRecorder(backend=scenario.cluster.backend)
    if traced.mesh is not None:
        recorder.collectives.name_axes(traced.mesh)
    units = _units(traced.root, traced.blocks)
    watch = _UnitWatch(recorder, units, progress)
    counters = {phase: flop_counter() for phase in ("forward", "backward", "optimizer")}
    with ExitStack() as stack:
        stack.enter_context(fake_tensor_mode())
        stack.enter_context(storage_resize_hook(recorder.on_resize))
        stack.enter_context(dtensor_shape_propagation(recorder.unrecorded))
        stack.enter_context(recorder)
        if uses_ddp(scenario):
            materialise(traced.root)
            model = wrap_ddp(traced.root, recorder)
        else:
            traced.root.to_empty(device="cpu")
            model = traced.root
        steps = max(request.steps, DDP_STEPS) if uses_ddp(scenario) else request.steps
        # DTensor works out each op's global output shape on fake tensors the first time it meets the op (its
        # sharding propagation, cached after): ops of the whole model's size that the counter would take for the
        # rank's. Under tensor parallelism FLOPs are counted in the second step, after that cache is warm.
        flops_step = 1 if scenario.strategy.tp > 1 else 0
        steps = max(steps, flops_step + 2)
        params = [param for param in traced.root.parameters()]
        optimizer = make_optimizer(traced.root, scenario)
        recorder.label(params, "parameters")
        for step in range(steps):
            last = step == steps - 1
            # FLOPs are counted in an early step, memory in the last: FlopCounterMode decomposes composite ops
            # (silu_backward into five element-wise ops, say), which changes what a step allocates.
            counting = step == flops_step
            if last:
                recorder.start_window()
            for micro in range(scenario.training.grad_accum_steps):
                before_forward(model, recorder)
                recorder.phase, recorder.where = "forward", "forward"
                progress(f"step {step + 1}/{steps}{label} micro-batch {micro + 1}: forward")
                inputs, targets = traced.make_batch()
                with counters["forward"] if counting else ExitStack(), forward_context(scenario):
                    outputs = model(inputs)
                    recorder.phase, recorder.where = "loss", "loss"
                    with loss_context(scenario):
                        loss = traced.loss(outputs, targets)
                del outputs
                recorder.end_forward(loss)
                recorder.phase, recorder.where = "backward", "backward"
                progress(f"step {step + 1}/{steps}{label}: backward")
                with counters["backward"] if counting else ExitStack(), loss_context(scenario):
                    loss.backward()
                del loss
            recorder.label([p.grad for p in params if p.grad is not None], "gradients")
            recorder.phase, recorder.where = "optimizer", "optimizer step"
            progress(f"step {step + 1}/{steps}{label}: optimizer")
            with counters["optimizer"] if counting else ExitStack():
                optimizer.step()
            state = _optimizer_state(optimizer)
            recorder.label(state, "optimizer_state")
            optimizer.zero_grad(set_to_none=True)
            recorder.label(params, "parameters")
        recorder.recording = False
        peak = recorder.peak
        per_rank = recorder.breakdown()
        root_name = type(traced.root).__name__
        flops_by_module: dict[str, int] = {}
        for counter in counters.values():
            for name, count in module_flops(counter, root_name).items():
                flops_by_module[name] = flops_by_module.get(name, 0) + count
        rows = tuple(
            ModuleRow(
                name=name,
                parameters_bytes=storage_bytes(list(module.parameters(recurse=module in traced.blocks))),
                activations_bytes=watch.activations.get(name, 0),
                flops=flops_by_module.get(name, 0),
            )
            for name, module in units
        )
    flops = FlopCount(
        forward_flops=counters["forward"].get_total_flops(),
        backward_flops=counters["backward"].get_total_flops(),
        optimizer_flops=counters["optimizer"].get_total_flops(),
        attention_formula_flops=sum(attention_flops(counter) for counter in counters.values()),
    )
    result = TraceResult(
        world_size=request.world_size,
        strategy=scenario.strategy.name,
        engine=engine,
        per_rank=per_rank,
        peak_moment=f"{peak.phase}: {peak.where}",
        peak_by_category=tuple(peak.at_peak.items()),
        ledger=recorder.ledger(),
        flops=flops,
        per_module=rows,
        notes=tuple(traced.engine_notes),
        reserved_peak_bytes=replay(
            recorder.events, window_start=recorder.window_event, device_bytes=_allocatable_bytes(scenario)
        ).reserved_peak_bytes,
    )
    if request.memory_snapshot:
        with open(request.memory_snapshot, "wb") as file:
            pickle.dump(memory_snapshot(recorder.events, device_bytes=_allocatable_bytes(scenario)), file)
    return DepthTrace(
        blocks=len(traced.blocks), block_prefix=prefix or "", result=result, moments=tuple(recorder.moments.values())
    )


def refuse_model_parallel(request: TraceRequest) -> None:
    """TraceSetupError, in one line, for the tensor and context parallelism the trace cannot replay; the remedy
    named is one the trace's command line has (not --engine paper, which it refuses)."""
    strategy = request.scenario.strategy
    if (strategy.tp > 1 or strategy.cp > 1) and (request.factory or request.implementation == "hf"):
        source = "--module" if request.factory else "--implementation hf"
        flags = " ".join(
            f"--{axis} {degree}" for axis, degree in (("tp", strategy.tp), ("cp", strategy.cp)) if degree > 1
        )
        raise TraceSetupError(
            f"{flags} with {source}: the trace splits shardscope's reference modules only "
            "(--model); use `shardscope estimate` for this model"
        )
    refusal = torch_model_parallel_refusal(request.scenario)
    if refusal:
        raise TraceSetupError(f"{refusal}; `shardscope estimate` predicts it")


def _allocatable_bytes(scenario: Scenario) -> int:
    """What the caching allocator can take from the GPU: its memory less the framework context assumed outside it."""
    return scenario.cluster.gpu.memory_bytes - scenario.overheads.context_bytes


def _block_prefix(traced: TracedModel) -> str | None:
    """'layers.' when the blocks are the units 'layers.0', 'layers.1', ... in order; else None."""
    block_ids = {id(block): index for index, block in enumerate(traced.blocks)}
    names = [name for name, module in traced.root.named_modules() if id(module) in block_ids]
    if not names or not names[0].endswith(".0"):
        return None
    prefix = names[0][:-1]
    return prefix if names == [f"{prefix}{index}" for index in range(len(names))] else None


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    return [value for state in inner.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
