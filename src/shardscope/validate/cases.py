"""The validation matrix: which cases to predict, trace and run, and how one case reads in each layer's terms."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from shardscope.choices import STRATEGIES, engine_name, parse_choice
from shardscope.mesh import DATA_PARALLEL_PRESETS, comparable_strategies, data_parallel_mesh
from shardscope.presets import model_preset
from shardscope.runtime.config import NO_OVERHEAD, RUN_ENGINES, RUN_GPU
from shardscope.specs import ClusterSpec, Scenario, SpecError, Strategy, TrainingSpec

CASE_STRATEGIES = comparable_strategies(grouped=True)
DEVICE_BACKEND = {"cpu": "gloo", "cuda": "nccl"}


def _grouped(strategy: str) -> bool:
    """The strategy splits the ranks into replicating shard groups (hsdp): it needs two groups of two."""
    return DATA_PARALLEL_PRESETS[parse_choice("ValidationCase.strategy", strategy, STRATEGIES)].groups_replicate


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationCase:
    """One model, strategy, engine, world size, precision and checkpointing mode."""

    model: str
    """Model preset id (a tiny one: it really trains)."""
    strategy: str
    """ddp, zero1, zero2, zero3 or hsdp."""
    engine: str
    """'paper' (the teaching strategies run, the paper engine predicts; 'teaching' is another word for it) or
    'pytorch' (torch's own engines run and the pytorch engine predicts them)."""
    world_size: int
    """Ranks."""
    precision: str = "fp32"
    """'fp32' or 'bf16-mixed'."""
    checkpointing: str = "none"
    """A checkpointing mode: 'none', 'full', 'selective', 'op' or 'every:N'."""
    micro_batch_size: int = 2
    """Sequences per rank."""
    sequence_length: int = 32
    """Tokens per sequence."""
    device: str = "cpu"
    """'cpu' (gloo processes) or 'cuda' (nccl, one GPU per rank, torch.cuda.max_memory_allocated as the peak)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", parse_choice("ValidationCase.engine", engine_name(self.engine), RUN_ENGINES))
        if self.device not in DEVICE_BACKEND:
            raise SpecError(f"ValidationCase.device={self.device!r} is not known; allowed: cpu, cuda")
        if _grouped(self.strategy) and self.world_size < 4:
            raise SpecError("ValidationCase: hsdp needs world_size >= 4 (two groups of two)")

    @property
    def shard_group(self) -> int:
        """hsdp: two groups; 0 for the others."""
        return self.world_size // 2 if _grouped(self.strategy) else 0

    @property
    def backend(self) -> str:
        """The collectives library the case runs on: gloo on CPU, nccl on CUDA."""
        return DEVICE_BACKEND[self.device]

    @property
    def label(self) -> str:
        """A short name for tables."""
        return (
            f"{self.model} {self.strategy} {self.engine} w{self.world_size} {self.precision}"
            + {"none": "", "full": " ckpt"}.get(self.checkpointing, f" ckpt {self.checkpointing}")
            + (" cuda" if self.device == "cuda" else "")
        )

    def scenario(self) -> Scenario:
        """The case as the core and the trace read it."""
        return Scenario(
            model=model_preset(self.model),
            cluster=ClusterSpec(
                gpu=RUN_GPU, world_size=self.world_size, gpus_per_node=self.world_size, backend=self.backend
            ),
            training=TrainingSpec(
                micro_batch_size=self.micro_batch_size,
                sequence_length=self.sequence_length,
                precision=self.precision,
                checkpointing=self.checkpointing,
            ),
            strategy=Strategy(name=self.strategy, engine=engine_name(self.engine), shard_group=self.shard_group),
            overheads=NO_OVERHEAD,
        )

    def to_json(self) -> dict[str, object]:
        """The case's fields."""
        return {
            "model": self.model,
            "strategy": self.strategy,
            "engine": self.engine,
            "world_size": self.world_size,
            "precision": self.precision,
            "checkpointing": self.checkpointing,
            "device": self.device,
            "parallelism": data_parallel_mesh(self.strategy, self.world_size, self.shard_group).to_json(),
        }


def full_matrix(device: str = "cpu") -> tuple[ValidationCase, ...]:
    """Every combination of issue 6: models x strategies x engines x world sizes 2 and 4 x precisions x
    checkpointing (hsdp only at world size 4)."""
    cases = []
    for model, strategy, engine, world, precision, checkpointing in itertools.product(
        ("tiny-gpt2", "tiny-llama", "tiny-moe"),
        CASE_STRATEGIES,
        RUN_ENGINES,
        (2, 4),
        ("fp32", "bf16-mixed"),
        ("none", "full"),
    ):
        if _grouped(strategy) and world < 4:
            continue
        cases.append(
            ValidationCase(
                model=model,
                strategy=strategy,
                engine=engine,
                world_size=world,
                precision=precision,
                checkpointing=checkpointing,
                device=device,
            )
        )
    return tuple(cases)


def quick_matrix(device: str = "cpu") -> tuple[ValidationCase, ...]:
    """A few cases that cover every strategy and both engines, small enough for CI."""
    return (
        ValidationCase(model="tiny-gpt2", strategy="ddp", engine="pytorch", world_size=2, device=device),
        ValidationCase(model="tiny-gpt2", strategy="zero1", engine="paper", world_size=2, device=device),
        ValidationCase(
            model="tiny-llama", strategy="zero2", engine="paper", world_size=2, precision="bf16-mixed", device=device
        ),
        ValidationCase(model="tiny-llama", strategy="zero3", engine="pytorch", world_size=2, device=device),
        ValidationCase(
            model="tiny-gpt2", strategy="zero3", engine="paper", world_size=2, checkpointing="full", device=device
        ),
    )
