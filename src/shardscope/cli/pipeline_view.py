"""`shardscope timeline --pp N`: a pipeline's step as the terminal shows it, stages by time with each micro-batch's
forward and backward, the bubble left as dots, and the numbers `estimate --pp N --time` reports."""

from __future__ import annotations

import math

from shardscope.cli.tables import render_table
from shardscope.core.pipeline import pipeline_stages
from shardscope.core.pipeline_time import PipelineStep
from shardscope.core.result import CollectiveRow
from shardscope.core.timeline import TimeEstimate
from shardscope.units import format_bytes

FEWEST_COLUMNS, MOST_COLUMNS = 100, 130
"""Width of the picture in characters (the whole step, the time after the last backward included): wide enough for
the shortest forward or backward to take three columns where that fits in MOST_COLUMNS."""
LABEL_COLUMNS = 3
"""Each forward and backward carries its micro-batch's number (F3, B3) when every one has at least this many columns;
otherwise none does, and the picture shows only their direction."""
MOST_ROWS = 24
"""Stages drawn at most; a longer pipeline shows its first and last MOST_ROWS / 2."""
FORWARD, BACKWARD, IDLE, EXPOSED, OPTIMIZER = ">", "<", ".", "~", "o"
LABEL_WIDTH = 19
"""Characters before a stage's row: 'stage 127 (rank 31)' and shorter line up."""
LEGEND = (
    f"F3{FORWARD * 2} forward of micro-batch 3, B3{BACKWARD * 4} its backward (no numbers where one is under "
    f"{LABEL_COLUMNS} columns), {IDLE} idle (the bubble, and the wait for the last rank), {EXPOSED} exposed "
    f"data-parallel communication, {OPTIMIZER} optimizer step"
)


def picture_columns(step: PipelineStep) -> int:
    """The picture's width: LABEL_COLUMNS for the shortest forward or backward, within the bounds."""
    shortest = min(end - start for actions in step.actions for _, start, end in actions)
    wanted = math.ceil(LABEL_COLUMNS * step.step_time_s / shortest) if shortest > 0 else MOST_COLUMNS
    return min(MOST_COLUMNS, max(FEWEST_COLUMNS, wanted))


def schedule_picture(step: PipelineStep, columns: int) -> list[str]:
    """One line per stage: its forwards and backwards where they run, its rank's idle time as dots, and what the
    rank does after its last backward."""
    scale = columns / step.step_time_s
    shortest = min(end - start for actions in step.actions for _, start, end in actions)
    labelled = shortest * scale >= LABEL_COLUMNS - 0.5  # rounded to whole columns, each then has at least three

    def cell(time_s: float) -> int:
        return min(columns, round(time_s * scale))

    virtual = step.scenario.strategy.virtual_stages
    lines = []
    for stage in pipeline_stages(step.scenario):
        actions = step.actions[stage.rank]
        row = [IDLE] * cell(step.end_s(stage.rank)) + [" "] * columns
        for action, start, end in actions:
            low = min(cell(start), columns - 1)
            high = max(cell(end), low + 1)
            if action.stage != stage.index:  # the rank runs another of its stages: not idle, not this row's
                row[low:high] = " " * (high - low)
                continue
            text = f"{'B' if action.backward else 'F'}{action.micro_batch}"
            fill = BACKWARD if action.backward else FORWARD
            shown = text[: high - low] if labelled else ""
            row[low:high] = shown + fill * (high - low - len(shown))
        moment = actions[-1][2]
        for mark, duration in zip((EXPOSED, OPTIMIZER), step.after_s(stage.rank), strict=True):
            low, high = cell(moment), cell(moment + duration)
            row[low:high] = mark * (high - low)
            moment += duration
        label = f"stage {stage.index}" + (f" (rank {stage.rank})" if virtual > 1 else "")
        lines.append(f"{label:>{LABEL_WIDTH}} |{''.join(row[:columns])}|")
    if len(lines) > MOST_ROWS:
        half = MOST_ROWS // 2
        lines = [*lines[:half], f"{'...':>{LABEL_WIDTH}}  {len(lines) - MOST_ROWS} stages not drawn", *lines[-half:]]
    last = f"{step.step_time_s * 1e3:.1f} ms"
    lines.append(f"{'':>{LABEL_WIDTH}}  0 ms{last:>{columns - 4}}")
    return lines


