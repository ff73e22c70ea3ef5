"""The full validation matrix (issues 6, 19 and 20): predicted, traced and measured for every case; writes
docs/accuracy.md.

Run: .venv/bin/python benchmarks/bench_validate.py [--out docs/accuracy.md] [--hardware profile.toml]
It takes about 40 minutes on a 2-core machine (every case really trains on gloo, and each torch-engine case is traced).
With --model-parallel it runs only issue 19's tensor- and context-parallel cases (a few minutes), with --pipeline
only issue 20's pipeline and expert-parallel cases, and rewrites only that section of the file, leaving the others
as they are.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

from shardscope.validate.cases import expert_parallel_matrix, full_matrix, model_parallel_matrix, pipeline_matrix
from shardscope.validate.compare import TARGETS
from shardscope.validate.runner import CaseResult, validate_cases

MODEL_PARALLEL_HEADING = "## Tensor, sequence and context parallelism"
PIPELINE_HEADING = "## Pipeline and expert parallelism"
MODEL_PARALLEL_TEXT = (
    "Tensor parallelism (tp 2) with and without sequence parallelism (sp), and context parallelism (cp 2, ring "
    "attention), inside data parallelism, on 4 gloo ranks (dp 2 x tp 2 and cp 2 x tp 2) and one 3-D case on 8 "
    "(dp 2 x cp 2 x tp 2); micro-batch 2 x 32 tokens. The paper engine predicts the teaching grid "
    "(runtime/teaching/model_parallel.py), which runs the tp and cp ranks inside ddp; it has no trace column. "
    "Targets as above. ledger_payload sums the step's collectives and point_to_point_payload its send and "
    "recv (ring attention's exchange, in the cases with cp); the run's ledger counts both, from the same "
    "dispatch mode. Where the trace's activations or peak differ from the run's by a few hundred bytes, it is the "
    "token batch, which the two hold differently: on CPU the run's rank slices the data-parallel ranks' whole "
    "batch without a copy and counts those storages, where the trace makes its rank's own tokens; under cp the run "
    "frees its chunk of the targets once the loss's backward has used it, where the trace's loop keeps it to the "
    "end of the step."
)
PIPELINE_TEXT = (
    "Pipelines of 4 micro-batches of 2 x 32 tokens on 4 gloo ranks: the teaching pipeline "
    "(runtime/teaching/pipeline.py) inside ddp, pp 2 x dp 2 and pp 4 under each schedule, which the paper engine "
    "predicts; torch.distributed.pipelining inside fully_shard (runtime/torch_pipeline.py), pp 2 x dp 2 under 1F1B "
    "and GPipe, which the pytorch engine predicts (FSDP2 keeping a stage's units gathered and its gradients "
    "unsharded between micro-batches: core/engines/fsdp2_pipeline.py) and `trace --pp` replays. Rank 0 holds the "
    "first stage. Expert parallelism: tiny-moe's experts split over ep 2 inside fsdp on 4 ranks, run by the "
    "teaching implementation, dropless and under GShard's capacity rule (capacity factor 1.25: every expert takes "
    "ceil(1.25 x 32 x 2 / 4) = 20 rows of each sequence, padded); and the capacity rule without expert parallelism "
    "inside torch's fully_shard on 2 ranks, which the trace replays. Targets as above; point_to_point_payload is "
    "the pipeline's sends and receives. "
    "Under 1F1B the torch pipeline's first stage holds one micro-batch's output past its backward: "
    "Schedule1F1B keeps the Works of its second-to-last warm-up send, and so the tensor it sent, to the end of its "
    "steady phase (docs/trace.md, the pipeline section); the trace replays that and the core counts it. The MoE "
    "router's routing is data-dependent: dropless, the prediction assumes even all-to-alls, the run's are not; "
    "under the capacity rule every buffer and message has a size the routing does not change."
)
SECTION_OPTIONS = {
    MODEL_PARALLEL_HEADING: ("--model-parallel", MODEL_PARALLEL_TEXT),
    PIPELINE_HEADING: ("--pipeline", PIPELINE_TEXT),
}
"""The sections after the data-parallel rows, in the file's order: the option that rewrites each alone, its text."""
SECTIONS = tuple(SECTION_OPTIONS)


