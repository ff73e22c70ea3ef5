"""What the planner answers: ranked plans, the best plan of each family, and why the other families do not fit."""

from __future__ import annotations

from dataclasses import dataclass

from shardscope.core.result import MemoryEstimate
from shardscope.planner.failure import FailureMode
from shardscope.planner.request import PlanRequest
from shardscope.planner.timing import PlanTiming
from shardscope.specs import Scenario


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
        """The strategy as printed: 'hsdp(8)' or the family."""
        strategy = self.scenario.strategy
        return strategy.label if strategy.preset.groups_replicate else self.family

    @property
    def gpus(self) -> int:
        """World size."""
        return self.scenario.cluster.world_size

    @property
    def global_batch_tokens(self) -> int:
        """Tokens per optimizer step across the job."""
        training = self.scenario.training
        return training.tokens_per_micro_batch * training.grad_accum_steps * self.gpus


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
    """Memory estimates computed (the rest were pruned or cached)."""
    fitting: int
    """Candidates that fit and were not dominated by a cheaper setting."""
    time_evaluations: int
    """Plans whose step was simulated (the rest were bounded out)."""


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
