"""The data-parallel strategy of a scenario, and the tensor and context parallel degrees it runs beside."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardscope.choices import (
    ENGINES,
    OFFLOADS,
    STRATEGIES,
    EngineName,
    Offload,
    SpecError,
    StrategyName,
    require_choice,
    require_int,
)
from shardscope.mesh import DATA_PARALLEL_PRESETS, MAX_DEGREE, DataParallelPreset, canonical_strategy


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
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise SpecError(f"{owner}.sequence_parallel={self.sequence_parallel!r} must be true, false or unset")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError(f"{owner}.sequence_parallel=True needs tensor parallelism (tp > 1), not tp=1")
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
        return name + (f"+cp{self.cp}" if self.cp > 1 else "")

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
