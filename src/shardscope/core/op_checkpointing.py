"""torchtitan's selective op activation checkpointing ('op'), as the core counts it.

torchtitan wraps each transformer block in a checkpoint whose policy saves the outputs of the matmuls, of the
attention kernels, of max, topk and the reduce-scatter and all-to-all, and recomputes every second mm and all the
rest (torchtitan/distributed/activation_checkpoint.py, `SelectiveAC`, commit c5d93d109 of 2026-06-15; the reference
models apply the same policy with torch.utils.checkpoint.create_selective_checkpoint_contexts). A linear layer with a
bias runs as one addmm, which the policy saves and does not count; one without runs as an mm, and the policy saves
the odd ones (the 1st, 3rd, ...) of a block's forward. The MoE router's mm is recomputed and not counted
(torchtitan's default `force_recompute_mm_shapes_by_fqns`, "moe.router.gate").
"""

from __future__ import annotations

from functools import cache

from shardscope.core.params import ParamTensor, param_layout
from shardscope.specs import ModelSpec


@cache
def saved_linears(model: ModelSpec, tp: int = 1, ep: int = 1) -> tuple[tuple[ParamTensor, bool], ...]:
    """Each weight matrix of a block in forward order (its creation order), as one of `tp` tensor-parallel ranks holds
    it, and whether the policy saves the output of its matmul. MoE: every expert is assumed to receive tokens, so each
    runs its three matmuls (the rank's num_experts / ep of them under expert parallelism)."""
    block = param_layout(model, tp, ep).block
    names = {tensor.name for tensor in block}
    mm_count = 0
    linears = []
    for tensor in block:
        if len(tensor.shape) != 2:
            continue
        if tensor.name.removesuffix("weight") + "bias" in names:
            linears.append((tensor, True))  # addmm
            continue
        if ".router." in tensor.name:
            linears.append((tensor, False))
            continue
        mm_count += 1
        linears.append((tensor, mm_count % 2 == 1))
    return tuple(linears)


def recomputed_linears(model: ModelSpec, tp: int = 1) -> tuple[ParamTensor, ...]:
    """The weight matrices (one tensor-parallel rank's slices) whose matmuls the policy recomputes in backward."""
    return tuple(tensor for tensor, saved in saved_linears(model, tp) if not saved)
