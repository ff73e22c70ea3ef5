"""Activation memory: what autograd saves for backward, op by op, for one rank's micro-batch.

The per-op accounting follows "Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al.),
which gives sbh(34 + 5as/h) bytes per layer for GPT with 16-bit activations and dropout. shardscope's reference
models have no dropout, so its terms are the paper's without the dropout masks and dropout outputs (34 -> 32 and
5as/h -> 2as/h for gpt2), and the llama family adds SwiGLU's extra projection and RoPE. Fused attention (sdpa, the
kernels of "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness") keeps its output and a
log-sum-exp per row instead of the s x s score matrix. Full checkpointing keeps each block's input and recomputes one
block at a time in backward ('every:N' does so for every N-th block only); selective checkpointing recomputes only
the attention core (the paper's Section 4); 'op' keeps what torchtitan's op policy saves (core/op_checkpointing.py).
Under tensor, sequence and context parallelism every term is the rank's share of the tensor (core/rank_share.py): the
paper's Table 2 with its dropout terms removed as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from shardscope.choices import checkpoint_every, checkpoints_block
from shardscope.core.op_checkpointing import saved_linears
from shardscope.core.params import param_layout
from shardscope.core.rank_share import (
    WHOLE,
    RankShare,
    Sizes,
    activation_bytes_per_element,
    ring_attention_backward_bytes,
    sizes_of,
)
from shardscope.specs import ModelSpec, TrainingSpec

INDEX_BYTES = 8  # token ids and targets are int64


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationEstimate:
    """Activation memory of one micro-batch on one rank."""

    saved_bytes: int
    """Bytes saved for backward at the end of forward, all blocks, embeddings and the loss included."""
    block_bytes: int
    """One block's saved tensors without checkpointing."""
    stored_block_bytes: int
    """What the top block keeps under the chosen checkpointing."""
    recompute_bytes: int
    """Extra bytes live in backward while the top block is recomputed (0 where it is not checkpointed)."""
    logits_bytes: int
    """The logits tensor in the compute dtype (tokens x vocab)."""
    loss_forward_spike_bytes: int
    """Transient bytes at the loss in forward beyond what is saved: the logits and their fp32 copy."""
    loss_backward_spike_bytes: int
    """Transient bytes at the start of backward: gradients of the log-softmax output and input."""
    head_bytes: int
    """What the head saves (final norm, output head input, log-softmax output; the vocab-parallel cross entropy's
    targets and their mask), freed first in backward."""
    head_gradient_bytes: int
    """The logits' gradient still live as backward leaves the head: the loss's fp32 gradients, or their 16-bit cast
    when the model computes in 16 bits (the fp32 ones are freed once the cast has passed them on)."""
    hidden_bytes: int
    """One tokens x hidden tensor in the compute dtype (the gradient flowing between blocks)."""
    log_softmax_bytes: int = 0
    """The loss's log-softmax output (tokens x vocab in fp32), made at the loss, after the output head."""
    block_backward_bytes: int = 0
    """Bytes a block holds at the peak of its own backward beyond what it stored in forward: under checkpointing its
    recomputed tensors, and in its MLP's backward the output projection's weight gradient and the MLP's activation
    gradients (see `_mlp_backward_bytes`)."""
    first_stored_block_bytes: int = 0
    """What the bottom block (the first in forward) keeps; `stored_block_bytes` is the top block's. They differ under
    'every:N', which checkpoints only some blocks."""
    first_block_backward_bytes: int = 0
    """`block_backward_bytes` of the bottom block (that field is the top block's)."""
    stored_blocks_bytes: int = 0
    """What all the blocks keep together."""
    shared_bytes: int = 0
    """What every block reads and some block saves, made once per forward before the blocks (the rotary tables and
    the causal mask): part of `saved_bytes`, once per pipeline stage that runs blocks."""
    inputs_bytes: int = 0
    """What is still saved once every block's backward is done (the blocks' shared RoPE tables and mask are freed
    with the last of them): the token ids (and gpt2's position ids), the targets, and the loss's total weight."""


