"""The JSON Schema of every versioned document, built from the types and constants that write it; run as
`python -m shardscope.schemas.generate` to rewrite the checked-in files (`--check` only compares them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardscope.choices import (
    BACKENDS,
    ENGINE_ALIASES,
    ENGINES,
    OFFLOADS,
    PRECISIONS,
    STRATEGIES,
)
from shardscope.core.result import CATEGORIES, ESTIMATE_SCHEMA
from shardscope.planner.request import CHECKPOINTING_ORDER, RANKINGS
from shardscope.planner.request import FAMILIES as PLAN_FAMILIES
from shardscope.planner.result import PLAN_SCHEMA
from shardscope.presets.hardware import PROFILE_SCHEMA
from shardscope.runtime.api import SCHEMA as RUN_SCHEMA
from shardscope.schemas import SCHEMA_FILES
from shardscope.schemas.parts import (
    BOOLEAN,
    BYTES,
    CHECKPOINTING_MODE,
    COUNT,
    DEFS,
    DEGREE,
    NUMBER,
    STRING,
    STRINGS,
    Schema,
    array,
    closed,
    const,
    enum,
    mapping,
    nullable,
    ref,
    with_defs,
)
from shardscope.schemas.profile import hardware_schema
from shardscope.trace.result import SCHEMA as TRACE_SCHEMA
from shardscope.validate.cases import DEVICE_BACKEND
from shardscope.validate.compare import REPORTED_ONLY, TARGETS
from shardscope.validate.runner import VALIDATE_SCHEMA

ENGINE_WORDS = (*ENGINES, *ENGINE_ALIASES)

ESTIMATE_ENTRY: dict[str, Schema] = {
    "strategy": enum(STRATEGIES),
    "engine": enum(ENGINES),
    "world_size": DEGREE,
    "shard_group": DEGREE,
    "parallelism": ref("parallelism"),
    "sequence_parallel": BOOLEAN,
    "offload": enum(OFFLOADS),
    "parameters": COUNT,
    "per_rank": closed(
        {**DEFS["per_rank"]["properties"], "reserved_peak_bytes": BYTES},
        description="The busiest rank's bytes by category and its peak, and what the caching allocator reserves at "
        "most (without the context; `fits` is judged on it plus overhead_bytes).",
    ),
    "host_bytes": BYTES,
    "fits": BOOLEAN,
    "peak_moment": STRING,
    "activations_estimated": BOOLEAN,
    "assumptions": STRINGS,
}
COMMUNICATION: dict[str, Schema] = {
    "ledger": array(ref("collective")),
    "wire_bytes_per_rank": BYTES,
    "time_s": NUMBER,
    "exposed_time_s": NUMBER,
}
STEP: dict[str, Schema] = {"compute_time_s": NUMBER, "step_time_s": NUMBER, "tokens_per_s": NUMBER, "mfu": NUMBER}


SOURCE = closed(
    {
        "path": STRING,
        "format": enum(("deepspeed", "torchtitan", "accelerate")),
        "mapping": array(
            closed({"field": STRING, "flag": STRING, "value": {"type": ["string", "integer", "boolean"]}})
        ),
        "unmodelled": {"type": "object", "additionalProperties": STRING},
    },
    description="The --from config file and the flags each of its fields gave (configs.mapping.ConfigMapping).",
)


def pipeline_stage() -> Schema:
    """One entry of `per_stage`, in an estimate's strategy and in a plan."""
    return closed(
        {
            "pipeline_rank": COUNT,
            "stages": STRINGS,
            "layers": COUNT,
            "in_flight": array(COUNT),
            "per_rank": ref("per_rank"),
            "peak_moment": STRING,
        },
        description="One pipeline rank's memory (StageMemory.to_json).",
    )


