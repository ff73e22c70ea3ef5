"""Context parallelism for torch's engines, in the trace and in runs: shardscope's teaching ring attention.

torch's own `torch.distributed.tensor.experimental.context_parallel` cannot run here. It shards the attention by
giving DTensor sharding rules to the CUDA attention kernels (flash, memory-efficient, cuDNN); on a CPU, fake tensors
included, `F.scaled_dot_product_attention` dispatches to `aten._scaled_dot_product_flash_attention_for_cpu`, for which
DTensor has no rule ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered", torch 2.13). So the reference model's attention core is swapped for the teaching ring
attention (shardscope.ring_attention, imported, not copied): the sequence cut into 2 x cp
chunks, rank i keeping chunks i and 2cp-1-i (load-balanced under the causal mask), K and V passed round the cp ranks
by send/recv (batch_isend_irecv), dK and dV brought home the same way. torch's fake process group runs send and recv
as it runs collectives (it allocates nothing and moves nothing), so the replay issues the very calls a gloo run does.

Everything outside attention works per token, so the model runs on the rank's tokens alone, at their true positions
(RoPE's angles, gpt2's learned positions), as the teaching grid runs it (TensorParallelLM.loss). fully_shard then
shards over the data-parallel axes and cp together: the cp ranks hold the same weights and see different tokens, so
their gradients are averaged with the data-parallel ranks' (torchtitan's dp_shard_cp).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardscope.reference_models import TransformerLM
from shardscope.ring_attention import use_ring_attention, zigzag_positions


class SequenceSplit:
    """A reference model's attention made a ring over the cp group, and its forward made one of the rank's tokens."""

    def __init__(self, model: TransformerLM, group: dist.ProcessGroup, sequence_length: int) -> None:
        self.group, self.sequence_length = group, sequence_length
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        use_ring_attention(model, group)
        model.forward = self._forward(model)  # type: ignore[method-assign]

    def positions(self, device: Any) -> torch.Tensor:
        """The true positions of this rank's tokens (made each step, as the reference model makes its own)."""
        return zigzag_positions(self.sequence_length, self.size, self.rank).to(device)

    def rank_tokens(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's columns of a batch of whole sequences (inputs and targets)."""
        positions = self.positions(inputs.device)
        return inputs[:, positions], targets[:, positions]

    def _forward(self, model: TransformerLM) -> Any:
        def forward(input_ids: torch.Tensor) -> torch.Tensor:
            """Logits of the rank's tokens (batch, seq / cp, vocab), as TransformerLM.forward at their positions."""
            positions = self.positions(input_ids.device)
            x = model.embed_tokens(input_ids)
            if model.spec.family == "gpt2":
                x = x + model.embed_positions(positions)
            mask, cos, sin = model._context(self.sequence_length, x)
            mask = mask[positions][:, positions]  # unused by ring attention, which masks by position itself
            if cos is not None and sin is not None:
                cos, sin = cos[positions], sin[positions]
            for index, block in enumerate(model.layers):
                x = model._run_block(index, block, x, (mask, cos, sin))
            logits: torch.Tensor = model.lm_head(model.norm(x))
            return logits

        return forward
