"""The pipeline's peak floor (core/pipeline_memory.py `pipeline_peak_floor_bytes`) stays under the busiest pipeline
rank's peak for every engine, family, offload, schedule, layer split, checkpointing, precision and model-parallel
cut, and is close enough to it to be worth asking."""

from __future__ import annotations

import statistics

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardscope.choices import SpecError
from shardscope.core.pipeline_memory import pipeline_memory, pipeline_peak_floor_bytes
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

FAMILIES = {"ddp": ("ddp", 0), "zero1": ("zero1", 0), "zero2": ("zero2", 0), "zero3": ("zero3", 0), "hsdp": ("hsdp", 2)}
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
    name, group = FAMILIES[family]
    pp, schedule, virtual, layers = pipeline
    model = "tiny-llama" if layers else "llama-3-8b"
    try:
        return Scenario(
            model=model_preset(model),
            cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16, gpus_per_node=8),
            training=TrainingSpec(
                micro_batch_size=micro_batch,
                sequence_length=256,
                grad_accum_steps=grad_accum,
                precision=precision,  # type: ignore[arg-type]
                checkpointing=checkpointing,  # type: ignore[arg-type]
            ),
            strategy=Strategy(
                name=name,  # type: ignore[arg-type]
                engine=engine,  # type: ignore[arg-type]
                shard_group=group,
                offload=offload,  # type: ignore[arg-type]
                tp=tp,
                pp=pp,
                pp_schedule=schedule,  # type: ignore[arg-type]
                pp_virtual_stages=virtual,
                pp_layers=layers,
            ),
        )
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
