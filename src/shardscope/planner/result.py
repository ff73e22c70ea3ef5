"""What the planner answers: ranked plans, the best plan of each family, and why the other families do not fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardscope.core.comm import collective_ledger
from shardscope.core.params import count_parameters
from shardscope.core.result import MemoryEstimate
from shardscope.planner.failure import FailureMode
from shardscope.planner.request import PlanRequest
from shardscope.planner.timing import PlanTiming
from shardscope.specs import Scenario

PLAN_SCHEMA = "shardscope.plan/v1"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One way to train that fits: the scenario, its memory, its time, and what goes wrong next."""

    memory: MemoryEstimate
    """Per-rank memory (the scenario is memory.scenario)."""
    timing: PlanTiming
    """Step time and throughput."""
    failure_mode: FailureMode
    """The risk the plan runs into first."""
    risks: tuple[FailureMode, ...]
    """Every risk found, failure_mode first."""
    cost_per_million_tokens: float | None
    """price_per_gpu_hour x gpus x hours per million tokens; None without a price."""
    mesh_reason: str = ""
    """Why the plan splits the model with tensor, context, pipeline or expert parallelism ('' when it does not)."""

    @property
    def scenario(self) -> Scenario:
        """The question this plan answers."""
        return self.memory.scenario

    @property
    def family(self) -> str:
        """'ddp', 'zero1', 'zero2', 'zero3' or 'hsdp'."""
        return self.scenario.strategy.canonical_name

    @property
    def label(self) -> str:
        """The strategy as printed: the family, an hsdp's shard group and the model-parallel degrees ('hsdp(8)',
        'zero3+tp8')."""
        return self.scenario.strategy.label

    @property
    def gpus(self) -> int:
        """World size."""
        return self.scenario.cluster.world_size

    @property
    def global_batch_tokens(self) -> int:
        """Tokens per optimizer step across the job."""
        return self.scenario.tokens_per_step

    def to_json(self) -> dict[str, Any]:
        """One plan of `shardscope.plan/v1`: the fields of an estimate, its time, and the plan's own fields."""
        scenario, timing = self.scenario, self.timing
        training = scenario.training
        document = self.memory.to_json()
        document.update(
            gpus=self.gpus,
            micro_batch=training.micro_batch_size,
            grad_accum=training.grad_accum_steps,
            checkpointing=training.checkpointing,
            global_batch_tokens=self.global_batch_tokens,
            communication={
                "ledger": [row.to_json() for row in timing.ledger or collective_ledger(scenario)],
                "wire_bytes_per_rank": timing.wire_bytes_per_rank,
                "time_s": timing.comm_time_s,
                "exposed_time_s": timing.exposed_comm_s,
                "host_copy_time_s": timing.host_copy_s,
            },
            compute_time_s=timing.compute_time_s,
            step_time_s=timing.step_time_s,
            tokens_per_s=timing.tokens_per_s,
            mfu=timing.mfu,
            simulated_micro_batches=timing.simulated_micro_batches,
            cost_per_million_tokens=self.cost_per_million_tokens,
            mesh_reason=self.mesh_reason,
            failure_mode=self.failure_mode.to_json(),
            risks=[risk.to_json() for risk in self.risks[1:]],
        )
        return document


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """A family with no fitting plan anywhere in the space, and its closest attempt."""

    family: str
    """'ddp', 'zero1', 'zero2', 'zero3' or 'hsdp'."""
    category: str
    """Where the closest attempt breaks the budget: the category at which the running sum of its categories (in
    DESIGN.md order) passes the budget; 'host' when only host memory overflows."""
    over_by_bytes: int
    """How far the closest attempt's peak is over the budget."""
    closest: MemoryEstimate
    """The attempt that came closest."""

    def to_json(self) -> dict[str, object]:
        """One entry of `rejected` in `shardscope.plan/v1`."""
        scenario = self.closest.scenario
        return {
            "family": self.family,
            "category": self.category,
            "over_by_bytes": self.over_by_bytes,
            "closest": {
                "gpus": scenario.cluster.world_size,
                "shard_group": scenario.shard_degree,
                "parallelism": scenario.parallelism.to_json(),
                "offload": scenario.strategy.offload,
                "checkpointing": scenario.training.checkpointing,
                "micro_batch": scenario.training.micro_batch_size,
                "peak_bytes": self.closest.per_rank.peak_bytes,
            },
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchStats:
    """How much work the search did."""

    candidates: int
    """Points of the space considered (GPU count x strategy x offload x checkpointing x micro-batch)."""
    memory_evaluations: int
    """Memory estimates computed: the rest were dominated by a cheaper setting, left because their model states
    break the budget, or skipped because a lower bound on their step puts them out of the answer."""
    fitting: int
    """Of the candidates estimated, those that fit and were not dominated by a cheaper setting (a setting skipped by
    its lower bound is not counted, fitting or not)."""
    time_evaluations: int
    """Plans whose step was simulated (the rest were bounded out)."""

    def to_json(self) -> dict[str, int]:
        """The `stats` object of `shardscope.plan/v1`."""
        return {
            "candidates": self.candidates,
            "memory_evaluations": self.memory_evaluations,
            "fitting": self.fitting,
            "time_evaluations": self.time_evaluations,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The planner's answer."""

    request: PlanRequest
    """The question."""
    plans: tuple[Plan, ...]
    """The best plans, ranked by request.rank_by."""
    best_per_family: tuple[Plan, ...]
    """The best plan of every family that fits, ranked."""
    rejected: tuple[Rejection, ...]
    """Families with no plan that fits."""
    stats: SearchStats
    """Work done."""

    @property
    def fewest_gpus(self) -> int | None:
        """The smallest GPU count among the plans (the answer to --min-gpus), or None when nothing fits."""
        return min((plan.gpus for plan in self.plans), default=None)

    def to_json(self) -> dict[str, Any]:
        """The `shardscope.plan/v1` document."""
        request = self.request
        return {
            "schema": PLAN_SCHEMA,
            "model": {**request.model.to_json(), "parameters": count_parameters(request.model)},
            "gpu": request.gpu.to_json(),
            "request": _request_json(request),
            "fewest_gpus": self.fewest_gpus if request.min_gpus else None,
            "plans": [entry.to_json() for entry in self.plans],
            "best_per_family": [entry.to_json() for entry in self.best_per_family],
            "rejected": [rejection.to_json() for rejection in self.rejected],
            "stats": self.stats.to_json(),
        }


def _request_json(request: PlanRequest) -> dict[str, Any]:
    """The `request` object of `shardscope.plan/v1`: the question's limits (its model and GPU have their own)."""
    return {
        "sequence_length": request.sequence_length,
        "global_batch_tokens": request.global_batch_tokens,
        "batch_tolerance": request.batch_tolerance,
        "gpus_per_node": request.gpus_per_node,
        "max_gpus": request.max_gpus,
        "headroom": request.headroom,
        "budget_bytes": request.budget_bytes,
        "host_memory_bytes": request.host_memory_bytes,
        "rank_by": request.rank_by,
        "price_per_gpu_hour": request.price_per_gpu_hour,
        "min_gpus": request.min_gpus,
        "hardware": request.hardware.name if request.hardware else None,
    }
