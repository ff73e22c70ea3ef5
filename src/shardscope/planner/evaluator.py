"""Memory, time and lower bounds of the planner's scenarios, each computed once and kept: the search asks the same
bounds of many points (every family, shard group and offload of a shape share their compute)."""

from __future__ import annotations

from shardscope.core.memory import estimate_memory
from shardscope.core.pipeline_time import stage_times
from shardscope.core.result import MemoryEstimate
from shardscope.planner.pipeline import (
    pipeline_bound_s,
    pipeline_timing,
    rank_end_s,
    schedule_ends_s,
    tail_floor_s,
)
from shardscope.planner.request import PlanRequest
from shardscope.planner.timing import (
    ROUNDING_MARGIN,
    PlanTiming,
    communication_floor,
    micro_batch_compute_s,
    optimizer_floor_s,
    plan_timing,
    tensor_parallel_floor_s,
)
from shardscope.presets.hardware import default_profile
from shardscope.specs import Scenario

RANKS_TRIED = 2
"""Pipeline ranks whose exact end `Evaluator.pipeline_rank_end_s` works out before a plan is simulated whole."""


class Evaluator:
    """Memory, time and bounds of scenarios, each computed once."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self.hardware = request.hardware or default_profile(request.gpu)
        self._memory: dict[Scenario, MemoryEstimate] = {}
        self._timing: dict[Scenario, PlanTiming] = {}
        self._tight: dict[Scenario, float] = {}
        self._optimizer: dict[Scenario, float] = {}
        self._micro_batch_compute: dict[tuple[int, str, int, int, bool], float] = {}
        self._bound: dict[tuple[int, int, str, int, int, bool], float] = {}
        self._tp_floor: dict[tuple[str, int, int, bool], float] = {}
        self._tp_floor_at: dict[tuple[str, int, int, bool, int], float] = {}
        self._pipeline_bound: dict[tuple[object, ...], float] = {}
        self._stage_times: dict[tuple[object, ...], tuple[list[float], list[float]]] = {}
        self._rank_floors: dict[Scenario, list[float]] = {}
        self._rank_ends: dict[Scenario, dict[int, float]] = {}
        self._backward_ends: dict[tuple[object, ...], list[float]] = {}

    def memory(self, scenario: Scenario) -> MemoryEstimate:
        found = self._memory.get(scenario)
        if found is None:
            found = self._memory[scenario] = estimate_memory(scenario)
        return found

    def new_memory(self, scenario: Scenario) -> MemoryEstimate:
        """The memory of a point of the search: each is asked once (every point differs in GPU count, degrees,
        setting or micro-batch), so the cache is written without the lookup (its key hashes a whole scenario)."""
        found = self._memory[scenario] = estimate_memory(scenario)
        return found

    def timing(self, scenario: Scenario) -> PlanTiming:
        found = self._timing.get(scenario)
        if found is None:
            pipelined = scenario.strategy.pp > 1
            found = (pipeline_timing if pipelined else plan_timing)(scenario, self.hardware)
            self._timing[scenario] = found
        return found

    def pipeline_bound_s(self, scenario: Scenario) -> float:
        """`planner.pipeline.pipeline_bound_s`, kept per pipeline shape: it reads the stages' compute and the
        messages between them, the same for every data-parallel family, shard group and offload."""
        key = _pipeline_shape(scenario)
        found = self._pipeline_bound.get(key)
        if found is None:
            found = self._pipeline_bound[key] = pipeline_bound_s(scenario, self.hardware, self._stage_s(key, scenario))
        return found

    def _stage_s(self, key: tuple[object, ...], scenario: Scenario) -> tuple[list[float], list[float]]:
        """The stages' compute, that of one micro-batch whatever the GPU count and micro-batch count, kept."""
        stage_key = (*key[1:-1], False)
        found = self._stage_times.get(stage_key)
        if found is None:
            found = self._stage_times[stage_key] = stage_times(scenario, self.hardware)
        return found

    def backward_ends_s(self, scenario: Scenario) -> list[float]:
        """`planner.pipeline.schedule_ends_s`, kept per pipeline shape (the same for every data-parallel family,
        shard group and offload, as `pipeline_bound_s`)."""
        key = _pipeline_shape(scenario)
        found = self._backward_ends.get(key)
        if found is None:
            found = self._backward_ends[key] = schedule_ends_s(scenario, self.hardware, self._stage_s(key, scenario))
        return found

    def schedule_bound_s(self, scenario: Scenario) -> float:
        """The latest pipeline rank's last backward as the schedule places it: a lower bound under the step between
        `pipeline_bound_s` (which it never falls below) and the tight bound, shared by every family and offload of
        a pipeline shape, so the search asks it before it estimates their memory."""
        return max(self.backward_ends_s(scenario)) * (1.0 - ROUNDING_MARGIN)

    def lower_bound_s(self, scenario: Scenario) -> float:
        if scenario.strategy.pp > 1:
            return self.pipeline_bound_s(scenario)
        training, strategy = scenario.training, scenario.strategy
        # what the compute stream does: the batch shape, the recompute, and each rank's share of the model
        shape = (training.checkpointing, strategy.tp, strategy.cp, strategy.uses_sequence_parallel)
        key = (training.micro_batch_size, training.grad_accum_steps, *shape)
        found = self._bound.get(key)
        if found is None:
            floor = self._tp_floor.get(shape)
            if floor is None:
                floor = self._tp_floor[shape] = tensor_parallel_floor_s(scenario, self.hardware)
            found = self._bound[key] = self.compute_bound_s(scenario) + floor * training.grad_accum_steps
        return found

    def compute_bound_s(self, scenario: Scenario) -> float:
        """compute_lower_bound_s, one micro-batch priced once for every micro-batch count."""
        training, strategy = scenario.training, scenario.strategy
        key = (
            training.micro_batch_size,
            training.checkpointing,
            strategy.tp,
            strategy.cp,
            strategy.uses_sequence_parallel,
        )
        found = self._micro_batch_compute.get(key)
        if found is None:
            found = self._micro_batch_compute[key] = micro_batch_compute_s(scenario, self.hardware)
        return found * training.grad_accum_steps

    def further_bound_s(self, scenario: Scenario, asked: int) -> float | None:
        """The `asked`-th bound after the cheap one (`lower_bound_s`), each tighter and costlier than the one
        before, None once none is left (the plan is simulated): without a pipeline, the compute chain with the
        optimizer step (`optimizer_bound_s`), then the communication floor (`tight_bound_s`); a pipeline's floor,
        then the exact ends of its likeliest last ranks (`pipeline_rank_end_s`)."""
        if scenario.strategy.pp > 1:
            return self.tight_bound_s(scenario) if asked == 0 else self.pipeline_rank_end_s(scenario, asked - 1)
        if asked == 0:
            return self.optimizer_bound_s(scenario)
        return self.tight_bound_s(scenario) if asked == 1 else None

    def optimizer_bound_s(self, scenario: Scenario) -> float:
        """The compute stream's chain (`chain_s`) then the optimizer step (`planner.timing.optimizer_floor_s`): what
        the communication floor adds its calls to, with no call built, so an offloaded plan whose CPU-Adam step
        already puts it out of the running is never asked the floor."""
        return (self.chain_s(scenario) + self._optimizer_s(scenario)) * (1.0 - ROUNDING_MARGIN)

    def _optimizer_s(self, scenario: Scenario) -> float:
        found = self._optimizer.get(scenario)
        if found is None:
            found = self._optimizer[scenario] = optimizer_floor_s(scenario, self.hardware)
        return found

    def tight_bound_s(self, scenario: Scenario) -> float:
        """The lower bound with the communication floor (planner.timing.CommunicationFloor): costlier to compute, so
        asked only of a plan the compute bound did not prune, and kept: the second ranking (`_Search.best_of`)
        asks again."""
        found = self._tight.get(scenario)
        if found is None:
            pipelined = scenario.strategy.pp > 1
            found = self._pipeline_tight_bound_s(scenario) if pipelined else self._tight_bound_s(scenario)
            self._tight[scenario] = found
        return found

    def _pipeline_tight_bound_s(self, scenario: Scenario) -> float:
        """The latest of the pipeline ranks' floors (`pipeline_rank_floors_s`)."""
        return max(self.pipeline_rank_floors_s(scenario)) * (1.0 - ROUNDING_MARGIN)

    def pipeline_rank_floors_s(self, scenario: Scenario) -> list[float]:
        """Per pipeline rank, a floor under when it finishes: the end of its last backward as the schedule places
        it (`planner.pipeline.schedule_ends_s`) plus the floor under what it does after it
        (`planner.pipeline.tail_floor_s`, which depends on the data-parallel degrees too); kept, asked only of a
        plan the cheap bound did not prune."""
        found = self._rank_floors.get(scenario)
        if found is None:
            ends, after_s = self.backward_ends_s(scenario), tail_floor_s(scenario, self.hardware)
            found = self._rank_floors[scenario] = [end + after for end, after in zip(ends, after_s, strict=True)]
        return found

    def pipeline_rank_end_s(self, scenario: Scenario, nth: int) -> float | None:
        """When the `nth` likeliest pipeline rank to finish last (by its floor, `pipeline_rank_floors_s`) finishes,
        exactly (`planner.pipeline.rank_end_s`), kept; None past the RANKS_TRIED likeliest. Each is a lower bound
        under the step at the cost of one rank's runs, so a plan one of them already puts out of the running is
        never simulated whole."""
        floors = self.pipeline_rank_floors_s(scenario)
        if nth >= min(RANKS_TRIED, len(floors)):
            return None
        ends = self._rank_ends.setdefault(scenario, {})
        found = ends.get(nth)
        if found is None:
            rank = sorted(range(len(floors)), key=lambda rank: -floors[rank])[nth]
            found = ends[nth] = rank_end_s(scenario, self.hardware, rank, self.backward_ends_s(scenario)[rank])
        return found

    def chain_s(self, scenario: Scenario) -> float:
        """The compute stream's chain: the compute bound plus the tensor-parallel floor at the plan's micro-batch."""
        training, strategy = scenario.training, scenario.strategy
        shape = (training.checkpointing, strategy.tp, strategy.cp, strategy.uses_sequence_parallel)
        key = (*shape, training.micro_batch_size)
        floor = self._tp_floor_at.get(key)
        if floor is None:
            floor = self._tp_floor_at[key] = tensor_parallel_floor_s(scenario, self.hardware, training.micro_batch_size)
        return self.compute_bound_s(scenario) + floor * training.grad_accum_steps

    def _tight_bound_s(self, scenario: Scenario) -> float:
        floor = communication_floor(scenario, self.hardware, self._optimizer_s(scenario))
        return floor.bound_s(self.chain_s(scenario))

    @property
    def memory_evaluations(self) -> int:
        return len(self._memory)

    @property
    def time_evaluations(self) -> int:
        return len(self._timing)


def _pipeline_shape(scenario: Scenario) -> tuple[object, ...]:
    """What a pipeline's schedule reads of a scenario (the GPU count, the degrees, the schedule, the micro-batch and
    its count, the checkpointing): every family, shard group and offload of it shares its bounds."""
    training, strategy = scenario.training, scenario.strategy
    return (
        scenario.cluster.world_size,
        strategy.tp,
        strategy.cp,
        strategy.pp,
        strategy.pp_schedule,
        strategy.virtual_stages,
        strategy.ep,
        training.micro_batch_size,
        training.checkpointing,
        training.grad_accum_steps,
    )
