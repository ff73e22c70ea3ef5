"""Statements a reader should take away, each computed from the report's own numbers, and the assumptions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardscope.core.memory import describe_assumptions
from shardscope.core.params import count_parameters
from shardscope.core.result import CATEGORIES
from shardscope.planner import PlanResult
from shardscope.presets.hardware import HardwareProfile
from shardscope.units import format_bytes

if TYPE_CHECKING:
    from shardscope.report.content import Row

MOMENTS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd-momentum": "SGD with momentum", "sgd": "SGD"}


def _gib(num_bytes: float) -> str:
    return format_bytes(num_bytes, "GiB")


def _moments(row: Row) -> str | None:
    """The optimizer's moments against the 16-bit weights, for the whole model."""
    training = row.memory.scenario.training
    moments = MOMENTS[training.optimizer]
    if not moments:
        return None
    parameters = count_parameters(row.memory.scenario.model)
    moment_bytes = 4 if training.is_mixed or training.precision == "fp32" else 2 if training.precision == "bf16" else 8
    weights = 2 * parameters
    held = moments * moment_bytes * parameters
    return (
        f"{OPTIMIZER_NAMES[training.optimizer]}'s {moments} moment{'s' if moments > 1 else ''} in "
        f"{moment_bytes * 8}-bit floats are {held / weights:.0f} times the bf16 weights: {_gib(held)} against "
        f"{_gib(weights)} for the whole model, before any sharding"
    )


def _activations(row: Row) -> str | None:
    per_rank = row.memory.per_rank
    training = row.memory.scenario.training
    if not row.memory.activations_estimated or not per_rank.parameters_bytes:
        return None
    ratio = per_rank.activations_bytes / per_rank.parameters_bytes
    return (
        f"activations are {ratio:.1f} times parameter memory at sequence length {training.sequence_length} "
        f"({_gib(per_rank.activations_bytes)} against {_gib(per_rank.parameters_bytes)} per rank, micro-batch "
        f"{training.micro_batch_size}, checkpointing {training.checkpointing})"
    )


def _sharding(rows: Sequence[Row]) -> str | None:
    """Memory per rank falls and bytes sent rise from DDP to the most sharded strategy."""
    by_label = {row.label: row for row in rows}
    ddp, sharded = by_label.get("ddp"), by_label.get("zero3")
    if ddp is None or sharded is None:
        return None
    text = (
        f"sharding cuts the peak per rank from {_gib(ddp.memory.per_rank.peak_bytes)} (ddp) to "
        f"{_gib(sharded.memory.per_rank.peak_bytes)} (zero3)"
    )
    if ddp.timing and sharded.timing and ddp.timing.wire_bytes_per_rank:
        ratio = sharded.timing.wire_bytes_per_rank / ddp.timing.wire_bytes_per_rank
        text += (
            f", while the bytes each rank sends per step go from {ddp.timing.wire_bytes_per_rank / 1e9:.1f} GB to "
            f"{sharded.timing.wire_bytes_per_rank / 1e9:.1f} GB ({ratio:.2f} times)"
        )
    return text


def _chosen(row: Row) -> list[str]:
    per_rank = row.memory.per_rank
    largest = max(CATEGORIES, key=per_rank.category_bytes)
    found = [
        f"the chosen plan ({row.label}) peaks at {_gib(per_rank.peak_bytes)} at the {row.memory.peak_moment}; its "
        f"largest category is {largest.replace('_', ' ')} ({_gib(per_rank.category_bytes(largest))})"
    ]
    if row.timing is not None:
        share = row.timing.exposed_comm_s / row.timing.step_time_s
        waiting = "communication not hidden behind compute"
        if row.memory.scenario.strategy.pp > 1:
            waiting = "beyond the last pipeline rank's compute: its share of the bubble and its exposed communication"
        found.append(
            f"{share:.0%} of its {row.timing.step_time_s:.3f} s step is {waiting}; "
            f"MFU {row.timing.mfu:.0%}, {row.timing.tokens_per_s:,.0f} tokens per second"
        )
    return found


def observations(rows: Sequence[Row], chosen: int) -> tuple[str, ...]:
    """Plain-English statements, each with the numbers that show it."""
    found = [_moments(rows[chosen]), _activations(rows[chosen]), _sharding(rows)]
    misses = [row.label for row in rows if not row.fits]
    if misses:
        found.append(f"does not fit in GPU memory at this setting: {', '.join(misses)}")
    return tuple(text for text in found if text) + tuple(_chosen(rows[chosen]))


def assumptions(row: Row, hardware: HardwareProfile | None, plan: PlanResult | None) -> tuple[str, ...]:
    """The chosen plan's memory assumptions, the hardware's, and the planner's."""
    found = list(describe_assumptions(row.memory))
    if hardware is not None:
        speed = f"{hardware.efficiency:.0%} of peak FLOP/s"
        if hardware.per_op_kernels:
            speed = f"each op at its kernel ceiling where the GPU has them (else {speed})"
        found.append(
            f"time model: {hardware.name}, {speed}, {hardware.algorithm} collectives, "
            f"communication {'overlapped with' if hardware.overlap else 'serialised with'} compute ({hardware.source})"
        )
        if row.memory.scenario.strategy.pp > 1:
            found.append("a pipeline's step is simulated whole: every pipeline rank, every micro-batch")
        else:
            found.append("a step of k micro-batches is timed from simulations of one and two, extended linearly")
    if plan is not None:
        request = plan.request
        found.append(
            f"plans keep {request.headroom:.0%} of GPU memory free (budget {_gib(request.budget_bytes)}) and reach "
            f"the global batch within {request.batch_tolerance:.0%}"
        )
    return tuple(found)
