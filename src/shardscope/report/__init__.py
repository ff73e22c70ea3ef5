"""`shardscope report`: one self-contained HTML page with the comparison, the charts, observations and assumptions.

matplotlib is imported only when a report is written, never by `import shardscope.report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardscope.planner import PlanResult
    from shardscope.presets.hardware import HardwareProfile
    from shardscope.specs import Scenario


def write_report(
    subject: Sequence[Scenario] | PlanResult,
    path: str | Path,
    *,
    png_dir: str | Path | None = None,
    hardware: HardwareProfile | None = None,
) -> Path:
    """Write the report for scenarios to compare (one per strategy) or for a plan; returns the page's path.

    With scenarios, the chosen plan is the fastest that fits; with a PlanResult, its best plan, compared with every
    other family at the same GPUs and batch. png_dir also receives each chart as a PNG file.
    """
    from shardscope.report.charts import draw
    from shardscope.report.content import build
    from shardscope.report.html import render

    data = build(subject, hardware)
    charts = draw(data, Path(png_dir) if png_dir is not None else None)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render(data, charts), encoding="utf-8")
    return target


__all__ = ["write_report"]
