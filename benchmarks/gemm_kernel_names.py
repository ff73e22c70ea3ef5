"""The cuBLAS kernels torch.matmul runs for bf16 GEMMs of a model's shapes (their names carry the tile size).

Usage: python benchmarks/gemm_kernel_names.py   (a CUDA GPU; seconds). presets/gpu_kernels.json's tile cites it.
"""

import torch

SHAPES = ((8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096), (8192, 1024, 4096), (8192, 128256, 4096))

for m, n, k in SHAPES:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    torch.matmul(a, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.matmul(a, b)
        torch.cuda.synchronize()
    names = sorted({event.key for event in prof.key_averages() if not event.key.startswith(("aten::", "cuda"))})
    print(f"{m}x{n}x{k}: {names}")
