"""torch's DTensor tensor parallelism on a reference llama: the plan torchtitan applies, for the trace and for runs.

The plan follows torchtitan's `apply_tp` for Llama (torchtitan/models/llama3/infra/parallelize.py at commit
81c1243395b46ce693a0681cfe1bb20e9b9433fb), written for shardscope's module names: the embedding split over the
vocabulary (RowwiseParallel) with its output scattered along the sequence, every norm over sequence shards
(SequenceParallel), each attention and MLP entered by an all-gather of the sequence (PrepareModuleInput), q/k/v and
gate/up column-parallel, o and down row-parallel with their outputs reduce-scattered back to sequence shards, and the
head column-parallel with its logits left split over the vocabulary for loss parallel
(torch.distributed.tensor.parallel.loss_parallel). Without sequence parallelism the norms stay plain modules, the
regions are entered by a replicated input and left by an all-reduce (RowwiseParallel's default Replicate output),
as Megatron-LM's g and f.

Only the llama family is planned: gpt2's fused c_attn is (q; k; v) stacked along its output features, which DTensor's
Shard(0) cuts into contiguous pieces (rank 0 would hold all of q and half of k) where the core and the teaching
implementation split each of q, k and v by heads; its learned positions would also be added to full-length inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardscope.specs import Scenario

if TYPE_CHECKING:  # torch is imported where a model is split, so RunConfig can check a scenario without it
    from torch import nn


class TensorParallelError(ValueError):
    """A scenario torch's tensor-parallel plan does not cover; the message says why and what to do."""


def torch_model_parallel_refusal(scenario: Scenario) -> str:
    """Why torch's own engines cannot split this scenario's model (on fake tensors or on gloo), in one line without
    a remedy (the command adds the options that work for it), or '' when they can. Context parallelism is the
    teaching ring attention (trace/context_parallel.py), which composes with DTensor's tensor parallelism."""
    strategy, model = scenario.strategy, scenario.model
    if strategy.tp == 1 and strategy.cp == 1:
        return ""
    if strategy.preset.zero_stage in (0, 1):
        if strategy.tp > 1:
            return (
                f"--tp {strategy.tp} with --strategy {strategy.name}: torch's DistributedDataParallel and "
                "ZeroRedundancyOptimizer do not take DTensor parameters on a 2-D mesh (torchtitan: 'DDP has not "
                "supported > 1D parallelism'); --strategy fsdp, zero2 or hsdp do"
            )
        return (
            f"--cp {strategy.cp} with --strategy {strategy.name}: the pytorch engine's context parallelism is built "
            "over fully_shard only (the cp ranks' gradients averaged with the data-parallel ranks'); --strategy "
            "fsdp, zero2 or hsdp do"
        )
    if strategy.tp > 1 and model.family != "llama":
        why = (
            "its fused c_attn would be cut into contiguous pieces by DTensor, not by heads within each of q, k and v"
            if model.family == "gpt2"
            else f"torch's tensor-parallel plan here covers the llama family only, not {model.family}"
        )
        return f"--tp {strategy.tp} with model {model.name}: {why}"
    return ""


def parallelize(root: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Split a reference llama (shardscope.reference_models.TransformerLM) over the 1-D tp mesh, in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    sequence = Shard(1)  # (batch, seq, hidden): the sequence dim the residual stream is split along
    between = sequence if sequence_parallel else Replicate()  # the layout between the parallel regions
    root_plan: dict[str, Any] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # loss parallel: the logits stay split over the vocabulary (a DTensor), the cross entropy reduces over it
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(root, tp_mesh, root_plan)
    for block in root.layers:  # type: ignore[union-attr]
        plan: dict[str, Any] = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        # Each region is entered once (PrepareModuleInput hands its linears one replicated DTensor), so backward
        # sums their input gradients before one reduce-scatter (with sequence parallelism) or one all-reduce
        # (without it: Megatron's f); linears that each took the plain input would each all-reduce their own.
        plan |= {
            "attn": PrepareModuleInput(input_layouts=(between, None), desired_input_layouts=(Replicate(), None)),
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        }
        if sequence_parallel:
            plan |= {"input_norm": SequenceParallel(), "post_attention_norm": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)
        # The column-parallel outputs are local tensors of this rank's heads: the attention views them by its share.
        block.attn.heads //= tp
        block.attn.kv_heads //= tp


def loss_context(scenario: Scenario) -> Any:
    """loss_parallel() under tensor parallelism (around the loss and its backward), else a null context."""
    import contextlib

    if scenario.strategy.tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
