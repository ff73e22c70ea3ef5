"""Side by side: one row per case and quantity, with the error of the prediction and of the trace against the
measurement, and whether each is within its target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardscope.core.result import CollectiveRow, MemoryBreakdown
from shardscope.validate.cases import ValidationCase

# Relative error allowed: (prediction, trace). Model states and the ledger must agree to the byte.
TARGETS: dict[str, tuple[float, float]] = {
    "parameters": (0.0, 0.0),
    "gradients": (0.0, 0.0),
    "optimizer_state": (0.0, 0.0),
    "ledger_payload": (0.0, 0.0),
    "point_to_point_payload": (0.0, 0.0),
    "activations": (0.05, 0.05),
    "peak": (0.05, 0.01),
}
REPORTED_ONLY = ("step_time_s",)  # timed, shown with its error, not gated (the time model has its own benchmark)


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationRow:
    """One quantity of one case, in the three layers."""

    case: ValidationCase
    """The case."""
    quantity: str
    """A memory category, 'peak', 'ledger_payload' (bytes of the step's collectives), 'point_to_point_payload'
    (bytes of its send and recv) or 'step_time_s'."""
    predicted: float
    """The core's figure."""
    traced: float | None
    """The trace's figure; None where the trace could not run this case."""
    measured: float
    """The real run's figure (rank 0)."""

    @property
    def error(self) -> float:
        """Relative error of the prediction against the measurement."""
        return _relative(self.predicted, self.measured)

    @property
    def traced_error(self) -> float | None:
        """Relative error of the trace against the measurement."""
        return None if self.traced is None else _relative(self.traced, self.measured)

    @property
    def ok(self) -> bool:
        """Within the targets (always true for quantities that are only reported)."""
        if self.quantity in REPORTED_ONLY:
            return True
        predicted_target, traced_target = TARGETS[self.quantity]
        traced_ok = self.traced_error is None or self.traced_error <= traced_target + 1e-12
        return self.error <= predicted_target + 1e-12 and traced_ok

    def to_json(self) -> dict[str, Any]:
        """One row of `shardscope.validate/v1`."""
        unit = "s" if self.quantity == "step_time_s" else "bytes"
        return {
            "case": self.case.to_json(),
            "category": self.quantity,
            f"predicted_{unit}": self.predicted,
            f"traced_{unit}": self.traced,
            f"measured_{unit}": self.measured,
            "error": self.error,
            "traced_error": self.traced_error,
            "ok": self.ok,
        }


def _relative(value: float, reference: float) -> float:
    if reference == 0:
        return 0.0 if value == 0 else float("inf")
    return abs(value - reference) / abs(reference)


POINT_TO_POINT = ("send", "recv")
"""Ring attention's exchange and a pipeline's messages: a payload row of their own (point_to_point_payload), and
compared call for call with the collectives (ledger_differences)."""
LedgerShape = tuple[str, str, int, int]


def _step_collectives(ledger: tuple[CollectiveRow, ...]) -> list[CollectiveRow]:
    """One step's collective rows: setup excluded (it happens once), send and recv excluded (counted apart)."""
    return [row for row in ledger if row.phase != "setup" and row.op not in POINT_TO_POINT]


def step_payload_bytes(ledger: tuple[CollectiveRow, ...]) -> int:
    """Bytes of one step's collectives."""
    return sum(row.total_payload_bytes for row in _step_collectives(ledger))


def point_to_point_bytes(ledger: tuple[CollectiveRow, ...]) -> int:
    """Bytes one step sends and receives point to point (context parallelism's ring, a pipeline's messages)."""
    return sum(row.total_payload_bytes for row in ledger if row.phase != "setup" and row.op in POINT_TO_POINT)


def _calls(ledger: tuple[CollectiveRow, ...]) -> dict[LedgerShape, int]:
    # by (phase, op, group size, payload): the run's rows do not know which mesh dimension a group is; send and
    # recv are calls like the collectives here (only the payload rows keep them apart)
    calls: dict[LedgerShape, int] = {}
    for row in ledger:
        if row.phase == "setup":
            continue
        shape = (row.phase, row.op, row.group_size, row.payload_bytes)
        calls[shape] = calls.get(shape, 0) + row.count
    return calls


def ledger_differences(predicted: tuple[CollectiveRow, ...], measured: tuple[CollectiveRow, ...]) -> tuple[str, ...]:
    """Every kind of collective, send or recv call whose count differs between the prediction and the run, one line
    each; empty when the two ledgers agree call for call (a stricter check than the payload totals)."""
    want, got = _calls(predicted), _calls(measured)
    return tuple(
        f"{phase} {op} of {payload:,} B over {size} ranks: predicted {want.get(shape, 0)}, measured {got.get(shape, 0)}"
        for shape in sorted(set(want) | set(got))
        if want.get(shape, 0) != got.get(shape, 0)
        for phase, op, size, payload in (shape,)
    )


def compare_case(
    case: ValidationCase,
    predicted: MemoryBreakdown,
    predicted_ledger: tuple[CollectiveRow, ...],
    predicted_step_s: float,
    traced: MemoryBreakdown | None,
    traced_ledger: tuple[CollectiveRow, ...] | None,
    traced_peak: int | None,
    measured: MemoryBreakdown,
    measured_ledger: tuple[CollectiveRow, ...],
    measured_step_s: float,
) -> tuple[ValidationRow, ...]:
    """The rows of one case."""
    rows = []
    for category in ("parameters", "gradients", "optimizer_state", "activations"):
        rows.append(
            ValidationRow(
                case=case,
                quantity=category,
                predicted=predicted.category_bytes(category),
                traced=None if traced is None else traced.category_bytes(category),
                measured=measured.category_bytes(category),
            )
        )
    rows.append(
        ValidationRow(
            case=case,
            quantity="peak",
            predicted=predicted.peak_bytes,
            traced=traced_peak,
            measured=measured.peak_bytes,
        )
    )
    rows.append(
        ValidationRow(
            case=case,
            quantity="ledger_payload",
            predicted=step_payload_bytes(predicted_ledger),
            traced=None if traced_ledger is None else step_payload_bytes(traced_ledger),
            measured=step_payload_bytes(measured_ledger),
        )
    )
    predicted_ring, measured_ring = point_to_point_bytes(predicted_ledger), point_to_point_bytes(measured_ledger)
    if predicted_ring or measured_ring:  # only the cases with a ring or a pipeline have the row
        rows.append(
            ValidationRow(
                case=case,
                quantity="point_to_point_payload",
                predicted=predicted_ring,
                traced=None if traced_ledger is None else point_to_point_bytes(traced_ledger),
                measured=measured_ring,
            )
        )
    rows.append(
        ValidationRow(
            case=case, quantity="step_time_s", predicted=predicted_step_s, traced=None, measured=measured_step_s
        )
    )
    return tuple(rows)
