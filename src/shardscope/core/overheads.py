"""What an engine costs beyond FLOPs, ops and collectives, and where in the step the timeline adds it.

Each rule pairs a measured profile term (presets.hardware, measured by `shardscope calibrate`) with the places it is
paid, read from the engine's code:
- torch DDP: its per-step bookkeeping with the first backward stage (the head's), where its reducer's autograd hooks
  start (benchmarks/bench_time_phases.py measures it there, not in forward);
- FSDP2: its per-unit bookkeeping, half with the unit's forward and half with its backward;
- the teaching strategies (shardscope.runtime.teaching): one Python hook call per hook they register, at the stage
  where torch calls it;
- async collectives (teaching and torch DDP's gradient all-reduces, issued with async_op=True from backward): the
  compute that runs while one is in flight is slowed, by the measured extra per second in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardscope.core.comm import CommEvent
from shardscope.core.params import param_layout
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario


def uses_fsdp2(scenario: Scenario) -> bool:
    """torch's zero2, zero3 and hsdp run on FSDP2's fully_shard."""
    strategy = scenario.strategy
    return strategy.engine == "pytorch" and (strategy.stage == 3 or strategy.name == "zero2")


def hook_calls(scenario: Scenario) -> dict[tuple[str, int], int]:
    """Python hook calls per micro-batch by (kind, stage) they fire in, as the teaching strategies register them
    (shardscope.runtime.teaching): DDP and ZeRO-2 a post-accumulate-grad hook per parameter tensor, fired in the
    backward of the stage that uses it; ZeRO-3/HSDP the same, plus a forward pre-hook per unit (the root's on the
    whole model, at the embeddings), a forward hook per block, and a gradient hook on each block's output, fired in
    that block's backward. ZeRO-1 reduces after backward, without hooks; torch's engines hook from C++ (their cost
    is in the DDP and FSDP2 terms). Recomputation's second forward hook calls are not counted."""
    strategy = scenario.strategy
    if strategy.engine != "paper" or strategy.canonical_name == "zero1":
        return {}
    layout = param_layout(scenario.model)
    blocks = layout.num_blocks
    embed = sum(1 for tensor in layout.root if tensor.name.startswith("embed"))
    calls = {("backward", 0): embed, ("backward", blocks + 1): len(layout.root) - embed}
    for stage in range(1, blocks + 1):
        calls[("backward", stage)] = len(layout.block)
    if strategy.stage == 3:
        calls[("forward", 0)] = 1
        for stage in range(1, blocks + 1):
            calls[("forward", stage)] = 2
            calls[("backward", stage)] += 1
    return calls


def flatten_ops(tensors: int) -> int:
    """Ops of one unit's gradients flattened and averaged (runtime.teaching.flat.FlatLayout.flatten, then div_): a
    zeros and a div_, and a slice, detach, reshape and copy_ per tensor."""
    return 2 + 4 * tensors


def bookkeeping_ops(scenario: Scenario) -> dict[tuple[str, int], int]:
    """Ops the teaching strategies (shardscope.runtime.teaching) dispatch from Python around their collectives, by
    (kind, stage): ('backward', stage) per micro-batch, ('optimizer', -1) once per step. Read from their code and
    checked op for op with a dispatch-mode counter (tests/time/test_bookkeeping_ops.py):
    - ddp: a div_ per unit after backward, a zero_ per unit in the step;
    - zero1: after backward, per unit, the reduced shard's empty, its slice, copy_ and div_; in the step, per unit,
      two slices of the shard, the clone sent to the all-gather and the gradients' zero_;
    - zero2, zero3, hsdp: per unit, when its last gradient lands, a zeros and a div_ plus four per tensor to flatten
      the gradients (slice, detach, reshape, copy_): a block in its own backward, the root in the embeddings'; zero2's
      step adds a slice and a clone per unit;
    - under mixed precision, the step casts each unit's gradient shard to fp32 and copies the master weights back.
    torch's engines: none (their work is in the DDP, FSDP2 and ZeroRedundancyOptimizer terms)."""
    strategy = scenario.strategy
    if strategy.engine != "paper":
        return {}
    layout = param_layout(scenario.model)
    units = layout.num_blocks + 1
    name = strategy.canonical_name
    # per unit; DDP's and ZeRO-1's ops after backward run once per step, with the optimizer's
    after_backward = {"ddp": 1, "zero1": 4}.get(name, 0)
    in_step = {"ddp": 1, "zero1": 4, "zero2": 2}.get(name, 0) + (2 if scenario.training.is_mixed else 0)
    ops = {("optimizer", -1): units * (after_backward + in_step)}
    if strategy.stage >= 2:
        ops[("backward", 0)] = flatten_ops(len(layout.root))
        for stage in range(1, layout.num_blocks + 1):
            ops[("backward", stage)] = flatten_ops(len(layout.block))
    return ops


