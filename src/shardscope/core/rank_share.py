"""Which part of a micro-batch's activations one rank holds under tensor, sequence and context parallelism.

Tensor parallelism (Megatron-LM's column- and row-parallel linears, torchtitan's Llama plan: colwise q/k/v, gate/up
and lm_head, rowwise o/down) splits the heads, the FFN width and the vocabulary tp ways: the tensors inside attention
and the MLP and the logits are 1/tp on each rank. The block-boundary tensors (norm inputs and outputs, the residual
stream) are whole on every rank, unless sequence parallelism splits them along the sequence, tp ways ("Reducing
Activation Recomputation in Large Transformer Models", Korthikanti et al. 2022, Section 4.2.2). With sequence
parallelism a column-parallel linear's input is all-gathered first: torch's DTensor ColwiseParallel saves that
gathered, whole-sequence input for its weight gradient, while Megatron-LM (and the paper's Table 2) keeps the
sequence-sharded input and all-gathers it again in backward.

Context parallelism splits every sequence cp ways: each rank holds seq/cp tokens of every activation, in two of 2 x cp
chunks (load-balanced, so each rank's causal attention work is 1/cp of the whole). Attention runs as ring attention
("Ring Attention with Blockwise Transformers for Near-Infinite Context", Liu et al. 2023; torch's
context_parallel): for backward each rank saves only its own q, k, v, output and log-sum-exp, and in backward the K/V
chunks travel the ring again with their gradients (`ring_attention_backward_bytes`). Ring attention replaces eager
attention too (torch's context_parallel runs only on SDPA; the teaching ring computes its blocks itself), so no
score matrix is saved under context parallelism. In forward the received K/V pair
and the running output and log-sum-exp are live only inside one block's attention, at no moment the engines compare
(nor are the other transients of a block's forward), so they are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from shardscope.specs import ModelSpec, Scenario, TrainingSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class RankShare:
    """How one rank's share of a micro-batch's activations is cut."""

    tp: int = 1
    """Tensor-parallel degree: heads, FFN width and vocabulary are split tp ways."""
    cp: int = 1
    """Context-parallel degree: every rank holds seq/cp tokens of each activation."""
    sequence_parallel: bool = False
    """The norms and the residual stream hold tokens/tp per rank (Korthikanti et al., Section 4.2.2)."""
    regathers_in_backward: bool = False
    """Under sequence parallelism, the column-parallel linears save their sequence-sharded input and all-gather it
    again in backward (Megatron-LM, the paper's Table 2); False: they save the gathered input (torch's DTensor)."""
    ep: int = 1
    """Expert-parallel degree: the rank runs num_experts / ep experts of each MoE layer, on the tokens routed to them
    from its whole expert group (core/expert_parallel.py)."""
    vocab_parallel_loss: bool = False
    """The embedding and the cross entropy are Megatron-LM's vocabulary-parallel ones (the teaching
    TensorParallelLM): each keeps a one-byte mask per token of where the token or the target falls outside the
    rank's vocabulary slice, and the cross entropy keeps no total weight (core/activations.py counts them)."""

    @property
    def boundary_split(self) -> int:
        """How many ways the block-boundary tensors (norms, residual stream) are split beyond cp."""
        return self.tp if self.sequence_parallel else 1

    @property
    def gathered_split(self) -> int:
        """How many ways the input a column-parallel linear saves is split beyond cp."""
        return self.tp if self.sequence_parallel and self.regathers_in_backward else 1


WHOLE = RankShare()
"""No tensor or context parallelism: the rank holds its whole micro-batch."""


def rank_share(scenario: Scenario, megatron: bool = False) -> RankShare:
    """The scenario's cut of the activations; `megatron`: the engine runs tensor parallelism as Megatron-LM does
    rather than as torch's DTensor plan (see `RankShare.regathers_in_backward` and `.vocab_parallel_loss`)."""
    strategy = scenario.strategy
    if strategy.tp == 1 and strategy.cp == 1 and strategy.ep == 1:
        return WHOLE
    return _share(strategy.tp, strategy.cp, strategy.ep, strategy.uses_sequence_parallel, megatron)


