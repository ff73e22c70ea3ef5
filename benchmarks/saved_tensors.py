"""What autograd saves for backward, op by op, on this device: the evidence for the per-op activation model.

The trace replays a step on fake CPU tensors, so it sees the kernels torch picks on a CPU. On a GPU torch picks
others for some ops (a fused RMSNorm, another attention kernel), and they save other tensors. This runs each op of
a transformer block once, at a model's shapes, under torch.autograd.graph.saved_tensors_hooks, and prints the bytes
of the distinct storages each op saves (parameters excluded) and, on a GPU, the most the op's forward and backward
allocated beyond their inputs and outputs.

    python benchmarks/saved_tensors.py --device cuda --out saved-h200.json    # on a GPU
    python benchmarks/saved_tensors.py --device cpu --seq-len 512              # here
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shardscope.presets import model_preset
from shardscope.reference_models import NORM_EPS, _rotate_half


def _saved(run: Callable[[], torch.Tensor], params: set[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in params:  # a parameter or a view of one (W^T) is not saved
            saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, saved


def probe(name: str, run: Callable[[], torch.Tensor], params: tuple[torch.Tensor, ...], device: str) -> dict[str, Any]:
    """One op: the storages it saves (distinct, parameters excluded) and, on CUDA, its transient high water."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out, saved = _saved(run, {param.untyped_storage().data_ptr() for param in params})
    storages: dict[int, tuple[int, str]] = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(), f"{tuple(tensor.shape)} {str(tensor.dtype)[6:]}")
    out.float().sum().backward()
    row = {
        "op": name,
        "saved_bytes": sum(size for size, _ in storages.values()),
        "saved": sorted(description for _, description in storages.values()),
    }
    if device == "cuda":
        torch.cuda.synchronize()
        row["high_water_bytes"] = torch.cuda.max_memory_allocated() - base
    return row


def probes(model: str, seq: int, device: str) -> list[dict[str, Any]]:
    """Each op of a llama-style block and the loss, at the model's widths, one sequence of `seq` tokens, in bf16."""
    spec = model_preset(model)
    bf16 = torch.bfloat16

    def leaf(*shape: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(True)

    hidden, heads, kv_heads, head_dim = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = leaf(1, seq, hidden)
    norm = leaf(hidden)
    weight = leaf(spec.ffn_hidden_size, hidden)
    gate, up = leaf(1, seq, spec.ffn_hidden_size), leaf(1, seq, spec.ffn_hidden_size)
    q, k, v = leaf(1, heads, seq, head_dim), leaf(1, kv_heads, seq, head_dim), leaf(1, kv_heads, seq, head_dim)
    cos, sin = (
        torch.randn(seq, head_dim, device=device, dtype=bf16),
        torch.randn(seq, head_dim, device=device, dtype=bf16),
    )
    logits = leaf(1, seq, spec.vocab_size)
    targets = torch.randint(0, spec.vocab_size, (seq,), device=device)
    repeat = heads // kv_heads
    cases: list[tuple[str, Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]] = [
        ("rms_norm", lambda: F.rms_norm(x, (hidden,), norm, NORM_EPS), (norm,)),
        ("linear (gate_proj)", lambda: F.linear(x, weight), (weight,)),
        ("silu", lambda: F.silu(gate), ()),
        ("silu(gate) * up", lambda: F.silu(gate) * up, ()),
        ("rotary", lambda: q * cos + _rotate_half(q) * sin, ()),
        (
            "sdpa causal, enable_gqa",
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=repeat > 1),
            (),
        ),
        (
            "sdpa causal, k/v repeated",
            lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), is_causal=True
            ),
            (),
        ),
        ("cross_entropy(logits.float())", lambda: F.cross_entropy(logits.float().view(seq, -1), targets), ()),
    ]
    return [probe(name, run, params, device) for name, run, params in cases]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = probes(args.model, args.seq_len, args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    document = {"device": where, "torch": torch.__version__, "model": args.model, "seq_len": args.seq_len, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{where}, torch {torch.__version__}, {args.model} widths, {args.seq_len} tokens, bf16")
    for row in rows:
        extra = f", high water {row['high_water_bytes']:,} B" if "high_water_bytes" in row else ""
        print(f"{row['op']:32} saves {row['saved_bytes']:>14,} B{extra}: {'; '.join(row['saved'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