def render_pipeline(step: PipelineStep, estimate: TimeEstimate) -> str:
    """The summary of `timeline --pp`: the step's numbers (those of `estimate --time`), the bubble, the picture and
    the ledger of the pipeline rank that finishes last."""
    scenario, strategy = step.scenario, step.scenario.strategy
    shown, columns = step.shown_rank, picture_columns(step)
    layout = f", {strategy.virtual_stages} per rank" if strategy.virtual_stages > 1 else ""
    lines = [
        f"{scenario.model.name}, {strategy.label} ({strategy.engine}) on {scenario.cluster.world_size} ranks, "
        f"{scenario.cluster.ranks_per_node} per node; hardware: {estimate.hardware.name}",
        f"mesh {scenario.parallelism.described}; {strategy.pp_schedule} schedule, {strategy.pipeline_stages} stages"
        f"{layout}, {scenario.training.grad_accum_steps} micro-batches",
        "",
        f"step time           {step.step_time_s * 1e3:10.3f} ms (pipeline rank {shown} finishes last)",
        f"pipeline span       {step.span_s * 1e3:10.3f} ms (first forward to last backward)",
        f"bubble              {step.bubble_fraction:10.1%} of the pipeline ranks' time in the span is idle "
        f"(equal stages, free messages: {step.equal_stages_bubble_fraction:.1%})",
        f"message             {step.send.time_s * 1e3:10.3f} ms per send between stages",
        f"compute             {estimate.compute_time_s * 1e3:10.3f} ms (pipeline rank {shown})",
        f"communication       {estimate.comm_time_s * 1e3:10.3f} ms (sum of calls)",
        f"exposed comm        {estimate.exposed_comm_s * 1e3:10.3f} ms (the step beyond rank {shown}'s compute)",
        f"tokens per second   {estimate.tokens_per_s:10.1f} (whole job)",
        f"MFU                 {estimate.mfu:10.1%}",
        f"wire bytes per rank {format_bytes(estimate.wire_bytes_per_rank, 'MiB'):>13}",
        "",
        f"stages by time (one column = {step.step_time_s / columns * 1e3:.3f} ms):",
        *schedule_picture(step, columns),
        LEGEND,
        "",
        f"calls of pipeline rank {shown}:",
        render_table(
            ["phase", "op", "group", "payload", "calls"],
            [_ledger_cells(row) for row in estimate.ledger],
        ),
    ]
    return "\n".join(lines)


def _ledger_cells(row: CollectiveRow) -> list[str]:
    return [row.phase, row.op, f"{row.group} {row.group_size}", format_bytes(row.payload_bytes, "MiB"), str(row.count)]


def pipeline_json(step: PipelineStep) -> dict[str, object]:
    """The `pipeline` part of `timeline --pp --json`: the bubble and every rank's actions in time."""
    return {
        "span_s": step.span_s,
        "bubble_fraction": step.bubble_fraction,
        "last_pipeline_rank": step.shown_rank,
        "send_s": step.send.time_s,
        "ranks": [
            {
                "pipeline_rank": rank,
                "end_s": step.end_s(rank),
                "exposed_comm_s": step.after_s(rank)[0],
                "optimizer_s": step.after_s(rank)[1],
                "actions": [
                    {
                        "stage": action.stage,
                        "pass": "backward" if action.backward else "forward",
                        "micro_batch": action.micro_batch,
                        "start_s": start,
                        "end_s": end,
                    }
                    for action, start, end in actions
                ],
            }
            for rank, actions in enumerate(step.actions)
        ],
    }
