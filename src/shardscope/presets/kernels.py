"""Kernel ceilings of a GPU (gpu_kernels.json, keyed by architecture): what core.kernels prices each op with."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from shardscope.presets import gpu_kernels_file, gpu_preset_names, gpu_record


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelCeilings:
    """Achievable fractions of one GPU's datasheet figures, per kernel kind, and its GEMM tiling."""

    architecture: str
    """The architecture the fractions were measured or published for, e.g. 'hopper'."""
    sm_count: int
    """Streaming multiprocessors: a wave of GEMM tiles runs one tile per SM."""
    gemm_tile: tuple[int, int]
    """Output tile of a large cuBLAS GEMM (rows x columns)."""
    matmul_fraction: float
    """Fraction of the dense peak a large GEMM reaches."""
    memory_fraction: float
    """Fraction of the memory bandwidth a streaming kernel (copy) reaches."""
    attention: tuple[tuple[int, tuple[tuple[int, float, float], ...]], ...]
    """Flash attention by head dim: (sequence length, forward fraction, backward fraction) of the dense peak, causal,
    FLOPs counted as FlashAttention counts them."""
    host_memory_bandwidth_bytes_per_s: float
    """Memory bandwidth of the host of one node (CPU offload's optimizer step)."""


@cache
def kernel_ceilings(gpu_id: str) -> KernelCeilings | None:
    """The ceilings of a GPU preset, or None when its architecture or SM count is not in gpu_kernels.json."""
    if gpu_id not in gpu_preset_names():
        return None
    data = gpu_kernels_file()
    entry = data["architectures"].get(gpu_record(gpu_id).architecture)
    sm_count = data["sm_count"].get(gpu_id)
    if entry is None or sm_count is None:
        return None
    attention = tuple(
        (int(head_dim), tuple((int(seq), float(f), float(b)) for seq, (f, b) in sorted(rows.items(), key=_seq)))
        for head_dim, rows in sorted(entry["attention"].items(), key=_seq)
    )
    rows, columns = entry["gemm_tile"]
    return KernelCeilings(
        architecture=gpu_record(gpu_id).architecture,
        sm_count=int(sm_count),
        gemm_tile=(int(rows), int(columns)),
        matmul_fraction=float(entry["matmul_fraction"]),
        memory_fraction=float(entry["memory_fraction"]),
        attention=attention,
        host_memory_bandwidth_bytes_per_s=float(entry["host_memory_bandwidth_bytes_per_s"]),
    )


def _seq(item: tuple[str, object]) -> int:
    return int(item[0])
