"""Pipeline parallelism's stages: which layers each stage holds, and the parameter tensors of one stage.

A pipeline of pp ranks runs pp x V stages (V virtual stages per rank under interleaved 1F1B, else 1). Stage k lives on
pipeline rank k mod pp, as torch's ScheduleInterleaved1F1B numbers them (`forward_stage_index`: local index x pp +
rank). The first stage also holds the embeddings, the last the final norm and the output head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from shardscope.core.params import ParamLayout, StageModel, param_layout
from shardscope.specs import ModelSpec, Scenario

INPUT_WEIGHT = 1
"""The embeddings count as this many layers in the default split: torchtitan's
`pipeline_parallel_first_stage_less_layers` default (torchtitan/config/configs.py at commit
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a)."""
OUTPUT_WEIGHT = 1
"""The final norm and output head count as this many layers: `pipeline_parallel_last_stage_less_layers`' default."""


def default_layer_split(num_stages: int, num_layers: int) -> tuple[int, ...]:
    """Transformer layers per stage as torchtitan splits them by default (`_generate_llm_fqn_per_model_part` in
    torchtitan/distributed/pipeline_parallel.py at commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a).

    The rule: count the embeddings as one more layer and the norm with the output head as another, so there are
    L + 2 "effective" layers; give every stage (L + 2) // S of them and the first (L + 2) % S stages one more; the first
    stage's share includes the embeddings and the last stage's the head, so each holds one transformer layer fewer.
    E.g. 32 layers on 4 stages: 34 effective layers, 9, 9, 8, 8, so 8, 9, 8, 7 transformer layers."""
    if num_stages == 1:
        return (num_layers,)
    effective = num_layers + INPUT_WEIGHT + OUTPUT_WEIGHT
    per_stage, extra = divmod(effective, num_stages)
    split = [per_stage + (1 if stage < extra else 0) for stage in range(num_stages)]
    split[0] -= INPUT_WEIGHT
    split[-1] -= OUTPUT_WEIGHT
    return tuple(split)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineStage:
    """One stage of the pipeline: its layers and the pipeline rank that runs it."""

    index: int
    """Its place in the pipeline, 0 to pp x V - 1 (the order forward runs through them)."""
    rank: int
    """The pipeline rank holding it: index mod pp."""
    first_layer: int
    """Index of its first transformer layer."""
    layers: int
    """Transformer layers it holds."""
    embedding: bool
    """It is the first stage: it also holds the embeddings."""
    head: bool
    """It is the last stage: it also holds the final norm and the output head (and computes the loss)."""

    @property
    def described(self) -> str:
        """The stage as printed, e.g. 'embed+layers 0-7' or 'layers 24-31+head'."""
        last = self.first_layer + self.layers - 1
        parts = ["embed"] if self.embedding else []
        if self.layers:
            parts.append(f"layers {self.first_layer}-{last}" if self.layers > 1 else f"layer {self.first_layer}")
        return "+".join(parts + (["head"] if self.head else []))


@cache
def _stages(num_layers: int, pp: int, virtual: int, explicit: tuple[int, ...]) -> tuple[PipelineStage, ...]:
    count = pp * virtual
    split = explicit or default_layer_split(count, num_layers)
    stages, first = [], 0
    for index, layers in enumerate(split):
        stages.append(
            PipelineStage(
                index=index,
                rank=index % pp,
                first_layer=first,
                layers=layers,
                embedding=index == 0,
                head=index == count - 1,
            )
        )
        first += layers
    return tuple(stages)


def pipeline_stages(scenario: Scenario) -> tuple[PipelineStage, ...]:
    """Every stage of the scenario's pipeline, first to last (one stage of every layer when pp is 1)."""
    strategy = scenario.strategy
    return _stages(scenario.model.num_layers, strategy.pp, strategy.virtual_stages, strategy.pp_layers)


def rank_stages(scenario: Scenario, pipeline_rank: int) -> tuple[PipelineStage, ...]:
    """The stages one pipeline rank holds (V of them under interleaved 1F1B)."""
    return tuple(stage for stage in pipeline_stages(scenario) if stage.rank == pipeline_rank)


@cache
def stage_layout(model: ModelSpec, tp: int, embedding: bool, head: bool, layers: int) -> ParamLayout:
    """The parameter tensors one tensor-parallel rank of a stage holds: its blocks, the embeddings on the first stage
    and the final norm and output head on the last. A tied output head is the embedding's weight, so the last stage
    keeps its own copy of it (as Megatron-LM keeps the word embeddings on the first and last stages)."""
    held = param_layout(stage_model(model, max(1, layers), embedding, head), tp)
    return ParamLayout(root=held.root, block=held.block, num_blocks=layers)


def stage_model(model: ModelSpec, layers: int, embedding: bool, head: bool) -> StageModel:
    """The part of `model` a pipeline rank holds: `layers` blocks and the root's ends it holds."""
    values = {name: getattr(model, name) for name in ModelSpec.__dataclass_fields__}
    return StageModel(**{**values, "num_layers": layers}, holds_embedding=embedding, holds_head=head)


def layout_of(scenario: Scenario, stage: PipelineStage) -> ParamLayout:
    """The parameter tensors one tensor-parallel rank of `stage` holds before data-parallel sharding."""
    return stage_layout(scenario.model, scenario.strategy.tp, stage.embedding, stage.head, stage.layers)


def pipeline_rank_of(scenario: Scenario, rank: int) -> int:
    """The pipeline rank of a global rank: pp is the outermost mesh dimension, so blocks of world / pp ranks."""
    return rank // (scenario.cluster.world_size // scenario.strategy.pp)
