"""Compute: FLOPs of every stage of a step, and the time they take on a GPU at a stated efficiency.

FLOPs are counted from the matmul shapes of the model (2 FLOPs per multiply-add), as in "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM" (Narayanan et al., Section 5.1): a GPT block with an MLP of
4h costs 24bsh^2 + 4bs^2h forward, the logits 2bshV, backward twice forward, and full recomputation one more forward,
so a step is 96Bslh^2(1 + s/6h + V/16lh). Attention is counted over the full s x s square as that paper and PaLM
("PaLM: Scaling Language Modeling with Pathways", Appendix B) do, even though causal kernels skip half of it.
Selective recomputation recomputes only the attention core ("Reducing Activation Recomputation in Large Transformer
Models", Section 4). Elementwise ops (norms, activations, residual adds) are not counted as FLOPs; they cost time
through the per-kernel overhead.

FLOPs are one rank's: tensor parallelism divides every matmul of a block and the vocabulary-split head by tp (each
rank multiplies by its slice of the weights, core.params), and context parallelism divides the tokens by cp. Under
context parallelism each rank's queries attend to the whole sequence; with the load-balanced chunks (two of 2 x cp
per rank) every rank does 1/cp of the attention core.

On a GPU preset whose architecture has kernel ceilings (presets/gpu_kernels.json), time is priced per op by
core.kernels. Otherwise, and whenever an efficiency is given (--efficiency, a profile file): time = FLOPs / (peak x
efficiency) + kernels x overhead per kernel. That efficiency is an assumption: 0.5 by default, the fraction of peak
Megatron-LM reports for its large runs (52% at 1T parameters on A100). A calibrated profile replaces the datasheet
peak by measured matmul throughput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from shardscope.choices import checkpointed_blocks
from shardscope.core.engines import rules_for
from shardscope.core.op_checkpointing import recomputed_linears, saved_linears
from shardscope.core.params import ParamTensor, param_layout
from shardscope.presets.hardware import HardwareProfile
from shardscope.presets.kernels import KernelCeilings, kernel_ceilings
from shardscope.specs import ModelSpec, Scenario, SpecError, TrainingSpec

DEFAULT_EFFICIENCY = 0.5
# Ops (aten ops as torch dispatches them, views included) one block runs in forward and in backward, counted with a
# dispatch-mode counter on shardscope.reference_models at micro-batch 2 x 32 (tiny presets, fp32; the count does not
# depend on sizes): (family, attention) -> (forward, backward). Multiplied by the calibrated per-op cost they are what
# a CPU step of a small model spends beyond its FLOPs. MoE counts are tiny-moe's (4 experts, 2 per token).
OPS_PER_BLOCK = {
    ("gpt2", "eager"): (51, 88),
    ("gpt2", "sdpa"): (32, 68),
    ("llama", "eager"): (93, 158),
    ("llama", "sdpa"): (68, 133),
    ("moe", "eager"): (153, 295),
    ("moe", "sdpa"): (128, 270),
}
# Ops outside the blocks (embeddings; final norm, head and cross-entropy loss), same counter: (forward, backward).
OPS_EMBED = (2, 2)
OPS_HEAD = {"gpt2": (14, 21), "llama": (27, 32), "moe": (27, 32)}
# fp32 accesses per element of one optimizer step. A fused kernel (DeepSpeed's FusedAdam and CPUAdam) reads
# parameter, gradient and two moments and writes parameter and moments once: 7 for Adam(W) ("Adam: A Method for
# Stochastic Optimization", Algorithm 1), SGD with momentum 5, plain SGD 3. torch's single-tensor and foreach steps
# make one pass per op, counted in torch.optim's _single_tensor_adam and _single_tensor_sgd: AdamW's decay mul_ 2,
# lerp_ 3, mul_ 2, addcmul_ 3, sqrt 2, divide 2, add_ 2, addcdiv_ 4 = 20 (Adam 18: no decay pass); SGD with
# momentum mul_ 2, add_ 3 and the update 3 = 8; plain SGD 3.
FUSED_OPTIMIZER_ACCESSES = {"adamw": 7, "adam": 7, "sgd-momentum": 5, "sgd": 3}
OPTIMIZER_ACCESSES = {"adamw": 20, "adam": 18, "sgd-momentum": 8, "sgd": 3}
# Kernels per parameter tensor of a single-tensor (foreach=False) step, counted in torch.optim's _single_tensor_adam
# and _single_tensor_sgd: AdamW's decay, two moment updates, bias corrections, sqrt, divide and update.
OPTIMIZER_KERNELS_PER_TENSOR = {"adamw": 12, "adam": 11, "sgd-momentum": 3, "sgd": 1}


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeModel:
    """How fast one rank computes: its matmul throughput, an efficiency, and a per-kernel overhead."""

    peak_flops_per_s: float
    """Peak dense FLOP/s for the step's dtype (datasheet), or measured matmul throughput (calibrated)."""
    efficiency: float = DEFAULT_EFFICIENCY
    """Fraction of the peak a training step's matmuls reach (an assumption; 1.0 when the peak was measured)."""
    kernel_overhead_s: float = 0.0
    """Launch and dispatch cost of one forward op (measured by calibrate; ~0 for a busy GPU)."""
    backward_op_overhead_s: float = 0.0
    """The same for one backward op, autograd included."""
    optimizer_tensor_overhead_s: float = 0.0
    """Cost per parameter tensor of a single-tensor optimizer step; 0: its kernels x kernel_overhead_s."""
    memory_bandwidth_bytes_per_s: float = 0.0
    """Device memory bandwidth for the optimizer step; 0 to ignore its cost."""
    kernels: KernelCeilings | None = None
    """The GPU's kernel ceilings: each op priced by core.kernels instead of peak x efficiency (None: efficiency)."""

    def __post_init__(self) -> None:
        for name in ("peak_flops_per_s", "efficiency"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise SpecError(f"ComputeModel.{name}={value} must be a positive number")
        if self.efficiency > 1:
            raise SpecError(f"ComputeModel.efficiency={self.efficiency} must be at most 1")
        for name in ("kernel_overhead_s", "backward_op_overhead_s", "optimizer_tensor_overhead_s"):
            if not getattr(self, name) >= 0:
                raise SpecError(f"ComputeModel.{name}={getattr(self, name)} must be zero or more")
        if not self.memory_bandwidth_bytes_per_s >= 0:
            raise SpecError("ComputeModel.memory_bandwidth_bytes_per_s must be zero or more")

    def seconds(self, flops: float, kernels: float) -> float:
        """Time of forward work of so many FLOPs in so many ops."""
        return flops / (self.peak_flops_per_s * self.efficiency) + kernels * self.kernel_overhead_s

    def backward_seconds(self, flops: float, ops: float) -> float:
        """Time of backward work of so many FLOPs in so many ops (the forward per-op cost when none is measured)."""
        per_op = self.backward_op_overhead_s or self.kernel_overhead_s
        return flops / (self.peak_flops_per_s * self.efficiency) + ops * per_op


@dataclass(frozen=True, slots=True, kw_only=True)
class StageFlops:
    """FLOPs of one compute stage for one micro-batch."""

    name: str
    """'embed', 'block 0'.., or 'head'."""
    forward_flops: float
    """Forward FLOPs."""
    backward_flops: float
    """Backward FLOPs (twice forward)."""
    recompute_flops: float
    """FLOPs recomputed in backward under checkpointing."""
    forward_kernels: float
    """Ops run in forward."""
    backward_kernels: float
    """Ops run in backward."""
    recompute_kernels: float
    """Kernels launched to recompute."""


def compute_dtype(training: TrainingSpec) -> str:
    """The dtype matmuls run in: bf16/fp16 under mixed or pure 16-bit precision, else fp32 or fp64."""
    return {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}.get(training.precision, training.precision)


def _expert_share(model: ModelSpec, training: TrainingSpec, cp: int) -> float:
    """The rows each expert's matrices see, as a share of the rank's tokens: top-k / experts (dropless, balanced
    routing), or its padded capacity rows (ModelSpec.expert_rows) over the tokens."""
    if model.capacity_factor:
        tokens = training.tokens_per_micro_batch // cp
        return model.expert_rows(training.micro_batch_size, training.sequence_length // cp) / model.num_experts / tokens
    return model.experts_per_token / max(1, model.num_experts)


def _matmul_flops(tensors: tuple[ParamTensor, ...], tokens: int, expert_share: float) -> float:
    """2 x tokens x in x out for every weight matrix; the experts' matrices see `expert_share` of the tokens."""
    flops = 0.0
    for tensor in tensors:
        if len(tensor.shape) != 2:
            continue
        share = expert_share if ".experts." in tensor.name else 1.0
        flops += 2.0 * tokens * tensor.numel * share
    return flops


def _attention_core_flops(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> float:
    """QK^T and attention x V: 2 x 2bs^2 x (heads x head_dim), the full square (Megatron-LM's 4bs^2h); one rank's
    share is its heads (1/tp) and its query rows (1/cp)."""
    seq = training.sequence_length
    return 4.0 * training.micro_batch_size * seq * seq * (model.num_heads // tp) * model.head_dim / cp


def head_matrices(model: ModelSpec, tp: int = 1) -> tuple[tuple[int, int], ...]:
    """(out, in) of the matmuls after the blocks on one of `tp` tensor-parallel ranks (the vocabulary split): the
    head's own weights, or the embedding matrix used a second time when tied."""
    layout = param_layout(model, tp)
    own = tuple(t.shape for t in layout.root if len(t.shape) == 2 and not t.name.startswith("embed"))
    tied = ((model.vocab_size // tp, model.hidden_size),) if model.tie_embeddings else ()
    return tuple((shape[0], shape[1]) for shape in own) + tied


@cache
def stage_flops(model: ModelSpec, training: TrainingSpec, tp: int = 1, cp: int = 1) -> tuple[StageFlops, ...]:
    """FLOPs of every stage in forward order on one rank of `tp` x `cp`: embeddings, the blocks, then final norm,
    head and loss."""
    layout = param_layout(model, tp)
    tokens = training.tokens_per_micro_batch // cp
    expert_share = _expert_share(model, training, cp)
    block_matmuls = _matmul_flops(layout.block, tokens, expert_share)
    attention = _attention_core_flops(model, training, tp, cp)
    block_forward = block_matmuls + attention
    block_kernels, block_backward = (float(count) for count in OPS_PER_BLOCK[(model.family, training.attention)])
    # Recomputed in backward, per block: everything under 'full' (and on the blocks 'every:N' checkpoints), the
    # attention core under 'selective', the matmuls torchtitan's op policy does not save under 'op' (its saved ops
    # are cache lookups; the attention kernel is saved).
    op_saved = len(saved_linears(model)) - len(recomputed_linears(model)) + 1  # and the attention kernel
    partial = {
        "selective": (attention, 1.0),
        "op": (
            _matmul_flops(recomputed_linears(model, tp), tokens, expert_share),
            block_kernels - op_saved,
        ),
    }.get(training.checkpointing, (0.0, 0.0))
    whole = (block_forward, block_kernels)
    recomputed = [
        whole if checkpointed else partial
        for checkpointed in checkpointed_blocks(training.checkpointing, model.num_layers)
    ]
    head = sum(2.0 * tokens * out_features * in_features for out_features, in_features in head_matrices(model, tp))
    stages = [
        StageFlops(
            name="embed",
            forward_flops=0.0,
            backward_flops=0.0,
            recompute_flops=0.0,
            forward_kernels=OPS_EMBED[0],
            backward_kernels=OPS_EMBED[1],
            recompute_kernels=0.0,
        )
    ]
    stages += [
        StageFlops(
            name=name,
            forward_flops=block_forward,
            backward_flops=2 * block_forward,
            recompute_flops=recompute_flops,
            forward_kernels=block_kernels,
            backward_kernels=block_backward,
            recompute_kernels=recompute_kernels,
        )
        for name, (recompute_flops, recompute_kernels) in zip(block_names(model.num_layers), recomputed, strict=True)
    ]
    stages.append(
        StageFlops(
            name="head",
            forward_flops=head,
            backward_flops=2 * head,
            recompute_flops=0.0,
            forward_kernels=OPS_HEAD[model.family][0],
            backward_kernels=OPS_HEAD[model.family][1],
            recompute_kernels=0.0,
        )
    )
    return tuple(stages)


@cache
def block_names(num_layers: int) -> tuple[str, ...]:
    """The blocks' stage names, bottom first."""
    return tuple(f"block {index}" for index in range(num_layers))


def rank_stage_flops(scenario: Scenario) -> tuple[StageFlops, ...]:
    """`stage_flops` of one rank of the scenario: its tensor- and context-parallel share."""
    return stage_flops(scenario.model, scenario.training, scenario.strategy.tp, scenario.strategy.cp)


def model_flops_per_step(scenario: Scenario) -> float:
    """FLOPs one rank's step needs without recomputation: what MFU counts (PaLM, Appendix B)."""
    per_micro_batch = sum(stage.forward_flops + stage.backward_flops for stage in rank_stage_flops(scenario))
    return per_micro_batch * scenario.training.grad_accum_steps


def hardware_flops_per_step(scenario: Scenario) -> float:
    """FLOPs one rank's step executes, recomputation included (hardware FLOPs utilisation counts these)."""
    recompute = sum(stage.recompute_flops for stage in rank_stage_flops(scenario))
    return model_flops_per_step(scenario) + recompute * scenario.training.grad_accum_steps


def optimizer_step_s(scenario: Scenario, compute: ComputeModel, shard_numel: int, shard_tensors: int) -> float:
    """The optimizer step over the rank's shard: memory-bound, fp32 state accesses over the memory bandwidth (one
    pass per op under torch's optimizers, fused under DeepSpeed's), plus the kernels it launches per tensor.

    With kernel ceilings the device step runs at the copy fraction of the bandwidth, and under CPU offload the step
    is DeepSpeed's CPU-Adam: one fused pass ("ZeRO-Offload: Democratizing Billion-Scale Model Training": its CPU-Adam)
    over the host's memory bandwidth, shared by the node's ranks."""
    optimizer = scenario.training.optimizer
    per_tensor = (
        compute.optimizer_tensor_overhead_s or OPTIMIZER_KERNELS_PER_TENSOR[optimizer] * compute.kernel_overhead_s
    )
    kernels = per_tensor * shard_tensors
    state_bytes = 8 if scenario.training.precision == "fp64" else 4
    ceilings = compute.kernels
    if ceilings is not None and scenario.strategy.offload != "none":
        host = ceilings.host_memory_bandwidth_bytes_per_s / scenario.cluster.ranks_per_node
        return kernels + FUSED_OPTIMIZER_ACCESSES[optimizer] * state_bytes * shard_numel / host
    bandwidth = compute.memory_bandwidth_bytes_per_s * (ceilings.memory_fraction if ceilings else 1.0)
    if bandwidth <= 0:
        return kernels
    fused = rules_for(scenario).fused_optimizer
    accessed = (FUSED_OPTIMIZER_ACCESSES if fused else OPTIMIZER_ACCESSES)[optimizer] * state_bytes * shard_numel
    return kernels + accessed / bandwidth


def compute_model(scenario: Scenario, profile: HardwareProfile) -> ComputeModel:
    """The compute half: measured matmul throughput if the profile has it, else the GPU's datasheet peak; priced per
    op (core.kernels) where the profile asks for it and the GPU's architecture has kernel ceilings, for 16-bit compute
    over NCCL (a gloo run is a CPU run)."""
    peak = profile.matmul_flops_per_s
    dtype = compute_dtype(scenario.training)
    ceilings = None
    if profile.per_op_kernels and peak <= 0 and scenario.cluster.backend == "nccl" and dtype in ("bf16", "fp16"):
        ceilings = kernel_ceilings(scenario.cluster.gpu.id)
    if peak <= 0:
        datasheet = scenario.cluster.gpu.peak_flops(dtype)
        if datasheet is None:
            raise SpecError(
                f"GPU {scenario.cluster.gpu.id!r} has no datasheet peak for {dtype}; give a calibrated "
                f"--hardware profile or choose a GPU preset"
            )
        peak = datasheet
    forward_op_s, backward_op_s = profile.op_overheads(scenario.model.family)
    return ComputeModel(
        peak_flops_per_s=peak,
        efficiency=profile.efficiency,
        kernel_overhead_s=forward_op_s,
        backward_op_overhead_s=backward_op_s,
        optimizer_tensor_overhead_s=profile.optimizer_tensor_overhead_s,
        memory_bandwidth_bytes_per_s=profile.memory_bandwidth_bytes_per_s,
        kernels=ceilings,
    )
