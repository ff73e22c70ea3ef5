"""The report's charts, drawn with matplotlib (imported here only) and returned as SVG text or written as PNG.

Text stays text in the SVG (svg.fonttype 'none'), so the page is small and its labels are searchable.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from shardscope.core.memory_curve import memory_curve
from shardscope.core.pipeline import pipeline_stages
from shardscope.core.pipeline_schedule import Action
from shardscope.core.result import CATEGORIES, OPS
from shardscope.core.timeline import STREAMS, Span
from shardscope.report.content import ReportData
from shardscope.units import GIB

plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "shardscope", "font.size": 9})
COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "activations": "#c44e52",
    "buffers": "#8172b3",
    "temporary": "#937860",
    "overhead": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "recompute": "#c44e52",
    "optimizer": "#55a868",
    "all_reduce": "#8172b3",
    "reduce_scatter": "#da8bc3",
    "all_gather": "#64b5cd",
    "broadcast": "#ccb974",
    "all_to_all": "#e377c2",
    "send": "#b07aa1",
    "recv": "#9c755f",
    "host_to_device": "#8c8c8c",
    "device_to_host": "#595959",
    "bubble": "#f2d0d0",
    "exposed": "#8172b3",
}
NUMBER_WIDTH = 0.015  # a pass wider than this fraction of the step carries its micro-batch's number
MERGE_GAP = 1e-3  # spans closer than this fraction of the step are drawn as one bar


@dataclass(frozen=True, slots=True, kw_only=True)
class Chart:
    """One chart: a file-safe name, a caption, and its SVG text."""

    name: str
    """Used for the PNG file name."""
    caption: str
    """What it shows."""
    svg: str
    """The SVG document."""


def _memory_bars(data: ReportData) -> Figure:
    figure, axes = plt.subplots(figsize=(7.5, 3.6))
    labels = [row.label + (" *" if index == data.chosen else "") for index, row in enumerate(data.rows)]
    bottom = [0.0] * len(data.rows)
    for category in CATEGORIES:
        values = [row.memory.per_rank.category_bytes(category) / GIB for row in data.rows]
        axes.bar(labels, values, bottom=bottom, color=COLORS[category], label=category.replace("_", " "))
        bottom = [low + value for low, value in zip(bottom, values, strict=True)]
    peaks = [row.memory.per_rank.peak_bytes / GIB for row in data.rows]
    axes.scatter(labels, peaks, marker="_", s=900, color="black", zorder=3, label="peak (one moment)")
    capacity = data.rows[0].memory.scenario.cluster.gpu.memory_bytes / GIB
    axes.axhline(capacity, color="#b00020", linestyle="--", linewidth=1.2, label=f"GPU memory {capacity:.0f} GiB")
    if data.budget_bytes < capacity * GIB:
        axes.axhline(data.budget_bytes / GIB, color="#b00020", linestyle=":", linewidth=1, label="budget")
    axes.set_ylabel("GiB per rank (largest size of each category)")
    top = max(capacity * 1.15, min(max(bottom), capacity * 4) * 1.05)
    axes.set_ylim(0, top)
    for index, peak in enumerate(peaks):  # the peak in numbers, also for bars cut off at the top
        axes.annotate(f"peak {peak:,.0f} GiB", (index, min(peak, top * 0.93)), ha="center", va="bottom", fontsize=7)
    axes.legend(fontsize=7, ncols=2, loc="upper right")
    return figure


def _comm_bars(data: ReportData) -> Figure:
    figure, axes = plt.subplots(figsize=(7.5, 3.2))
    labels = [row.label for row in data.rows]
    bottom = [0.0] * len(data.rows)
    for op in OPS:
        values = [sum(r.total_payload_bytes for r in row.ledger if r.op == op) / 1e9 for row in data.rows]
        if any(values):
            axes.bar(labels, values, bottom=bottom, color=COLORS[op], label=op.replace("_", "-"))
            bottom = [low + value for low, value in zip(bottom, values, strict=True)]
    for index, row in enumerate(data.rows):
        if row.timing is not None:
            axes.annotate(
                f"{row.timing.comm_time_s:.2f} s", (index, bottom[index]), ha="center", va="bottom", fontsize=7
            )
    axes.set_ylabel("GB per rank per step (payload)")
    axes.set_ylim(0, max([*bottom, 1e-9]) * 1.2)
    axes.legend(fontsize=7)
    return figure


def _memory_over_time(data: ReportData) -> Figure:
    assert data.timeline is not None
    row = data.rows[data.chosen]
    curve = memory_curve(row.memory, data.timeline)
    figure, axes = plt.subplots(figsize=(7.5, 3.2))
    series = [[value / GIB for value in values] for values in curve.bytes_by_category]
    colors = [COLORS[name] for name in curve.categories]
    names = [name.replace("_", " ") for name in curve.categories]
    for layer in axes.stackplot(curve.times_s, *series, colors=colors, labels=names, step="post"):
        layer.set_rasterized(True)  # thousands of vertices: a bitmap inside the SVG keeps the page small
    axes.axhline(
        row.memory.per_rank.peak_bytes / GIB, color="black", linestyle="--", linewidth=1, label="predicted peak"
    )
    capacity = row.memory.scenario.cluster.gpu.memory_bytes / GIB
    axes.axhline(capacity, color="#b00020", linestyle="--", linewidth=1.2, label="GPU memory")
    axes.set_xlabel("time in the step (s)")
    axes.set_ylabel("GiB on rank 0")
    axes.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return figure


def _merged(spans: list[Span], gap_s: float) -> list[tuple[float, float, str]]:
    """(start, duration, category) with neighbours of one category joined."""
    merged: list[tuple[float, float, str]] = []
    for span in sorted(spans, key=lambda span: span.start_s):
        if merged and merged[-1][2] == span.category and span.start_s - sum(merged[-1][:2]) <= gap_s:
            start, _, category = merged[-1]
            merged[-1] = (start, span.end_s - start, category)
        else:
            merged.append((span.start_s, span.duration_s, span.category))
    return merged


def _timeline(data: ReportData) -> Figure:
    assert data.timeline is not None
    estimate = data.timeline
    figure, axes = plt.subplots(figsize=(7.5, 2.4))
    seen: set[str] = set()
    used = {span.stream for span in estimate.spans}
    lanes = [stream for stream in STREAMS if stream in used or stream != "model_parallel"]  # tp/cp's only with them
    for lane, stream in enumerate(lanes):
        spans = [span for span in estimate.spans if span.stream == stream]
        for start, duration, category in _merged(spans, estimate.step_time_s * MERGE_GAP):
            label = category.replace("_", "-") if category not in seen else None
            seen.add(category)
            axes.broken_barh(
                [(start, duration)], (lane - 0.4, 0.8), color=COLORS.get(category, "#333"), label=label, rasterized=True
            )
    axes.set_yticks(range(len(lanes)), [f"{stream} stream" for stream in lanes])
    axes.invert_yaxis()
    axes.set_xlabel("time in the step (s)")
    axes.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    return figure


def _rank_idle(actions: tuple[tuple[Action, float, float], ...]) -> list[tuple[float, float]]:
    """(start, duration) of a pipeline rank's gaps between its first and last pass: its share of the bubble."""
    gaps, free = [], 0.0
    for _, start, end in actions:
        if start > free:
            gaps.append((free, start - free))
        free = max(free, end)
    return gaps


