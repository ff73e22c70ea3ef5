"""Interconnect presets and hardware profiles: the links and speeds the time model runs on.

A hardware profile is a TOML file (`--hardware profile.toml`): presets.profile_toml reads and writes it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shardscope.choices import FAMILIES
from shardscope.presets import LINK_ROLES, gpu_preset_names, gpu_record, gpus_file
from shardscope.specs import GpuSpec, SpecError

PROFILE_SCHEMA = "shardscope.hardware/v2"
LEGACY_PROFILE_SCHEMA = "shardscope.hardware/v1"  # the host terms flat in [framework]; still read
DEFAULT_EFFICIENCY = 0.5  # see core.compute: Megatron-LM's reported fraction of peak


class HardwareError(SpecError):
    """An unknown interconnect, an impossible speed, or a profile file that cannot be read."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InterconnectSpec:
    """One link: its bandwidth per direction per GPU and its per-step latency, with where they come from."""

    id: str
    """Preset id, e.g. 'nvlink4', or 'custom'/'measured'."""
    name: str
    """Readable name."""
    bandwidth_bytes_per_s: float
    """Bytes per second in one direction, per GPU."""
    latency_s: float
    """Latency of one algorithm step."""
    source: str = ""
    """The datasheet or measurement the numbers come from."""

    def __post_init__(self) -> None:
        if not (
            isinstance(self.bandwidth_bytes_per_s, int | float)
            and self.bandwidth_bytes_per_s > 0
            and math.isfinite(self.bandwidth_bytes_per_s)
        ):
            raise HardwareError(
                f"interconnect {self.id!r}: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} "
                f"must be a positive number"
            )
        if not (isinstance(self.latency_s, int | float) and self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise HardwareError(f"interconnect {self.id!r}: latency_s={self.latency_s!r} must be zero or more")


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCost:
    """A collective op's own measured cost, where one op is much slower than another at the same payload (gloo's
    reduce_scatter against its all_gather)."""

    op: str
    """'all_reduce', 'all_gather', 'reduce_scatter' or 'broadcast'."""
    call_latency_s: float
    """Fixed cost of one call of this op."""
    bandwidth_bytes_per_s: float
    """Ring wire bytes per second this op reaches."""

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise HardwareError(f"network.ops.{self.op} is not a collective; allowed: {', '.join(COLLECTIVE_OPS)}")
        if not (isinstance(self.call_latency_s, int | float) and 0 <= self.call_latency_s < math.inf):
            raise HardwareError(f"network.ops.{self.op}: call_latency_s={self.call_latency_s!r} must be zero or more")
        if not (isinstance(self.bandwidth_bytes_per_s, int | float) and 0 < self.bandwidth_bytes_per_s < math.inf):
            raise HardwareError(
                f"network.ops.{self.op}: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} must be positive"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyOpCost:
    """Per-op costs measured on a reference model of one family: a llama block's ops (many small elementwise ones:
    RMSNorm's pieces, rotary embeddings, SwiGLU) cost less each than a gpt2 block's (fused layer norm, GELU)."""

    family: str
    """A model family ('gpt2', 'llama', 'moe')."""
    kernel_overhead_s: float
    """Cost of one forward op of this family's models."""
    backward_op_overhead_s: float
    """Cost of one backward op of this family's models."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise HardwareError(
                f"host_overheads.families.{self.family} is not a model family; allowed: {', '.join(FAMILIES)}"
            )
        for name in ("kernel_overhead_s", "backward_op_overhead_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                raise HardwareError(
                    f"host_overheads.families.{self.family}: {name}={value!r} must be a number, zero or more"
                )


HOST_FIELDS = (
    "fsdp_optimizer_tensor_overhead_s",
    "zero_tensor_overhead_s",
    "sync_wait_s",
    "optimizer_step_overhead_s",
    "hook_overhead_s",
    "bookkeeping_op_overhead_s",
    "async_compute_slowdown",
)
FRAMEWORK_FIELDS = ("ddp_step_overhead_s", "fsdp_unit_overhead_s")
OVERHEAD_FIELDS = ("kernel_overhead_s", "backward_op_overhead_s", "optimizer_tensor_overhead_s", *FRAMEWORK_FIELDS)


PYTHON_OP_COUNTS = (
    "backward_hooks_per_tensor",
    "forward_hooks_per_unit",
    "forward_hooks_per_block",
    "backward_hooks_per_block",
    "backward_ops_per_unit",
    "backward_ops_per_tensor",
    "step_ops_per_unit",
    "mixed_step_ops_per_unit",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PythonOps:
    """How many Python hook calls and small bookkeeping ops an implementation runs around its collectives at one ZeRO
    stage, per parameter tensor, per unit (the root or a block) and per block. The implementation declares them
    (the teaching strategies: shardscope.runtime.teaching.op_counts) and calibrate stores them beside the per-call
    costs that price them, so the core places them without knowing how the implementation is written."""

    stage: int
    """ZeRO stage: 0 for DDP, 1 to 3 (HSDP runs stage 3's)."""
    backward_hooks_per_tensor: int = 0
    """Hooks per parameter tensor per micro-batch, in the backward of the unit that uses it."""
    forward_hooks_per_unit: int = 0
    """Hooks per unit per micro-batch in its forward (the root's at the embeddings)."""
    forward_hooks_per_block: int = 0
    """More hooks per block per micro-batch in its forward."""
    backward_hooks_per_block: int = 0
    """More hooks per block per micro-batch in its backward."""
    backward_ops_per_unit: int = 0
    """Ops per unit per micro-batch when its last gradient lands (the root's in the embeddings' backward)."""
    backward_ops_per_tensor: int = 0
    """More ops per parameter tensor of that unit, at the same moment."""
    step_ops_per_unit: int = 0
    """Ops per unit once per step, beside the optimizer step."""
    mixed_step_ops_per_unit: int = 0
    """More ops per unit per step under mixed precision."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise HardwareError(f"host_overheads.python_ops: stage={self.stage!r} must be 0, 1, 2 or 3")
        for name in PYTHON_OP_COUNTS:
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise HardwareError(
                    f"[host_overheads.python_ops.stage_{self.stage}]: {name}={value!r} must be 0 or more, whole"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class HostOverheads:
    """Costs a CPU host running gloo pays that a GPU's time model has no use for: the host framework's per-hook,
    per-op and per-tensor Python work, the wait for the later rank and the compute lost beside an async collective.
    Measured by `shardscope calibrate`; a profile without them (every GPU datasheet profile) takes them all as 0."""

    fsdp_optimizer_tensor_overhead_s: float = 0.0
    """Extra cost of one FSDP2 (DTensor) parameter in the optimizer step, over a plain tensor's."""
    zero_tensor_overhead_s: float = 0.0
    """torch's ZeroRedundancyOptimizer's own work per parameter tensor per step (its per-tensor broadcast
    bookkeeping), beyond the broadcasts and the wrapped optimizer's step."""
    sync_wait_s: float = 0.0
    """Wait at a blocking collective after compute, for the rank that finished its compute later (ranks on a
    shared CPU never finish together); paid once per synchronisation point of a step without overlap."""
    optimizer_step_overhead_s: float = 0.0
    """What one optimizer step costs beyond the same step repeated at once: it runs after the forward, backward and
    communication have evicted its code and tensors from the caches; paid once per step, whatever its tensor count."""
    hook_overhead_s: float = 0.0
    """One call of a Python hook that torch makes during a step (a module's forward pre-hook or forward hook, a
    tensor's gradient hook, a parameter's post-accumulate-grad hook), the hook's own work excluded; python_ops
    says how many."""
    bookkeeping_op_overhead_s: float = 0.0
    """One small op an implementation dispatches from Python around its collectives (flattening gradients into a
    buffer, shard slices, div_, clone, zero_); python_ops says how many."""
    async_compute_slowdown: float = 0.0
    """Extra time per second that an async collective is in flight beside compute, beyond doing the two one after
    the other (a fraction): on a CPU rank gloo's thread and autograd share the core."""
    family_op_costs: tuple[FamilyOpCost, ...] = ()
    """Per-op compute costs of a model family, replacing the profile's kernel_overhead_s and backward_op_overhead_s
    for it."""
    python_ops: tuple[PythonOps, ...] = ()
    """The hook calls and bookkeeping ops the priced implementation runs, per ZeRO stage; a stage without a record
    runs none."""

    def python_ops_at(self, stage: int) -> PythonOps:
        """The Python hooks and ops run at a ZeRO stage; none where the extension has no record for it."""
        return next((ops for ops in self.python_ops if ops.stage == stage), PythonOps(stage=stage))

    def __post_init__(self) -> None:
        for name in HOST_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                raise HardwareError(f"host_overheads: {name}={value!r} must be a number, zero or more")


NO_HOST_OVERHEADS = HostOverheads()


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    """Everything the time model needs beyond the GPU preset: links, algorithm, compute speed assumptions."""

    name: str
    """What this profile describes."""
    intra_node: InterconnectSpec
    """GPU to GPU inside a node."""
    inter_node: InterconnectSpec
    """Per GPU across nodes."""
    host: InterconnectSpec
    """GPU to host, for offload copies."""
    call_latency_s: float
    """Fixed cost of one collective call."""
    algorithm: str = "ring"
    """Collective algorithm: 'ring', 'tree', 'hierarchical' or 'auto'."""
    overlap: bool = True
    """Communication runs on its own stream, concurrently with compute (GPUs); False serialises (CPU gloo)."""
    matmul_flops_per_s: float = 0.0
    """Measured matmul throughput; 0 means the GPU preset's datasheet peak."""
    efficiency: float = DEFAULT_EFFICIENCY
    """Fraction of the peak a training step's matmuls reach (not read when per_op_kernels applies)."""
    per_op_kernels: bool = False
    """Price each op at its kernel kind's ceiling (core.kernels) where the GPU's architecture has them, instead of
    FLOPs / (peak x efficiency); the datasheet profile of a GPU preset sets it, a given efficiency clears it."""
    kernel_overhead_s: float = 0.0
    """Launch and dispatch cost of one forward op (one aten op, as core.compute counts them)."""
    backward_op_overhead_s: float = 0.0
    """The same for one backward op, the autograd engine's work included."""
    optimizer_tensor_overhead_s: float = 0.0
    """Cost of one parameter tensor in a single-tensor (foreach=False) optimizer step, beyond its memory traffic;
    0: the optimizer's kernels per tensor times kernel_overhead_s."""
    memory_bandwidth_bytes_per_s: float = 0.0
    """Device memory bandwidth (optimizer step); 0 means the GPU preset's datasheet figure, if known."""
    ddp_step_overhead_s: float = 0.0
    """torch DistributedDataParallel's own work per step (forward pre-hook, reducer bookkeeping)."""
    fsdp_unit_overhead_s: float = 0.0
    """FSDP2's own work per unit per step: pre/post-forward and pre/post-backward hooks, all-gather copy-in and
    copy-out, swapping DTensor and unsharded parameters."""
    op_costs: tuple[OpCost, ...] = ()
    """Per-op collective costs replacing call_latency_s and the link bandwidth for that op (calibrated gloo)."""
    host_overheads: HostOverheads | None = None
    """The CPU host's own costs (calibrate measures them); None: all 0."""
    source: str = ""
    """Where the profile's numbers come from."""

    @property
    def host_terms(self) -> HostOverheads:
        """The host extension, all zero when the profile has none."""
        return self.host_overheads or NO_HOST_OVERHEADS

    def op_overheads(self, family: str) -> tuple[float, float]:
        """(forward, backward) cost per op for a model family: its own measured figures, if any, else the default."""
        for cost in self.host_terms.family_op_costs:
            if cost.family == family:
                return cost.kernel_overhead_s, cost.backward_op_overhead_s
        return self.kernel_overhead_s, self.backward_op_overhead_s

    def op_cost(self, op: str) -> OpCost | None:
        """The measured cost of a collective op, if the profile has one."""
        return next((cost for cost in self.op_costs if cost.op == op), None)

    def __post_init__(self) -> None:
        if self.algorithm not in ("ring", "tree", "hierarchical", "auto"):
            raise HardwareError(
                f"profile {self.name!r}: algorithm={self.algorithm!r} is not known; allowed: ring, "
                f"tree, hierarchical, auto"
            )
        for name in ("call_latency_s", "matmul_flops_per_s", "memory_bandwidth_bytes_per_s", *OVERHEAD_FIELDS):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                raise HardwareError(f"profile {self.name!r}: {name}={value!r} must be a number, zero or more")
        if not (isinstance(self.efficiency, int | float) and 0 < self.efficiency <= 1):
            raise HardwareError(f"profile {self.name!r}: efficiency={self.efficiency!r} must be in (0, 1]")


def interconnect_preset_names() -> tuple[str, ...]:
    """Every interconnect preset id."""
    return tuple(gpus_file()["links"])


def interconnect_preset(name: str) -> InterconnectSpec:
    """The InterconnectSpec of a preset id such as 'ib-ndr'."""
    table = gpus_file()["links"]
    if name not in table:
        raise HardwareError(f"unknown interconnect {name!r}; known: {', '.join(table)}")
    entry = table[name]
    return InterconnectSpec(
        id=name,
        name=entry["name"],
        bandwidth_bytes_per_s=float(entry["bandwidth_bytes_per_s"]),
        latency_s=float(entry["latency_s"]),
        source=entry["source"],
    )


def gpu_memory_bandwidth(gpu: GpuSpec) -> float:
    """The GPU preset's datasheet memory bandwidth in bytes per second, or 0 for a GPU that is not a preset."""
    return float(gpu_record(gpu.id).memory_bandwidth_bytes_per_s) if gpu.id in gpu_preset_names() else 0.0


def default_profile(gpu: GpuSpec) -> HardwareProfile:
    """The datasheet profile of a GPU preset: its typical links, NCCL's latencies, per-op kernel ceilings where its
    architecture has them (else the default efficiency)."""
    data = gpus_file()
    if gpu.id in gpu_preset_names():
        record = gpu_record(gpu.id)
        links = {role: getattr(record, role) for role in LINK_ROLES}
    else:
        links = data["custom_gpu_links"]
    profile = HardwareProfile(
        name=f"datasheet: {gpu.name}",
        intra_node=interconnect_preset(links["intra_node"]),
        inter_node=interconnect_preset(links["inter_node"]),
        host=interconnect_preset(links["host"]),
        call_latency_s=float(data["call_latency_s"]),
        memory_bandwidth_bytes_per_s=gpu_memory_bandwidth(gpu),
        per_op_kernels=True,
        source=f"{gpu.source}; links: gpus.json; {data['call_latency_source']}; "
        f"framework: {data['framework_defaults']['source']}",
    )
    overheads: dict[str, Any] = {name: float(data["framework_defaults"][name]) for name in OVERHEAD_FIELDS}
    return dataclasses.replace(profile, **overheads)
