"""Replay a pipeline with torch.distributed.pipelining on fake tensors, one pipeline rank at a time.

Each pipeline rank is traced as its own first global rank (pp is the outermost mesh axis): the fake process group
is made again with that rank, the reference model is cut to the rank's stages with core.pipeline's layer split
(torchtitan's), every block and the stage root are sharded with fully_shard over the data-parallel axes, and the
rank's PipelineStage(s) run torch's ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B for the scenario's
micro-batches.

The fake process group completes every send and recv without moving data; what the schedules need beyond that
(the first step's metadata vote, send Works that hold what they sent) is in `trace.pipeline_hooks`.

"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardscope.core.allocator import replay
from shardscope.core.pipeline import PipelineStage, rank_stages
from shardscope.reference_models import TransformerLM, build_model, lm_loss
from shardscope.specs import Scenario
from shardscope.trace.compat import (
    dtensor_shape_propagation,
    fake_tensor_mode,
    init_fake_process_group,
    storage_resize_hook,
)
from shardscope.trace.gpu_kernels import use_gpu_kernels
from shardscope.trace.pipeline_hooks import (
    receive_buffers,
    sends_held_by_their_works,
    static_warm_up,
    watch_loss,
    watch_messages,
    watch_phases,
)
from shardscope.trace.request import TraceRequest, pipeline_refusal
from shardscope.trace.result import FlopCount, StageTrace, TraceResult
from shardscope.trace.setup import COMPUTE_DTYPES, DTYPES, TraceSetupError, make_optimizer
from shardscope.trace.tracker import StepRecorder

Progress = Callable[[str], None]
SCHEDULE_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


class StageModule(TransformerLM):
    """One pipeline stage of a reference model: its blocks, the embeddings on the first stage, the final norm and
    the output head on the last (as torchtitan's pipeline_module_split keeps them, others set to None)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Token ids (first stage) or hidden states in, hidden states or logits (last stage) out."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)

        context = self._context(x.shape[1], x)
        for index, block in enumerate(self.layers):
            x = self._run_block(index, block, x, context)

        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x))  # type: ignore[no-any-return]


def cut_stage(whole: TransformerLM, stage: PipelineStage, first_layer: int) -> StageModule:
    """The stage's part of `whole` (its modules, not copies): blocks first_layer on, the embeddings and the head
    where the stage holds them."""
    module = StageModule.__new__(StageModule)
    nn.Module.__init__(module)
    module.spec, module.checkpointing = whole.spec, whole.checkpointing
    module.embed_tokens = whole.embed_tokens if stage.embedding else None  # type: ignore[assignment]
    module.layers = nn.ModuleList(whole.layers[first_layer : first_layer + stage.layers])
    module.norm = whole.norm if stage.head else None  # type: ignore[assignment]
    module.lm_head = whole.lm_head if stage.head else None  # type: ignore[assignment]
    return module


def build_stage(scenario: Scenario, stage: PipelineStage) -> StageModule:
    """The stage's module on the meta device."""
    training = scenario.training
    spec = replace(scenario.model, num_layers=max(1, stage.layers))  # a stage may hold no block (only the head)
    whole = build_model(spec, training, device="meta", dtype=DTYPES[training.precision], seed=None)
    module = cut_stage(whole, stage, 0)
    if scenario.cluster.gpu_kernels:
        use_gpu_kernels(module)
    return module