def _pipeline_schedule(data: ReportData) -> Figure:
    step = data.pipeline
    assert step is not None
    stages = pipeline_stages(step.scenario)
    figure, axes = plt.subplots(figsize=(7.5, 0.9 + 0.32 * len(stages)))
    virtual = step.scenario.strategy.virtual_stages
    for row, stage in enumerate(stages):
        actions = step.actions[stage.rank]
        axes.broken_barh(_rank_idle(actions), (row - 0.4, 0.8), color=COLORS["bubble"], rasterized=True)
        for kind in ("forward", "backward"):
            bars = [
                (start, end - start)
                for a, start, end in actions
                if a.stage == stage.index and a.backward == (kind == "backward")
            ]
            axes.broken_barh(
                bars, (row - 0.4, 0.8), color=COLORS[kind], edgecolor="white", linewidth=0.3, rasterized=True
            )
        for action, start, end in actions:
            if action.stage == stage.index and end - start > step.step_time_s * NUMBER_WIDTH:
                axes.text(
                    (start + end) / 2, row, str(action.micro_batch), ha="center", va="center", fontsize=6, color="white"
                )
        moment = actions[-1][2]
        for kind, duration in zip(("exposed", "optimizer"), step.after_s(stage.rank), strict=True):
            axes.broken_barh([(moment, duration)], (row - 0.4, 0.8), color=COLORS[kind], rasterized=True)
            moment += duration
    labels = [f"stage {stage.index}" + (f" (rank {stage.rank})" if virtual > 1 else "") for stage in stages]
    axes.set_yticks(range(len(stages)), labels)
    axes.invert_yaxis()
    axes.set_xlim(0, step.step_time_s)
    axes.set_xlabel("time in the step (s)")
    handles = [
        Patch(color=COLORS[key], label=label)
        for key, label in (
            ("forward", "forward (micro-batch number)"),
            ("backward", "backward"),
            (
                "bubble",
                f"idle: bubble {step.bubble_fraction:.1%} (equal stages {step.equal_stages_bubble_fraction:.1%})",
            ),
            ("exposed", "exposed data-parallel comm"),
            ("optimizer", "optimizer step"),
        )
    ]
    axes.legend(handles=handles, fontsize=7, ncols=3, loc="lower center", bbox_to_anchor=(0.5, 1.01))
    return figure