def _norm_bytes(model: ModelSpec, sizes: Sizes, fused_rms: bool, input_element: int) -> int:
    """What a norm saves besides its output: LayerNorm (fused) its input, mean and 1/std (in the input's dtype, as
    torch's CPU kernel keeps them); RMSNorm on a CPU (composite, in fp32) its upcast input, the normalised tensor and
    1/rms; RMSNorm on a GPU (CUDA's fused kernel, shardscope.trace.gpu_kernels) its input (input_element bytes each)
    and 1/rms. A norm sits at the block boundary: its tokens are split tp ways under sequence parallelism."""
    tokens = sizes.boundary_tokens
    if model.family == "gpt2":
        return sizes.boundary + 2 * tokens * sizes.element
    if fused_rms:
        return tokens * model.hidden_size * input_element + tokens * sizes.stat
    return 2 * tokens * model.hidden_size * sizes.stat + tokens * sizes.stat


def _attention_bytes(model: ModelSpec, training: TrainingSpec, sizes: Sizes) -> tuple[int, int]:
    """(bytes the attention saves from its input projection's input on, the part selective checkpointing drops)."""
    # gpt2's fused c_attn output holds q, k and v in one storage; llama keeps rotated q and k, and v. gpt2's q, k
    # and v are each as wide as its hidden size.
    projections = 3 * sizes.query if model.family == "gpt2" else sizes.query + 2 * sizes.kv
    if training.attention == "eager" and not sizes.ring:
        # The batched matmuls save contiguous copies of q, k and v (k and v repeated to every head), and the
        # softmax output; the head-major output is copied back to token-major for the output projection.
        core = 3 * sizes.query + sizes.probs
        kept_by_selective = projections
        full = core + sizes.query
    else:
        # Fused kernels save q, k, v (views of the projections), the output and a log-sum-exp; the output is laid
        # out token-major already, so the output projection's input is a view of it. Ring attention (context
        # parallelism, whatever the attention kind) saves the same of the rank's own tokens.
        core = projections + sizes.lse
        kept_by_selective = projections
        full = core + sizes.query
    selective = kept_by_selective + sizes.query
    # The input projections save their (all-gathered) input once, shared by q, k and v.
    return sizes.gathered + full, full - selective


def _mlp_bytes(model: ModelSpec, sizes: Sizes) -> int:
    """What the MLP saves from its input on."""
    tokens, element, hidden = sizes.tokens, sizes.element, model.hidden_size
    if model.family == "gpt2":
        return sizes.gathered + 2 * tokens * sizes.ffn * element  # fc input, GELU input, proj input
    if model.family == "llama":
        # SwiGLU: shared gate/up input, gate output, SiLU output, up output, down input.
        return sizes.gathered + 4 * tokens * sizes.ffn * element
    routed, experts = tokens * model.experts_per_token, model.num_experts
    # Mixtral of Experts: router input and probabilities, top-k indices and renormalised weights, then per routed
    # token: its gathered input, SwiGLU's four tensors, its output and weight, and the nonzero() row index pairs.
    # Under tensor parallelism the router runs on every rank over the gathered tokens; each expert's FFN is split.
    router = sizes.gathered + tokens * experts * element + routed * (8 + element) + tokens * element
    if model.capacity_factor:
        # The capacity rule (expert_routing.py): the experts' padded rows, each with its input, SwiGLU's four
        # tensors and the int64 token it holds (the dispatch's index), then per routed copy its output read back
        # from the buffer, its weight and its int64 row (the combine's). Measured with saved_tensors_hooks on
        # tiny-moe, with expert parallelism and without.
        rows_bytes = sizes.expert_rows * (hidden * element + 4 * sizes.ffn * element + INDEX_BYTES)
        return router + rows_bytes + routed * (hidden * element + element + INDEX_BYTES)
    per_routed = 3 * hidden * element + 4 * sizes.ffn * element + 16 + element
    if sizes.experts < model.num_experts:
        # Expert parallelism (runtime/teaching/expert_parallel.py): the expert's rank keeps each output (its combine
        # buffer's input), the token's rank the copy the combine brings back, and three int64 token orders instead
        # of the row pair (measured with saved_tensors_hooks on tiny-moe).
        per_routed += hidden * element + 2 * INDEX_BYTES
    return router + routed * per_routed


