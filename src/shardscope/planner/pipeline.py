"""Pipelines in the planner: their step time is the schedule's (`core.pipeline_time`), never the shortcut of
`planner.timing` (a pipeline's step is not one rank's compute plus its collectives: it has a bubble, and each
pipeline rank holds its own layers), a lower bound under that step, and the model states of the busiest stage, which
no micro-batch or checkpointing setting reduces.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardscope.core.compute import compute_model
from shardscope.core.engines import rules_for
from shardscope.core.network import collective_cost, network_model
from shardscope.core.pipeline import rank_stages
from shardscope.core.pipeline_memory import boundary_bytes, rank_proxy
from shardscope.core.pipeline_schedule import simulate_pipeline
from shardscope.core.pipeline_time import rank_placement, send_placement, stage_times
from shardscope.core.timeline import EXACT_MICRO_BATCHES, estimate_time, exposed_and_optimizer_s, step_runs
from shardscope.core.timeline_tasks import optimizer_task_s
from shardscope.planner.timing import ROUNDING_MARGIN, PlanTiming, tensor_parallel_floor_s
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario


def pipeline_timing(scenario: Scenario, hardware: HardwareProfile) -> PlanTiming:
    """The step of a pipeline plan as `estimate --time` gives it: the schedule simulated action by action on every
    pipeline rank (`core.pipeline_time.estimate_pipeline_time`)."""
    estimate = estimate_time(scenario, hardware)
    return PlanTiming(
        step_time_s=estimate.step_time_s,
        compute_time_s=estimate.compute_time_s,
        comm_time_s=estimate.comm_time_s,
        exposed_comm_s=estimate.exposed_comm_s,
        host_copy_s=estimate.host_copy_s,
        wire_bytes_per_rank=estimate.wire_bytes_per_rank,
        tokens_per_s=estimate.tokens_per_s,
        mfu=estimate.mfu,
        simulated_micro_batches=estimate.simulated_micro_batches,
        ledger=estimate.ledger,
    )


def pipeline_bound_s(
    scenario: Scenario,
    hardware: HardwareProfile,
    stage_s: tuple[list[float], list[float]] | None = None,
    after_s: Sequence[float] = (),
) -> float:
    """A lower bound under a pipeline's step, whatever its schedule: each pipeline rank r runs every micro-batch's
    forward and backward of its stages (m x their sum), and cannot start before the first micro-batch has passed the
    stages in front of it (the forwards of stages 0 to r - 1 and a message after each), nor end before its last
    backward has gone back through them. (Rank r's first action is a forward of its first stage, r, since every
    later stage of the rank needs that one's output; its last is a backward of stage r, since every other stage of the
    rank sends it its gradient.) For equal stages with free messages the bound of the last rank is 1F1B's makespan
    (m + p - 1)(F + B). The data-parallel collectives and the optimizer step after the last backward only add.
    `stage_s`: the scenario's `core.pipeline_time.stage_times`, when the caller has them; `after_s`: per pipeline
    rank, a floor under what it does after its last backward (`tail_floor_s`), none by default."""
    strategy, m = scenario.strategy, scenario.training.grad_accum_steps
    forward_s, backward_s = stage_s or stage_times(scenario, hardware)
    send_s = collective_cost("send", boundary_bytes(scenario), send_placement(scenario), network_model(hardware)).time_s
    best = 0.0
    for rank in range(strategy.pp):
        before = sum(forward_s[stage] + backward_s[stage] for stage in range(rank)) + 2 * rank * send_s
        busy = sum(forward_s[stage.index] + backward_s[stage.index] for stage in rank_stages(scenario, rank))
        best = max(best, before + m * busy + (after_s[rank] if after_s else 0.0))
    return best * (1.0 - ROUNDING_MARGIN)


def schedule_ends_s(
    scenario: Scenario, hardware: HardwareProfile, stage_s: tuple[list[float], list[float]]
) -> list[float]:
    """Per pipeline rank, the end of its last backward exactly as `core.pipeline_time` schedules it
    (`core.pipeline_schedule.simulate_pipeline` of the same stage times and message, without the ranks'
    data-parallel runs). The step is the latest rank's end plus its exposed communication and optimizer step, so
    each end plus a floor under those (`tail_floor_s`) is a lower bound tighter than `pipeline_bound_s`; it costs a
    schedule simulation (milliseconds), so it is asked only of a plan the cheaper bound did not prune."""
    strategy = scenario.strategy
    forward_s, backward_s = stage_s
    send_s = collective_cost("send", boundary_bytes(scenario), send_placement(scenario), network_model(hardware)).time_s
    timeline, _ = simulate_pipeline(
        strategy.pp_schedule,
        strategy.pp,
        strategy.virtual_stages,
        scenario.training.grad_accum_steps,
        forward_s,
        backward_s,
        send_s,
    )
    return [actions[-1][2] for actions in timeline]


def rank_end_s(scenario: Scenario, hardware: HardwareProfile, rank: int, backward_end_s: float) -> float:
    """When pipeline rank `rank` finishes its step, exactly as `core.pipeline_time.PipelineStep.end_s` (the end of
    its last backward, `schedule_ends_s`, plus its proxy's exposed communication and optimizer step, from the same
    runs): a lower bound under the step, which is the latest rank's end, at the cost of one rank's runs instead of
    every rank's."""
    proxy = rank_proxy(scenario, rank_stages(scenario, rank))
    exposed, optimizer = exposed_and_optimizer_s(proxy, step_runs(proxy, hardware, rank_placement(scenario, rank)))
    return backward_end_s + exposed + optimizer


