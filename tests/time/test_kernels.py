"""The per-op kernel model (core.kernels): GEMMs cost whole tiles in whole waves, flash attention runs at its
measured throughput, CPU offload's optimizer step is CPU-Adam at the host's memory bandwidth, and the model applies
to 16-bit NCCL steps on GPUs with kernel ceilings only (gloo and a given efficiency keep FLOPs / (peak x eff))."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from timecases import scenario

from shardscope.cli import main
from shardscope.core.compute import FUSED_OPTIMIZER_ACCESSES, compute_model, optimizer_step_s
from shardscope.core.kernels import _flash_fractions, gemm_s
from shardscope.core.timeline import estimate_time
from shardscope.presets import gpu_kernels_file, gpu_preset_names
from shardscope.presets.hardware import default_profile
from shardscope.presets.kernels import KernelCeilings, kernel_ceilings

REPO = Path(__file__).resolve().parents[2]


def _h100() -> tuple[KernelCeilings, float]:
    ceilings = kernel_ceilings("h100-80gb")
    assert ceilings is not None
    return ceilings, 989.4e12 * ceilings.matmul_fraction


def test_a_gemm_costs_whole_tiles_in_whole_waves() -> None:
    ceilings, rate = _h100()
    assert ceilings.sm_count == 132 and ceilings.gemm_tile == (256, 128)
    # 8192^3: 64 x 32 = 2048 tiles of 256 x 128 (either way round) in 16 waves of 132, the last one 68/132 full.
    waves = math.ceil(2048 / 132)
    assert gemm_s(8192, 8192, 8192, ceilings, rate) == pytest.approx(2 * 8192 * waves * 132 * 128 * 256 / rate)
    # Wave quantization: 132 tiles are one wave, 133 are two.
    one_wave = gemm_s(128, 256 * 132, 4096, ceilings, rate)
    assert gemm_s(128, 256 * 133, 4096, ceilings, rate) == pytest.approx(2 * one_wave)
    # Tile quantization: one row past a tile boundary is a second row of tiles, here a second wave.
    assert gemm_s(129, 256 * 132, 4096, ceilings, rate) == pytest.approx(2 * one_wave)


def test_flash_attention_runs_at_the_measured_fractions() -> None:
    ceilings, _ = _h100()
    rows = dict((head_dim, table) for head_dim, table in ceilings.attention)
    for seq, forward, backward in rows[128]:
        assert _flash_fractions(ceilings, 128, seq) == (forward, backward)
    low, high = _flash_fractions(ceilings, 128, 2048), _flash_fractions(ceilings, 128, 4096)
    middle = _flash_fractions(ceilings, 128, 2896)
    assert low[0] < middle[0] < high[0] and low[1] < middle[1] < high[1]
    assert _flash_fractions(ceilings, 128, 65536) == _flash_fractions(ceilings, 128, 16384)


def test_cpu_offload_prices_the_optimizer_step_as_cpu_adam() -> None:
    case = scenario(strategy="zero3", offload="optimizer")
    compute = compute_model(case, default_profile(case.cluster.gpu))
    assert compute.kernels is not None
    shard = 8_030_261_248 // 16
    host_per_rank = compute.kernels.host_memory_bandwidth_bytes_per_s / 8  # DGX H100's two sockets, 8 ranks
    cpu_adam = FUSED_OPTIMIZER_ACCESSES["adamw"] * 4 * shard / host_per_rank
    assert optimizer_step_s(case, compute, shard, 1) == pytest.approx(cpu_adam)
    on_gpu = optimizer_step_s(scenario(strategy="zero3"), compute, shard, 1)
    assert cpu_adam > 10 * on_gpu  # host memory is ~40x slower per rank than HBM


@pytest.mark.parametrize(
    "change",
    [
        {"precision": "fp32"},
        {"backend": "gloo"},
    ],
)
def test_gloo_and_fp32_keep_the_efficiency_model(change: dict[str, str]) -> None:
    if "backend" in change:
        case = scenario()
        case = dataclasses.replace(case, cluster=dataclasses.replace(case.cluster, backend="gloo"))
    else:
        case = scenario(**change)
    assert compute_model(case, default_profile(case.cluster.gpu)).kernels is None


def test_a_given_efficiency_replaces_the_kernel_model() -> None:
    case = scenario()
    profile = default_profile(case.cluster.gpu)
    assert compute_model(case, profile).kernels is not None
    given = dataclasses.replace(profile, efficiency=0.5, per_op_kernels=False)
    assert compute_model(case, given).kernels is None


def test_ceilings_exist_for_sourced_architectures_only() -> None:
    with_ceilings = {name for name in gpu_preset_names() if kernel_ceilings(name) is not None}
    assert with_ceilings == {"a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie-80gb", "h200-141gb"}
    assert kernel_ceilings("custom") is None


def test_the_efficiency_flag_brings_back_the_global_efficiency_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "llama-3-8b", "--gpus", "16", "--seq-len", "2048", "--time", "--json"]
    steps = []
    for extra in ([], ["--efficiency", "0.5"]):
        assert main([*argv, *extra]) == 0
        steps.append(json.loads(capsys.readouterr().out)["strategies"][0]["step_time_s"])
    case = scenario(strategy="ddp", engine="pytorch")
    efficiency = dataclasses.replace(default_profile(case.cluster.gpu), per_op_kernels=False)
    assert steps[1] == estimate_time(case, efficiency).step_time_s != steps[0]
    assert steps[0] == estimate_time(case).step_time_s


def test_hopper_ceilings_are_the_saved_h200_measurement() -> None:
    """presets/gpu_kernels.json's Hopper fractions are benchmarks/results/gpu_kernels-h200.json over the H200's
    datasheet figures (989.4 TFLOP/s dense bf16, 4.8 TB/s), rounded to 3 digits."""
    measured = json.loads((REPO / "benchmarks" / "results" / "gpu_kernels-h200.json").read_text())
    hopper = gpu_kernels_file()["architectures"]["hopper"]
    assert hopper["matmul_fraction"] == round(measured["matmul_bf16_tflops"]["8192"] / 989.4, 3)
    assert hopper["memory_fraction"] == round(measured["copy_tb_per_s"] / 4.8, 3)
    for head_dim, rows in measured["attention_causal_bf16_tflops_forward_backward"].items():
        for seq, pair in rows.items():
            assert hopper["attention"][head_dim][seq] == [round(value / 989.4, 3) for value in pair]