def _mlp_backward_bytes(model: ModelSpec, sizes: Sizes) -> int:
    """Bytes a block's MLP backward adds at its peak, beyond the block's saved tensors. The output projection's
    backward frees its saved input (tokens x ffn) and makes its weight (and bias) gradient and its input's gradient;
    then gpt2's GELU backward makes one more tokens x ffn tensor, and SwiGLU's product backward two (the gate's and
    the up projection's gradients) while its own input gradient is still live. Measured with the trace's tracker
    (`shardscope trace --model tiny-gpt2 --gpus 4 --gpus-per-node 4 --checkpointing full --strategy zero3 --engine
    pytorch --micro-batch 2 --seq-len 32`: peak at gelu_backward of the bottom block; tiny-llama's at the SwiGLU
    product's backward)."""
    ffn = sizes.tokens * sizes.ffn * sizes.element
    weight = sizes.ffn * model.hidden_size * sizes.element
    if model.family == "gpt2":
        return weight + model.hidden_size * sizes.element + ffn
    if model.family == "moe":
        return _moe_backward_bytes(model, sizes, weight)
    return weight + 2 * ffn


def _moe_backward_bytes(model: ModelSpec, sizes: Sizes, weight: int) -> int:
    """MoE's MLP backward peaks in the SwiGLU product's backward of the last expert to run backward (the first in
    forward): every routed token's output and weighted output are freed, the other experts have freed what they
    saved (gathered input, SwiGLU's four tensors, nonzero() row pairs) and hold their three weight gradients, the
    routed inputs' gradients accumulate into one tokens x hidden tensor, and this expert holds its output projection's
    weight gradient and two of its tokens x ffn gradients. Routing is data-dependent: the core assumes each expert
    gets tokens x top-k / experts rows; tests/core/test_backend_peak.py pins how far under a measured uneven routing
    that puts it. Under expert parallelism the rank's num_experts / ep experts get as many rows in all (its expert
    group's tokens routed to them, dropless and even: core/expert_parallel.py)."""
    element, hidden, ffn = sizes.element, model.hidden_size, sizes.ffn
    routed = sizes.tokens * model.experts_per_token
    per_expert = -(-sizes.expert_rows // sizes.experts)
    others = sizes.experts - 1
    if model.capacity_factor:
        return _capacity_backward_bytes(model, sizes, weight, per_expert)
    saved_per_row = hidden * element + 4 * ffn * element + 16  # gathered input, SwiGLU's four, the row pair
    freed = routed * (2 * hidden * element + element) + others * per_expert * saved_per_row
    made = others * 3 * weight + weight + 2 * per_expert * ffn * element + sizes.tokens * hidden * element
    return made - freed


def _capacity_backward_bytes(model: ModelSpec, sizes: Sizes, weight: int, per_expert: int) -> int:
    """The capacity rule's MLP backward (expert_routing.py) at the same moment, the SwiGLU product's backward of the
    last expert to run backward: the combine has freed each routed copy's output, weight and row; the other experts
    have freed SwiGLU's four tensors and hold their three weight gradients and their input's gradient (the
    dispatch's backward joins them only once every expert is done); this expert holds its output projection's weight
    gradient and two of its rows x ffn gradients. Their inputs are views of the one dispatched buffer, kept until
    the last expert is done, except under expert parallelism, where each expert's rows are a copy of their own.
    Read from the code path (expert_routing.py), not measured yet: the validated cases (docs/accuracy.md) reach
    their peak elsewhere."""
    element, hidden, ffn = sizes.element, model.hidden_size, sizes.ffn
    others = sizes.experts - 1
    freed = sizes.tokens * model.experts_per_token * (hidden * element + element + INDEX_BYTES)
    freed += others * per_expert * 4 * ffn * element
    if sizes.experts < model.num_experts:
        freed += others * per_expert * hidden * element
    made = others * 3 * weight + weight + 2 * per_expert * ffn * element + others * per_expert * hidden * element
    return made - freed


def _block_bytes(model: ModelSpec, training: TrainingSpec, sizes: Sizes, norm: int) -> tuple[int, int]:
    """(bytes one block saves, bytes that selective checkpointing does not keep), given what one norm saves."""
    attention, dropped = _attention_bytes(model, training, sizes)
    return 2 * norm + attention + _mlp_bytes(model, sizes), dropped


def _shared_bytes(model: ModelSpec, training: TrainingSpec, share: RankShare) -> int:
    """Tensors every block uses, saved once: RoPE's cos and sin, the causal mask of eager (not ring: it masks by
    position itself) or recomputed attention; under context parallelism the rows of the rank's own positions."""
    seq = training.sequence_length
    rows = seq // share.cp
    rope = 2 * rows * model.head_dim * activation_bytes_per_element(training) if model.family != "gpt2" else 0
    eager = training.attention == "eager" and share.cp == 1
    mask = rows * seq if eager or training.checkpointing == "selective" else 0
    if _checkpoint_holds_context(training, share):
        # torch.utils.checkpoint (non-reentrant) keeps a checkpointed block's inputs, which its recomputation
        # closes over, until that block's backward: RoPE's tables and the mask, whatever the attention kind (under
        # context parallelism the mask of the rank's own positions, rows x rows).
        mask = max(mask, rows * rows)
    return rope + mask


def _checkpoint_holds_context(training: TrainingSpec, share: RankShare) -> bool:
    """Whether the shared tensors are kept as the inputs of checkpointed blocks: some block is checkpointed (whole,
    or by the op policy). Followed under tensor or context parallelism only, where validation measured it; the same
    inputs are kept without them, but the data-parallel numbers are held fixed until they are validated again."""
    checkpointed = training.checkpointing == "op" or checkpoint_every(training.checkpointing) > 0
    return checkpointed and share != WHOLE


def _autocast_extra(model: ModelSpec, training: TrainingSpec, sizes: Sizes, share: RankShare) -> tuple[int, int, int]:
    """What torch.autocast saves beyond 16-bit compute: (per block, per checkpointed block input, head and shared).

    Autocast keeps fp32 weights and an fp32 residual stream: every matmul saves a 16-bit copy of its weight, the
    norms see fp32 inputs, RoPE's tables stay fp32 and llama's rotated q and k are made in fp32 and cast again
    (three more tokens x hidden 16-bit tensors per block, measured).
    """
    layout = param_layout(model, share.tp, share.ep)
    head_weight = model.vocab_size // share.tp * model.hidden_size * sizes.element  # lm_head's copy, tied or not
    block_weights = sum(t.numel for t in layout.block if len(t.shape) == 2) * sizes.element
    widen = 4 - sizes.element
    boundary = sizes.boundary_tokens * model.hidden_size * widen  # the fp32 residual stream a block starts from
    if model.family == "gpt2":
        norm = boundary + 2 * sizes.boundary_tokens * widen  # fp32 input and statistics
        return block_weights + 2 * norm, boundary, head_weight + norm
    keeps_rope = _keeps_shared(training) or _checkpoint_holds_context(training, share)
    rope = 2 * training.sequence_length // share.cp * model.head_dim * widen if keeps_rope else 0
    # Checkpointing the attention core also keeps the 16-bit casts of its rotated q and k (measured).
    selective = sizes.query + sizes.kv if training.checkpointing == "selective" else 0
    # MoE: each expert's gate and up projections cast its rows to 16 bits apart (two copies, one counted), and each
    # routed copy's output is weighted in fp32; in a block, one tokens x hidden 16-bit tensor fewer than the MoE
    # layer alone holds (measured with saved_tensors_hooks, both ways; tests/validate/test_activation_accounting.py
    # holds the block's count for top-1 and top-2, dropless and under the capacity rule).
    routed = (sizes.expert_rows - sizes.tokens) * model.hidden_size * sizes.element if model.num_experts else 0
    routed += sizes.tokens * model.experts_per_token * model.hidden_size * widen
    # Three more tokens x hidden 16-bit tensors around the rotated q and k: split with the heads.
    rotary = 3 * sizes.tokens * (model.hidden_size // share.tp) * sizes.element
    return block_weights + rotary + selective + routed, boundary, head_weight + rope


def _op_cached_bytes(model: ModelSpec, training: TrainingSpec, sizes: Sizes, share: RankShare) -> int:
    """What torchtitan's op policy keeps of one block besides its input (core/op_checkpointing.py): the outputs of
    the matmuls it saves, of the attention kernel (sdpa: the output and a log-sum-exp per row; eager: the two batched
    matmuls' outputs, scores and context), and MoE's top-k (weights and int64 indices). MoE routing is data-
    dependent: each expert is assumed to get an even share of the routed rows."""
    routed = sizes.tokens * model.experts_per_token
    per_expert = -(-sizes.expert_rows // max(1, sizes.experts))
    linears = sum(
        (per_expert if ".experts." in tensor.name else sizes.tokens) * tensor.shape[0] * sizes.element
        for tensor, saved in saved_linears(model, share.tp, share.ep)
        if saved
    )
    attention = sizes.query + (sizes.lse if training.attention == "sdpa" or sizes.ring else sizes.probs)
    # Under sequence parallelism the policy also saves the reduce-scatters of the attention's and the MLP's output.
    scattered = 2 * sizes.boundary if share.sequence_parallel else 0
    return linears + attention + routed * (sizes.element + INDEX_BYTES) + scattered


def _keeps_shared(training: TrainingSpec) -> bool:
    """Whether some block saves the shared tensors itself: not when every block is checkpointed whole ('full',
    'every:1') or by the op policy, which recompute RoPE and the mask."""
    return training.checkpointing != "op" and checkpoint_every(training.checkpointing) != 1


@dataclass(frozen=True, slots=True)
class _BlockTerms:
    """One block under one checkpointing mode: what it keeps, what its backward recomputes, and what it holds at the
    peak of its own backward beyond what it kept (its MLP's backward not included)."""

    stored: int
    recompute: int
    backward: int


@cache
def estimate_activations(
    model: ModelSpec,
    training: TrainingSpec,
    autocast: bool = False,
    gpu_kernels: bool = False,
    share: RankShare = WHOLE,
) -> ActivationEstimate:
    """Saved activations of one micro-batch on one rank; requires a shaped model. `autocast`: torch.autocast over fp32
    weights (torch's DDP under mixed precision) rather than 16-bit weights. `gpu_kernels`: the ranks are GPUs, whose
    fused RMSNorm saves its input instead of fp32 copies (ClusterSpec.gpu_kernels). `share`: the rank's cut of the
    tensors under tensor, sequence and context parallelism (core/rank_share.py)."""
    sizes = sizes_of(model, training, share)
    widened = autocast and training.is_mixed
    norm = _norm_bytes(model, sizes, gpu_kernels, 4 if widened else sizes.element)
    block, selective_dropped = _block_bytes(model, training, sizes, norm)
    keeps_shared = _keeps_shared(training) or _checkpoint_holds_context(training, share)
    shared = _shared_bytes(model, training, share) if keeps_shared else 0
    block_extra = input_extra = head_extra = 0
    if widened:
        block_extra, input_extra, head_extra = _autocast_extra(model, training, sizes, share)
        block += block_extra
    # gpt2's first LayerNorm saves the block's input itself, as do llama's fused RMSNorm and its composite in fp32
    # (its upcast is a no-op): under full checkpointing that tensor is the one stored, not recomputed.
    input_reused = sizes.boundary if model.family == "gpt2" or gpu_kernels or sizes.element == sizes.stat else 0
    # A block checkpointed whole keeps only its input and recreates the rest one block at a time in backward; the op
    # policy keeps its input and what it saves, and recomputes the rest (what it saved is handed back, not made
    # again, and what backward does not need is freed as the recomputation passes it).
    whole = _BlockTerms(sizes.boundary + input_extra, block, block - input_reused)
    cached = _op_cached_bytes(model, training, sizes, share) if training.checkpointing == "op" else 0
    terms = {
        "none": _BlockTerms(block, 0, 0),
        "selective": _BlockTerms(block - selective_dropped, selective_dropped, selective_dropped),
        "op": _BlockTerms(whole.stored + cached, block - cached, whole.backward - cached),
    }
    mode = terms.get(training.checkpointing, terms["none"])
    top = whole if checkpoints_block(training.checkpointing, model.num_layers - 1) else mode
    first = whole if checkpoints_block(training.checkpointing, 0) else mode
    every = checkpoint_every(training.checkpointing)
    whole_blocks = model.num_layers // every if every else 0  # torchtitan's rule: blocks N-1, 2N-1, ...
    stored_blocks = whole_blocks * whole.stored + (model.num_layers - whole_blocks) * mode.stored
    # A block's backward peaks in its MLP's backward or, under context parallelism, in ring attention's backward
    # with a K/V chunk pair and its gradients in flight, whichever holds more.
    mlp_backward = _mlp_backward_bytes(model, sizes)
    ring = ring_attention_backward_bytes(sizes, share)
    own_backward = max(mlp_backward, ring) if ring else mlp_backward
    loss_element = sizes.stat
    tokens = sizes.tokens
    vocab = model.vocab_size // share.tp  # loss parallel: lm_head's output, the logits and the loss split by vocabulary
    logits = tokens * vocab * sizes.element
    # The head: the final norm, lm_head's input, and the log-softmax output the loss keeps; token ids (embedding),
    # gpt2's position ids, targets and the loss's total weight.
    head = norm + sizes.gathered
    log_softmax = tokens * vocab * loss_element
    positions = training.sequence_length // share.cp * INDEX_BYTES if model.family == "gpt2" else 0
    ids = 2 * tokens * INDEX_BYTES + positions
    head += head_extra
    total_weight = loss_element
    forward_spike = logits + (tokens * vocab * loss_element if sizes.element != loss_element else 0)
    backward_spike = 2 * tokens * vocab * loss_element
    head_gradient = backward_spike if sizes.element == loss_element else logits
    if share.vocab_parallel_loss:
        # Megatron-LM's vocab-parallel embedding and cross entropy keep a one-byte mask per token beside the token
        # ids and the targets, and no total weight; the cross entropy's targets and mask go with its softmax, first
        # in backward. Its backward keeps them while it makes the gradient, so the loss value is live at the spike
        # too (torch's cross entropy has freed its total weight by then, which `saved` counts in its place). Of
        # its two tokens x vocab fp32 tensors one is left as backward leaves the head: the one-hot target is freed.
        ids = tokens * (INDEX_BYTES + 1) + positions  # the embedding's token ids and mask
        head += tokens * (INDEX_BYTES + 1)  # the cross entropy's targets and mask
        total_weight = 0
        backward_spike += loss_element
        head_gradient = log_softmax if sizes.element == loss_element else logits
    saved = stored_blocks + shared + head + log_softmax + ids + total_weight
    return ActivationEstimate(
        saved_bytes=saved,
        block_bytes=block,
        stored_block_bytes=top.stored,
        recompute_bytes=top.recompute,
        logits_bytes=logits,
        loss_forward_spike_bytes=forward_spike,
        loss_backward_spike_bytes=backward_spike,
        head_bytes=head + log_softmax,
        head_gradient_bytes=head_gradient,
        hidden_bytes=sizes.boundary,
        log_softmax_bytes=log_softmax,
        block_backward_bytes=top.backward + own_backward,
        first_stored_block_bytes=first.stored,
        first_block_backward_bytes=first.backward + own_backward,
        stored_blocks_bytes=stored_blocks,
        shared_bytes=shared,
        inputs_bytes=ids + total_weight,
    )