def tail_floor_s(scenario: Scenario, hardware: HardwareProfile) -> list[float]:
    """Per pipeline rank, a floor under what its proxy's step does after its last backward (`core.pipeline_time`):
    its optimizer step (the time model's task for it, which only compute slowed beside asynchronous calls
    lengthens) and, for a step simulated whole, its exposed communication, at least the tensor-parallel calls inside
    every micro-batch's stages. The time model runs each of those between the compute task before its stage and the
    stage, which waits for it (`core.timeline_tasks`), so the compute stream idles at least their time: m x
    `tensor_parallel_floor_s` at the scenario's micro-batch size. A step longer than EXACT_MICRO_BATCHES
    micro-batches has its exposed time extended from two shorter runs, which that sum does not bound: its floor is
    the optimizer step alone."""
    strategy, m = scenario.strategy, scenario.training.grad_accum_steps
    whole = strategy.tp > 1 and m <= EXACT_MICRO_BATCHES
    floors: dict[Scenario, float] = {}  # ranks that hold the same share their proxy's floor
    size = scenario.training.micro_batch_size
    proxies = [rank_proxy(scenario, rank_stages(scenario, rank)) for rank in range(strategy.pp)]
    for proxy in proxies:
        if proxy not in floors:
            framework = rules_for(proxy).framework_s(proxy, hardware)
            optimizer = optimizer_task_s(proxy, compute_model(proxy, hardware), hardware, framework)
            floors[proxy] = (m * tensor_parallel_floor_s(proxy, hardware, size) if whole else 0.0) + optimizer
    return [floors[proxy] for proxy in proxies]


def busiest_states_bytes(scenario: Scenario) -> int:
    """The parameters, gradients and optimizer state one GPU of the busiest pipeline rank keeps on the GPU for the
    whole step (its engine's rules for the layers it holds, as `core.pipeline_memory` counts them): no peak of the
    pipeline is below it, whatever the micro-batch and checkpointing, so a pipeline whose states exceed the budget is
    dropped before its memory is estimated."""
    rules = rules_for(scenario)
    held = 0
    proxies = {rank_proxy(scenario, rank_stages(scenario, rank)) for rank in range(scenario.strategy.pp)}
    for proxy in proxies:
        states = rules.rank_states(proxy, 0)
        held = max(held, states.parameters_bytes + states.gradients_bytes + states.optimizer_state_bytes)
    return held