def estimate_schema() -> Schema:
    """`estimate --json`: one model, cluster and training setup, an entry per strategy (with `--time`, its time)."""
    time = {"communication": closed(COMMUNICATION), **STEP, "simulated_micro_batches": COUNT, "hardware": STRING}
    optional = {**time, "per_stage": array(pipeline_stage())}
    entry = closed(
        {**ESTIMATE_ENTRY, **optional}, optional=optional, description="One strategy (MemoryEstimate.to_json)."
    )
    entry["dependentRequired"] = {"step_time_s": [key for key in time if key != "step_time_s"]}
    cluster = {"gpu": ref("gpu"), "world_size": DEGREE, "gpus_per_node": DEGREE, "num_nodes": DEGREE}
    document = {
        "schema": const(ESTIMATE_SCHEMA),
        "model": ref("model"),
        "cluster": closed({**cluster, "backend": enum(BACKENDS)}),
        "training": ref("training"),
        "strategies": {**array(entry), "minItems": 1},
        "source": SOURCE,
    }
    return with_defs(
        ESTIMATE_SCHEMA,
        "Predicted per-rank memory of strategies (core.result.estimate_document).",
        closed(document, optional=("source",)),
    )


def plan_schema() -> Schema:
    """`plan --json`: ranked plans, the best of each family, the families that do not fit, and the search's work."""
    entry = closed(
        {
            **ESTIMATE_ENTRY,
            "gpus": DEGREE,
            "micro_batch": DEGREE,
            "grad_accum": DEGREE,
            "checkpointing": enum(CHECKPOINTING_ORDER),
            "global_batch_tokens": COUNT,
            "communication": closed({**COMMUNICATION, "host_copy_time_s": NUMBER}),
            **STEP,
            "simulated_micro_batches": COUNT,
            "cost_per_million_tokens": nullable(NUMBER),
            "mesh_reason": STRING,
            "failure_mode": ref("failure_mode"),
            "risks": array(ref("failure_mode")),
            "per_stage": array(pipeline_stage()),
        },
        optional=("per_stage",),
        description="One plan (Plan.to_json): an estimate's fields, its time and the plan's own; a pipeline's carries "
        "per_stage.",
    )
    request = {
        "sequence_length": DEGREE,
        "global_batch_tokens": nullable(COUNT),
        "batch_tolerance": NUMBER,
        "gpus_per_node": DEGREE,
        "max_gpus": DEGREE,
        "headroom": NUMBER,
        "budget_bytes": BYTES,
        "host_memory_bytes": BYTES,
        "rank_by": enum(RANKINGS),
        "price_per_gpu_hour": nullable(NUMBER),
        "min_gpus": BOOLEAN,
        "hardware": nullable(STRING),
    }
    closest = {
        "gpus": DEGREE,
        "shard_group": DEGREE,
        "parallelism": ref("parallelism"),
        "offload": enum(OFFLOADS),
        "checkpointing": enum(CHECKPOINTING_ORDER),
        "micro_batch": DEGREE,
        "peak_bytes": BYTES,
    }
    rejection = {
        "family": enum(PLAN_FAMILIES),
        "category": enum((*CATEGORIES, "host")),
        "over_by_bytes": BYTES,
        "closest": closed(closest),
    }
    stats = ("candidates", "memory_evaluations", "fitting", "time_evaluations")
    document = {
        "schema": const(PLAN_SCHEMA),
        "model": ref("model"),
        "gpu": ref("gpu"),
        "request": closed(request),
        "fewest_gpus": nullable(DEGREE),
        "plans": array(entry),
        "best_per_family": array(entry),
        "rejected": array(closed(rejection, description="A family with no plan that fits (Rejection.to_json).")),
        "stats": closed(dict.fromkeys(stats, COUNT)),
        "source": SOURCE,
    }
    return with_defs(
        PLAN_SCHEMA,
        "Plans that fit, ranked (planner.result.PlanResult.to_json).",
        closed(document, optional=("source",)),
    )


def trace_schema() -> Schema:
    """`trace --json`: rank 0 of a step replayed on fake tensors."""
    flops = ("forward_flops", "backward_flops", "optimizer_flops", "attention_formula_flops", "total_flops")
    per_rank = {
        **DEFS["per_rank"]["properties"],
        "ledger": array(ref("collective")),
        "flops": closed(dict.fromkeys(flops, COUNT)),
        "peak_moment": STRING,
        "reserved_peak_bytes": nullable(BYTES),
    }
    module = {"name": STRING, "parameters_bytes": BYTES, "activations_bytes": BYTES, "flops": COUNT}
    document = {
        "schema": const(TRACE_SCHEMA),
        "model": STRING,
        "world_size": DEGREE,
        "strategy": enum(STRATEGIES),
        "engine": STRING,
        "parallelism": ref("parallelism"),
        "per_rank": closed(per_rank),
        "peak_by_category": mapping(enum(CATEGORIES), BYTES),
        "per_module": array(closed(module)),
        "fallbacks": array(closed({"category": enum(CATEGORIES), "reason": STRING})),
        "notes": STRINGS,
        "traced_blocks": array(DEGREE),
        "elapsed_s": NUMBER,
        "source": SOURCE,
    }
    return with_defs(
        TRACE_SCHEMA,
        "A replay on fake tensors (trace.result.TraceResult.to_json).",
        closed(document, optional=("source",)),
    )