@cache
def _share(tp: int, cp: int, ep: int, sequence_parallel: bool, megatron: bool) -> RankShare:
    """One RankShare per cut (a planner search asks for it at every point it estimates)."""
    return RankShare(
        tp=tp,
        cp=cp,
        ep=ep,
        sequence_parallel=sequence_parallel,
        regathers_in_backward=megatron and sequence_parallel,
        vocab_parallel_loss=megatron and tp > 1,
    )


def activation_bytes_per_element(training: TrainingSpec) -> int:
    """Bytes per activation element: the compute dtype."""
    return {"fp32": 4, "fp64": 8}.get(training.precision, 2)


def stat_bytes(training: TrainingSpec) -> int:
    """Bytes of the norm statistics, RMSNorm's upcast copies and the loss: fp32 (fp64 when computing in fp64)."""
    return 8 if training.precision == "fp64" else 4


@dataclass(frozen=True, slots=True)
class Sizes:
    """Byte sizes of the tensors one block saves on one rank, for one micro-batch."""

    tokens: int  # the rank's tokens: micro-batch tokens / cp
    boundary_tokens: int  # tokens of the block-boundary tensors: / tp more under sequence parallelism
    element: int
    stat: int
    boundary: int  # boundary_tokens x hidden_size: the residual stream, a norm's input and output
    gathered: int  # what a column-parallel linear saves as its input (see RankShare.gathered_split)
    query: int  # tokens x heads/tp x head_dim
    kv: int  # tokens x kv_heads/tp x head_dim
    lse: int  # a log-sum-exp per row and head (fused attention)
    probs: int  # the batch x heads/tp x seq x seq softmax output (eager attention, without ring attention)
    ffn: int  # the FFN width one rank holds: ffn_hidden_size / tp
    ring: bool  # attention runs as ring attention (context parallelism), which never holds a score matrix
    experts: int = 0  # the MoE experts one rank runs: num_experts / ep
    expert_rows: int = 0  # rows an MoE layer's experts run on for the rank's tokens (ModelSpec.expert_rows)


def sizes_of(model: ModelSpec, training: TrainingSpec, share: RankShare) -> Sizes:
    """The tensors of one block as one rank holds them."""
    element, stat = activation_bytes_per_element(training), stat_bytes(training)
    tokens = training.tokens_per_micro_batch // share.cp
    seq, batch, heads = training.sequence_length, training.micro_batch_size, model.num_heads // share.tp
    rows = seq // share.cp  # each rank's query rows per sequence
    boundary_tokens = tokens // share.boundary_split
    return Sizes(
        tokens=tokens,
        boundary_tokens=boundary_tokens,
        element=element,
        stat=stat,
        boundary=boundary_tokens * model.hidden_size * element,
        gathered=tokens // share.gathered_split * model.hidden_size * element,
        query=tokens * heads * model.head_dim * element,
        kv=tokens * (model.num_kv_heads // share.tp) * model.head_dim * element,
        lse=batch * heads * rows * stat,
        probs=batch * heads * seq * seq * element,
        ffn=model.ffn_hidden_size // share.tp,
        ring=share.cp > 1,
        experts=model.num_experts // share.ep,
        expert_rows=model.expert_rows(batch, rows),
    )


def ring_attention_backward_bytes(sizes: Sizes, share: RankShare) -> int:
    """What ring attention's backward holds beyond the saved tensors: one received K/V chunk pair and the gradients
    of a K/V pair travelling the ring with it (torch's context_parallel sends dK and dV around the ring in backward).
    Assumes one chunk in flight at a time, double buffering not counted; 0 without context parallelism."""
    return 4 * sizes.kv if share.cp > 1 else 0
