"""The Python ops of shardscope's teaching strategies (shardscope.runtime.teaching), which the 'paper' engine
predicts: the hooks they register and the bookkeeping ops they dispatch around their collectives, by the compute task
they run beside. Priced by the CPU profile's per-hook and per-op costs (`shardscope calibrate`)."""

from __future__ import annotations

from shardscope.core.params import param_layout
from shardscope.specs import Scenario


def hook_calls(scenario: Scenario) -> dict[tuple[str, int], int]:
    """Python hook calls per micro-batch by (kind, stage) they fire in, as the teaching strategies register them
    (shardscope.runtime.teaching): DDP and ZeRO-2 a post-accumulate-grad hook per parameter tensor, fired in the
    backward of the stage that uses it; ZeRO-3/HSDP the same, plus a forward pre-hook per unit (the root's on the
    whole model, at the embeddings), a forward hook per block, and a gradient hook on each block's output, fired in
    that block's backward. ZeRO-1 reduces after backward, without hooks. Recomputation's second forward hook calls
    are not counted."""
    strategy = scenario.strategy
    if strategy.stage == 1:
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
    - under mixed precision, the step casts each unit's gradient shard to fp32 and copies the master weights back."""
    strategy = scenario.strategy
    layout = param_layout(scenario.model)
    units = layout.num_blocks + 1
    # per unit, by ZeRO stage; DDP's and ZeRO-1's ops after backward run once per step, with the optimizer's
    after_backward = (1, 4, 0, 0)[strategy.stage]
    in_step = (1, 4, 2, 0)[strategy.stage] + (2 if scenario.training.is_mixed else 0)
    ops = {("optimizer", -1): units * (after_backward + in_step)}
    if strategy.stage >= 2:
        ops[("backward", 0)] = flatten_ops(len(layout.root))
        for stage in range(1, layout.num_blocks + 1):
            ops[("backward", stage)] = flatten_ops(len(layout.block))
    return ops