def run_schema() -> Schema:
    """`run --json`: what every rank of a real run measured."""
    document = {
        "schema": const(RUN_SCHEMA),
        "model": closed({"name": STRING, "parameters": COUNT}),
        "strategy": enum(STRATEGIES),
        "engine": enum(ENGINE_WORDS),
        "world_size": DEGREE,
        "parallelism": ref("parallelism"),
        "sequence_parallel": BOOLEAN,
        "per_rank": {**array(ref("per_rank")), "minItems": 1},
        "ledger": array(ref("collective")),
        "parity": closed({"reference": STRING, "max_abs_diff": NUMBER, "ok": BOOLEAN}),
        "step_time_s": NUMBER,
    }
    return with_defs(RUN_SCHEMA, "A real run, rank by rank (runtime.api.RunResult.to_json).", closed(document))


def validate_schema() -> Schema:
    """`validate --json`: predicted, traced and measured side by side, one row per case and quantity."""
    case = {
        "model": STRING,
        "strategy": enum(STRATEGIES),
        "engine": enum(ENGINE_WORDS),
        "world_size": DEGREE,
        "precision": enum(PRECISIONS),
        "checkpointing": CHECKPOINTING_MODE,
        "device": enum(DEVICE_BACKEND),
        "parallelism": ref("parallelism"),
        "sequence_parallel": BOOLEAN,  # present when tp > 1
        "pp_schedule": STRING,  # these two when pp > 1
        "grad_accum": DEGREE,
        "capacity_factor": NUMBER,  # when the MoE model routes under a capacity rule
    }
    rows = []
    for quantities, unit, value in ((tuple(TARGETS), "bytes", BYTES), (REPORTED_ONLY, "s", NUMBER)):
        row = {
            "case": closed(case, optional=("sequence_parallel", "pp_schedule", "grad_accum", "capacity_factor")),
            "category": enum(quantities),
            f"predicted_{unit}": value,
            f"traced_{unit}": nullable(value),
            f"measured_{unit}": value,
            "error": NUMBER,
            "traced_error": nullable(NUMBER),
            "ok": BOOLEAN,
        }
        rows.append(closed(row))
    document = {
        "schema": const(VALIDATE_SCHEMA),
        "ok": BOOLEAN,
        "rows": array({"oneOf": rows}),
        "notes": mapping(STRING, STRINGS),
        "not_run": mapping(STRING, STRING),  # cases no run engine implements yet, with the reason
    }
    return with_defs(
        VALIDATE_SCHEMA,
        "Three layers side by side (validate.runner.validation_document).",
        closed(document, optional=("not_run",)),
    )


BUILDERS = {
    ESTIMATE_SCHEMA: estimate_schema,
    PLAN_SCHEMA: plan_schema,
    TRACE_SCHEMA: trace_schema,
    RUN_SCHEMA: run_schema,
    VALIDATE_SCHEMA: validate_schema,
    PROFILE_SCHEMA: hardware_schema,
}


def schema_text(name: str) -> str:
    """The checked-in text of a schema: two-space JSON and a final newline."""
    return json.dumps(BUILDERS[name](), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write every schema file next to this module, or with --check say which differ (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the files with what would be written")
    args = parser.parse_args(argv)
    if set(BUILDERS) != set(SCHEMA_FILES):
        raise SystemExit(f"schemas without a builder or a file: {sorted(set(BUILDERS) ^ set(SCHEMA_FILES))}")
    stale = []
    for name, filename in SCHEMA_FILES.items():
        path = Path(__file__).with_name(filename)
        text = schema_text(name)
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(filename)
        if not args.check:
            path.write_text(text, encoding="utf-8")
    verb = "differ from what the types generate" if args.check else "written"
    print(f"{len(stale)} of {len(SCHEMA_FILES)} schema files {verb}" + (f": {', '.join(stale)}" if stale else ""))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
