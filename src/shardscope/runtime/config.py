"""What a real run is asked to do, checked before any process starts, and the error a failed run raises."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardscope.choices import parse_choice
from shardscope.mesh import DATA_PARALLEL_PRESETS, canonical_strategy
from shardscope.presets import model_preset
from shardscope.procs.launcher import MAX_LOCAL_WORLD_SIZE, RunError
from shardscope.specs import STRATEGIES, ModelSpec, SpecError, TrainingSpec

RUN_ENGINES = ("teaching", "pytorch")
FAULTS = ("raise", "exit", "hang")
__all__ = ["FAULTS", "MAX_LOCAL_WORLD_SIZE", "RUN_ENGINES", "RunConfig", "RunError"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """One real training run: which model, strategy and engine, on how many ranks, for how many steps."""

    model: str = "tiny-gpt2"
    """Model preset id (a shaped family: gpt2, llama or moe)."""
    strategy: str = "zero3"
    """'ddp', 'zero1', 'zero2', 'zero3', 'fsdp' (= zero3) or 'hsdp'."""
    engine: str = "teaching"
    """'teaching' (shardscope's strategies written from collectives) or 'pytorch' (DDP, ZeroRedundancyOptimizer,
    FSDP2)."""
    world_size: int = 2
    """Ranks (processes)."""
    steps: int = 3
    """Optimizer steps; the last one is measured, the others timed."""
    precision: str = "fp64"
    """'fp64', 'fp32' or 'bf16-mixed' (16-bit parameters and gradients, fp32 master and moments)."""
    micro_batch_size: int = 2
    """Sequences per rank per step."""
    sequence_length: int = 32
    """Tokens per sequence."""
    checkpointing: str = "none"
    """'none', 'full' or 'selective'."""
    attention: str = "sdpa"
    """'eager' or 'sdpa'."""
    optimizer: str = "adamw"
    """'adamw', 'adam', 'sgd' or 'sgd-momentum'."""
    shard_group: int = 0
    """hsdp: ranks per shard group (must divide world_size)."""
    timeout_s: float = 120.0
    """The whole run ends within this many seconds, whatever fails."""
    seed: int = 0
    """Rank r starts from weights of seed+r; the reference uses rank 0's."""
    backend: str = "auto"
    """'gloo', 'nccl' or 'auto' (nccl when CUDA is available, else gloo)."""
    rendezvous: str = "tcp"
    """'tcp' (a free port on localhost, retried when taken) or 'file' (a file in the run's directory)."""
    fault: str = ""
    """Tests only: 'KIND:RANK' with KIND raise, exit or hang, injected in that rank's first forward."""

    def __post_init__(self) -> None:
        model_spec = model_preset(self.model)
        if not model_spec.has_shape:
            raise SpecError(f"RunConfig.model={self.model!r} has no shape to build; choose a gpt2, llama or moe preset")
        strategy = parse_choice("RunConfig.strategy", self.strategy, STRATEGIES)
        parse_choice("RunConfig.engine", self.engine, RUN_ENGINES)
        if self.precision not in ("fp64", "fp32", "bf16-mixed"):
            raise SpecError(f"RunConfig.precision={self.precision!r} is not runnable; allowed: fp64, fp32, bf16-mixed")
        if self.world_size < 1:  # the local launcher caps it further (MAX_LOCAL_WORLD_SIZE); torchrun does not
            raise SpecError(f"RunConfig.world_size={self.world_size} must be at least 1")
        if self.steps < 1:
            raise SpecError(f"RunConfig.steps={self.steps} must be at least 1")
        if DATA_PARALLEL_PRESETS[strategy].groups_replicate:
            if self.shard_group < 1 or self.world_size % self.shard_group:
                raise SpecError(
                    f"RunConfig.shard_group={self.shard_group} must divide world_size={self.world_size} for hsdp"
                )
        elif self.shard_group:
            raise SpecError(f"RunConfig.shard_group={self.shard_group} is only used by hsdp")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise SpecError(f"RunConfig.timeout_s={self.timeout_s} must be a positive, finite number of seconds")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise SpecError(f"RunConfig.backend={self.backend!r} is not known; allowed: auto, gloo, nccl")
        if self.rendezvous not in ("tcp", "file"):
            raise SpecError(f"RunConfig.rendezvous={self.rendezvous!r} is not known; allowed: tcp, file")
        if self.fault and (self.fault.split(":")[0] not in FAULTS or not self.fault.partition(":")[2].isdigit()):
            raise SpecError(f"RunConfig.fault={self.fault!r} must be KIND:RANK with KIND one of {', '.join(FAULTS)}")
        self.training  # validates micro batch, sequence length, checkpointing and attention  # noqa: B018
        if model_spec.family == "gpt2" and self.sequence_length > model_spec.max_positions:
            raise SpecError(
                f"RunConfig.sequence_length={self.sequence_length} exceeds {self.model}'s max_positions="
                f"{model_spec.max_positions}"
            )

    @property
    def model_spec(self) -> ModelSpec:
        """The preset's ModelSpec."""
        return model_preset(self.model)

    @property
    def training(self) -> TrainingSpec:
        """The TrainingSpec of one rank's step."""
        return TrainingSpec(
            micro_batch_size=self.micro_batch_size,
            sequence_length=self.sequence_length,
            precision=self.precision,
            optimizer=self.optimizer,
            checkpointing=self.checkpointing,
            attention=self.attention,
        )

    @property
    def canonical_strategy(self) -> str:
        """'fsdp' runs as 'zero3'."""
        return canonical_strategy(parse_choice("RunConfig.strategy", self.strategy, STRATEGIES))

    def to_args(self) -> list[str]:
        """Command-line flags for `python -m shardscope.runtime.worker` that rebuild this config."""
        args = []
        for item in dataclasses.fields(self):
            args += [f"--{item.name.replace('_', '-')}", str(getattr(self, item.name))]
        return args
