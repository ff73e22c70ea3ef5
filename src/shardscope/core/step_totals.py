"""The totals of a step the planner ranks by (`step_totals`), without the ledger and schedule `core.timeline.simulate`
builds, and what a step's first micro-batch adds to them where every micro-batch repeats the same schedule
(`step_totals_and_increment`), so the planner extends a step of k micro-batches from one run of two."""

from __future__ import annotations

from itertools import compress, count, repeat
from operator import and_, attrgetter, eq, itemgetter, not_
from typing import NamedTuple

from shardscope.core.timeline import StepRun, run_step, run_totals
from shardscope.core.timeline_tasks import STREAM_OF_GROUP
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario


class StepTotals(NamedTuple):
    """The numbers of `simulate`'s TimeEstimate that the planner ranks by, without the ledger and the schedule it
    reads none of (merging the ledger and building a thousand spans cost as much as the scheduling)."""

    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    exposed_comm_s: float
    host_copy_s: float
    wire_bytes_per_rank: int
    peak_flops_per_s: float


def step_totals(scenario: Scenario, profile: HardwareProfile) -> StepTotals:
    """`simulate(scenario, profile)`'s totals, equal to the last bit (tests/time/test_step_totals.py): the same run
    from half the tasks (`core.step_graph.merged_runs`), summed in the same order (host copies in start order)."""
    return _step_totals_of(run_step(scenario, profile, merged=True))


def _step_totals_of(run: StepRun) -> StepTotals:
    """`step_totals` of a run."""
    step, compute_busy, comm, wire = run_totals(run)
    tasks, starts = run.tasks, run.starts
    # The host copies in index order, filtered at C speed (a step has a thousand tasks and a few copies), then in
    # issue order (run.order's: by key, then by index), then by start (stable, as the schedule's sort by start).
    host = list(compress(count(), map(eq, map(_STREAM, tasks), repeat("host"))))
    host.sort(key=lambda index: tasks[index].key)
    host.sort(key=starts.__getitem__)
    return StepTotals(
        step_time_s=step,
        compute_time_s=compute_busy,
        comm_time_s=comm,
        exposed_comm_s=max(0.0, step - compute_busy),
        host_copy_s=sum(tasks[index].duration_s for index in host),
        wire_bytes_per_rank=wire,
        peak_flops_per_s=run.compute.peak_flops_per_s,
    )


def step_totals_and_increment(scenario: Scenario, profile: HardwareProfile) -> tuple[StepTotals, StepTotals | None]:
    """`step_totals` of a step of two micro-batches, and what its first micro-batch adds to each total where
    every micro-batch repeats the same schedule (None elsewhere): the step from the end of its last backward to the end
    of the next micro-batch's, the compute stream's busy time of its tasks, and its calls' seconds, host copies and
    wire bytes. The planner extends a step of k micro-batches from these (`planner.timing.plan_timing`).

    The schedule repeats with overlap and no compute slowed beside asynchronous calls, where no stream can fall further
    behind from one micro-batch to the next: a ZeRO-3, FSDP or HSDP step (each micro-batch's compute waits for gathers
    queued behind the reductions before them), or a step whose micro-batch 0 makes no data-parallel call or copy after
    its backward (DDP and ZeRO-1 reduce in the last micro-batch only). Not under ZeRO-2, nor the paper's DDP beside
    context parallelism: reductions after every backward that no compute waits for can pile up on their stream, and
    the step grows by them, not by the compute. tests/planner/test_one_run_extension.py holds it to the extension from
    runs of one and two micro-batches."""
    run = run_step(scenario, profile, merged=True)
    totals = _step_totals_of(run)
    if not profile.overlap or profile.host_terms.async_compute_slowdown:
        return totals, None
    first = list(map(not_, map(_MICRO_BATCH, run.events)))  # micro-batch 0's calls
    if scenario.strategy.stage != 3:
        after_backward = map(eq, map(_TRIGGER, run.events), repeat("after_backward"))
        own_streams = map(
            _DATA_PARALLEL_STREAMS.__contains__, map(STREAM_OF_GROUP.get, map(_GROUP, run.events), repeat("comm"))
        )
        if any(compress(map(and_, after_backward, own_streams), first)):
            return totals, None
    per_micro_batch = (run.computes - 1) // scenario.training.grad_accum_steps  # the optimizer step is the last
    seconds = run.call_seconds or tuple(map(_DURATION, run.tasks[run.computes :]))
    host = map(and_, first, map(eq, map(_GROUP, run.events), repeat("host")))
    added = StepTotals(
        step_time_s=run.finish[2 * per_micro_batch - 1] - run.finish[per_micro_batch - 1],
        compute_time_s=sum(map(_DURATION, run.tasks[:per_micro_batch])),
        comm_time_s=sum(compress(seconds, first)),
        exposed_comm_s=0.0,
        host_copy_s=sum(compress(seconds, host)),
        wire_bytes_per_rank=round(sum(map(_WIRE_BYTES, compress(run.costs, first)))),
        peak_flops_per_s=totals.peak_flops_per_s,
    )
    return totals, added


_STREAM = itemgetter(2)  # Task.stream
_DURATION, _WIRE_BYTES = attrgetter("duration_s"), attrgetter("wire_bytes")
_MICRO_BATCH, _GROUP, _TRIGGER = attrgetter("micro_batch"), attrgetter("group"), attrgetter("trigger")
_DATA_PARALLEL_STREAMS = ("comm", "host")  # the data-parallel calls' stream and the host copies'
