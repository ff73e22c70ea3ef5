"""Per-op time of a step on a GPU: each op at the ceiling of its kernel kind, no global efficiency.

- Matmuls: every linear of a block and the head, forward (Y = XW^T) and its two backward GEMMs (dX = dY W,
  dW = dY^T X), as M x N x K GEMMs cut into output tiles that run one per SM in waves ("The Case for Co-Designing
  Model Architectures with Hardware", Anthony et al. 2024; NVIDIA's Matrix Multiplication Background
  User's Guide: tile and wave quantization). A partial tile or a partial last wave costs a whole one.
- Attention core under sdpa: flash attention at its measured forward and backward throughput for the head dim and
  sequence length, over the causal half of the square (FlashAttention-2, Dao 2023, counts its benchmarks so).
  Eager attention: QK^T and attention x V as batched GEMMs over the whole square, and the scale, mask and softmax as
  memory-bound passes over the scores.
- Memory-bound ops (norms, activations, residual adds, rotary embeddings, the cross-entropy's log-softmax): the bytes
  they read and write over the memory bandwidth at its achievable (copy) fraction. A backward elementwise op reads
  its saved input and the incoming gradient and writes one gradient: twice its forward's bytes.
Under tensor and context parallelism each op is one rank's: its slice of every weight (core.params), its tokens
(1/cp), its heads (1/tp), and the norms and residual adds on 1/tp of the tokens under sequence parallelism; ring
attention runs the flash kernel on the rank's query chunks against every K/V chunk, causal half, 1/cp of the whole.
The ceilings per architecture, each with its source, are presets/gpu_kernels.json; core.compute.compute_model picks
this model for a GPU preset that has them (--efficiency brings back FLOPs / (peak x efficiency)).
"""

from __future__ import annotations

import math
from bisect import bisect_left

from shardscope.choices import checkpointed_blocks
from shardscope.core.compute import ComputeModel, head_matrices, rank_stage_flops
from shardscope.core.op_checkpointing import recomputed_linears
from shardscope.core.params import ParamTensor, param_layout
from shardscope.core.rank_share import RankShare, rank_share
from shardscope.presets.kernels import KernelCeilings
from shardscope.specs import ModelSpec, Scenario

FLASH_BACKWARD_FLOPS = 2.5  # FlashAttention's count: backward runs 5 matmuls of the forward's 2 (QK^T recomputed)
ACTIVATION_BYTES = 2  # the per-op model applies to 16-bit compute only (core.compute.compute_model)
LOG_SOFTMAX_BYTES = 4  # cross-entropy upcasts the logits to fp32


def gemm_s(rows: int, columns: int, depth: int, ceilings: KernelCeilings, rate: float, batch: int = 1) -> float:
    """One (batched) GEMM of a rows x columns output over depth: whole waves of whole tiles at the matmul rate, the
    tile laid whichever way round wastes less."""
    best = math.inf
    tile_rows, tile_columns = ceilings.gemm_tile
    for along, across in ((tile_rows, tile_columns), (tile_columns, tile_rows)):
        tiles = math.ceil(rows / along) * math.ceil(columns / across) * batch
        waves = math.ceil(tiles / ceilings.sm_count)
        best = min(best, waves * ceilings.sm_count * along * across)
    return 2.0 * depth * best / rate


def linear_s(
    tokens: int, out_features: int, in_features: int, ceilings: KernelCeilings, rate: float
) -> tuple[float, float]:
    """(forward, backward) of one linear layer over so many tokens."""
    forward = gemm_s(tokens, out_features, in_features, ceilings, rate)
    backward = gemm_s(tokens, in_features, out_features, ceilings, rate)
    backward += gemm_s(out_features, in_features, tokens, ceilings, rate)
    return forward, backward


def _flash_fractions(ceilings: KernelCeilings, head_dim: int, seq: int) -> tuple[float, float]:
    """Measured (forward, backward) fractions of peak: the nearest head dim, interpolated in log2 of the sequence
    length between measured lengths and held at the ends."""
    _, rows = min(ceilings.attention, key=lambda entry: abs(math.log2(entry[0] / head_dim)))
    lengths = [row[0] for row in rows]
    index = bisect_left(lengths, seq)
    if index == 0 or index == len(rows):
        _, forward, backward = rows[min(index, len(rows) - 1)]
        return forward, backward
    (low, f0, b0), (high, f1, b1) = rows[index - 1], rows[index]
    weight = math.log2(seq / low) / math.log2(high / low)
    return f0 + weight * (f1 - f0), b0 + weight * (b1 - b0)