def framework_s(scenario: Scenario, profile: HardwareProfile) -> dict[tuple[str, int], float]:
    """The engine's own work by (kind, stage) it runs beside, per micro-batch (the optimizer's, ('optimizer', -1),
    once per step): torch DDP's per step (at the first backward stage), FSDP2's per unit (half with the unit's
    forward, half with its backward), the teaching strategies' hook calls where they fire and their bookkeeping
    ops."""
    strategy = scenario.strategy
    extra: dict[tuple[str, int], float] = {}
    if strategy.engine == "pytorch" and strategy.canonical_name in ("ddp", "zero1"):
        extra[("backward", scenario.model.num_layers + 1)] = profile.ddp_step_overhead_s
    elif uses_fsdp2(scenario):
        half = profile.fsdp_unit_overhead_s / 2
        extra[("forward", 0)] = extra[("backward", 0)] = half  # the root unit
        for stage in range(1, scenario.model.num_layers + 1):
            extra[("forward", stage)] = extra[("backward", stage)] = half
    if profile.hook_overhead_s:
        for place, calls in hook_calls(scenario).items():
            extra[place] = extra.get(place, 0.0) + calls * profile.hook_overhead_s
    if profile.bookkeeping_op_overhead_s:
        for place, ops in bookkeeping_ops(scenario).items():
            extra[place] = extra.get(place, 0.0) + ops * profile.bookkeeping_op_overhead_s
    return extra


def optimizer_tensors(scenario: Scenario) -> int:
    """Tensors one rank's optimizer steps over: the teaching strategies keep one flat buffer (or shard) per unit;
    torch's DDP every parameter; ZeroRedundancyOptimizer about 1/world of them; FSDP2 every parameter, as a
    DTensor shard; DeepSpeed flat partitions (counted as the tensors of its shard)."""
    layout = param_layout(scenario.model)
    strategy = scenario.strategy
    tensors = layout.tensor_count
    if strategy.engine == "paper":
        return layout.num_blocks + 1
    if strategy.engine == "pytorch":
        if strategy.canonical_name == "zero1":
            return -(-tensors // scenario.cluster.world_size)
        return tensors
    degree = 1 if strategy.stage == 0 else scenario.shard_degree
    return tensors if degree == 1 else -(-tensors // degree)


def is_async(event: CommEvent, scenario: Scenario) -> bool:
    """Issued with async_op=True while backward goes on: the gradient all-reduces of the teaching DDP
    (DataParallelBucket) and of torch's DDP Reducer (ddp, and zero1 under the pytorch engine). Every other
    collective of the teaching strategies blocks; FSDP2's own overlap is part of its per-unit term."""
    name = scenario.strategy.canonical_name
    ddp_based = name == "ddp" or (name == "zero1" and scenario.strategy.engine == "pytorch")
    return ddp_based and scenario.strategy.engine in ("paper", "pytorch") and event.trigger == "after_backward"


def async_slowdown_s(
    compute_s: Sequence[float], issued: Sequence[tuple[int, float]], wait_at: int, slowdown: float
) -> list[float]:
    """Extra seconds of each compute task while async collectives are in flight beside it.

    compute_s: the compute tasks' durations in issue order; issued: (index of the compute task after which the
    collective is issued, its duration) in issue order; wait_at: the compute task that waits for them all (the
    optimizer step). Time runs on the compute stream's clock, as if overlap were free; gloo's thread runs the
    collectives one after another, each from its issue or from the end of the one before, whichever is later.
    Each compute task before wait_at is charged slowdown x the part of it that some collective overlaps.
    """
    starts, clock = [], 0.0
    for duration in compute_s:
        starts.append(clock)
        clock += duration
    windows, busy_until = [], 0.0
    for after, duration in issued:
        begin = max(busy_until, starts[after] + compute_s[after])
        busy_until = begin + duration
        windows.append((begin, busy_until))
    extra = [0.0] * len(compute_s)
    for index in range(min(wait_at, len(compute_s))):
        start, end = starts[index], starts[index] + compute_s[index]
        overlap = sum(max(0.0, min(end, stop) - max(start, begin)) for begin, stop in windows)
        extra[index] = slowdown * overlap
    return extra