def _fmt(value: float | None, quantity: str) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if quantity == "step_time_s" else f"{int(value):,}"


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def summary(results: list[CaseResult]) -> list[str]:
    """Per quantity, the prediction and the trace apart: rows within target and the largest error."""
    by_quantity: dict[str, list] = defaultdict(list)
    for result in results:
        for row in result.rows:
            by_quantity[row.quantity].append(row)
    lines = [
        "| quantity | target (predicted / traced) | predicted within target | largest predicted error | "
        "traced within target | largest traced error |",
        "|---|---|---|---|---|---|",
    ]
    for quantity, rows in by_quantity.items():
        target = TARGETS.get(quantity, (float("inf"), float("inf")))
        target_text = f"{target[0]:.0%} / {target[1]:.0%}" if quantity in TARGETS else "reported only"
        predicted_ok = sum(row.error <= target[0] + 1e-12 for row in rows)
        traced = [row.traced_error for row in rows if row.traced_error is not None]
        traced_ok = sum(error <= target[1] + 1e-12 for error in traced)
        lines.append(
            f"| {quantity} | {target_text} | {predicted_ok} of {len(rows)} | "
            f"{_err(max(row.error for row in rows))} | {traced_ok} of {len(traced)} | "
            f"{_err(max(traced) if traced else None)} |"
        )
    return lines


def _machine(device: str) -> str:
    import torch

    return (
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {'nccl on CUDA' if device == 'cuda' else 'gloo on CPU'}."
    )


