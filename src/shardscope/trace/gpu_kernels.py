"""GPU kernels that save other tensors than their CPU counterparts, stood in for in traces of GPU scenarios.

The trace runs on fake CPU tensors, so torch dispatches to its CPU kernels. Where a CUDA kernel keeps other tensors
for backward, the trace of a GPU scenario (ClusterSpec.gpu_kernels: the nccl backend) swaps in a stand-in that
allocates and saves what the CUDA kernel does. Measured on an H200 (torch 2.11, `benchmarks/saved_tensors.py`,
benchmarks/results/saved-tensors-h200.json against saved-tensors-cpu.json):

- RMSNorm: torch.nn.functional.rms_norm calls aten::_fused_rms_norm, which has CUDA, MPS and XPU kernels and on a CPU
  falls back to rms_norm_composite (aten/src/ATen/native/layer_norm.cpp). The CUDA kernel saves its input and 1/rms
  (fp32, one per row): 2 bytes x hidden + 4 per bf16 token. The composite saves an fp32 copy of the input, the fp32
  normalised tensor and 1/rms: 8 x hidden + 4.

Everything else measured there saves the same tensors on both (linear, SiLU, the SwiGLU product, rotary, attention
but for two 8-byte RNG words of the CUDA kernel, cross entropy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _FusedRMSNorm(torch.autograd.Function):
    """aten::_fused_rms_norm as CUDA runs it, on fake tensors: its output and 1/rms are allocated (fake tensors hold
    no values), its input, 1/rms and weight saved, and its backward is the op itself (it has a meta kernel)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        del eps  # the values are not computed: only sizes matter on fake tensors
        accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = torch.empty_like(x)
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=accumulate)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_weight = torch.ops.aten._fused_rms_norm_backward(
            grad, x, [x.shape[-1]], rstd, weight, [True, True]
        )
        return grad_x, grad_weight, None


def use_gpu_kernels(root: nn.Module) -> int:
    """Make every reference RMSNorm under root run as CUDA's fused kernel; returns how many were changed. For fake
    tensors only: the stand-in computes no values."""
    from shardscope.reference_models import NORM_EPS, RMSNorm

    changed = 0
    for module in root.modules():
        if isinstance(module, RMSNorm):
            module.forward = _fused_forward(module, NORM_EPS)  # type: ignore[method-assign]
            changed += 1
    return changed


def _fused_forward(module: nn.Module, eps: float) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNorm.apply(x, module.weight, eps)  # type: ignore[no-any-return]

    return forward