def attention_core_s(scenario: Scenario, compute: ComputeModel, ceilings: KernelCeilings) -> tuple[float, float]:
    """(forward, backward) of the attention core of one block for one micro-batch on one rank: its heads (1/tp) and
    its query rows (1/cp) against the whole sequence."""
    model, training, strategy = scenario.model, scenario.training, scenario.strategy
    batch, seq, head_dim = training.micro_batch_size, training.sequence_length, model.head_dim
    heads, rows = model.num_heads // strategy.tp, seq // strategy.cp
    peak = compute.peak_flops_per_s
    if training.attention == "sdpa":
        flops = 4.0 * batch * seq * seq * heads * head_dim / 2 / strategy.cp  # the causal half, the rank's share
        # Ring attention runs the kernel on the rank's seq/cp query rows against one seq/cp K/V chunk at a time.
        forward_fraction, backward_fraction = _flash_fractions(ceilings, head_dim, rows)
        return flops / (peak * forward_fraction), FLASH_BACKWARD_FLOPS * flops / (peak * backward_fraction)
    rate = peak * ceilings.matmul_fraction
    pairs = batch * heads
    forward = gemm_s(rows, seq, head_dim, ceilings, rate, pairs) + gemm_s(rows, head_dim, seq, ceilings, rate, pairs)
    # Backward: two GEMMs the size of each forward one.
    backward = 2 * gemm_s(rows, head_dim, seq, ceilings, rate, pairs) + 2 * gemm_s(
        rows, seq, head_dim, ceilings, rate, pairs
    )
    scores_bytes = 3 * 2 * pairs * rows * seq * ACTIVATION_BYTES  # scale, mask, softmax: each reads and writes
    streaming = compute.memory_bandwidth_bytes_per_s * ceilings.memory_fraction
    return forward + scores_bytes / streaming, backward + 2 * scores_bytes / streaming


