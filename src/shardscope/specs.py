"""The vocabulary of a scenario: a model, a cluster, a training setup and a strategy.

Every spec is a frozen dataclass with a docstring on each field and validation that names the field, the value and
what is allowed. Derived values are properties. A `Scenario` joins the four; the core, the trace and the runtime all
take one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

from shardscope.choices import (
    ATTENTION,
    BACKENDS,
    FAMILIES,
    OPTIMIZERS,
    PRECISIONS,
    Attention,
    Backend,
    Family,
    OptimizerName,
    Precision,
    SpecError,
    parse_checkpointing,
    require_choice,
    require_int,
)
from shardscope.mesh import MeshError, Parallelism, data_parallel_mesh
from shardscope.strategy import (
    Strategy,
    require_expert_shape,
    require_model_parallel_shape,
    require_pipeline_shape,
)

__all__ = [
    "ClusterSpec",
    "GpuSpec",
    "ModelSpec",
    "Overheads",
    "Parallelism",
    "Scenario",
    "SpecError",
    "Strategy",
    "TrainingSpec",
]

# Sanity bounds: anything past these is a typo, not a model (the largest published dense models are ~1e12).
MAX_PARAMETERS = 10**15
MAX_SEQUENCE_LENGTH = 10**8
MAX_WORLD_SIZE = 10**6


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape, enough to count its parameters and activations exactly."""

    name: str
    """Preset id or a free label, e.g. 'llama-3-8b'."""
    family: Family
    """'gpt2' (LayerNorm, GELU MLP, learned positions), 'llama' (RMSNorm, SwiGLU, RoPE, GQA), 'moe' (llama with
    mixture-of-experts MLPs), or 'count' (only a parameter count is known, no shape)."""
    hidden_size: int = 0
    """Width of the residual stream (d_model)."""
    num_layers: int = 0
    """Number of transformer blocks."""
    num_heads: int = 0
    """Query attention heads."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); equal to num_heads for multi-head attention."""
    head_dim: int = 0
    """Width of one attention head; usually hidden_size // num_heads."""
    ffn_hidden_size: int = 0
    """Inner width of the MLP (per expert for 'moe')."""
    vocab_size: int = 0
    """Vocabulary size (rows of the embedding and of the output head)."""
    max_positions: int = 0
    """Learned position embeddings (gpt2 only); the context limit for the others."""
    tie_embeddings: bool = False
    """The output head shares the input embedding's weight."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (Qwen2); gpt2 always has biases everywhere."""
    num_experts: int = 0
    """Experts per MoE layer ('moe' only)."""
    experts_per_token: int = 0
    """Experts each token is routed to, top-k ('moe' only)."""
    capacity_factor: float = 0.0
    """Rows each expert takes per sequence, as a multiple of an even share ('moe' only): 0 routes dropless, every
    token to its top-k experts (Mixtral, torchtitan); F > 0 gives every expert `expert_capacity` rows per sequence,
    padded when fewer tokens choose it and dropping the routed copies past them (GShard's capacity per local group,
    a group being one sequence: "GShard: Scaling Giant Models with Conditional Computation and Automatic
    Sharding")."""
    declared_parameters: int = 0
    """The parameter count, for family 'count' only; shaped families derive it from the shape."""
    source: str = ""
    """Where the shape comes from (the published config it was read from)."""

    def __post_init__(self) -> None:
        owner = "ModelSpec"
        require_choice(owner, "family", self.family, FAMILIES)
        if self.family == "count":
            require_int(owner, "declared_parameters", self.declared_parameters, 1, MAX_PARAMETERS)
            return
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
        ):
            require_int(owner, name, getattr(self, name), 1, 10**7)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"{owner}.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.family == "gpt2":
            require_int(owner, "max_positions", self.max_positions, 1, MAX_SEQUENCE_LENGTH)
            if self.head_dim * self.num_heads != self.hidden_size:
                raise SpecError(
                    f"{owner}.head_dim={self.head_dim} times num_heads={self.num_heads} must equal "
                    f"hidden_size={self.hidden_size} for gpt2"
                )
        if self.family == "moe":
            require_int(owner, "num_experts", self.num_experts, 1, 100_000)
            require_int(owner, "experts_per_token", self.experts_per_token, 1, self.num_experts)
            _require_capacity_factor(self)
        elif self.num_experts or self.experts_per_token or self.capacity_factor:
            raise SpecError(
                f"{owner}.num_experts={self.num_experts}, capacity_factor={self.capacity_factor} are only allowed for "
                "family 'moe'"
            )

    def expert_capacity(self, sequence_length: int) -> int:
        """Rows of one expert per sequence under the capacity rule (0: dropless, no capacity):
        ceil(capacity_factor x sequence_length x top-k / num_experts), the factor read as the decimal it was given."""
        if not self.capacity_factor:
            return 0
        factor = Fraction(self.capacity_factor).limit_denominator(10**6)
        return math.ceil(factor * sequence_length * self.experts_per_token / self.num_experts)

    def expert_rows(self, sequences: int, positions: int) -> int:
        """Rows the experts of one MoE layer run on, all of them together, for `sequences` sequences of `positions`
        tokens each: every token top-k times (dropless), or every expert's capacity rows of every sequence, padded
        (the capacity rule). 0 without experts."""
        capacity = self.expert_capacity(positions)
        if capacity:
            return self.num_experts * sequences * capacity
        return sequences * positions * self.experts_per_token

    @property
    def has_shape(self) -> bool:
        """False when only a parameter count is known (activations cannot be estimated)."""
        return self.family != "count"

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object."""
        return asdict(self)


def _require_capacity_factor(model: ModelSpec) -> None:
    """SpecError naming the value unless it is 0 (dropless) or a number over 0 and at most num_experts / top-k,
    where every expert can take every token of a sequence and nothing is dropped."""
    factor, most = model.capacity_factor, model.num_experts / model.experts_per_token
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor):
        raise SpecError(f"ModelSpec.capacity_factor={factor!r} must be a number")
    if factor < 0 or factor > most:
        raise SpecError(
            f"ModelSpec.capacity_factor={factor} must be 0 (dropless) or over 0 and at most num_experts / "
            f"experts_per_token = {most:g}, where no token is dropped"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    """One accelerator model: its memory and peak dense throughput, as the vendor states them."""

    id: str
    """Preset id, e.g. 'h100-80gb'."""
    name: str
    """The vendor's product name."""
    memory_bytes: int
    """Device memory in bytes."""
    peak_flops_per_s: tuple[tuple[str, float], ...] = ()
    """Peak dense FLOP/s by dtype ('bf16', 'fp16', 'fp32', 'tf32', 'fp64'), from the vendor datasheet."""
    source: str = ""
    """The datasheet the numbers come from."""

    def __post_init__(self) -> None:
        require_int("GpuSpec", "memory_bytes", self.memory_bytes, 1)

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object."""
        return {
            "id": self.id,
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "peak_flops_per_s": dict(self.peak_flops_per_s),
            "source": self.source,
        }

    def peak_flops(self, dtype: str) -> float | None:
        """Peak dense FLOP/s for a dtype, or None when the datasheet gives none."""
        return dict(self.peak_flops_per_s).get(dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """The GPUs a job runs on: how many, of which kind, and how many share a node."""

    gpu: GpuSpec
    """The accelerator on every rank."""
    world_size: int
    """Total ranks (GPUs) in the job."""
    gpus_per_node: int = 8
    """GPUs in one node; the world is whole nodes, or one partly used node."""
    backend: Backend = "nccl"
    """The collectives library: 'nccl' (GPUs) or 'gloo' (CPU processes, as `validate` runs here). It decides what
    a collective allocates beside its input, e.g. gloo's reduce-scatter works on a clone of its whole input."""

    def __post_init__(self) -> None:
        require_int("ClusterSpec", "world_size", self.world_size, 1, MAX_WORLD_SIZE)
        require_int("ClusterSpec", "gpus_per_node", self.gpus_per_node, 1, 1024)
        require_choice("ClusterSpec", "backend", self.backend, BACKENDS)
        if self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node:
            raise SpecError(
                f"ClusterSpec.world_size={self.world_size} must be a multiple of "
                f"gpus_per_node={self.gpus_per_node} (whole nodes), or at most one node"
            )

    @property
    def gpu_kernels(self) -> bool:
        """The ranks are GPUs (nccl), so torch runs its CUDA kernels, some of which save other tensors for backward
        than their CPU counterparts (the fused RMSNorm: see shardscope.trace.gpu_kernels)."""
        return self.backend == "nccl"

    @property
    def ranks_per_node(self) -> int:
        """Ranks on one node: gpus_per_node, or the whole world when it fits on one node."""
        return min(self.world_size, self.gpus_per_node)

    @property
    def num_nodes(self) -> int:
        """Nodes the job spans."""
        return self.world_size // self.ranks_per_node

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object."""
        return {
            "gpu": self.gpu.to_json(),
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "num_nodes": self.num_nodes,
            "backend": self.backend,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSpec:
    """What one training step does on one rank."""

    micro_batch_size: int = 1
    """Sequences per rank per forward/backward."""
    sequence_length: int = 2048
    """Tokens per sequence."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step."""
    precision: Precision = "bf16-mixed"
    """'fp32', 'fp64', 'bf16-mixed' or 'fp16-mixed' (16-bit compute, fp32 master weights), or 'bf16' (pure)."""
    optimizer: OptimizerName = "adamw"
    """'adamw', 'adam', 'sgd' or 'sgd-momentum'."""
    checkpointing: str = "none"
    """Activation checkpointing: 'none'; 'full' (keep only block inputs); 'selective' (recompute the attention core,
    Megatron's); 'op' (torchtitan's selective op policy per block); or 'every:N' (full on every N-th block)."""
    attention: Attention = "sdpa"
    """'eager' (materialises the score matrix) or 'sdpa' (fused flash/memory-efficient kernels)."""

    def __post_init__(self) -> None:
        owner = "TrainingSpec"
        require_int(owner, "micro_batch_size", self.micro_batch_size, 1, 10**6)
        require_int(owner, "sequence_length", self.sequence_length, 1, MAX_SEQUENCE_LENGTH)
        require_int(owner, "grad_accum_steps", self.grad_accum_steps, 1, 10**6)
        require_choice(owner, "precision", self.precision, PRECISIONS)
        require_choice(owner, "optimizer", self.optimizer, OPTIMIZERS)
        parse_checkpointing(self.checkpointing, f"{owner}.checkpointing")
        require_choice(owner, "attention", self.attention, ATTENTION)

    @property
    def is_mixed(self) -> bool:
        """16-bit compute with an fp32 master copy."""
        return self.precision in ("bf16-mixed", "fp16-mixed")

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one rank processes per forward."""
        return self.micro_batch_size * self.sequence_length

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object."""
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Overheads:
    """Memory that is not a tensor of the model: stated assumptions, overridable, never folded into other categories."""

    context_bytes: int = 512 * 1024 * 1024
    """Framework and driver context per GPU (CUDA context, cuBLAS/NCCL workspaces); typical figure, not measured."""
    allocator_headroom: float | None = None
    """None: the reserved peak is the caching allocator model's (core.allocation_stream). A fraction: an explicit
    override of that model, the reserved peak taken as the allocated tensor peak x (1 + fraction)."""

    def __post_init__(self) -> None:
        require_int("Overheads", "context_bytes", self.context_bytes, 0)
        if self.allocator_headroom is not None and not 0.0 <= self.allocator_headroom <= 1.0:
            raise SpecError(f"Overheads.allocator_headroom={self.allocator_headroom} must be between 0 and 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """One question: this model, on this cluster, trained this way, with this strategy."""

    model: ModelSpec
    """The model."""
    cluster: ClusterSpec
    """The GPUs."""
    training: TrainingSpec = field(default_factory=TrainingSpec)
    """The step."""
    strategy: Strategy = field(default_factory=lambda: Strategy(name="ddp"))
    """The data-parallel strategy."""
    overheads: Overheads = field(default_factory=Overheads)
    """Non-tensor memory assumptions."""

    parallelism: Parallelism = field(init=False, compare=False)
    """The device mesh the strategy makes of the cluster's GPUs (derived)."""

    def __post_init__(self) -> None:
        strategy = self.strategy
        tp, cp, pp, ep = strategy.tp, strategy.cp, strategy.pp, strategy.ep
        mesh = data_parallel_mesh(
            strategy.name, self.cluster.world_size, strategy.shard_group, tp=tp, cp=cp, pp=pp, ep=ep
        )
        object.__setattr__(self, "parallelism", mesh)
        if tp > 1 or cp > 1:
            require_model_parallel_shape(self.model, self.training.sequence_length, strategy)
        if pp > 1 or strategy.pp_layers:
            require_pipeline_shape(self.model, self.training.grad_accum_steps, strategy)
        if strategy.ep > 1:
            require_expert_shape(self.model, strategy)
            if self.shard_degree % strategy.ep:  # hsdp: its expert groups lie inside its shard groups
                raise MeshError(
                    f"ep {strategy.ep} must divide hsdp's shard group {strategy.shard_group} x cp {strategy.cp} = "
                    f"{self.shard_degree}"
                )
        if self.model.capacity_factor and max(tp, cp, pp) > 1:
            raise SpecError(
                f"ModelSpec.capacity_factor={self.model.capacity_factor} with tp {tp}, cp {cp}, pp {pp}: the capacity "
                "rule is modelled with data and expert parallelism only (route dropless, capacity_factor 0, there)"
            )

    @property
    def state_ranks(self) -> int:
        """Ranks that hold the same tensor-parallel slice of the same pipeline stage's model states: the world
        divided by tp x pp (the data-parallel and the context-parallel ranks; FSDP shards over dp_shard x cp, as
        torchtitan does)."""
        return self.cluster.world_size // (self.strategy.tp * self.strategy.pp)

    @property
    def shard_degree(self) -> int:
        """Ranks that share one copy of the sharded states: the hsdp shard group (times cp), else every rank
        holding the same tensor-parallel slice (DDP's included, where nothing is sharded: see `parallelism.dp_shard`
        for the degree that shards)."""
        mesh = self.parallelism
        return mesh.dp_shard * mesh.cp if self.strategy.preset.shards else self.state_ranks

    @property
    def replica_degree(self) -> int:
        """Copies of the sharded states across the ranks holding one tensor-parallel slice (hsdp groups); 1 for the
        others."""
        return self.state_ranks // self.shard_degree

    @property
    def tokens_per_step(self) -> int:
        """Tokens the whole job trains per optimizer step: every data-parallel rank's micro-batches (tp and cp ranks
        work on the same sequences)."""
        training = self.training
        return training.tokens_per_micro_batch * training.grad_accum_steps * self.parallelism.data_parallel

    @property
    def warnings(self) -> tuple[str, ...]:
        """Valid but unusual choices the user should hear about (tp spanning nodes)."""
        tp, per_node = self.strategy.tp, self.cluster.gpus_per_node
        if tp > per_node:
            return (
                f"tp {tp} is more than the {per_node} GPUs of a node: every tensor-parallel collective crosses the "
                f"inter-node link",
            )
        return ()
