"""The data-parallel strategy of a scenario, and the tensor, context and pipeline parallel degrees it runs beside."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shardscope.choices import (
    ENGINES,
    OFFLOADS,
    PIPELINE_SCHEDULES,
    STRATEGIES,
    EngineName,
    Offload,
    PipelineSchedule,
    SpecError,
    StrategyName,
    require_choice,
    require_int,
)
from shardscope.mesh import DATA_PARALLEL_PRESETS, MAX_DEGREE, DataParallelPreset, canonical_strategy

if TYPE_CHECKING:
    from shardscope.specs import ModelSpec


DEFAULT_VIRTUAL_STAGES = 2
"""Stages per rank of a multi-stage schedule when not given: torchtitan's `_get_pipeline_metadata` falls back to
`stages_per_rank = 1 if is_single_stage_schedule else 2` (torchtitan/distributed/pipeline_parallel.py at commit
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    """How the data-parallel ranks split the model states, and whose memory rules apply."""

    name: StrategyName
    """'ddp', 'zero1', 'zero2', 'zero3', 'fsdp' (read as zero3) or 'hsdp'."""
    engine: EngineName = "pytorch"
    """Whose accounting: 'paper' (the ZeRO paper), 'pytorch' (DDP, ZeroRedundancyOptimizer, FSDP2) or 'deepspeed'."""
    shard_group: int = 0
    """hsdp only: ranks in one shard group; groups replicate each other."""
    offload: Offload = "none"
    """'none', 'optimizer' (optimizer state on the host) or 'optimizer+params' (zero3/hsdp: parameters too)."""
    bucket_bytes: int = 25 * 1024 * 1024
    """Gradient bucket size for DDP's all-reduce (torch's default is 25 MiB)."""
    reshard_after_forward: bool = True
    """zero3/hsdp under FSDP2: free gathered parameters after forward (False keeps them until backward)."""
    gradient_as_bucket_view: bool = False
    """DDP: gradients are views into the buckets, so the bucket copy costs no extra memory."""
    tp: int = 1
    """Tensor parallel degree: GPUs that split each layer's weights (Megatron's column- and row-parallel linears,
    innermost in the mesh, inside a node). The data-parallel strategy applies over the world divided by tp x cp."""
    cp: int = 1
    """Context parallel degree: GPUs that split each sequence (ring attention over 2 x cp chunks)."""
    sequence_parallel: bool | None = None
    """Sequence parallelism in the norms and the residual stream between tp ranks ("Reducing Activation
    Recomputation in Large Transformer Models", Section 4.2); None: on whenever tp > 1."""
    pp: int = 1
    """Pipeline parallel degree: GPUs that each hold consecutive layers (outermost in the mesh); the gradient
    accumulation steps become the pipeline's micro-batches."""
    pp_schedule: PipelineSchedule = "1f1b"
    """The pipeline's order of micro-batches: 'gpipe', '1f1b' or 'interleaved-1f1b' (torch.distributed.pipelining)."""
    pp_virtual_stages: int = 0
    """interleaved-1f1b only: stages per pipeline rank (0: unset, which means 2, torchtitan's default)."""
    pp_layers: tuple[int, ...] = ()
    """Transformer layers of each pipeline stage, first to last (pp x virtual stages of them); empty: torchtitan's
    default split (`shardscope.core.pipeline.default_layer_split`)."""
    ep: int = 1
    """Expert parallel degree (mixture-of-experts models): GPUs that split each MoE layer's experts, borrowed from
    the data-parallel shard and context-parallel GPUs, as torchtitan's ParallelDims borrows them."""

    def __post_init__(self) -> None:
        owner = "Strategy"
        require_choice(owner, "name", self.name, STRATEGIES)
        require_choice(owner, "engine", self.engine, ENGINES)
        require_choice(owner, "offload", self.offload, OFFLOADS)
        require_int(owner, "bucket_bytes", self.bucket_bytes, 1)
        if self.preset.groups_replicate:
            require_int(owner, "shard_group", self.shard_group, 1, MAX_DEGREE)
        elif self.shard_group:
            raise SpecError(
                f"{owner}.shard_group={self.shard_group} is only used by hsdp; leave it unset for {self.name}"
            )
        require_int(owner, "tp", self.tp, 1, MAX_DEGREE)
        require_int(owner, "cp", self.cp, 1, MAX_DEGREE)
        require_int(owner, "ep", self.ep, 1, MAX_DEGREE)
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise SpecError(f"{owner}.sequence_parallel={self.sequence_parallel!r} must be true, false or unset")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError(f"{owner}.sequence_parallel=True needs tensor parallelism (tp > 1), not tp=1")
        _require_pipeline(self)
        if self.offload == "optimizer+params" and self.stage < 3:
            raise SpecError(
                f"{owner}.offload='optimizer+params' needs sharded parameters (zero3, fsdp or hsdp), not {self.name}"
            )

    @property
    def canonical_name(self) -> StrategyName:
        """'fsdp' is another name for 'zero3'."""
        return canonical_strategy(self.name)

    @property
    def uses_sequence_parallel(self) -> bool:
        """Sequence parallelism is on: asked for, or left unset with tp > 1."""
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def label(self) -> str:
        """The strategy as printed: its name, an hsdp's shard group and the model-parallel degrees above 1, e.g.
        'hsdp(8)' or 'fsdp+tp4+cp2'."""
        name = f"{self.name}({self.shard_group})" if self.preset.groups_replicate else self.name
        if self.tp > 1:
            name += f"+tp{self.tp}" + ("" if self.uses_sequence_parallel else "(no-sp)")
        name += f"+cp{self.cp}" if self.cp > 1 else ""
        name += f"+ep{self.ep}" if self.ep > 1 else ""
        if self.pp > 1:
            virtual = f",v{self.virtual_stages}" if self.pp_schedule == "interleaved-1f1b" else ""
            name += f"+pp{self.pp}({self.pp_schedule}{virtual})"
        return name

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per pipeline rank: pp_virtual_stages (2 when unset) under interleaved-1f1b, else 1."""
        if self.pp_schedule != "interleaved-1f1b":
            return 1
        return self.pp_virtual_stages or DEFAULT_VIRTUAL_STAGES

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages in all: pp x virtual stages."""
        return self.pp * self.virtual_stages

    def sibling(self, name: StrategyName, shard_group: int) -> Strategy:
        """The strategy `name` with this one's other settings, for a side-by-side comparison: `shard_group` when
        `name` splits into groups, and parameter offload kept only where parameters are sharded."""
        preset = DATA_PARALLEL_PRESETS[name]
        offload = self.offload
        if offload == "optimizer+params" and preset.zero_stage < 3:
            offload = "optimizer"
        return replace(self, name=name, shard_group=shard_group if preset.groups_replicate else 0, offload=offload)

    @property
    def preset(self) -> DataParallelPreset:
        """What the strategy's name means in mesh degrees."""
        return DATA_PARALLEL_PRESETS[self.name]

    @property
    def stage(self) -> int:
        """ZeRO stage: 0 for ddp, 1 to 3, and 3 for hsdp inside a group."""
        return DATA_PARALLEL_PRESETS[self.name].zero_stage


def _require_pipeline(strategy: Strategy) -> None:
    """SpecError naming the values when the pipeline settings contradict each other (the model's layers and the
    micro-batches are checked by `Scenario`)."""
    owner = "Strategy"
    require_int(owner, "pp", strategy.pp, 1, MAX_DEGREE)
    require_choice(owner, "pp_schedule", strategy.pp_schedule, PIPELINE_SCHEDULES)
    require_int(owner, "pp_virtual_stages", strategy.pp_virtual_stages, 0, MAX_DEGREE)
    if strategy.pp_virtual_stages and strategy.pp_schedule != "interleaved-1f1b":
        raise SpecError(
            f"{owner}.pp_virtual_stages={strategy.pp_virtual_stages} needs pp_schedule='interleaved-1f1b', "
            f"not {strategy.pp_schedule!r}"
        )
    if strategy.pp_schedule == "interleaved-1f1b" and strategy.pp_virtual_stages == 1:
        # torchtitan: "Multi-stage schedule requires at least 2 stages per rank" (_get_pipeline_metadata).
        raise SpecError(f"{owner}.pp_virtual_stages=1: interleaved-1f1b needs at least 2 stages per pipeline rank")
    if isinstance(strategy.pp_layers, list):  # read back from JSON (a trace request)
        object.__setattr__(strategy, "pp_layers", tuple(strategy.pp_layers))
    if not isinstance(strategy.pp_layers, tuple):
        raise SpecError(f"{owner}.pp_layers={strategy.pp_layers!r} must be a tuple of whole numbers")
    for layers in strategy.pp_layers:
        require_int(owner, "pp_layers", layers, 0, MAX_DEGREE)
    if strategy.pp_layers and len(strategy.pp_layers) != strategy.pipeline_stages:
        raise SpecError(
            f"{owner}.pp_layers has {len(strategy.pp_layers)} stages "
            f"({','.join(map(str, strategy.pp_layers))}), not pp {strategy.pp} x virtual stages "
            f"{strategy.virtual_stages} = {strategy.pipeline_stages}"
        )


def require_model_parallel_shape(model: ModelSpec, sequence_length: int, strategy: Strategy) -> None:
    """SpecError naming the values when tp does not divide the heads, the KV heads, the FFN width or the
    vocabulary, or cp does not split the sequence into 2 x cp equal chunks (load-balanced ring attention)."""
    if not model.has_shape:
        raise SpecError(
            f"Strategy.tp={strategy.tp}, cp={strategy.cp} needs the model's shape; {model.name!r} has only a "
            f"parameter count (give --model or --config)"
        )
    tp = strategy.tp
    for name in ("num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size"):
        value = getattr(model, name)
        if value % tp:
            raise SpecError(f"Strategy.tp={tp} must divide {model.name}'s {name}={value}")
    cp, sequence = strategy.cp, sequence_length
    if sequence % (2 * cp):
        raise SpecError(
            f"Strategy.cp={cp} must split sequence_length={sequence} into 2 x cp = {2 * cp} equal chunks "
            f"(load-balanced ring attention)"
        )
    if strategy.uses_sequence_parallel and sequence % (tp * cp):
        raise SpecError(
            f"sequence parallelism splits each rank's {sequence // cp} tokens over tp={tp}: sequence_length={sequence} "
            f"must be a multiple of cp x tp = {cp * tp}"
        )


def require_pipeline_shape(model: ModelSpec, micro_batches: int, strategy: Strategy) -> None:
    """SpecError naming the values when the model's layers cannot fill the pipeline's stages, `pp_layers` does not
    add up to them, or the micro-batches (the gradient accumulation steps) break a constraint that torch's schedule
    imposes (torch/distributed/pipelining/schedules.py, torch 2.13): Schedule1F1B refuses fewer micro-batches than
    stages; ScheduleInterleaved1F1B runs rounds of max(1, m // pp) and needs m to be a multiple of their number;
    ScheduleGPipe takes any m."""
    pp, stages = strategy.pp, strategy.pipeline_stages
    if not model.has_shape:
        raise SpecError(
            f"Strategy.pp={pp} splits the model's layers; {model.name!r} has only a parameter count (give --model or "
            f"--config)"
        )
    layers = model.num_layers
    if stages > layers:
        raise SpecError(
            f"pp {pp} x virtual stages {strategy.virtual_stages} = {stages} pipeline stages is more than "
            f"{model.name}'s {layers} layers"
        )
    if strategy.pp_layers and sum(strategy.pp_layers) != layers:
        raise SpecError(
            f"Strategy.pp_layers={','.join(map(str, strategy.pp_layers))} adds up to {sum(strategy.pp_layers)} "
            f"layers, not {model.name}'s {layers}"
        )
    if strategy.pp_schedule == "1f1b" and micro_batches < pp:
        raise SpecError(
            f"1f1b needs at least as many micro-batches as stages (torch's Schedule1F1B): grad_accum_steps="
            f"{micro_batches} < pp={pp}"
        )
    rounds = max(1, micro_batches // pp)
    if strategy.pp_schedule == "interleaved-1f1b" and micro_batches % rounds:
        raise SpecError(
            f"interleaved-1f1b runs max(1, m // pp) = {rounds} rounds (torch's ScheduleInterleaved1F1B): "
            f"grad_accum_steps={micro_batches} must be a multiple of {rounds}"
        )


def require_expert_shape(model: ModelSpec, strategy: Strategy) -> None:
    """SpecError naming the values when expert parallelism is asked of a model without experts, or ep does not
    divide the experts of an MoE layer (each rank holds num_experts / ep of them)."""
    if model.family != "moe":
        raise SpecError(
            f"Strategy.ep={strategy.ep} splits mixture-of-experts layers; {model.name!r} is a {model.family!r} model "
            f"without experts"
        )
    if model.num_experts % strategy.ep:
        raise SpecError(f"Strategy.ep={strategy.ep} must divide {model.name}'s num_experts={model.num_experts}")
