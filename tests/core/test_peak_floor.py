"""The peak floor (core/peak_floor.py) and the floor of a batch alone stay under the peak `estimate_memory` gives,
for every engine, family, offload, checkpointing, precision and model-parallel cut, and the first is close enough to
it to be worth asking."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardscope.choices import SpecError
from shardscope.core.memory import estimate_memory
from shardscope.core.model_states import STEP_TENSOR_BYTES
from shardscope.core.params import param_layout
from shardscope.core.peak_floor import batch_floor_bytes, held_floor, peak_floor_bytes
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

FAMILIES = {  # name, shard group
    "ddp": ("ddp", 0),
    "zero1": ("zero1", 0),
    "zero2": ("zero2", 0),
    "zero3": ("zero3", 0),
    "hsdp": ("hsdp", 2),
}
CUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (1, 2, 2)]  # (tp, cp, ep)


def _scenario(
    model: str,
    engine: str,
    family: str,
    offload: str,
    checkpointing: str,
    precision: str,
    cut: tuple[int, int, int],
    micro_batch: int,
    grad_accum: int,
    sequence_parallel: bool,
) -> Scenario:
    name, group = FAMILIES[family]
    tp, cp, ep = cut
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=8, gpus_per_node=8),
        training=TrainingSpec(
            micro_batch_size=micro_batch,
            sequence_length=256,
            grad_accum_steps=grad_accum,
            precision=precision,  # type: ignore[arg-type]
            checkpointing=checkpointing,
        ),
        strategy=Strategy(
            name=name,  # type: ignore[arg-type]
            engine=engine,  # type: ignore[arg-type]
            shard_group=group,
            offload=offload,  # type: ignore[arg-type]
            tp=tp,
            cp=cp,
            ep=ep,
            sequence_parallel=sequence_parallel if tp > 1 else None,
        ),
    )


def _point(*choices: object) -> Scenario | None:
    """`_scenario` of the choices, None where the specs refuse them (offload of an unsharded family, ep of a dense
    model, ...)."""
    try:
        return _scenario(*choices)  # type: ignore[arg-type]
    except SpecError:
        return None


POINTS = st.builds(
    _point,
    st.sampled_from(["tiny-llama", "tiny-moe", "tiny-gpt2", "llama-3-8b", "mixtral-8x7b"]),
    st.sampled_from(["pytorch", "deepspeed", "paper"]),
    st.sampled_from(list(FAMILIES)),
    st.sampled_from(["none", "optimizer", "optimizer+params"]),
    st.sampled_from(["none", "selective", "full"]),
    st.sampled_from(["bf16-mixed", "fp32", "bf16", "fp16-mixed"]),
    st.sampled_from(CUTS),
    st.integers(1, 3),
    st.integers(1, 3),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(POINTS)
def test_the_floor_is_under_the_peak(scenario: Scenario | None) -> None:
    assume(scenario is not None)
    assert scenario is not None
    try:
        peak = estimate_memory(scenario).per_rank.peak_bytes
    except SpecError:
        assume(False)  # a combination the estimate refuses
        return
    assert peak_floor_bytes(scenario) <= peak
    assert batch_floor_bytes(scenario) <= peak


def _every_setting(engine: str) -> list[Scenario]:
    found = []
    for family in FAMILIES:
        for offload in ("none", "optimizer", "optimizer+params"):
            for checkpointing in ("none", "full"):
                for cut in CUTS[:4]:
                    try:
                        found.append(
                            _scenario(
                                "llama-3-8b", engine, family, offload, checkpointing, "bf16-mixed", cut, 2, 2, True
                            )
                        )
                    except SpecError:
                        continue
    return found


@pytest.mark.parametrize("engine", ["pytorch", "deepspeed", "paper"])
def test_the_floor_is_close_to_the_peak(engine: str) -> None:
    """Over llama-3-8b's settings on 8 GPUs the floor is at least half of the peak in the median (a floor of the
    context alone, or of the states without the activations, is far under it)."""
    ratios = []
    for scenario in _every_setting(engine):
        peak = estimate_memory(scenario).per_rank.peak_bytes
        floor = peak_floor_bytes(scenario)
        assert floor <= peak
        ratios.append(floor / peak)
    assert len(ratios) >= 40
    assert statistics.median(ratios) >= 0.5


def test_the_floor_takes_the_least_share_of_the_busiest_rank() -> None:
    """ZeroRedundancyOptimizer gives whole tensors to ranks, so one holds more, and which one takes the greedy
    assignment of every tensor: the floor takes the least the busiest rank's share can be, the largest tensor or an
    even share of the elements, whichever is more. With a rank per tensor or more that is the busiest rank's own
    share (the largest tensor alone); with fewer ranks it is under it."""
    layout = param_layout(model_preset("tiny-llama"))
    for world_size, exact in ((layout.tensor_count, True), (3, False)):
        scenario = dataclasses.replace(
            _scenario("tiny-llama", "pytorch", "zero1", "none", "none", "bf16-mixed", (1, 1, 1), 1, 1, False),
            cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=world_size, gpus_per_node=1),
        )
        busiest = estimate_memory(scenario).rank
        per_rank = [held_floor(scenario, rank).states_bytes for rank in range(world_size)]
        assert per_rank[busiest] == max(per_rank)
        floor = held_floor(scenario).states_bytes
        assert floor == per_rank[busiest] if exact else floor < per_rank[busiest]
        # the weights, DDP's gradient buckets and the gradients in fp32 (autocast), then Adam's two fp32 moments of
        # the least share and one step counter
        least = max(layout.largest_tensor_numel, -(-layout.total_numel // world_size))
        context = scenario.overheads.context_bytes
        assert floor == context + 3 * 4 * layout.total_numel + 2 * 4 * least + STEP_TENSOR_BYTES