def block_elementwise_bytes(model: ModelSpec, tokens: int, share: RankShare, expert_rows: int) -> float:
    """Bytes the memory-bound ops of one block move in forward: two norms (read and write h), two residual adds
    (read 2h, write h), and the MLP's activation (GELU: read and write the ffn width; SwiGLU: read gate and up,
    write one); llama-family blocks add rotary embeddings on q and k, and MoE blocks run the activation once per
    routed expert and combine the experts' outputs. `tokens` are the rank's; its norms and residual adds run on
    1/tp of them under sequence parallelism, and its activation and rotary embeddings on 1/tp of the widths.
    `expert_rows`: the rows an MoE layer's experts run on (ModelSpec.expert_rows)."""
    hidden, ffn, tp = model.hidden_size, model.ffn_hidden_size // share.tp, share.tp
    boundary = (4 * hidden + 6 * hidden) * (tokens // share.boundary_split)
    elements = 0
    if model.family == "gpt2":
        elements += 2 * ffn * tokens
    else:
        elements += 2 * (model.num_heads // tp + model.num_kv_heads // tp) * model.head_dim * tokens
        activation_rows = expert_rows if model.num_experts else tokens
        elements += 3 * ffn * activation_rows
        if model.num_experts:
            elements += (model.experts_per_token + 1) * hidden * tokens
    return float((boundary + elements) * ACTIVATION_BYTES)


def _linears_s(
    tensors: tuple[ParamTensor, ...], scenario: Scenario, ceilings: KernelCeilings, rate: float
) -> tuple[float, float]:
    """(forward, backward) of the linears among `tensors`; an expert's see its share of the tokens (balanced
    routing). `tensors` are one tensor-parallel rank's slices; the tokens are the rank's (1/cp)."""
    model, tokens = scenario.model, scenario.training.tokens_per_micro_batch // scenario.strategy.cp
    routed = math.ceil(tokens * model.experts_per_token / max(1, model.num_experts))
    if model.capacity_factor:  # each expert runs on its padded capacity rows
        training = scenario.training
        routed = model.expert_rows(training.micro_batch_size, training.sequence_length) // model.num_experts
    forward = backward = 0.0
    for tensor in tensors:
        if len(tensor.shape) == 2:
            rows = routed if ".experts." in tensor.name else tokens
            one_forward, one_backward = linear_s(rows, tensor.shape[0], tensor.shape[1], ceilings, rate)
            forward, backward = forward + one_forward, backward + one_backward
    return forward, backward


def _head_s(scenario: Scenario, ceilings: KernelCeilings, rate: float) -> tuple[float, float]:
    """(forward, backward) of the head's matmuls on one rank: its vocabulary slice, its tokens."""
    forward = backward = 0.0
    tokens = scenario.training.tokens_per_micro_batch // scenario.strategy.cp
    for out_features, in_features in head_matrices(scenario.model, scenario.strategy.tp):
        one_forward, one_backward = linear_s(tokens, out_features, in_features, ceilings, rate)
        forward, backward = forward + one_forward, backward + one_backward
    return forward, backward


def stage_seconds(scenario: Scenario, compute: ComputeModel) -> tuple[list[float], list[float], list[float]]:
    """(forward, recompute, backward) seconds of every stage of one micro-batch, in core.compute.stage_flops order:
    per op when the compute model has kernel ceilings, else FLOPs / (peak x efficiency)."""
    stages = rank_stage_flops(scenario)
    ceilings = compute.kernels
    if ceilings is None:
        return (
            [compute.seconds(stage.forward_flops, stage.forward_kernels) for stage in stages],
            [compute.seconds(stage.recompute_flops, stage.recompute_kernels) for stage in stages],
            [compute.backward_seconds(stage.backward_flops, stage.backward_kernels) for stage in stages],
        )
    model, training, share = scenario.model, scenario.training, rank_share(scenario)
    tokens = training.tokens_per_micro_batch // share.cp
    streaming = compute.memory_bandwidth_bytes_per_s * ceilings.memory_fraction
    rate = compute.peak_flops_per_s * ceilings.matmul_fraction
    block_forward, block_backward = _linears_s(param_layout(model, share.tp).block, scenario, ceilings, rate)
    head_forward, head_backward = _head_s(scenario, ceilings, rate)
    attention_forward, attention_backward = attention_core_s(scenario, compute, ceilings)
    expert_rows = model.expert_rows(training.micro_batch_size, training.sequence_length // share.cp)
    elementwise = block_elementwise_bytes(model, tokens, share, expert_rows) / streaming
    block_forward += attention_forward + elementwise
    block_backward += attention_backward + 2 * elementwise
    embed = 2.0 * tokens * model.hidden_size * ACTIVATION_BYTES / streaming  # gather: read and write h per token
    # The final norm (on 1/tp of the tokens under sequence parallelism) and the loss over the rank's vocabulary.
    head_elementwise = (
        2 * model.hidden_size * ACTIVATION_BYTES * (tokens // share.boundary_split)
        + model.vocab_size // share.tp * (ACTIVATION_BYTES + LOG_SOFTMAX_BYTES) * tokens
    ) / streaming
    forward = [embed] + [block_forward] * model.num_layers + [head_forward + head_elementwise]
    backward = [2 * embed] + [block_backward] * model.num_layers + [head_backward + 2 * head_elementwise]
    # Recomputed per block as core.compute.stage_flops counts it: the whole block where it is checkpointed ('full',
    # 'every:N'), the attention core under 'selective', the linears torchtitan's op policy does not save under 'op'.
    partial = {
        "selective": attention_forward,
        "op": _linears_s(recomputed_linears(model, share.tp), scenario, ceilings, rate)[0],
    }.get(training.checkpointing, 0.0)
    checkpointing = training.checkpointing
    recompute = [0.0]
    recompute += [block_forward if whole else partial for whole in checkpointed_blocks(checkpointing, model.num_layers)]
    recompute.append(0.0)
    per_op_forward, per_op_backward = (
        compute.kernel_overhead_s,
        compute.backward_op_overhead_s or compute.kernel_overhead_s,
    )
    return (
        [seconds + stage.forward_kernels * per_op_forward for seconds, stage in zip(forward, stages, strict=True)],
        [seconds + stage.recompute_kernels * per_op_forward for seconds, stage in zip(recompute, stages, strict=True)],
        [seconds + stage.backward_kernels * per_op_backward for seconds, stage in zip(backward, stages, strict=True)],
    )
