"""Parallelism as the degrees of a device mesh, as torchtitan's ParallelDims has it, and the data-parallel strategy
names as presets over the data-parallel degrees.

A job of W GPUs is a mesh `pp x dp_replicate x dp_shard x cp x tp` (outermost first; tp innermost, inside a node)
whose product is W. Expert parallelism does not add GPUs: as in torchtitan, its `ep` ranks are borrowed from
`dp_shard x cp`, so ep must divide that product; under DDP, which shards nothing, from `dp_replicate x cp`
(`Parallelism.expert_lenders`). DDP, ZeRO-1/2/3, FSDP and HSDP differ only in how the
data-parallel GPUs are split (replicate or shard, and over which degree) and in what the shard degree shards (the ZeRO
stage): see `DATA_PARALLEL_PRESETS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shardscope.choices import SpecError, StrategyName

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh dimensions that multiply to the world size, outermost first (their names are the degrees' names)."""
MAX_DEGREE = 10**6


class MeshError(SpecError):
    """Degrees that do not form a mesh of the GPUs given; the message names the degrees and their values."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DataParallelPreset:
    """What a data-parallel strategy name means in degrees."""

    zero_stage: int
    """What the shard degree shards: 0 nothing (DDP), 1 the optimizer state, 2 also the gradients, 3 also the
    parameters ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Section 5)."""
    shards: bool
    """The data-parallel GPUs form one shard group (False: they all replicate, as DDP)."""
    groups_replicate: bool
    """Shard groups of a given size replicate each other (HSDP); False: one group of every data-parallel GPU."""

    @property
    def full_shard(self) -> bool:
        """Parameters, gradients and optimizer state sharded over every data-parallel GPU (ZeRO-3, FSDP)."""
        return self.zero_stage == 3 and not self.groups_replicate


DATA_PARALLEL_PRESETS: dict[StrategyName, DataParallelPreset] = {
    "ddp": DataParallelPreset(zero_stage=0, shards=False, groups_replicate=False),
    "zero1": DataParallelPreset(zero_stage=1, shards=True, groups_replicate=False),
    "zero2": DataParallelPreset(zero_stage=2, shards=True, groups_replicate=False),
    "zero3": DataParallelPreset(zero_stage=3, shards=True, groups_replicate=False),
    "fsdp": DataParallelPreset(zero_stage=3, shards=True, groups_replicate=False),
    "hsdp": DataParallelPreset(zero_stage=3, shards=True, groups_replicate=True),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """The degrees of the device mesh one job runs on."""

    dp_replicate: int = 1
    """Data-parallel GPUs that hold the same states and average gradients (DDP; HSDP across shard groups)."""
    dp_shard: int = 1
    """Data-parallel GPUs that split the states their ZeRO stage shards (ZeRO-1/2/3, FSDP; HSDP inside a group)."""
    cp: int = 1
    """Context parallel: GPUs that split each sequence (ring attention)."""
    tp: int = 1
    """Tensor parallel: GPUs that split each layer's weights (innermost, inside a node)."""
    pp: int = 1
    """Pipeline parallel: GPUs that each hold a stage of consecutive layers."""
    ep: int = 1
    """Expert parallel: GPUs that split a mixture-of-experts layer's experts, borrowed from `expert_lenders`."""

    def __post_init__(self) -> None:
        for name in (*MESH_DIMS, "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DEGREE:
                raise MeshError(f"parallelism {name}={value!r} must be a whole number between 1 and {MAX_DEGREE}")
        if self.expert_lenders % self.ep:
            lender = "dp_shard" if self.dp_shard > 1 else "dp_replicate"
            raise MeshError(
                f"ep {self.ep} must divide {lender} {getattr(self, lender)} x cp {self.cp} = {self.expert_lenders} "
                f"(expert parallelism borrows those GPUs)"
            )

    @property
    def expert_lenders(self) -> int:
        """The GPUs expert parallelism borrows its ep ranks from: dp_shard x cp, as torchtitan's ParallelDims; where
        no GPU shards (dp_shard 1: DDP), dp_replicate x cp, as DeepSpeed-MoE carves its expert-parallel groups out of
        the data-parallel ranks whatever the ZeRO stage (microsoft/DeepSpeed, deepspeed/utils/groups.py,
        `_create_expert_and_data_parallel`)."""
        return (self.dp_shard if self.dp_shard > 1 else self.dp_replicate) * self.cp

    @property
    def world_size(self) -> int:
        """GPUs in the mesh: the product of the degrees (ep borrows, it does not add)."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """GPUs that see different data: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def described(self) -> str:
        """The mesh as printed, outermost first: the data-parallel degrees always, the others where they split the
        GPUs, e.g. 'dp_replicate 1 x dp_shard 4 x cp 2 x tp 4'."""
        used = [(name, getattr(self, name)) for name in MESH_DIMS if name.startswith("dp_") or getattr(self, name) > 1]
        return " x ".join(f"{name} {value}" for name, value in used)

    @property
    def splits_model(self) -> bool:
        """Tensor, context or pipeline parallelism splits the model (the mesh is more than data-parallel)."""
        return self.tp * self.cp * self.pp > 1

    def require_world_size(self, gpus: int) -> None:
        """MeshError naming every degree above 1 when their product is not `gpus`."""
        if self.world_size != gpus:
            raise MeshError(f"{self.described} = {self.world_size}, not the {gpus} GPUs given")

    def to_json(self) -> dict[str, Any]:
        """The six degrees as a JSON object."""
        return {name: getattr(self, name) for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}


def comparable_strategies(grouped: bool) -> tuple[StrategyName, ...]:
    """One strategy per preset (fsdp is zero3), for a side-by-side comparison; the presets that split the GPUs into
    replicating groups (hsdp) only when `grouped` (a shard group is given, or the job spans nodes)."""
    return tuple(
        name
        for name, preset in DATA_PARALLEL_PRESETS.items()
        if canonical_strategy(name) == name and (grouped or not preset.groups_replicate)
    )


STRATEGY_ALIASES: dict[str, StrategyName] = {"fsdp": "zero3"}
"""Names of the same preset: FSDP fully shards over every data-parallel GPU, as ZeRO-3 does."""


def canonical_strategy(name: StrategyName) -> StrategyName:
    """One name per preset ('fsdp' is 'zero3')."""
    return STRATEGY_ALIASES.get(name, name)


@lru_cache(maxsize=4096)  # pure and frozen: a planner sweep builds its scenarios from a few hundred meshes
def data_parallel_mesh(
    strategy: StrategyName,
    world_size: int,
    shard_group: int = 0,
    *,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
) -> Parallelism:
    """The mesh a data-parallel strategy preset makes of `world_size` GPUs with `pp` x `tp` x `cp` of them per model
    replica: the world is divided by pp x cp x tp first, and the strategy splits the rest; hsdp splits it into
    groups of `shard_group`. pp is outermost, as torchtitan's ParallelDims unflattens its world mesh into
    ("pp", "dp_replicate", "dp_shard", "cp", "tp") (torchtitan/distributed/parallel_dims.py at commit
    b5bcd76c66d0acb1a08b176d9639425bc55e0b2a); `ep` borrows its GPUs from dp_shard x cp (ddp: dp_replicate x cp).
    MeshError when the degrees do not multiply to the world size or ep does not divide the GPUs it borrows."""
    split = pp * cp * tp
    if world_size % split:
        named = f"pp {pp} x cp {cp} x tp {tp}" if pp > 1 else f"cp {cp} x tp {tp}"
        raise MeshError(f"{named} = {split} does not divide the {world_size} GPUs given")
    data_parallel = world_size // split
    preset = DATA_PARALLEL_PRESETS[strategy]
    if preset.groups_replicate:
        mesh = Parallelism(
            dp_replicate=max(data_parallel // shard_group, 1), dp_shard=shard_group, cp=cp, tp=tp, pp=pp, ep=ep
        )
    elif preset.shards:
        mesh = Parallelism(dp_shard=data_parallel, cp=cp, tp=tp, pp=pp, ep=ep)
    else:
        mesh = Parallelism(dp_replicate=data_parallel, cp=cp, tp=tp, pp=pp, ep=ep)
    mesh.require_world_size(world_size)
    return mesh
