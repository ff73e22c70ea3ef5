"""What a real run is asked to do, checked before any process starts, and the error a failed run raises."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from shardscope.choices import ENGINE_ALIASES, EngineName, engine_name, parse_choice
from shardscope.mesh import DATA_PARALLEL_PRESETS, Parallelism, data_parallel_mesh
from shardscope.presets import custom_gpu, model_preset
from shardscope.procs.launcher import MAX_LOCAL_WORLD_SIZE, RunError
from shardscope.specs import ClusterSpec, ModelSpec, Overheads, Scenario, SpecError, Strategy, TrainingSpec
from shardscope.trace.tensor_parallel import torch_model_parallel_refusal
from shardscope.units import GIB

RUN_ENGINES: tuple[EngineName, ...] = ("paper", "pytorch")
"""Engines with an implementation to run: 'paper' (the teaching strategies, written from collectives) and 'pytorch'
(DDP, ZeroRedundancyOptimizer, FSDP2)."""
RUN_PRECISIONS = ("fp64", "fp32", "bf16-mixed")
FAULTS = ("raise", "exit", "hang")
# A CPU "GPU" big enough that fitting never matters; measurements have no framework context or allocator.
RUN_GPU = custom_gpu(1024 * GIB)
NO_OVERHEAD = Overheads(context_bytes=0, allocator_headroom=0.0)
__all__ = ["FAULTS", "MAX_LOCAL_WORLD_SIZE", "NO_OVERHEAD", "RUN_ENGINES", "RUN_GPU", "RunConfig", "RunError"]
# The option names of a run as flags, keywords and JSON use them, and where each lives in a RunConfig.
TRAINING_OPTIONS = {
    "precision": "precision",
    "micro_batch_size": "micro_batch_size",
    "sequence_length": "sequence_length",
    "checkpointing": "checkpointing",
    "attention": "attention",
    "optimizer": "optimizer",
    "grad_accum": "grad_accum_steps",
}
STRATEGY_OPTIONS = {
    "strategy": "name",
    "engine": "engine",
    "shard_group": "shard_group",
    "tp": "tp",
    "cp": "cp",
    "sequence_parallel": "sequence_parallel",
    "pp": "pp",
    "pp_schedule": "pp_schedule",
    "pp_virtual_stages": "pp_virtual_stages",
    "pp_layers": "pp_layers",
    "ep": "ep",
}
MODEL_PARALLEL_STAGES: dict[EngineName, tuple[int, ...]] = {"paper": (0, 1, 2, 3), "pytorch": (2, 3)}
"""The ZeRO stages each run engine implements under tp or cp: the teaching grid (runtime/teaching/model_parallel.py)
runs inside ddp, zero1, zero2, zero3/fsdp and hsdp; torch's engines (runtime/engines.py TorchTensorParallel: DTensor
tensor parallelism, the teaching ring attention for cp) under FSDP2 (zero2, zero3/fsdp, hsdp), as torchtitan composes
them (DDP takes no DTensor parameters)."""


def teaching_refusal(scenario: Scenario) -> str:
    """Why the teaching strategies cannot run a model-parallel scenario ('' when they can): the teaching pipeline
    (runtime/teaching/pipeline.py) runs with tp inside every data-parallel strategy, without cp, and needs a model
    without tied embeddings (the tie across the first and last stages is not built)."""
    strategy = scenario.strategy
    if strategy.pp == 1:
        return ""
    if strategy.cp > 1:
        return f"pp {strategy.pp} runs without cp (cp {strategy.cp} given)"
    if scenario.model.tie_embeddings:
        return f"pp {strategy.pp} needs a model without tied embeddings ({scenario.model.name} ties them)"
    return ""


def _torch_refusal(scenario: Scenario) -> str:
    if scenario.strategy.pp > 1:
        return torch_pipeline_refusal(scenario)
    why = torch_model_parallel_refusal(scenario)
    return f"{why}; --engine paper runs it (the teaching implementation)" if why else ""


def torch_pipeline_refusal(scenario: Scenario) -> str:
    """Why torch's pipelining cannot run a scenario ('' when it can): runtime/torch_pipeline.py shards the stages
    with fully_shard (zero2, zero3/fsdp, hsdp), without tp or cp, and cuts llama-style models without experts (a
    tie of the embeddings across the first and last stages, and gpt2's learned positions, are not built)."""
    strategy, model = scenario.strategy, scenario.model
    if strategy.tp > 1 or strategy.cp > 1:
        return f"pp {strategy.pp} runs without tp and cp (tp {strategy.tp}, cp {strategy.cp} given)"
    if strategy.stage < 2:
        return (
            f"pp {strategy.pp} runs inside fully_shard only (zero2, zero3, fsdp, hsdp), not {strategy.name}; "
            "--engine paper runs the teaching pipeline inside it"
        )
    if model.family != "llama":
        return f"pp {strategy.pp} cuts llama-style models only, not {model.name} (a {model.family} model)"
    if model.tie_embeddings:
        return f"pp {strategy.pp} needs a model without tied embeddings ({model.name} ties them)"
    return ""


def teaching_expert_refusal(scenario: Scenario) -> str:
    """Why the teaching strategies cannot split experts ('' when they can): the teaching expert parallelism
    (runtime/teaching/expert_data_parallel.py) runs inside every data-parallel strategy, without tp, cp or pp."""
    strategy = scenario.strategy
    if strategy.tp > 1 or strategy.cp > 1 or strategy.pp > 1:
        return f"ep {strategy.ep} runs without tp, cp and pp (tp {strategy.tp}, cp {strategy.cp}, pp {strategy.pp})"
    return ""


def _torch_expert_refusal(scenario: Scenario) -> str:
    ep = scenario.strategy.ep
    return f"ep {ep} runs on engine paper only (the teaching implementation), not {scenario.strategy.engine}"


EXPERT_PARALLEL_REFUSALS: dict[EngineName, Callable[[Scenario], str]] = {
    "paper": teaching_expert_refusal,
    "pytorch": _torch_expert_refusal,
}
"""Why an engine cannot split a MoE model's experts ('' when it can)."""


MODEL_PARALLEL_REFUSALS: dict[EngineName, Callable[[Scenario], str]] = {
    "paper": teaching_refusal,
    "pytorch": _torch_refusal,
}
"""Why an engine cannot run a model-parallel scenario its stages allow ('' when it can), with what runs it instead:
torch's plan has its own limits (trace/tensor_parallel.py), the teaching pipeline its own."""
OWN_OPTIONS = ("model", "capacity_factor", "world_size", "steps", "timeout_s", "seed", "backend", "rendezvous", "fault")
OPTIONS = (*OWN_OPTIONS, *STRATEGY_OPTIONS, *TRAINING_OPTIONS)


def _default_training() -> TrainingSpec:
    return TrainingSpec(micro_batch_size=2, sequence_length=32, precision="fp64")


def _default_strategy() -> Strategy:
    return Strategy(name="zero3", engine="paper")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """One real training run: which model, trained how, under which strategy, on how many ranks, for how long."""

    model: str = "tiny-gpt2"
    """Model preset id (a shaped family: gpt2, llama or moe)."""
    capacity_factor: float = 0.0
    """An MoE model's capacity rule (ModelSpec.capacity_factor; 0: dropless, as the preset routes)."""
    training: TrainingSpec = field(default_factory=_default_training)
    """One rank's step: precision fp64, fp32 or bf16-mixed (16-bit parameters and gradients, fp32 master and
    moments), one micro-batch per step."""
    strategy: Strategy = field(default_factory=_default_strategy)
    """The strategy and its engine: 'paper' runs the teaching strategies, 'pytorch' torch's own engines."""
    world_size: int = 2
    """Ranks (processes)."""
    steps: int = 3
    """Optimizer steps; the last one is measured, the others timed."""
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
        model_spec = self.model_spec
        if not model_spec.has_shape:
            raise SpecError(f"RunConfig.model={self.model!r} has no shape to build; choose a gpt2, llama or moe preset")
        parse_choice("RunConfig.strategy.engine", self.strategy.engine, RUN_ENGINES)
        parse_choice("RunConfig.training.precision", self.training.precision, RUN_PRECISIONS)
        if self.training.grad_accum_steps != 1 and self.strategy.pp == 1:
            raise SpecError(
                f"RunConfig.training.grad_accum_steps={self.training.grad_accum_steps}: runs take one "
                "micro-batch per step, except a pipeline's (pp above 1)"
            )
        if self.strategy.offload != "none":
            raise SpecError(f"RunConfig.strategy.offload={self.strategy.offload!r}: runs do not offload")
        if self.world_size < 1:  # the local launcher caps it further (MAX_LOCAL_WORLD_SIZE); torchrun does not
            raise SpecError(f"RunConfig.world_size={self.world_size} must be at least 1")
        if self.steps < 1:
            raise SpecError(f"RunConfig.steps={self.steps} must be at least 1")
        mesh = self.parallelism
        if self.strategy.ep > 1:
            self.scenario()  # the model has experts and ep divides them
            refusal = EXPERT_PARALLEL_REFUSALS[self.strategy.engine](self.scenario())
            if refusal:
                raise SpecError(f"RunConfig.strategy with engine {self.strategy.engine}: {refusal}")
        if mesh.splits_model:
            self.scenario()  # tp and cp must divide the model's widths and split the sequence
            stages = MODEL_PARALLEL_STAGES[self.strategy.engine]
            refusal = MODEL_PARALLEL_REFUSALS[self.strategy.engine](self.scenario())
            if refusal and self.strategy.pp > 1:
                raise SpecError(f"RunConfig.strategy with engine {self.strategy.engine}: {refusal}")
            if self.strategy.stage not in stages:
                allowed = [name for name, preset in DATA_PARALLEL_PRESETS.items() if preset.zero_stage in stages]
                raise SpecError(
                    f"RunConfig.strategy={self.strategy.name!r} with tp={self.strategy.tp}, cp={self.strategy.cp}: "
                    f"engine {self.strategy.engine} runs tensor and context parallelism with "
                    f"{', '.join(allowed) or 'no strategy yet (not built)'}"
                )
            if refusal:
                raise SpecError(f"RunConfig.strategy with engine {self.strategy.engine}: {refusal}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise SpecError(f"RunConfig.timeout_s={self.timeout_s} must be a positive, finite number of seconds")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise SpecError(f"RunConfig.backend={self.backend!r} is not known; allowed: auto, gloo, nccl")
        if self.rendezvous not in ("tcp", "file"):
            raise SpecError(f"RunConfig.rendezvous={self.rendezvous!r} is not known; allowed: tcp, file")
        if self.fault and (self.fault.split(":")[0] not in FAULTS or not self.fault.partition(":")[2].isdigit()):
            raise SpecError(f"RunConfig.fault={self.fault!r} must be KIND:RANK with KIND one of {', '.join(FAULTS)}")
        if model_spec.family == "gpt2" and self.training.sequence_length > model_spec.max_positions:
            raise SpecError(
                f"RunConfig.training.sequence_length={self.training.sequence_length} exceeds {self.model}'s "
                f"max_positions={model_spec.max_positions}"
            )

    @classmethod
    def from_options(cls, **options: Any) -> RunConfig:
        """A config from flat options, as `shardscope run`'s flags, the worker's flags and `run_training`'s keywords
        name them: model, strategy, engine ('teaching' is another word for 'paper'), shard_group, precision,
        micro_batch_size, sequence_length, checkpointing, attention, optimizer, and the run's own fields."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise SpecError(f"RunConfig: unknown option {unknown[0]!r}; allowed: {', '.join(OPTIONS)}")
        if "engine" in options:
            word = str(options["engine"])
            if word not in (*RUN_ENGINES, *ENGINE_ALIASES):
                raise SpecError(
                    f"RunConfig.engine={word!r} is not known; allowed: {', '.join(RUN_ENGINES)} (teaching "
                    "is another word for paper)"
                )
            options["engine"] = engine_name(word)
        training = replace(
            _default_training(), **{TRAINING_OPTIONS[k]: v for k, v in options.items() if k in TRAINING_OPTIONS}
        )
        strategy = Strategy(
            **{
                STRATEGY_OPTIONS[k]: v
                for k, v in {"strategy": "zero3", "engine": "paper", **options}.items()
                if k in STRATEGY_OPTIONS
            }
        )
        own = {k: v for k, v in options.items() if k not in TRAINING_OPTIONS and k not in STRATEGY_OPTIONS}
        return cls(training=training, strategy=strategy, **own)

    def options(self) -> dict[str, Any]:
        """The flat options that rebuild this config with `from_options` (for the worker's flags and JSON)."""
        own = {name: getattr(self, name) for name in OWN_OPTIONS}
        training = {option: getattr(self.training, name) for option, name in TRAINING_OPTIONS.items()}
        strategy = {option: getattr(self.strategy, name) for option, name in STRATEGY_OPTIONS.items()}
        strategy["sequence_parallel"] = self.strategy.uses_sequence_parallel
        return {**own, **strategy, **training}

    @property
    def model_spec(self) -> ModelSpec:
        """The preset's ModelSpec, under the run's capacity rule."""
        preset = model_preset(self.model)
        return replace(preset, capacity_factor=self.capacity_factor) if self.capacity_factor else preset

    @property
    def parallelism(self) -> Parallelism:
        """The mesh the run's strategy and degrees make of its ranks."""
        strategy = self.strategy
        return data_parallel_mesh(
            strategy.name,
            self.world_size,
            strategy.shard_group,
            tp=strategy.tp,
            cp=strategy.cp,
            pp=strategy.pp,
            ep=strategy.ep,
        )

    def resolved_backend(self) -> str:
        """The backend the ranks use: 'auto' is nccl where CUDA is available, else gloo (asks torch: slow to import)."""
        if self.backend != "auto":
            return self.backend
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"

    def scenario(self) -> Scenario:
        """The run as the core predicts it: its model, training and strategy on world_size gloo ranks of RUN_GPU."""
        return Scenario(
            model=self.model_spec,
            cluster=ClusterSpec(gpu=RUN_GPU, world_size=self.world_size, gpus_per_node=self.world_size, backend="gloo"),
            training=self.training,
            strategy=self.strategy,
            overheads=NO_OVERHEAD,
        )
