"""The step time of a pipeline: its schedule simulated action by action, so the bubble comes out of the order torch
runs, and the messages between stages in the ledger.

Each stage's forward and backward of one micro-batch are the sums of the per-layer times of `core.kernels` over its
layers (the embeddings' on the first stage, the head's and the loss's on the last); a message between stages costs
what `core.network` prices a point-to-point send of one micro-batch's hidden states. `core.pipeline_schedule` runs
every rank's actions in its schedule's order. After its last backward, a pipeline rank does what a step without a
pipeline does after its compute: its data-parallel collectives left exposed and its optimizer step, both as the
time model prices them for a model of the rank's layers (`core.pipeline_memory.stage_proxy`, whose root unit is
whole), added in series. Bubble: with equal stages and free messages the makespan is (m + p - 1)(F + B) for GPipe
and 1F1B, and m(F + B) + (p - 1)(F + B)/V for interleaved 1F1B ("Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Section 2.2: bubble fractions (p - 1)/m and (p - 1)/(V m) of the ideal time).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardscope.core.comm import collective_ledger, comm_event_parts, with_micro_batches
from shardscope.core.comm_events import CommEvent
from shardscope.core.compute import compute_model, model_flops_per_step
from shardscope.core.engines import rules_for
from shardscope.core.engines.pipeline_load import PipelineCalls
from shardscope.core.kept import kept
from shardscope.core.kernels import stage_seconds
from shardscope.core.network import CollectiveCost, Placement, collective_cost, network_model
from shardscope.core.pipeline import PipelineStage, pipeline_stages, rank_stages
from shardscope.core.pipeline_memory import boundary_bytes, pipeline_rank_actions, rank_proxy
from shardscope.core.pipeline_schedule import Action, simulate_pipeline
from shardscope.core.result import CollectiveRow, merge_ledger
from shardscope.core.step_graph import EventPlacement
from shardscope.core.timeline import (
    StepRuns,
    TimeEstimate,
    exposed_and_optimizer_s,
    run_micro_batches,
    step_calls,
    step_runs,
)
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario


def stage_times(scenario: Scenario, profile: HardwareProfile) -> tuple[list[float], list[float]]:
    """Forward and backward (recomputation included) seconds of one micro-batch on every stage."""
    forward, recompute, backward = stage_seconds(scenario, compute_model(scenario, profile))
    last = len(forward) - 1  # elements: the embeddings, every block, the head

    def elements(stage: PipelineStage) -> list[int]:
        blocks = list(range(1 + stage.first_layer, 1 + stage.first_layer + stage.layers))
        return ([0] if stage.embedding else []) + blocks + ([last] if stage.head else [])

    stages = pipeline_stages(scenario)
    return (
        [sum(forward[i] for i in elements(stage)) for stage in stages],
        [sum(recompute[i] + backward[i] for i in elements(stage)) for stage in stages],
    )


REPEATED_FROM_END = 7
"""The last micro-batches of a longer step that its shorter runs stand for (`rank_placement`), so that the micro-batch
a longer run adds (the 9th) is past 1F1B's warm-up and before its cool-down (at most pp - 1 = 7 micro-batches each
for pp up to 8): its calls are those of every micro-batch of the steady state."""


def send_placement(scenario: Scenario) -> Placement:
    """Two neighbouring pipeline ranks: world / pp ranks apart (pp is outermost), so on different nodes once a
    pipeline rank's GPUs fill a node."""
    apart = scenario.cluster.world_size // scenario.strategy.pp
    return Placement(size=2, per_node=1 if apart >= scenario.cluster.ranks_per_node else 2)


