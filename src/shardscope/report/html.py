"""The page: one self-contained HTML file (inline CSS, inline SVG, no network), from the report's content."""

from __future__ import annotations

from html import escape

from shardscope.report.charts import Chart
from shardscope.report.content import ReportData
from shardscope.units import format_bytes

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; } td, th { padding: .2em .7em; text-align: right; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
tr.chosen { background: #eef4ff; font-weight: 600; } .no { color: #b00020; }
figure.chart { margin: 1em 0; } figure.chart svg { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: .9em; } dt { font-weight: 600; } dd { margin: 0 0 .3em 1em; }
"""
# The page needs no script; this one only records, for a headless check, how many charts rendered and any error.
CHECK = """
window.addEventListener("error", (e) => { document.body.dataset.errors = (document.body.dataset.errors || "") +
  e.message + ";"; });
window.addEventListener("load", () => { document.body.dataset.chartsRendered = [...document.querySelectorAll(
  "figure.chart svg")].filter((s) => { const r = s.getBoundingClientRect(); return r.width > 100 && r.height > 50;
  }).length; });
"""


def _gib(num_bytes: int) -> str:
    return format_bytes(num_bytes, "GiB")


def _table(header: list[str], rows: list[tuple[list[str], str]]) -> str:
    head = "".join(f"<th>{escape(cell)}</th>" for cell in header)
    body = "".join(
        f'<tr class="{css}">' + "".join(f"<td>{escape(cell)}</td>" for cell in cells) + "</tr>" for cells, css in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _comparison(data: ReportData) -> str:
    header = ["strategy", "params", "grads", "optimizer", "activations", "buffers", "temp", "peak", "reserved", "fits"]
    header += ["step s", "exposed comm s", "GB sent/rank", "tokens/s", "MFU"]
    rows = []
    for index, row in enumerate(data.rows):
        per_rank = row.memory.per_rank
        cells = [row.label + (" (chosen)" if index == data.chosen else "")]
        cells += [_gib(per_rank.category_bytes(name)) for name in ("parameters", "gradients", "optimizer_state")]
        cells += [_gib(per_rank.activations_bytes), _gib(per_rank.buffers_bytes), _gib(per_rank.temporary_bytes)]
        reserved = row.memory.reserved_peak_bytes + per_rank.overhead_bytes  # with the context, as the peak
        cells += [_gib(per_rank.peak_bytes), _gib(reserved), "yes" if row.fits else "NO"]
        timing = row.timing
        if timing is None:
            cells += ["-"] * 5
        else:
            cells += [f"{timing.step_time_s:.3f}", f"{timing.exposed_comm_s:.3f}"]
            cells += [f"{timing.wire_bytes_per_rank / 1e9:.1f}", f"{timing.tokens_per_s:,.0f}", f"{timing.mfu:.1%}"]
        rows.append((cells, "chosen" if index == data.chosen else ""))
    return _table(header, rows)


def _plans(data: ReportData) -> str:
    if data.plan is None:
        return ""
    header = ["#", "strategy", "GPUs", "micro", "accum", "ckpt", "offload", "peak", "step s", "tokens/s", "next"]
    rows = []
    for index, entry in enumerate(data.plan.plans, 1):
        training = entry.scenario.training
        cells = [str(index), entry.label, str(entry.gpus), str(training.micro_batch_size)]
        cells += [str(training.grad_accum_steps), training.checkpointing, entry.scenario.strategy.offload]
        cells += [_gib(entry.memory.per_rank.peak_bytes), f"{entry.timing.step_time_s:.3f}"]
        cells += [f"{entry.timing.tokens_per_s:,.0f}", entry.failure_mode.message]
        rows.append((cells, "chosen" if index == 1 else ""))
    rejected = "".join(
        f"<li>{escape(r.family)}: {escape(r.category.replace('_', ' '))} break the budget; the closest attempt is "
        f"over by {_gib(r.over_by_bytes)}</li>"
        for r in data.plan.rejected
    )
    section = f"<h2>Plans that fit, fastest first (ranked by {escape(data.plan.request.rank_by)})</h2>"
    section += _table(header, rows)
    return section + (f"<h3>Families that do not fit</h3><ul>{rejected}</ul>" if rejected else "")


def _stages(data: ReportData) -> str:
    """The chosen plan's pipeline: its bubble and every pipeline rank's memory by category (`per_stage`)."""
    memory = data.rows[data.chosen].memory
    if not memory.per_stage:
        return ""
    header = ["pipeline rank", "stages", "layers", "in flight", "params", "grads", "optimizer", "activations"]
    header += ["buffers", "temp", "peak", "peak moment"]
    rows = []
    for entry in memory.per_stage:
        per_rank = entry.per_rank
        cells = [str(entry.pipeline_rank), " & ".join(entry.stages), str(entry.layers)]
        cells += ["+".join(str(count) for count in entry.in_flight)]
        cells += [_gib(per_rank.category_bytes(name)) for name in ("parameters", "gradients", "optimizer_state")]
        cells += [_gib(per_rank.activations_bytes), _gib(per_rank.buffers_bytes), _gib(per_rank.temporary_bytes)]
        cells += [_gib(per_rank.peak_bytes), entry.peak_moment]
        rows.append((cells, "chosen" if per_rank == memory.per_rank else ""))  # the busiest, shown above
    strategy = memory.scenario.strategy
    section = f"<h2>Pipeline: {strategy.pp} ranks, {escape(strategy.pp_schedule)}"
    section += f", {memory.scenario.training.grad_accum_steps} micro-batches</h2>"
    step = data.pipeline
    if step is not None:
        section += (
            f"<p>Step {step.step_time_s:.3f} s, pipeline rank {step.shown_rank} finishes last; from the first forward "
            f"to the last backward ({step.span_s:.3f} s) the pipeline ranks sit idle {step.bubble_fraction:.1%} of "
            f"their time (the bubble; {step.equal_stages_bubble_fraction:.1%} with equal stages and free messages)."
            "</p>"
        )
    return section + _table(header, rows)


def render(data: ReportData, charts: tuple[Chart, ...]) -> str:
    """The whole page."""
    scenario = "".join(f"<dt>{escape(what)}</dt><dd>{escape(value)}</dd>" for what, value in data.scenario_lines)
    figures = "".join(
        f'<figure class="chart" id="{escape(chart.name)}">{chart.svg[chart.svg.index("<svg") :]}'
        f"<figcaption>{escape(chart.caption)}</figcaption></figure>"
        for chart in charts
    )
    observations = "".join(f"<li>{escape(text)}</li>" for text in data.observations)
    assumptions = "".join(f"<li>{escape(text)}</li>" for text in data.assumptions)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(data.title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style>
<script>{CHECK}</script></head>
<body><h1>{escape(data.title)}</h1>
<h2>Scenario (chosen plan)</h2><dl>{scenario}</dl>
{_plans(data)}
<h2>Strategies compared at the chosen plan's GPUs and batch</h2>{_comparison(data)}
{_stages(data)}
<h2>Charts</h2>{figures}
<h2>Observations</h2><ul>{observations}</ul>
<h2>Assumptions</h2><ul>{assumptions}</ul>
<p><small>Written by shardscope; every number on this page is computed, none measured.</small></p>
</body></html>
"""
