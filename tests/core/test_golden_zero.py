"""Golden figures from "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (Rajbhandari et al.),
Figure 1: a 7.5B-parameter model on 64 GPUs with mixed-precision Adam (K = 12) holds 120 GB of model states per GPU
under data parallelism, 31.4 GB with P_os (stage 1), 16.6 GB with P_os+g (stage 2) and 1.9 GB with P_os+g+p
(stage 3). The paper rounds to one decimal of GB (1e9 bytes)."""

import pytest

from shardscope.core.memory import estimate_memory
from shardscope.presets import gpu_preset
from shardscope.specs import ClusterSpec, ModelSpec, Scenario, Strategy, TrainingSpec
from shardscope.units import GB

FIGURE_1 = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


@pytest.mark.parametrize(("strategy", "expected_gb"), FIGURE_1.items())
def test_zero_paper_figure_1(strategy: str, expected_gb: float) -> None:
    scenario = Scenario(
        model=ModelSpec(name="7.5B", family="count", declared_parameters=7_500_000_000),
        cluster=ClusterSpec(gpu=gpu_preset("v100-32gb"), world_size=64, gpus_per_node=16),
        training=TrainingSpec(precision="fp16-mixed", optimizer="adam"),
        strategy=Strategy(name=strategy, engine="paper"),
    )
    model_states = estimate_memory(scenario).per_rank.model_state_bytes
    assert round(model_states / GB, 1) == expected_gb