def pipeline_ledger(scenario: Scenario, pipeline_rank: int) -> list[CollectiveRow]:
    """One GPU's point-to-point messages of a step on pipeline rank `pipeline_rank`: per micro-batch, each of its
    stages sends its output forward (but the last) and its input's gradient back (but the first), and receives them
    from its neighbours."""
    strategy, m = scenario.strategy, scenario.training.grad_accum_steps
    payload, last = boundary_bytes(scenario), strategy.pipeline_stages - 1
    stages = rank_stages(scenario, pipeline_rank)
    has_next = sum(stage.index < last for stage in stages)
    has_previous = sum(stage.index > 0 for stage in stages)
    rows = [
        ("forward", "send", has_next),
        ("forward", "recv", has_previous),
        ("backward", "send", has_previous),
        ("backward", "recv", has_next),
    ]
    return [
        CollectiveRow(phase=phase, op=op, group="pp", group_size=2, payload_bytes=payload, count=m * count)
        for phase, op, count in rows
        if count
    ]


def pipeline_rank_ledger(scenario: Scenario, pipeline_rank: int) -> tuple[CollectiveRow, ...]:
    """One GPU's step on pipeline rank `pipeline_rank`: its data-parallel collectives (the engine's, for the models
    of its stages: `rank_proxy`, as its rules' `pipeline_data_parallel_rows` says) and its messages to and from its
    neighbours."""

    def rows_of(stages: tuple[PipelineStage, ...]) -> list[CollectiveRow]:
        ledger = collective_ledger(rank_proxy(scenario, stages))
        return [row for row in ledger if row.payload_bytes]  # stages without a root have no root unit

    calls = PipelineCalls(rank_stages(scenario, pipeline_rank), pipeline_rank_actions(scenario, pipeline_rank))
    data_parallel = rules_for(scenario).pipeline_data_parallel_rows(scenario, calls, rows_of)
    return merge_ledger([*data_parallel, *pipeline_ledger(scenario, pipeline_rank)])


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineStep:
    """Every pipeline rank's step: its forwards and backwards in time, then what it does after its last backward."""

    scenario: Scenario
    """The question."""
    actions: tuple[tuple[tuple[Action, float, float], ...], ...]
    """Per pipeline rank, its forwards and backwards as (action, start_s, end_s), in the order it runs them."""
    proxies: tuple[Scenario, ...]
    """Per pipeline rank, the scenario without a pipeline of the model it holds (`rank_proxy`)."""
    after: tuple[tuple[float, float], ...]
    """Per pipeline rank, the exposed communication and optimizer seconds of the time model's step of its proxy,
    which follow the rank's last backward."""
    send: CollectiveCost
    """One message between neighbouring stages (one micro-batch's hidden states or their gradient)."""

    def after_s(self, rank: int) -> tuple[float, float]:
        """Exposed data-parallel communication and optimizer seconds of pipeline rank `rank` after its last
        backward."""
        return self.after[rank]

    def end_s(self, rank: int) -> float:
        """When pipeline rank `rank` has finished its step."""
        exposed, optimizer = self.after_s(rank)
        return self.actions[rank][-1][2] + exposed + optimizer

    @property
    def shown_rank(self) -> int:
        """The pipeline rank that finishes last (the later one of a tie): its step is the step."""
        return max(range(len(self.actions)), key=lambda rank: (self.end_s(rank), rank))

    @property
    def step_time_s(self) -> float:
        """The step: until the last pipeline rank has finished."""
        return self.end_s(self.shown_rank)

    @property
    def span_s(self) -> float:
        """From the first forward to the last backward of any stage."""
        return max(actions[-1][2] for actions in self.actions)

    @property
    def bubble_fraction(self) -> float:
        """The share of the pipeline ranks' time in the span that they sit idle: (p - 1)/(V m + p - 1) for equal
        stages and free messages (Megatron-LM paper, Section 2.2, bubble time over bubble plus ideal time)."""
        busy = sum(end - start for actions in self.actions for _, start, end in actions)
        return 1 - busy / (len(self.actions) * self.span_s)

    @property
    def equal_stages_bubble_fraction(self) -> float:
        """(p - 1)/(V m + p - 1): the bubble fraction of equal stages with free messages (Megatron-LM paper,
        Section 2.2: bubble time (p - 1)(F + B)/V against the ideal m (F + B))."""
        strategy = self.scenario.strategy
        others = strategy.pp - 1
        return others / (strategy.virtual_stages * self.scenario.training.grad_accum_steps + others)