def pipeline_mesh(scenario: Scenario, device: str) -> Any:
    """The (pp, data-parallel) DeviceMesh: pp outermost, then dp, or hsdp's replicate and shard axes."""
    from torch.distributed.device_mesh import init_device_mesh

    world, pp = scenario.cluster.world_size, scenario.strategy.pp
    if scenario.strategy.preset.groups_replicate:
        group = scenario.shard_degree
        return init_device_mesh(device, (pp, world // pp // group, group), mesh_dim_names=("pp", "replicate", "shard"))
    return init_device_mesh(device, (pp, world // pp), mesh_dim_names=("pp", "dp"))


def data_parallel_mesh(mesh: Any, scenario: Scenario) -> Any:
    """The data-parallel axes of `pipeline_mesh`, which fully_shard shards a stage over."""
    return mesh[("replicate", "shard")] if scenario.strategy.preset.groups_replicate else mesh["dp"]


def shard_stages(modules: list[StageModule], scenario: Scenario, dp_mesh: Any) -> bool:
    """fully_shard every block and each stage's root over the data-parallel axes, under the precision's policy;
    returns reshard_after_forward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute = COMPUTE_DTYPES.get(scenario.training.precision)
    policy = (
        MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
    )
    reshard = scenario.strategy.reshard_after_forward and scenario.strategy.stage == 3
    for module in modules:
        for block in module.layers:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    return reshard


def make_schedule(
    scenario: Scenario, stages: tuple[PipelineStage, ...], modules: list[StageModule], device: Any, group: Any
) -> tuple[list[Any], Any]:
    """torch's PipelineStage for each of the rank's stages, given static input and output shapes (micro-batch x
    sequence, hidden states or token ids in, hidden states or logits out), and the scenario's schedule over them."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import schedules

    training, strategy = scenario.training, scenario.strategy
    batch, seq, hidden = training.micro_batch_size, training.sequence_length, scenario.model.hidden_size
    act_dtype = COMPUTE_DTYPES.get(training.precision) or DTYPES[training.precision]
    made = []
    for stage, module in zip(stages, modules, strict=True):
        inputs = (
            torch.empty(batch, seq, dtype=torch.long, device=device)
            if stage.embedding
            else torch.empty(batch, seq, hidden, dtype=act_dtype, device=device, requires_grad=True)
        )
        width = scenario.model.vocab_size if stage.head else hidden
        outputs = torch.empty(batch, seq, width, dtype=act_dtype, device=device, requires_grad=True)
        made.append(
            TorchStage(
                module,
                stage.index,
                strategy.pipeline_stages,
                device,
                input_args=inputs,
                output_args=outputs,
                group=group,
            )
        )
    schedule_class = getattr(schedules, SCHEDULE_NAMES[strategy.pp_schedule])
    micro_batches = training.grad_accum_steps
    if strategy.pp_schedule == "interleaved-1f1b":
        return made, schedule_class(made, n_microbatches=micro_batches, loss_fn=lm_loss)
    return made, schedule_class(made[0], n_microbatches=micro_batches, loss_fn=lm_loss)


@dataclass(slots=True)
class _RankTrace:
    result: TraceResult
    stage: StageTrace


def trace_pipeline_rank(request: TraceRequest, pp_rank: int, progress: Progress) -> _RankTrace:
    """Replay the steady-state step of pipeline rank `pp_rank` (as the first global rank of its group)."""
    scenario = request.scenario
    strategy, training = scenario.strategy, scenario.training
    mesh = pipeline_mesh(scenario, "cpu")
    stages = rank_stages(scenario, pp_rank)
    progress(f"pipeline rank {pp_rank}: building {', '.join(stage.described for stage in stages)}")
    gc.collect()
    modules = [build_stage(scenario, stage) for stage in stages]
    reshard = shard_stages(modules, scenario, data_parallel_mesh(mesh, scenario))
    recorder = StepRecorder(backend=scenario.cluster.backend)
    recorder.collectives.name_axes(mesh)
    batch, seq = training.micro_batch_size, training.sequence_length
    micro_batches = training.grad_accum_steps
    with ExitStack() as stack:
        stack.enter_context(fake_tensor_mode())
        stack.enter_context(storage_resize_hook(recorder.on_resize))
        stack.enter_context(dtensor_shape_propagation(recorder.unrecorded))
        stack.enter_context(recorder)
        stack.enter_context(sends_held_by_their_works())
        for module in modules:
            module.to_empty(device="cpu")
        torch_stages, schedule = make_schedule(scenario, stages, modules, torch.device("cpu"), mesh.get_group("pp"))
        for made in torch_stages:
            watch_messages(made, recorder.collectives.message_phases)
            watch_phases(made, recorder, pp_rank, progress)
        static_warm_up(schedule)
        watch_loss(schedule, recorder)
        params = [param for module in modules for param in module.parameters()]
        optimizer = make_optimizer(_Params(params), scenario)
        recorder.label(params, "parameters")
        first, last = any(s.embedding for s in stages), any(s.head for s in stages)
        for step in range(request.steps):
            if step == request.steps - 1:
                recorder.start_window()
            recorder.phase, recorder.where = "setup" if step == 0 else "forward", "schedule"
            ids = torch.randint(0, scenario.model.vocab_size, (batch * micro_batches, seq)) if first else None
            targets = torch.randint(0, scenario.model.vocab_size, (batch * micro_batches, seq)) if last else None
            args = (ids,) if first else ()
            schedule.step(*args, target=targets, return_outputs=False)
            if step == 0:
                recorder.label(receive_buffers(torch_stages), "buffers")
            recorder.label([p.grad for p in params if p.grad is not None], "gradients")
            recorder.phase, recorder.where = "optimizer", "optimizer step"
            progress(f"pipeline rank {pp_rank}: step {step + 1}/{request.steps} optimizer")
            optimizer.step()
            recorder.label(_optimizer_state(optimizer), "optimizer_state")
            optimizer.zero_grad(set_to_none=True)
            recorder.label(params, "parameters")
        recorder.recording = False
        peak = recorder.peak
    per_rank = recorder.breakdown()
    rows = recorder.collectives.merged()
    moment = f"{peak.phase}: {peak.where}"
    device_bytes = scenario.cluster.gpu.memory_bytes - scenario.overheads.context_bytes
    reserved = replay(recorder.events, window_start=recorder.window_event, device_bytes=device_bytes)
    result = TraceResult(
        world_size=request.world_size,
        strategy=strategy.name,
        engine=f"torch.distributed.pipelining {SCHEDULE_NAMES[strategy.pp_schedule]} + torch fully_shard "
        f"(reshard_after_forward={reshard})",
        per_rank=per_rank,
        peak_moment=moment,
        peak_by_category=tuple(peak.at_peak.items()),
        ledger=rows,
        flops=FlopCount(forward_flops=0, backward_flops=0, optimizer_flops=0, attention_formula_flops=0),
        per_module=(),
        reserved_peak_bytes=reserved.reserved_peak_bytes,
    )
    stage_trace = StageTrace(
        pipeline_rank=pp_rank,
        stages=tuple(stage.described for stage in stages),
        layers=sum(stage.layers for stage in stages),
        per_rank=per_rank,
        peak_moment=moment,
        ledger=rows,
        reserved_peak_bytes=reserved.reserved_peak_bytes,
    )
    return _RankTrace(result=result, stage=stage_trace)


class _Params(nn.Module):
    """Holds a list of parameters so make_optimizer can take them from one module."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.held = nn.ParameterList(params)


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def run_pipeline_trace(request: TraceRequest, progress: Progress) -> TraceResult:
    """Trace every pipeline rank in turn; the result is the busiest rank's, with every rank in per_stage."""
    import torch.distributed as dist

    refusal = pipeline_refusal(request)
    if refusal:
        raise TraceSetupError(refusal)
    started = time.monotonic()
    scenario = request.scenario
    world, pp = scenario.cluster.world_size, scenario.strategy.pp
    traces = []
    for pp_rank in range(pp):
        init_fake_process_group(world, pp_rank * (world // pp))
        traces.append(trace_pipeline_rank(request, pp_rank, progress))
        dist.destroy_process_group()
    peaks = [trace.stage.per_rank.peak_bytes for trace in traces]
    busiest = traces[peaks.index(max(peaks))]
    return replace(
        busiest.result,
        per_stage=tuple(trace.stage for trace in traces),
        elapsed_s=time.monotonic() - started,
        notes=("FLOPs are not counted in a pipeline trace",),
    )
