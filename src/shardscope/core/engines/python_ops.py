"""Where an implementation's Python hooks and bookkeeping ops land in a step: the counts are data the profile's host
extension holds (presets.hardware.PythonOps, declared next to the implementation and stored by `shardscope
calibrate`); this module only places them by the compute task they run beside, from the model's parameter layout."""

from __future__ import annotations

from shardscope.core.params import rank_layout
from shardscope.presets.hardware import PythonOps
from shardscope.specs import Scenario


def hook_calls(scenario: Scenario, counts: PythonOps) -> dict[tuple[str, int], int]:
    """Python hook calls per micro-batch by (kind, stage) they fire in: per parameter tensor in the backward of the
    stage that uses it (the root's embeddings at stage 0, its other tensors at the head), per unit and per block in
    forward, per block in backward. Recomputation's second forward hook calls are not counted."""
    layout = rank_layout(scenario)
    blocks = layout.num_blocks
    embed = sum(1 for tensor in layout.root if tensor.name.startswith("embed"))
    per_tensor = counts.backward_hooks_per_tensor
    calls = {
        ("backward", 0): per_tensor * embed,
        ("backward", blocks + 1): per_tensor * (len(layout.root) - embed),
        ("forward", 0): counts.forward_hooks_per_unit,
    }
    for stage in range(1, blocks + 1):
        calls[("backward", stage)] = per_tensor * len(layout.block) + counts.backward_hooks_per_block
        calls[("forward", stage)] = counts.forward_hooks_per_unit + counts.forward_hooks_per_block
    return {place: count for place, count in calls.items() if count}


def bookkeeping_ops(scenario: Scenario, counts: PythonOps) -> dict[tuple[str, int], int]:
    """Bookkeeping ops by (kind, stage): ('backward', stage) per micro-batch when the unit's last gradient lands (a
    block in its own backward, the root in the embeddings'), ('optimizer', -1) once per step."""
    layout = rank_layout(scenario)
    units = layout.num_blocks + 1
    in_step = counts.step_ops_per_unit + (counts.mixed_step_ops_per_unit if scenario.training.is_mixed else 0)
    ops = {("optimizer", -1): units * in_step}

    def on_landing(tensors: int) -> int:
        return counts.backward_ops_per_unit + counts.backward_ops_per_tensor * tensors

    ops[("backward", 0)] = on_landing(len(layout.root))
    for stage in range(1, layout.num_blocks + 1):
        ops[("backward", stage)] = on_landing(len(layout.block))
    return {place: count for place, count in ops.items() if count}