def _memory_per_stage(data: ReportData) -> Figure:
    memory = data.rows[data.chosen].memory
    figure, axes = plt.subplots(figsize=(7.5, 3.4))
    labels = [f"rank {entry.pipeline_rank}\n{' & '.join(entry.stages)}" for entry in memory.per_stage]
    bottom = [0.0] * len(labels)
    for category in CATEGORIES:
        values = [entry.per_rank.category_bytes(category) / GIB for entry in memory.per_stage]
        axes.bar(labels, values, bottom=bottom, color=COLORS[category], label=category.replace("_", " "))
        bottom = [low + value for low, value in zip(bottom, values, strict=True)]
    peaks = [entry.per_rank.peak_bytes / GIB for entry in memory.per_stage]
    axes.scatter(labels, peaks, marker="_", s=900, color="black", zorder=3, label="peak (one moment)")
    for index, entry in enumerate(memory.per_stage):
        held = "+".join(str(count) for count in entry.in_flight)
        axes.annotate(
            f"{peaks[index]:,.1f} GiB, {held} in flight", (index, peaks[index]), ha="center", va="bottom", fontsize=7
        )
    capacity = memory.scenario.cluster.gpu.memory_bytes / GIB
    axes.axhline(capacity, color="#b00020", linestyle="--", linewidth=1.2, label=f"GPU memory {capacity:.0f} GiB")
    axes.set_ylabel("GiB per GPU of each pipeline rank")
    axes.set_ylim(0, max(capacity, *bottom, *peaks) * 1.15)
    axes.tick_params(axis="x", labelsize=7)
    axes.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    return figure


def _svg(figure: Figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", dpi=150, metadata={"Date": None})
    return buffer.getvalue()


def draw(data: ReportData, png_dir: Path | None = None) -> tuple[Chart, ...]:
    """Every chart the data allows, as SVG; also as PNG files in png_dir when given."""
    row = data.rows[data.chosen]
    makers = [("memory", "Per-rank memory by category against the GPU's capacity (* = chosen plan)", _memory_bars)]
    if any(row.ledger for row in data.rows):
        makers.append(("communication", "Communication per step for each strategy (time on the bars)", _comm_bars))
    if data.timeline is not None:
        shown = data.timeline.scenario.training.grad_accum_steps
        total = row.memory.scenario.training.grad_accum_steps
        steps = f"{shown} of {total} micro-batches" if shown < total else f"{total} micro-batch(es)"
        makers.append(("memory-over-time", f"Memory over time, chosen plan ({row.label}, {steps})", _memory_over_time))
        makers.append(("timeline", f"Step timeline, chosen plan ({row.label}, {steps})", _timeline))
    if data.pipeline is not None:
        step = data.pipeline
        caption = (
            f"Pipeline schedule, chosen plan ({row.label}, {step.scenario.training.grad_accum_steps} micro-batches): "
            f"stages by time, the step {step.step_time_s:.3f} s ends when pipeline rank {step.shown_rank} finishes"
        )
        makers.append(("pipeline-schedule", caption, _pipeline_schedule))
        caption = (
            f"Memory of each pipeline rank by category, chosen plan ({row.label}); micro-batches in flight at its peak"
        )
        makers.append(("memory-per-stage", caption, _memory_per_stage))
    charts = []
    for name, caption, maker in makers:
        figure = maker(data)
        charts.append(Chart(name=name, caption=caption, svg=_svg(figure)))
        if png_dir is not None:
            png_dir.mkdir(parents=True, exist_ok=True)
            figure.savefig(png_dir / f"{name}.png", dpi=120, bbox_inches="tight")
        plt.close(figure)
    return tuple(charts)