def _every_row(results: list[CaseResult]) -> list[str]:
    lines = [
        "| case | quantity | predicted | traced | measured | predicted error | traced error | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in (row for result in results for row in result.rows):
        lines.append(
            f"| {row.case.label} | {row.quantity} | {_fmt(row.predicted, row.quantity)} | "
            f"{_fmt(row.traced, row.quantity)} | {_fmt(row.measured, row.quantity)} | {_err(row.error)} | "
            f"{_err(row.traced_error)} | {'yes' if row.ok else 'NO'} |"
        )
    return lines


def matrix_section(heading: str, results: list[CaseResult], seconds: float, command: str, device: str) -> list[str]:
    """One of SECTIONS, of its own cases (issue 19's, issue 20's): its summary, rows, the cases no run engine
    implements yet, and notes."""
    flag, text = SECTION_OPTIONS[heading]
    ran = [result for result in results if not result.not_run]
    rows = [row for result in ran for row in result.rows]
    failing = [row for row in rows if not row.ok]
    call_for_call = sum(not result.ledger_mismatches for result in ran)
    lines = [
        heading,
        "",
        f"Written by `{command}` on {datetime.date.today().isoformat()}, in {seconds / 60:.1f} minutes "
        f"(`{flag}` rewrites this section only; the full run writes it too).",
        f"{_machine(device)} {len(ran)} cases really train (rank 0 compared); {len(results) - len(ran)} more are "
        "in the matrix and wait for a run engine (listed below).",
        "",
        f"{text} Beyond the totals, every kind of call, collective, send or recv (phase, op, group size, "
        f"payload), is compared by its count: {call_for_call} of {len(ran)} cases agree call for call (the others "
        "are listed below the rows).",
        "",
        f"**{len(rows) - len(failing)} of {len(rows)} rows within target.**",
        "",
        *summary(ran),
        "",
        "### Every row",
        "",
        *_every_row(ran),
    ]
    waiting: dict[str, list[str]] = defaultdict(list)
    for result in results:
        if result.not_run:
            waiting[result.not_run].append(result.case.label)
    if waiting:
        lines += ["", "### Not run yet", ""]
        lines += [f"- {reason}: {', '.join(labels)}" for reason, labels in waiting.items()]
    lines += ["", "### Collective calls that differ", ""]
    lines += [f"- {r.case.label}: {line}" for r in ran for line in r.ledger_mismatches] or ["- none"]
    notes = sorted({note for result in ran for note in result.notes})
    lines += ["", "### Notes", ""] + [f"- {note}" for note in notes]
    return lines


def replace_section(out: Path, section: list[str]) -> None:
    """Rewrite one of SECTIONS (its heading is the section's first line) up to the next of them or the end of the
    file, putting it in its place where it is missing."""
    heading = section[0]
    text = out.read_text().rstrip("\n") + "\n"
    later = SECTIONS[SECTIONS.index(heading) + 1 :]
    starts = [text.index(f"\n{other}\n") for other in later if f"\n{other}\n" in text]
    end = min(starts, default=len(text))
    marker = f"\n{heading}\n"
    start = text.index(marker) if marker in text and text.index(marker) < end else end
    before, after = text[:start].rstrip("\n"), text[end:].lstrip("\n")
    out.write_text(before + "\n\n" + "\n".join(section) + "\n" + ("\n" + after if after else ""))


def write(results: list[CaseResult], out: Path, seconds: float, command: str, device: str) -> None:
    model_parallel = [result for result in results if result.case.splits_model]
    pipeline = [result for result in results if _pipeline_or_experts(result)]
    results = [result for result in results if not result.case.splits_model and not _pipeline_or_experts(result)]
    rows = [row for result in results for row in result.rows]
    failing = [row for row in rows if not row.ok]
    lines = [
        "# Accuracy: predicted and traced against measured",
        "",
        f"Written by `{command}` on {datetime.date.today().isoformat()}, in {seconds / 60:.1f} minutes.",
        f"{_machine(device)} Every case really trains ({len(results)} cases, rank 0 compared).",
        "",
        "Targets: parameters, gradients, optimizer state and the step's collective payload agree to the byte; the "
        "prediction's activations and peak within 5% of the measurement; the trace's peak within 1%. The trace "
        "replays torch's engines only (teaching strategies have no trace column) and cannot run the MoE router's "
        "data-dependent `nonzero` on fake tensors. Runs on CPU use gloo, whose reduce-scatter clones its input; "
        "the prediction and the trace are asked for a gloo cluster and count that clone.",
        "",
        f"**{len(rows) - len(failing)} of {len(rows)} rows within target.**",
        "",
        *summary(results),
        "",
        "## Every row",
        "",
        *_every_row(results),
    ]
    notes = sorted({note for result in results for note in result.notes})
    lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    for heading, cases in ((MODEL_PARALLEL_HEADING, model_parallel), (PIPELINE_HEADING, pipeline)):
        if cases:
            lines += ["", *matrix_section(heading, cases, seconds, command, device)]
    out.write_text("\n".join(lines) + "\n")


def _pipeline_or_experts(result: CaseResult) -> bool:
    return result.case.pp > 1 or result.case.ep > 1 or result.case.capacity_factor > 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/accuracy.md"))
    parser.add_argument("--hardware", help="hardware profile for step-time predictions")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo on CPU or nccl on GPUs")
    parser.add_argument(
        "--model-parallel",
        action="store_true",
        help="run only the tensor- and context-parallel cases and rewrite only their section of --out",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="run only the pipeline and expert-parallel cases and rewrite only their section of --out",
    )
    args = parser.parse_args()
    hardware = None
    if args.hardware:
        from shardscope.presets.profile_toml import load_profile

        hardware = load_profile(args.hardware)
    pipeline = pipeline_matrix(args.device) + expert_parallel_matrix(args.device)
    if args.model_parallel:
        cases = model_parallel_matrix(args.device)
    elif args.pipeline:
        cases = pipeline
    else:
        cases = full_matrix(args.device) + model_parallel_matrix(args.device) + pipeline
    started = time.monotonic()
    results = validate_cases(cases, hardware=hardware, progress=lambda text: print(text, file=sys.stderr))
    seconds = time.monotonic() - started
    command = "python benchmarks/bench_validate.py" + (" --model-parallel" if args.model_parallel else "")
    command += " --pipeline" if args.pipeline else ""
    command += f" --hardware {args.hardware}" if args.hardware else ""
    command += " --device cuda" if args.device == "cuda" else ""
    if args.model_parallel or args.pipeline:
        heading = MODEL_PARALLEL_HEADING if args.model_parallel else PIPELINE_HEADING
        replace_section(args.out, matrix_section(heading, results, seconds, command, args.device))
    else:
        write(results, args.out, seconds, command, args.device)
    rows = [row for result in results for row in result.rows]
    print(f"{sum(row.ok for row in rows)} of {len(rows)} rows within target; wrote {args.out}")
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
