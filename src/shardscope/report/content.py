"""What a report shows, computed without matplotlib: the rows to compare, the chosen plan, observations, assumptions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from shardscope.core.comm import collective_ledger
from shardscope.core.memory import estimate_memory
from shardscope.core.params import count_parameters
from shardscope.core.pipeline_time import PipelineStep, pipeline_step
from shardscope.core.result import CollectiveRow, MemoryEstimate
from shardscope.core.timeline import TimeEstimate, estimate_time
from shardscope.mesh import comparable_strategies
from shardscope.planner import PlanResult, PlanTiming, plan_timing
from shardscope.planner.pipeline import pipeline_timing
from shardscope.presets.hardware import HardwareProfile, default_profile
from shardscope.report.observations import assumptions, observations
from shardscope.specs import Scenario, SpecError

# The chosen plan's step is simulated in full up to this many micro-batches; beyond, the picture shows this many.
TIMELINE_MICRO_BATCHES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One strategy in the comparison: its memory and, when the model has a shape, its time and ledger."""

    label: str
    """'zero3', 'hsdp(8)', ..."""
    memory: MemoryEstimate
    """Per-rank memory."""
    timing: PlanTiming | None
    """Step time; None when only a parameter count is known."""
    ledger: tuple[CollectiveRow, ...]
    """Collectives of one step."""

    @property
    def fits(self) -> bool:
        """The peak fits in the GPU's memory."""
        return self.memory.fits


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportData:
    """Everything the page and its charts show."""

    title: str
    """The page title."""
    scenario_lines: tuple[tuple[str, str], ...]
    """(what, value) pairs describing the question."""
    rows: tuple[Row, ...]
    """The strategies compared, at the chosen plan's GPU count and batch shape."""
    chosen: int
    """Index of the chosen plan among rows."""
    budget_bytes: int
    """The memory a plan may use (GPU memory less the planner's headroom; the GPU memory without a plan)."""
    timeline: TimeEstimate | None
    """The chosen plan's simulated step (at most TIMELINE_MICRO_BATCHES micro-batches)."""
    plan: PlanResult | None
    """The planner's answer, when the report was made from one."""
    observations: tuple[str, ...]
    """Statements computed from the numbers."""
    assumptions: tuple[str, ...]
    """What was assumed."""
    pipeline: PipelineStep | None = None
    """The chosen plan's pipeline, every rank simulated, when it has one (then `timeline` is None)."""


def _row(scenario: Scenario, hardware: HardwareProfile | None) -> Row:
    memory = estimate_memory(scenario)
    if hardware is None or not scenario.model.has_shape:
        return Row(label=scenario.strategy.label, memory=memory, timing=None, ledger=())
    if scenario.strategy.pp > 1:  # simulated whole: a pipeline schedule refuses the planner's shorter steps
        timing = pipeline_timing(scenario, hardware)
        return Row(label=scenario.strategy.label, memory=memory, timing=timing, ledger=timing.ledger or ())
    timing = plan_timing(scenario, hardware)
    return Row(label=scenario.strategy.label, memory=memory, timing=timing, ledger=collective_ledger(scenario))


