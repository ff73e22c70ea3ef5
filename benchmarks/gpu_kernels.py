"""Measured bf16 kernel speeds of one GPU, the ceilings of presets/gpu_kernels.json (docs/time-model.md).

Usage: python benchmarks/gpu_kernels.py   (a CUDA GPU; about a minute). Medians of 20 runs:
cuBLAS GEMMs (2MNK FLOPs), a 4 GiB copy (bytes read + written), and causal flash SDPA with 16 heads and 16k tokens
(FlashAttention-3's Figure 5 shapes) counted as FlashAttention counts: forward 2bs^2hd, backward 2.5x forward.
"""

from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WARMUP, REPEATS = 5, 20


def _median_ms(fn) -> float:  # type: ignore[no-untyped-def]
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops() -> dict[str, float]:
    out = {}
    for size in (4096, 8192, 16384):
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        ms = _median_ms(lambda a=a, b=b: torch.matmul(a, b))
        out[str(size)] = 2 * size**3 / (ms * 1e-3) / 1e12
    return out


def copy_bandwidth() -> float:
    src = torch.empty(2 * 2**30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def attention_tflops() -> dict[str, dict[str, list[float]]]:
    heads, tokens = 16, 16384
    out: dict[str, dict[str, list[float]]] = {}
    for head_dim in (64, 128):
        row = {}
        for seq in (512, 1024, 2048, 4096, 8192, 16384):
            shape = (tokens // seq, heads, seq, head_dim)
            qkv = tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
            forward_flops = 4 * tokens * seq * heads * head_dim / 2
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                forward_ms = _median_ms(lambda x=qkv: F.scaled_dot_product_attention(*x, is_causal=True))
                out_ = F.scaled_dot_product_attention(*qkv, is_causal=True)
                grad = torch.randn_like(out_)
                backward_ms = _median_ms(lambda o=out_, x=qkv, g=grad: torch.autograd.grad(o, x, g, retain_graph=True))
            row[str(seq)] = [
                forward_flops / (forward_ms * 1e-3) / 1e12,
                2.5 * forward_flops / (backward_ms * 1e-3) / 1e12,
            ]
        out[str(head_dim)] = row
    return out


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    document = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "matmul_bf16_tflops": matmul_tflops(),
        "copy_tb_per_s": copy_bandwidth(),
        "attention_causal_bf16_tflops_forward_backward": attention_tflops(),
    }
    print(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
