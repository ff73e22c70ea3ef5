"""The pipeline's peak floor (core/pipeline_memory.py `pipeline_peak_floor_bytes`) stays under the busiest pipeline
rank's peak for every engine, family, offload, schedule, layer split, checkpointing, precision and model-parallel
cut, and is close enough to it to be worth asking."""

from __future__ import annotations

import dataclasses
import statistics

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_peak_floor import FAMILIES
from test_peak_floor import _scenario as _flat_scenario

from shardscope.choices import SpecError
from shardscope.core.pipeline_memory import pipeline_memory, pipeline_peak_floor_bytes
from shardscope.specs import Scenario

PIPELINES = [  # (pp, schedule, virtual stages, layers per stage)
    (2, "gpipe", 0, ()),
    (2, "1f1b", 0, ()),
    (4, "1f1b", 0, ()),
    (2, "1f1b", 0, (2, 0)),
    (2, "interleaved-1f1b", 2, ()),
]


def _scenario(
    engine: str,
    family: str,
    offload: str,
    pipeline: tuple[int, str, int, tuple[int, ...]],
    checkpointing: str,
    precision: str,
    tp: int,
    micro_batch: int,
    grad_accum: int,
) -> Scenario | None:
    """The choices as a scenario of tiny-llama (2 layers) or llama-3-8b (32) on 16 GPUs, None where the specs refuse
    them (offload of an unsharded family, a split the model's layers cannot make, ...)."""
    pp, schedule, virtual, layers = pipeline
    model = "tiny-llama" if layers else "llama-3-8b"
    choices = (model, engine, family, offload, checkpointing, precision, (tp, 1, 1), micro_batch, grad_accum, False)
    try:
        flat = _flat_scenario(*choices)
        strategy = dataclasses.replace(
            flat.strategy,
            pp=pp,
            pp_schedule=schedule,  # type: ignore[arg-type]
            pp_virtual_stages=virtual,
            pp_layers=layers,
            sequence_parallel=None,
        )
        return dataclasses.replace(flat, cluster=dataclasses.replace(flat.cluster, world_size=16), strategy=strategy)
    except SpecError:
        return None


POINTS = st.builds(
    _scenario,
    st.sampled_from(["pytorch", "deepspeed", "paper"]),
    st.sampled_from(list(FAMILIES)),
    st.sampled_from(["none", "optimizer", "optimizer+params"]),
    st.sampled_from(PIPELINES),
    st.sampled_from(["none", "selective", "full"]),
    st.sampled_from(["bf16-mixed", "fp32", "bf16"]),
    st.sampled_from([1, 2]),
    st.integers(1, 3),
    st.integers(1, 8),
)


def _peaks(scenario: Scenario) -> list[int] | None:
    """Every pipeline rank's peak, None where the estimate refuses the scenario."""
    try:
        return [entry.per_rank.peak_bytes for entry in pipeline_memory(scenario).per_stage]
    except SpecError:
        return None


@settings(max_examples=300, deadline=None)
@given(POINTS)
def test_the_floor_is_under_the_busiest_ranks_peak(scenario: Scenario | None) -> None:
    assume(scenario is not None)
    assert scenario is not None
    peaks = _peaks(scenario)
    assume(peaks is not None)
    assert peaks is not None
    assert pipeline_peak_floor_bytes(scenario) <= max(peaks)


def test_the_floor_is_close_to_the_peak() -> None:
    """Over llama-3-8b's pipelines on 16 GPUs the floor is at least half of the peak in the median (the context and
    the states alone are far under it at large micro-batches)."""
    ratios = []
    for engine in ("pytorch", "deepspeed", "paper"):
        for family in FAMILIES:
            for pipeline in PIPELINES:
                for checkpointing in ("none", "full"):
                    scenario = _scenario(engine, family, "none", pipeline, checkpointing, "bf16-mixed", 2, 2, 8)
                    peaks = _peaks(scenario) if scenario is not None else None
                    if scenario is None or peaks is None:
                        continue
                    floor = pipeline_peak_floor_bytes(scenario)
                    assert floor <= max(peaks)
                    ratios.append(floor / max(peaks))
    assert len(ratios) >= 60
    assert statistics.median(ratios) >= 0.5