def pipeline_step(scenario: Scenario, profile: HardwareProfile) -> PipelineStep:
    """Simulate a pipeline scenario's schedule on every pipeline rank and price what each does after it."""
    return _pipeline_step(scenario, profile)[0]


def stands_for(count: int, micro_batches: int) -> tuple[int, ...]:
    """The step's micro-batch each micro-batch of a proxy of `count` stands for: the step's own when it runs them
    all; else the schedule's first ones and its last REPEATED_FROM_END ones, so a run one micro-batch longer adds one
    from the middle of the schedule, whose calls every further micro-batch repeats."""
    head = count - REPEATED_FROM_END
    return tuple(k if k < head else micro_batches - (count - k) for k in range(count))


def rank_placement(scenario: Scenario, pipeline_rank: int) -> EventPlacement:
    """What pipeline rank `pipeline_rank` makes of its proxy's data-parallel calls: its engine's
    `pipeline_step_events` for its schedule, the proxy's micro-batches standing for the step's as `stands_for` says
    (a proxy of fewer micro-batches: the time model's runs of a longer step, `core.timeline.step_runs`)."""
    calls = PipelineCalls(rank_stages(scenario, pipeline_rank), pipeline_rank_actions(scenario, pipeline_rank))
    rules, micro_batches = rules_for(scenario), scenario.training.grad_accum_steps

    def placement(proxy: Scenario, events: tuple[CommEvent, ...]) -> tuple[CommEvent, ...]:
        count = proxy.training.grad_accum_steps
        return rules.pipeline_step_events(scenario, calls, events, stands_for(count, micro_batches))

    return placement


def pipeline_rank_events(scenario: Scenario, pipeline_rank: int) -> tuple[CommEvent, ...]:
    """The calls the time model runs for pipeline rank `pipeline_rank` besides its messages: its proxy's, the
    data-parallel ones as `rank_placement` places them."""
    proxy = rank_proxy(scenario, rank_stages(scenario, pipeline_rank))
    data_parallel, model_parallel, offload = comm_event_parts(proxy)
    return rank_placement(scenario, pipeline_rank)(proxy, data_parallel) + model_parallel + offload


def _placed_runs(placed: dict[int, tuple[CommEvent, ...]]) -> EventPlacement:
    """The placement that gives each run the calls placed for its count of micro-batches."""
    return lambda run, _: placed[run.training.grad_accum_steps]


def _rank_runs(
    scenario: Scenario, profile: HardwareProfile, proxies: tuple[Scenario, ...]
) -> list[tuple[StepRuns, tuple[float, float]]]:
    """Every pipeline rank's `step_runs` of its proxy and what it does after its last backward; ranks whose proxies
    and placed calls are equal share them (found by comparing: the calls of ranks of one proxy are mostly the same
    objects, which a tuple compares by identity, where a key would hash every call), each rank's calls placed once
    per run."""
    micro_batches = scenario.training.grad_accum_steps
    counts = run_micro_batches(micro_batches)
    shared: list[tuple[Scenario, tuple[tuple[CommEvent, ...], ...] | None, tuple[StepRuns, tuple[float, float]]]] = []
    own_calls: dict[Scenario, dict[int, tuple[Scenario, tuple[CommEvent, ...]]]] = {}  # per proxy: its runs' calls
    ranks = []
    for rank, proxy in enumerate(proxies):
        if proxy not in own_calls:
            runs_of = (proxy if count == micro_batches else with_micro_batches(proxy, count) for count in counts)
            own_calls[proxy] = {run.training.grad_accum_steps: (run, comm_event_parts(run)[0]) for run in runs_of}
        placement = rank_placement(scenario, rank)
        placed: dict[int, tuple[CommEvent, ...]] = {}
        unchanged = True
        for count, (run, own) in own_calls[proxy].items():
            placed[count] = placement(run, own)
            unchanged = unchanged and placed[count] is own
        calls = None if unchanged else tuple(placed.values())  # the ranks whose calls are their proxy's share it
        found = next((made for other, its, made in shared if other == proxy and its == calls), None)
        if found is None:
            runs = step_runs(proxy, profile, _placed_runs(placed))
            found = (runs, exposed_and_optimizer_s(proxy, runs))
            shared.append((proxy, calls, found))
        ranks.append(found)
    return ranks