def _siblings(scenario: Scenario) -> list[Scenario]:
    """The chosen scenario under every family that can take its split, at the same GPUs and batch shape (offload
    kept where allowed)."""
    cluster, chosen = scenario.cluster, scenario.strategy
    found = []
    for name in comparable_strategies(grouped=cluster.num_nodes > 1 or chosen.preset.groups_replicate):
        if name == chosen.canonical_name:
            found.append(scenario)
            continue
        # an hsdp sibling's shard group: the chosen one's, or one node's data-parallel ranks
        group = chosen.shard_group or max(cluster.ranks_per_node // (chosen.tp * chosen.cp), 1)
        if scenario.parallelism.data_parallel % group:
            continue
        try:
            found.append(dataclasses.replace(scenario, strategy=chosen.sibling(name, group)))
        except SpecError:  # a family that cannot take the chosen plan's split (ep beyond the GPUs it would borrow)
            continue
    return found


def _choose(rows: Sequence[Row]) -> int:
    """The fastest row that fits; the smallest peak when none fits."""
    fitting = [index for index, row in enumerate(rows) if row.fits]
    if not fitting:
        return min(range(len(rows)), key=lambda index: rows[index].memory.per_rank.peak_bytes)

    def step_time(index: int) -> float:
        timing = rows[index].timing
        return timing.step_time_s if timing is not None else 0.0

    return min(fitting, key=step_time)


def _timeline(scenario: Scenario, hardware: HardwareProfile) -> TimeEstimate | None:
    if not scenario.model.has_shape or scenario.strategy.pp > 1:  # a pipeline is drawn from its PipelineStep
        return None
    steps = min(scenario.training.grad_accum_steps, TIMELINE_MICRO_BATCHES)
    shown = dataclasses.replace(scenario, training=dataclasses.replace(scenario.training, grad_accum_steps=steps))
    return estimate_time(shown, hardware)


def _describe(scenario: Scenario, hardware: HardwareProfile | None) -> tuple[tuple[str, str], ...]:
    model, cluster, training = scenario.model, scenario.cluster, scenario.training
    tokens = scenario.tokens_per_step
    lines = [
        ("model", f"{model.name} ({count_parameters(model):,} parameters, {model.family})"),
        (
            "GPUs",
            f"{cluster.world_size} x {cluster.gpu.name}, {cluster.ranks_per_node} per node, {cluster.num_nodes} nodes",
        ),
        ("training", f"{training.precision}, {training.optimizer}, {training.attention} attention"),
        (
            "batch",
            f"micro-batch {training.micro_batch_size} x {training.sequence_length} tokens, {training.grad_accum_steps} "
            f"micro-batches per step, {tokens:,} tokens per step",
        ),
        ("checkpointing", training.checkpointing),
    ]
    if scenario.parallelism.splits_model:
        sequence_parallel = "on" if scenario.strategy.uses_sequence_parallel else "off"
        lines.append(("mesh", f"{scenario.parallelism.described}, sequence parallelism {sequence_parallel}"))
    if hardware is not None:
        lines.append(
            (
                "hardware",
                f"{hardware.name}: {hardware.intra_node.name} in a node, {hardware.inter_node.name} between nodes",
            )
        )
    return tuple(lines)


def build(subject: Sequence[Scenario] | PlanResult, hardware: HardwareProfile | None = None) -> ReportData:
    """The report's content for scenarios to compare, or for a plan (its best plan against the other families)."""
    plan: PlanResult | None = None
    if isinstance(subject, PlanResult):
        plan = subject
        if not plan.plans:
            raise SpecError("the plan has no plan that fits; a report needs at least one")
        hardware = hardware or plan.request.hardware
        scenarios = _siblings(plan.plans[0].scenario)
        budget = plan.request.budget_bytes
    else:
        scenarios = list(subject)
        if not scenarios:
            raise SpecError("a report needs at least one scenario")
        budget = scenarios[0].cluster.gpu.memory_bytes
    first = scenarios[0]
    if first.model.has_shape:
        hardware = hardware or default_profile(first.cluster.gpu)
    rows = tuple(_row(scenario, hardware) for scenario in scenarios)
    chosen = _choose(rows)
    if plan is not None:
        chosen = next(index for index, row in enumerate(rows) if row.memory.scenario == plan.plans[0].scenario)
    scenario = rows[chosen].memory.scenario
    timeline = _timeline(scenario, hardware) if hardware else None
    pipeline = pipeline_step(scenario, hardware) if hardware and scenario.strategy.pp > 1 else None
    return ReportData(
        title=f"shardscope: {first.model.name} on {first.cluster.gpu.name}",
        scenario_lines=_describe(scenario, hardware),
        rows=rows,
        chosen=chosen,
        budget_bytes=budget,
        timeline=timeline,
        plan=plan,
        observations=observations(rows, chosen),
        assumptions=assumptions(rows[chosen], hardware, plan),
        pipeline=pipeline,
    )
