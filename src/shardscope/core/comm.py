"""The collective ledger: every collective call and host transfer one rank makes in one training step.

What to communicate is kept apart from when (picotron's habit): this module lists the calls in program order, each
tagged with the compute stage it waits for (`CommEvent.trigger`, `CommEvent.stage`); `core.timeline` decides when they
run, and `core.network` what they cost. The ledger (`collective_ledger`) is these events merged into rows of the
shared schema, so a predicted ledger and one measured by `shardscope run` line up row for row.

Payload convention (all layers agree): all_reduce and broadcast carry the buffer's bytes; all_gather and
reduce_scatter carry the UNSHARDED (gathered, pre-scatter) buffer's bytes; host transfers carry the bytes one rank
copies.

Compute stages of one micro-batch, in forward order: 0 = embeddings, 1..L = the transformer blocks, L+1 = final norm,
output head and loss. Backward visits them in reverse.

Communication volumes follow "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (Rajbhandari et
al.): DDP and ZeRO-1/2 move 2 x parameters per step, ZeRO-3 3 x (Section 7).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardscope.core.params import ParamLayout, ParamTensor, param_layout
from shardscope.core.result import CollectiveRow, merge_ledger
from shardscope.core.sharding import ceil_div, dim0_unit_sizes, flat_shard_numel
from shardscope.specs import Scenario, SpecError

# torch DDP's first gradient bucket is 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES); later ones bucket_bytes.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
# DeepSpeed ZeRO-1/2 defaults: reduce_bucket_size and allgather_bucket_size are 5e8 elements (DeepSpeed config docs).
DEEPSPEED_BUCKET_NUMEL = 500_000_000
# DistributedDataParallel.__init__ broadcasts rank 0's module states in 250 MiB buckets (its broadcast_bucket_size).
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024

TRIGGERS = ("before_forward", "before_backward", "after_backward", "after_step")
GROUPS = ("world", "shard", "replica", "host")


@dataclass(frozen=True, slots=True, kw_only=True)
class CommEvent:
    """One collective call or host copy, placed relative to the compute stage it serves."""

    row: CollectiveRow
    """What moves (count 1)."""
    group: str
    """'world' (all ranks), 'shard' (an hsdp shard group of consecutive ranks), 'replica' (ranks holding the same
    shard, strided by the shard group size), or 'host' (a copy between this GPU and its host)."""
    micro_batch: int
    """The micro-batch it belongs to (the last one for optimizer-phase events)."""
    stage: int
    """The compute stage it waits for or feeds (see the module docstring); -1 for the optimizer step."""
    trigger: str
    """'before_forward' / 'before_backward' (must finish before that stage runs), 'after_backward' (may start once
    that stage's backward is done), 'after_step' (after the optimizer step)."""
    label: str
    """A name for the trace, e.g. 'all_gather block 3'."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Unit:
    """An FSDP unit: the tensors it gathers and the stages that use them."""

    name: str
    tensors: tuple[ParamTensor, ...]
    first_stage: int
    """The first stage in forward that uses it (the stage its forward all-gather precedes)."""
    last_stage: int
    """The last stage in forward that uses it (its first stage in backward)."""


def _element_bytes(precision: str) -> int:
    return {"fp32": 4, "fp64": 8}.get(precision, 2)


def param_comm_bytes(scenario: Scenario) -> int:
    """Bytes per element of the parameters the strategy gathers or broadcasts."""
    training, strategy = scenario.training, scenario.strategy
    if not training.is_mixed:
        return _element_bytes(training.precision)
    # Mixed precision: DDP and ZeroRedundancyOptimizer under autocast keep fp32 parameters; FSDP2's
    # MixedPrecisionPolicy(param_dtype=bf16) gathers 16-bit; the ZeRO paper and DeepSpeed keep 16-bit parameters.
    if strategy.engine == "pytorch" and strategy.canonical_name in ("ddp", "zero1"):
        return 4
    return 2


def grad_comm_bytes(scenario: Scenario) -> int:
    """Bytes per element of the gradients the strategy reduces."""
    training, strategy = scenario.training, scenario.strategy
    if not training.is_mixed:
        return _element_bytes(training.precision)
    # pytorch: DDP reduces the fp32 gradients of fp32 parameters; FSDP2 is configured with reduce_dtype=fp32
    # (torchtitan's default), so both reduce 4 bytes. The ZeRO paper and DeepSpeed reduce fp16/bf16 gradients.
    return 4 if strategy.engine == "pytorch" else 2


def _stage_of(tensor_name: str, num_blocks: int) -> int:
    if tensor_name.startswith("layers."):
        return 1 + int(tensor_name.split(".")[1])
    return 0 if tensor_name.startswith("embed") else num_blocks + 1


def _units(layout: ParamLayout) -> tuple[_Unit, ...]:
    """FSDP wrapping: the root unit (embeddings, final norm, head) and one unit per block, in forward order."""
    root = _Unit(name="root", tensors=layout.root, first_stage=0, last_stage=layout.num_blocks + 1)
    blocks = tuple(
        _Unit(name=f"block {index}", tensors=layout.block, first_stage=index + 1, last_stage=index + 1)
        for index in range(layout.num_blocks)
    )
    return (root, *blocks)


def _unit_gathered_numels(scenario: Scenario, layout: ParamLayout) -> tuple[int, int]:
    """Elements of the root unit and of one block once gathered, padding included, by the engine's sharding rule
    (every block is the same, so a step's hundreds of unit events need these two numbers only)."""
    degree = scenario.shard_degree
    engine = scenario.strategy.engine
    if engine == "pytorch":  # FSDP2 pads every tensor's dim 0 to a multiple of the degree
        return dim0_unit_sizes(layout, degree)
    if engine == "deepspeed":  # DeepSpeed ZeRO-3 partitions each parameter flat, padded to the degree

        def padded(tensors: tuple[ParamTensor, ...]) -> int:
            return sum(ceil_div(tensor.numel, degree) * degree for tensor in tensors)

        return padded(layout.root), padded(layout.block)
    # the paper: one flat buffer per unit
    return (
        flat_shard_numel(layout.root_numel, degree) * degree,
        flat_shard_numel(layout.block_numel, degree) * degree,
    )


def gradient_buckets(scenario: Scenario) -> tuple[tuple[int, int], ...]:
    """Gradient buckets in the order they fill in backward: (bytes, stage whose backward completes the bucket).

    torch DDP (Reducer, `_compute_bucket_assignment_by_size`) walks the parameters in reverse and closes a bucket once
    it holds at least the limit: 1 MiB for the first bucket, then bucket_bytes. DeepSpeed uses its 5e8-element reduce
    bucket. The paper engine (shardscope's teaching strategies) reduces one flat bucket per FSDP unit, blocks in
    reverse, then the root.
    """
    layout = param_layout(scenario.model)
    element = grad_comm_bytes(scenario)
    strategy = scenario.strategy
    if strategy.engine == "paper":
        blocks = [(layout.block_numel * element, index + 1) for index in reversed(range(layout.num_blocks))]
        return (*blocks, (layout.root_numel * element, 0))
    if strategy.engine == "deepspeed":
        limits = [DEEPSPEED_BUCKET_NUMEL * element]
    elif strategy.engine == "pytorch":
        limits = [DDP_FIRST_BUCKET_BYTES, strategy.bucket_bytes]
    else:
        limits = [DDP_FIRST_BUCKET_BYTES, strategy.bucket_bytes]
    buckets: list[tuple[int, int]] = []
    size, ready_stage = 0, layout.num_blocks + 1
    for tensor in reversed(layout.tensors()):
        size += tensor.numel * element
        ready_stage = min(ready_stage, _stage_of(tensor.name, layout.num_blocks))
        if size >= limits[min(len(buckets), len(limits) - 1)]:
            buckets.append((size, ready_stage))
            size, ready_stage = 0, layout.num_blocks + 1
    if size:
        buckets.append((size, ready_stage))
    return tuple(buckets)


@lru_cache(maxsize=4096)
def _row(phase: str, op: str, size: int, payload: int) -> CollectiveRow:
    """One call's ledger row, shared by every event of that shape (a 70B step has hundreds of identical ones)."""
    return CollectiveRow(phase=phase, op=op, group_size=size, payload_bytes=payload, count=1)


def _event(phase: str, op: str, size: int, payload: int, group: str, at: tuple[int, int, str], label: str) -> CommEvent:
    """One call of `op` on a group of `size` ranks; `at` is (micro-batch, stage, trigger)."""
    row = _row(phase, op, size, payload)
    micro_batch, stage, trigger = at
    return CommEvent(row=row, group=group, micro_batch=micro_batch, stage=stage, trigger=trigger, label=label)


def _data_parallel_events(scenario: Scenario) -> list[CommEvent]:
    """DDP, ZeRO-1 and ZeRO-2: gradient buckets reduced in backward, then (ZeRO-1/2) the updated shards gathered."""
    strategy, world = scenario.strategy, scenario.cluster.world_size
    steps = scenario.training.grad_accum_steps
    name = strategy.canonical_name
    layout = param_layout(scenario.model)
    events: list[CommEvent] = []
    torch_ddp_based = name == "ddp" or (name == "zero1" and strategy.engine == "pytorch")
    # DDP's no_sync (and ZeRO-1, which keeps whole gradients) reduce on the last micro-batch only; ZeRO-2 keeps only a
    # gradient shard, so it must reduce every micro-batch.
    reduced_batches = range(steps) if name == "zero2" else range(steps - 1, steps)
    op = "all_reduce" if torch_ddp_based else "reduce_scatter"
    grad_element = grad_comm_bytes(scenario)
    # shardscope's teaching ZeRO-1 reduce-scatters every unit after the whole backward; the others as buckets fill.
    after_all = name == "zero1" and strategy.engine == "paper"
    for micro_batch in reduced_batches:
        for index, (size, stage) in enumerate(gradient_buckets(scenario)):
            # a reduce-scatter's buffer is padded to a multiple of the world size in elements, not bytes
            padded = flat_shard_numel(size // grad_element, world) * world * grad_element
            payload = size if op == "all_reduce" else padded
            at = (micro_batch, 0 if after_all else stage, "after_backward")
            events.append(_event("backward", op, world, payload, "world", at, f"{op} bucket {index}"))
    after_step = (steps - 1, -1, "after_step")
    if name == "ddp":
        return events
    element = param_comm_bytes(scenario)
    if torch_ddp_based:
        # ZeroRedundancyOptimizer.step: every rank broadcasts the parameters it updated, one call per tensor
        # (parameters_as_bucket_view=False, torch's default).
        for tensor in layout.tensors():
            payload = tensor.numel * element
            events.append(
                _event("optimizer", "broadcast", world, payload, "world", after_step, f"broadcast {tensor.name}")
            )
        return events
    if strategy.engine == "paper":  # the teaching ZeRO-1/2 gather each unit's padded flat buffer: root, then blocks
        pieces = [(layout.root_numel, "root")] + [(layout.block_numel, f"block {i}") for i in range(layout.num_blocks)]
    else:  # DeepSpeed gathers the flat partition in allgather_bucket_size pieces
        total = layout.total_numel
        pieces = [
            (min(DEEPSPEED_BUCKET_NUMEL, total - start), "parameters")
            for start in range(0, total, DEEPSPEED_BUCKET_NUMEL)
        ]
    for numel, name in pieces:
        payload = flat_shard_numel(numel, world) * world * element
        events.append(_event("optimizer", "all_gather", world, payload, "world", after_step, f"all_gather {name}"))
    return events


def _sharded_events(scenario: Scenario) -> list[CommEvent]:
    """ZeRO-3, FSDP and HSDP: per-unit all-gathers before use, per-unit reduce-scatters after backward."""
    strategy = scenario.strategy
    degree, replicas = scenario.shard_degree, scenario.replica_degree
    group = "shard" if strategy.name == "hsdp" else "world"
    param_bytes, grad_bytes = param_comm_bytes(scenario), grad_comm_bytes(scenario)
    offload_params = strategy.offload == "optimizer+params"
    # shardscope's teaching ZeRO-3 (the paper engine) keeps the root unit gathered from forward into backward (it is
    # used again at once); fully_shard(root, reshard_after_forward=True) and DeepSpeed regather it, as measured by
    # `shardscope run`. reshard_after_forward=False keeps every unit (ZeRO-2-like SHARD_GRAD_OP).
    regather_root = strategy.engine != "paper"
    reshard = strategy.reshard_after_forward and strategy.name != "zero2"
    layout = param_layout(scenario.model)
    units = _units(layout)
    root_numel, block_numel = _unit_gathered_numels(scenario, layout)
    events: list[CommEvent] = []
    for micro_batch in range(scenario.training.grad_accum_steps):
        for unit in units:
            numel = root_numel if unit.name == "root" else block_numel
            at = (micro_batch, unit.first_stage, "before_forward")
            if offload_params:
                events.append(
                    _event(
                        "forward", "host_to_device", 1, numel // degree * param_bytes, "host", at, f"h2d {unit.name}"
                    )
                )
            events.append(
                _event("forward", "all_gather", degree, numel * param_bytes, group, at, f"all_gather {unit.name}")
            )
        for unit in reversed(units):
            numel = root_numel if unit.name == "root" else block_numel
            at = (micro_batch, unit.last_stage, "before_backward")
            if reshard and (unit.name != "root" or regather_root):
                if offload_params:
                    events.append(
                        _event(
                            "backward",
                            "host_to_device",
                            1,
                            numel // degree * param_bytes,
                            "host",
                            at,
                            f"h2d {unit.name}",
                        )
                    )
                events.append(
                    _event("backward", "all_gather", degree, numel * param_bytes, group, at, f"all_gather {unit.name}")
                )
            at = (micro_batch, unit.first_stage, "after_backward")
            events.append(
                _event(
                    "backward", "reduce_scatter", degree, numel * grad_bytes, group, at, f"reduce_scatter {unit.name}"
                )
            )
            if replicas > 1:  # hsdp: the reduced shard is averaged across the replica groups
                events.append(
                    _event(
                        "backward",
                        "all_reduce",
                        replicas,
                        numel // degree * grad_bytes,
                        "replica",
                        at,
                        f"all_reduce {unit.name}",
                    )
                )
            if offload_params:
                events.append(
                    _event(
                        "backward",
                        "device_to_host",
                        1,
                        numel // degree * grad_bytes,
                        "host",
                        at,
                        f"d2h gradients {unit.name}",
                    )
                )
    return events


def _optimizer_offload_events(scenario: Scenario) -> list[CommEvent]:
    """ZeRO-Offload ("ZeRO-Offload: Democratizing Billion-Scale Model Training"): the reduced gradient shard goes to
    the host, the CPU optimizer steps, and the updated parameter shard comes back."""
    layout = param_layout(scenario.model)
    degree = 1 if scenario.strategy.stage == 0 else scenario.shard_degree
    shard_numel = flat_shard_numel(layout.total_numel, degree)
    last = scenario.training.grad_accum_steps - 1
    grads, params = shard_numel * grad_comm_bytes(scenario), shard_numel * param_comm_bytes(scenario)
    return [
        _event("backward", "device_to_host", 1, grads, "host", (last, 0, "after_backward"), "d2h gradients"),
        _event("optimizer", "host_to_device", 1, params, "host", (last, -1, "after_step"), "h2d parameters"),
    ]


def _per_unit(scenario: Scenario) -> bool:
    """ZeRO-3, FSDP, HSDP, and torch's ZeRO-2 (FSDP2 with reshard_after_forward=False) gather per unit."""
    strategy = scenario.strategy
    return strategy.stage == 3 or (strategy.name == "zero2" and strategy.engine == "pytorch")


def comm_events(scenario: Scenario) -> tuple[CommEvent, ...]:
    """Every collective and host copy of one step, in the order rank 0 issues them."""
    if not scenario.model.has_shape:
        raise SpecError(
            f"model {scenario.model.name!r} has only a parameter count; the ledger and the time model need its shape "
            f"(give --model or --config)"
        )
    events = _sharded_events(scenario) if _per_unit(scenario) else _data_parallel_events(scenario)
    if scenario.strategy.offload == "optimizer":
        events += _optimizer_offload_events(scenario)
    if scenario.cluster.world_size == 1:  # a single rank sends nothing; host copies remain
        events = [event for event in events if event.group == "host"]
    return tuple(events)


def collective_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """The step's ledger in the shared row schema (phase, op, group size, payload bytes, count)."""
    return merge_ledger([event.row for event in comm_events(scenario)])


def _storage_bytes(scenario: Scenario) -> int:
    """Bytes per element of the parameters as a rank stores them before training (what setup broadcasts)."""
    if scenario.training.is_mixed and scenario.strategy.engine == "pytorch":
        return 4  # torch's engines keep fp32 parameters and cast (autocast, MixedPrecisionPolicy)
    return _element_bytes(scenario.training.precision)


def setup_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """Collectives made once, before the first step, so that every rank starts from rank 0's weights.

    torch's DistributedDataParallel (ddp, and zero1 under the pytorch engine) checks parameter shapes
    (`_verify_param_shape_across_processes`: an all-gather of each rank's int64 tensor count, then a broadcast of
    every tensor's sizes and strides as int64) and broadcasts its module states coalesced into 250 MiB buckets
    (`_sync_module_states`; torch/csrc/utils/tensor_flatten.cpp `take_tensors` closes a bucket once it reaches the
    limit). Everything else (the teaching strategies, FSDP2, which does not broadcast, and DeepSpeed's
    `_broadcast_model`) broadcasts each parameter tensor from rank 0.
    """
    world = scenario.cluster.world_size
    if world == 1 or not scenario.model.has_shape:
        return ()
    tensors = param_layout(scenario.model).tensors()
    element = _storage_bytes(scenario)
    strategy = scenario.strategy
    if strategy.engine != "pytorch" or strategy.canonical_name not in ("ddp", "zero1"):
        rows = [
            CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=t.numel * element, count=1)
            for t in tensors
        ]
        return merge_ledger(rows)
    metadata = 8 * sum(2 * len(t.shape) for t in tensors)
    rows = [
        CollectiveRow(phase="setup", op="all_gather", group_size=world, payload_bytes=8 * world, count=1),
        CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=metadata, count=1),
    ]
    size = 0
    for tensor in tensors:
        size += tensor.numel * element
        if size >= DDP_BROADCAST_BUCKET_BYTES:
            rows.append(CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=size, count=1))
            size = 0
    if size:
        rows.append(CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=size, count=1))
    return merge_ledger(rows)


def run_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """What `shardscope run` records for rank 0: the setup collectives, then one step's."""
    return merge_ledger([*setup_ledger(scenario), *collective_ledger(scenario)])
