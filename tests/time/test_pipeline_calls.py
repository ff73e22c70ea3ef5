"""The time model of a pipeline runs the calls its ledger counts: under the pytorch engine FSDP2 inside
torch.distributed.pipelining reduce-scatters once per step and gathers a stage only where the schedule finds it
resharded (core.engines.fsdp2_pipeline), so each pipeline rank's calls summed per (phase, op, group, bytes) are
`pipeline_rank_ledger`'s rows; the paper and deepspeed engines' pipelines make every micro-batch's calls."""

from collections import Counter

import pytest

from shardscope.core.comm import collective_ledger, comm_event_parts, with_micro_batches
from shardscope.core.pipeline import rank_stages
from shardscope.core.pipeline_memory import rank_proxy
from shardscope.core.pipeline_time import (
    pipeline_ledger,
    pipeline_rank_events,
    pipeline_rank_ledger,
    rank_placement,
)
from shardscope.core.result import CollectiveRow
from shardscope.core.timeline import EXACT_MICRO_BATCHES
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

Key = tuple[str, str, str, int, int]


def scenario(gpus: int, micro_batches: int, **strategy: object) -> Scenario:
    return Scenario(
        model=model_preset("llama-3-8b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=gpus),
        training=TrainingSpec(grad_accum_steps=micro_batches),
        strategy=Strategy(**strategy),  # type: ignore[arg-type]
    )


def summed(rows: list[CollectiveRow]) -> Counter[Key]:
    totals: Counter[Key] = Counter()
    for row in rows:
        if row.payload_bytes:
            totals[(row.phase, row.op, row.group, row.group_size, row.payload_bytes)] += row.count
    return totals


def event_totals(case: Scenario, rank: int) -> Counter[Key]:
    return summed([call.row for call in pipeline_rank_events(case, rank)] + pipeline_ledger(case, rank))


PYTORCH_PIPELINES = [
    dict(name="fsdp", pp=4, pp_schedule="1f1b", micro_batches=8),
    dict(name="fsdp", pp=4, pp_schedule="gpipe", micro_batches=6),
    dict(name="zero2", pp=4, pp_schedule="1f1b", micro_batches=8),
    dict(name="hsdp", shard_group=2, pp=4, pp_schedule="1f1b", micro_batches=8),
    dict(name="fsdp", pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2, micro_batches=4),
    dict(name="fsdp", tp=2, pp=2, pp_schedule="1f1b", micro_batches=20),
]


@pytest.mark.parametrize("case", PYTORCH_PIPELINES, ids=lambda case: "-".join(map(str, case.values())))
def test_pytorch_pipeline_calls_are_its_ledger(case: dict[str, object]) -> None:
    options = dict(case)
    question = scenario(16, int(options.pop("micro_batches")), **options)  # type: ignore[call-overload]
    for rank in range(question.strategy.pp):
        ledger = summed(list(pipeline_rank_ledger(question, rank)))
        assert event_totals(question, rank) == ledger, rank
        # and fewer calls than every micro-batch's: the reduce-scatters once per step
        proxy = rank_proxy(question, rank_stages(question, rank))
        every = summed(list(collective_ledger(proxy)))
        reduce = [key for key in every if key[1:3] == ("reduce_scatter", "dp")]
        assert reduce and all(ledger[key] * question.training.grad_accum_steps == every[key] for key in reduce)


@pytest.mark.parametrize("engine", ["paper", "deepspeed"])
@pytest.mark.parametrize("name", ["zero2", "fsdp"])
def test_other_engines_pipelines_make_every_micro_batchs_calls(engine: str, name: str) -> None:
    question = scenario(8, 4, name=name, engine=engine, pp=2, pp_schedule="1f1b")
    for rank in range(2):
        proxy = rank_proxy(question, rank_stages(question, rank))
        calls = [call.row for call in pipeline_rank_events(question, rank)]
        assert summed(calls) == summed(list(collective_ledger(proxy)))
        assert event_totals(question, rank) == summed(list(pipeline_rank_ledger(question, rank)))


def placed(question: Scenario, rank: int, micro_batches: int) -> Counter[Key]:
    """The data-parallel calls the time model runs for a proxy of pipeline rank `rank` over `micro_batches` (0: the
    step's)."""
    proxy = rank_proxy(question, rank_stages(question, rank))
    shorter = with_micro_batches(proxy, micro_batches or question.training.grad_accum_steps)
    return summed([call.row for call in rank_placement(question, rank)(shorter, comm_event_parts(shorter)[0])])


LONG_PIPELINES = [
    dict(name="fsdp", pp=8, pp_schedule="1f1b", micro_batches=24),
    dict(name="fsdp", pp=4, pp_schedule="gpipe", micro_batches=20),
    dict(name="zero2", pp=8, pp_schedule="1f1b", micro_batches=32),
]


@pytest.mark.parametrize("case", LONG_PIPELINES, ids=lambda case: "-".join(map(str, case.values())))
def test_runs_of_a_long_pipeline_step_extend_to_its_calls(case: dict[str, object]) -> None:
    # the time model runs EXACT_MICRO_BATCHES - 1 and EXACT_MICRO_BATCHES micro-batches of a longer step and extends
    # every total by the difference: so do the calls it places
    options = dict(case)
    question = scenario(32, int(options.pop("micro_batches")), **options)  # type: ignore[call-overload]
    extra = question.training.grad_accum_steps - EXACT_MICRO_BATCHES
    for rank in range(question.strategy.pp):
        before, last, whole = (
            placed(question, rank, count) for count in (EXACT_MICRO_BATCHES - 1, EXACT_MICRO_BATCHES, 0)
        )
        extended = {key: last[key] + extra * (last[key] - before[key]) for key in last | before}
        assert {key: count for key, count in extended.items() if count} == whole
