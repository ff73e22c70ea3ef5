"""The validation matrix: which cases to predict, trace and run, and how one case reads in each layer's terms."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from shardscope.choices import STRATEGIES, engine_name, parse_choice
from shardscope.mesh import DATA_PARALLEL_PRESETS, comparable_strategies, data_parallel_mesh
from shardscope.presets import model_preset
from shardscope.runtime.config import NO_OVERHEAD, RUN_ENGINES, RUN_GPU, RunConfig
from shardscope.specs import ClusterSpec, Scenario, SpecError, Strategy, TrainingSpec

CASE_STRATEGIES = comparable_strategies(grouped=True)
DEVICE_BACKEND = {"cpu": "gloo", "cuda": "nccl"}


def _grouped(strategy: str) -> bool:
    """The strategy splits the ranks into replicating shard groups (hsdp): it needs two groups of two."""
    return DATA_PARALLEL_PRESETS[parse_choice("ValidationCase.strategy", strategy, STRATEGIES)].groups_replicate


MODEL_PARALLEL_MODELS = ("tiny-llama", "tiny-gpt2")
"""The models of the tensor- and context-parallel cases: grouped-query attention with a gated MLP, and gpt2's learned
positions with tied output weights (tiny-moe's experts are expert parallelism's, not issue 19's)."""
MODEL_PARALLEL_LAYOUTS = ((2, 1), (2, 2))
"""(tp, cp) on 4 ranks: tp 2 x dp 2, and tp 2 x cp 2 (dp 1)."""
THREE_D_LAYOUT = (8, 2, 2)
"""(world size, tp, cp) of the one 3-D case, dp 2 x cp 2 x tp 2: in the full matrix only (8 ranks on few cores)."""


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
    tp: int = 1
    """Tensor-parallel degree (innermost); the data-parallel strategy applies over world_size / (tp x cp)."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence (ring attention)."""
    sequence_parallel: bool = False
    """Sequence parallelism in the norms between the tp ranks (needs tp > 1)."""
    pp: int = 1
    """Pipeline-parallel degree (outermost): ranks that each hold consecutive layers."""
    pp_schedule: str = "1f1b"
    """The pipeline's schedule: gpipe, 1f1b or interleaved-1f1b (2 stages a rank)."""
    grad_accum: int = 1
    """Micro-batches per step (a pipeline's)."""
    ep: int = 1
    """Expert-parallel degree: ranks of the data-parallel ranks that split a MoE model's experts between them."""
    capacity_factor: float = 0.0
    """An MoE model's capacity rule (ModelSpec.capacity_factor); 0 routes dropless."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", parse_choice("ValidationCase.engine", engine_name(self.engine), RUN_ENGINES))
        if self.device not in DEVICE_BACKEND:
            raise SpecError(f"ValidationCase.device={self.device!r} is not known; allowed: cpu, cuda")
        if self.tp < 1 or self.cp < 1 or self.world_size % (self.tp * self.cp):
            raise SpecError(f"ValidationCase: tp({self.tp}) * cp({self.cp}) must divide world_size({self.world_size})")
        if self.pp < 1 or self.world_size % (self.pp * self.tp * self.cp):
            raise SpecError(f"ValidationCase: pp({self.pp}) * tp * cp must divide world_size({self.world_size})")
        if self.ep < 1 or self.data_ranks % self.ep:
            raise SpecError(f"ValidationCase: ep({self.ep}) must divide the {self.data_ranks} data-parallel ranks")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("ValidationCase.sequence_parallel=True needs tensor parallelism (tp > 1), not tp=1")
        if _grouped(self.strategy) and self.data_ranks < 4:
            raise SpecError("ValidationCase: hsdp needs 4 data-parallel ranks or more (two groups of two)")

    @property
    def data_ranks(self) -> int:
        """The ranks the data-parallel strategy spans: world_size / (pp x tp x cp)."""
        return self.world_size // (self.pp * self.tp * self.cp)

    @property
    def splits_model(self) -> bool:
        """Tensor or context parallelism: a case of issue 19's section of the matrix."""
        return self.tp * self.cp > 1

    @property
    def shard_group(self) -> int:
        """hsdp: two groups; 0 for the others."""
        return self.data_ranks // 2 if _grouped(self.strategy) else 0

    @property
    def backend(self) -> str:
        """The collectives library the case runs on: gloo on CPU, nccl on CUDA."""
        return DEVICE_BACKEND[self.device]

    @property
    def label(self) -> str:
        """A short name for tables."""
        mesh = (f" tp{self.tp}" if self.tp > 1 else "") + (f" cp{self.cp}" if self.cp > 1 else "")
        mesh += f" ep{self.ep}" if self.ep > 1 else ""
        mesh += f" capacity {self.capacity_factor:g}" if self.capacity_factor else ""
        if self.pp > 1:
            mesh += f" pp{self.pp} {self.pp_schedule} m{self.grad_accum}"
        return (
            f"{self.model} {self.strategy} {self.engine} w{self.world_size}{mesh}"
            + (" sp" if self.sequence_parallel else "")
            + f" {self.precision}"
            + {"none": "", "full": " ckpt"}.get(self.checkpointing, f" ckpt {self.checkpointing}")
            + (" cuda" if self.device == "cuda" else "")
        )

    def scenario(self) -> Scenario:
        """The case as the core and the trace read it."""
        preset = model_preset(self.model)
        return Scenario(
            model=replace(preset, capacity_factor=self.capacity_factor) if self.capacity_factor else preset,
            cluster=ClusterSpec(
                gpu=RUN_GPU, world_size=self.world_size, gpus_per_node=self.world_size, backend=self.backend
            ),
            training=TrainingSpec(
                micro_batch_size=self.micro_batch_size,
                sequence_length=self.sequence_length,
                precision=self.precision,
                checkpointing=self.checkpointing,
                grad_accum_steps=self.grad_accum,
            ),
            strategy=Strategy(
                name=self.strategy,
                engine=engine_name(self.engine),
                shard_group=self.shard_group,
                tp=self.tp,
                cp=self.cp,
                sequence_parallel=self.sequence_parallel,
                ep=self.ep,
                **self._pipeline_fields(),
            ),
            overheads=NO_OVERHEAD,
        )

    def _pipeline_fields(self) -> dict[str, object]:
        """The Strategy fields of the case's pipeline (none without one)."""
        if self.pp == 1:
            return {}
        virtual = 2 if self.pp_schedule == "interleaved-1f1b" else 0
        return {"pp": self.pp, "pp_schedule": self.pp_schedule, "pp_virtual_stages": virtual}

    def run_options(self, steps: int) -> dict[str, object]:
        """The case as `RunConfig.from_options` reads it."""
        return (
            {
                "model": self.model,
                "strategy": self.strategy,
                "engine": self.engine,
                "world_size": self.world_size,
                "steps": steps,
                "precision": self.precision,
                "micro_batch_size": self.micro_batch_size,
                "sequence_length": self.sequence_length,
                "checkpointing": self.checkpointing,
                "shard_group": self.shard_group,
                "backend": self.backend,
                "tp": self.tp,
                "cp": self.cp,
                "sequence_parallel": self.sequence_parallel,
                "ep": self.ep,
                **self._pipeline_fields(),
            }
            | ({"grad_accum": self.grad_accum} if self.pp > 1 else {})
            | self._capacity()
        )

    def _capacity(self) -> dict[str, object]:
        """The capacity rule, where the case has one (dropless cases read as before)."""
        return {"capacity_factor": self.capacity_factor} if self.capacity_factor else {}

    def not_runnable(self) -> str:
        """Why no run engine can run this case yet ('' when one can): the run's own check, e.g. FSDP under tensor
        parallelism before the teaching grid or torch's DTensor engine implements it."""
        try:
            RunConfig.from_options(**self.run_options(steps=3))
        except SpecError as error:
            return str(error)
        return ""

    def to_json(self) -> dict[str, object]:
        """The case's fields."""
        return (
            {
                "model": self.model,
                "strategy": self.strategy,
                "engine": self.engine,
                "world_size": self.world_size,
                "precision": self.precision,
                "checkpointing": self.checkpointing,
                "device": self.device,
                "parallelism": data_parallel_mesh(
                    self.strategy, self.world_size, self.shard_group, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep
                ).to_json(),
            }
            | ({"sequence_parallel": self.sequence_parallel} if self.tp > 1 else {})
            | ({"pp_schedule": self.pp_schedule, "grad_accum": self.grad_accum} if self.pp > 1 else {})
            | self._capacity()
        )


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


def model_parallel_matrix(device: str = "cpu", *, three_d: bool = True) -> tuple[ValidationCase, ...]:
    """Issue 19's cases: on 4 ranks tp 2 x dp 2 and tp 2 x cp 2, with and without sequence parallelism, fp32 and
    bf16-mixed, for both models, under ddp and fsdp and both engines; and (`three_d`) dp 2 x cp 2 x tp 2 on 8 ranks.
    Cases that no run engine implements yet stay in the matrix (ValidationCase.not_runnable says why), so they run as
    soon as one does: fsdp under tp, and torch's DTensor engine (engine 'pytorch')."""
    cases = [
        ValidationCase(
            model=model,
            strategy=strategy,
            engine=engine,
            world_size=4,
            precision=precision,
            tp=tp,
            cp=cp,
            sequence_parallel=sequence_parallel,
            device=device,
        )
        for model, strategy, engine, (tp, cp), sequence_parallel, precision in itertools.product(
            MODEL_PARALLEL_MODELS,
            ("ddp", "fsdp"),
            RUN_ENGINES,
            MODEL_PARALLEL_LAYOUTS,
            (False, True),
            ("fp32", "bf16-mixed"),
        )
    ]
    if three_d:
        world, tp, cp = THREE_D_LAYOUT
        cases += [
            ValidationCase(
                model="tiny-llama",
                strategy=strategy,
                engine="paper",
                world_size=world,
                tp=tp,
                cp=cp,
                sequence_parallel=True,
                device=device,
            )
            for strategy in ("ddp", "fsdp")
        ]
    return tuple(cases)


def pipeline_matrix(device: str = "cpu") -> tuple[ValidationCase, ...]:
    """Issue 20's pipeline cases, 4 micro-batches each. Run by the teaching pipeline: inside ddp, pp 2 x dp 2 under
    1F1B (tiny-llama) and pp 4 under each schedule (tiny-llama-8, whose 8 layers fill 8 interleaved stages); pp 2 x
    tp 2 (sequence parallel), pp 2 x dp 2 inside zero3, and the 8-rank pp 2 x tp 2 x dp 2 inside zero1 and zero3. Run
    by torch.distributed.pipelining inside fully_shard: pp 2 x dp 2 under 1F1B and GPipe (tiny-llama)."""
    cases = [_llama_pipeline("ddp", world_size=4)]
    cases += [
        ValidationCase(
            model="tiny-llama-8", strategy="ddp", engine="paper", world_size=4, pp=4, pp_schedule=schedule, grad_accum=4
        )
        for schedule in ("gpipe", "1f1b", "interleaved-1f1b")
    ]
    cases += [_llama_pipeline("ddp", world_size=4, tp=2), _llama_pipeline("zero3", world_size=4)]
    cases += [_llama_pipeline(strategy, world_size=8, tp=2) for strategy in ("zero1", "zero3")]
    torch_pipeline = ValidationCase(model="tiny-llama", strategy="fsdp", engine="pytorch", world_size=4, pp=2)
    cases += [replace(torch_pipeline, pp_schedule=schedule, grad_accum=4) for schedule in ("1f1b", "gpipe")]
    return tuple(replace(case, device=device) for case in cases)


def _llama_pipeline(strategy: str, *, world_size: int, tp: int = 1) -> ValidationCase:
    """tiny-llama on 2 pipeline ranks of 4 micro-batches under 1F1B, sequence parallel with tp."""
    return ValidationCase(
        model="tiny-llama",
        strategy=strategy,
        engine="paper",
        world_size=world_size,
        tp=tp,
        sequence_parallel=tp > 1,
        pp=2,
        grad_accum=4,
    )


def expert_parallel_matrix(device: str = "cpu") -> tuple[ValidationCase, ...]:
    """Expert parallelism: tiny-moe's experts split over ep 2 inside fsdp on 4 ranks, run by the teaching
    implementation (all-to-all dispatch and combine), dropless and under GShard's capacity rule (factor 1.25); and
    the capacity rule without expert parallelism inside torch's fully_shard on 2 ranks, which the trace replays."""
    experts = ValidationCase(model="tiny-moe", strategy="fsdp", engine="paper", world_size=4, ep=2, device=device)
    capacity = ValidationCase(
        model="tiny-moe", strategy="fsdp", engine="pytorch", world_size=2, capacity_factor=1.25, device=device
    )
    return experts, replace(experts, capacity_factor=1.25), capacity


def every_case(device: str = "cpu") -> tuple[ValidationCase, ...]:
    """The whole matrix: issue 6's data-parallel cases, issue 19's tensor- and context-parallel ones, then issue
    20's pipelines and expert parallelism."""
    return (
        full_matrix(device) + model_parallel_matrix(device) + pipeline_matrix(device) + expert_parallel_matrix(device)
    )


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
