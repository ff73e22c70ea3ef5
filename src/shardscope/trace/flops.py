"""FLOPs of a traced step: torch's FLOP counter, plus the fused attention kernels it does not count on a CPU.

torch counts the CUDA flash and memory-efficient kernels but not `_scaled_dot_product_flash_attention_for_cpu`,
which is what a CPU trace calls; for it we use the same formula torch uses on a GPU: Q·Kᵀ and P·V are
2·b·h·s_q·s_k·d each in forward (the causal mask is not discounted, as torch's counter does not), and backward
does four such products (dV, dP, dQ, dK).

Under tensor parallelism (and for FSDP's DTensor parameters) the counter skips an op on DTensors, whose shapes are
the whole model's, and counts the ops on local shards DTensor runs for it: a rank's FLOPs, not the model's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from shardscope.measure.storage import holds_dtensor

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attention_forward_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    batch, heads, seq_q, head_dim = query
    seq_k, value_dim = key[2], value[3]
    return 2 * batch * heads * seq_q * seq_k * head_dim + 2 * batch * heads * seq_q * seq_k * value_dim


def _attention_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * _attention_forward_flops(query, key, value)


class LocalFlopCounter(FlopCounterMode):
    """FlopCounterMode that counts the local shards' ops: its dispatch mode (torch's private `_FlopCounterMode`,
    made on entry, torch 2.6 to 2.13) hands ops on DTensors back to DTensor (NotImplemented), which runs them as local
    ops that reach the mode again."""

    def __enter__(self) -> LocalFlopCounter:
        super().__enter__()
        mode = self.mode
        base = type(mode)

        class _Local(base):  # type: ignore[valid-type, misc]
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if holds_dtensor(args) or holds_dtensor(kwargs):
                    return NotImplemented
                return super().__torch_dispatch__(func, types, args, kwargs)

        mode.__class__ = _Local
        return self


def flop_counter() -> FlopCounterMode:
    """torch's FlopCounterMode, per rank, with the CPU flash-attention kernels counted by formula."""
    mapping = {
        _CPU_FLASH: _attention_forward_flops,  # the counter looks ops up by packet, not overload
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
    }
    return LocalFlopCounter(display=False, custom_mapping=mapping)


def attention_flops(counter: FlopCounterMode) -> int:
    """The part of a counter's total that came from the attention-by-formula kernels."""
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
    counts = counter.get_flop_counts().get("Global", {})
    return sum(count for op, count in counts.items() if str(op).split(".")[-1] in names)


def module_flops(counter: FlopCounterMode, root_name: str) -> dict[str, int]:
    """FLOPs per module path (relative to the root, '' for the root itself)."""
    result: dict[str, int] = {}
    for name, counts in counter.get_flop_counts().items():
        if name == "Global" or not (name == root_name or name.startswith(root_name + ".")):
            continue
        result[name[len(root_name) + 1 :]] = sum(counts.values())
    return result
