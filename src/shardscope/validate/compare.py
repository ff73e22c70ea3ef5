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
    """A memory category, 'peak', 'ledger_payload' (bytes of the step's collectives) or 'step_time_s'."""
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


def step_payload_bytes(ledger: tuple[CollectiveRow, ...]) -> int:
    """Bytes of one step's collectives (setup excluded: it happens once)."""
    return sum(row.total_payload_bytes for row in ledger if row.phase != "setup")


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
    rows.append(
        ValidationRow(
            case=case, quantity="step_time_s", predicted=predicted_step_s, traced=None, measured=measured_step_s
        )
    )
    return tuple(rows)