CACHED_SCHEDULES = 64
"""Pipeline schedules simulated (`_pipeline_step`) kept: the planner's plans of one pipeline shape that differ in
their data-parallel strategy, shard group or offload have the same stage times and messages."""
_schedules: dict[tuple[object, ...], tuple[tuple[tuple[Action, float, float], ...], ...]] = {}


def _pipeline_step(scenario: Scenario, profile: HardwareProfile) -> tuple[PipelineStep, tuple[StepRuns, ...]]:
    """`pipeline_step`, and the runs of each pipeline rank's proxy (ranks that make the same calls share them), from
    which `estimate_pipeline_time` measures the shown rank's whole step without running it again."""
    strategy = scenario.strategy
    forward_s, backward_s = stage_times(scenario, profile)
    send = collective_cost("send", boundary_bytes(scenario), send_placement(scenario), network_model(profile))
    shape = (strategy.pp_schedule, strategy.pp, strategy.virtual_stages, scenario.training.grad_accum_steps)
    key = (*shape, tuple(forward_s), tuple(backward_s), send.time_s)

    def simulated() -> tuple[tuple[tuple[Action, float, float], ...], ...]:
        timeline, _ = simulate_pipeline(*shape, forward_s, backward_s, send.time_s)
        return tuple(tuple(actions) for actions in timeline)

    actions = kept(_schedules, key, simulated, CACHED_SCHEDULES)
    proxies = tuple(rank_proxy(scenario, rank_stages(scenario, rank)) for rank in range(strategy.pp))
    ranks = _rank_runs(scenario, profile, proxies)
    step = PipelineStep(
        scenario=scenario,
        actions=actions,
        proxies=proxies,
        after=tuple(after for _, after in ranks),
        send=send,
    )
    return step, tuple(runs for runs, _ in ranks)


def estimate_pipeline_time(scenario: Scenario, profile: HardwareProfile) -> TimeEstimate:
    """Step time of a pipeline scenario, shown for the pipeline rank that finishes last."""
    strategy, m = scenario.strategy, scenario.training.grad_accum_steps
    step_of_ranks, runs = _pipeline_step(scenario, profile)
    shown = step_of_ranks.shown_rank
    proxy = step_of_ranks.proxies[shown]
    step, tail = step_of_ranks.step_time_s, step_calls(proxy, runs[shown])
    optimizer = step_of_ranks.after_s(shown)[1]
    send = step_of_ranks.send
    actions = step_of_ranks.actions[shown]
    busy = sum(end - start for _, start, end in actions) + optimizer
    messages = pipeline_ledger(scenario, shown)
    sends = sum(row.count for row in messages if row.op == "send")
    schedule = tuple(
        (
            f"{'backward' if action.backward else 'forward'} stage {action.stage} micro-batch {action.micro_batch}",
            "compute",
            "backward" if action.backward else "forward",
            start,
            end - start,
            0,
        )
        for action, start, end in actions
    )
    return TimeEstimate(
        scenario=scenario,
        hardware=profile,
        ledger=pipeline_rank_ledger(scenario, shown),
        wire_bytes_per_rank=tail.wire_bytes_per_rank + round(sends * send.wire_bytes),
        comm_time_s=tail.comm_time_s + sends * send.time_s,
        exposed_comm_s=max(0.0, step - busy),
        compute_time_s=busy,
        step_time_s=step,
        model_flops=model_flops_per_step(scenario) / strategy.pp,
        peak_flops_per_s=tail.peak_flops_per_s,
        schedule=schedule,
        simulated_micro_batches=m,
    )
