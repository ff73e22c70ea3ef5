"""The Python hooks and bookkeeping ops the teaching strategies in this package run around their collectives, per
ZeRO stage: `shardscope calibrate` stores them in the profile's host extension beside the per-call costs it
measures, and the core's 'paper' engine places them in the step (core.engines.python_ops). Read from the code here
and checked op for op with a dispatch-mode counter (tests/time/test_bookkeeping_ops.py).

Hooks: DDP and ZeRO-2 register a post-accumulate-grad hook per parameter tensor; ZeRO-3/HSDP the same, plus a
forward pre-hook per unit, a forward hook per block and a gradient hook on each block's output; ZeRO-1 reduces after
backward, without hooks.

Bookkeeping ops per unit:
- ddp: a div_ after backward and a zero_ in the step;
- zero1: after backward, the reduced shard's empty, its slice, copy_ and div_; in the step, two slices of the shard,
  the clone sent to the all-gather and the gradients' zero_;
- zero2, zero3, hsdp: when the unit's last gradient lands, a zeros and a div_ plus four per tensor to flatten the
  gradients (flat.FlatLayout.flatten: slice, detach, reshape, copy_); zero2's step adds a slice and a clone;
- under mixed precision, the step casts the unit's gradient shard to fp32 and copies the master weights back.
"""

from __future__ import annotations

from shardscope.presets.hardware import PythonOps

FLATTEN_OPS_PER_UNIT = 2  # the buffer's zeros and the div_
FLATTEN_OPS_PER_TENSOR = 4  # slice, detach, reshape, copy_
MIXED_STEP_OPS_PER_UNIT = 2  # the fp32 cast of the gradient shard, the copy back into the 16-bit parameters

TEACHING_PYTHON_OPS = (
    PythonOps(
        stage=0, backward_hooks_per_tensor=1, step_ops_per_unit=1 + 1, mixed_step_ops_per_unit=MIXED_STEP_OPS_PER_UNIT
    ),
    PythonOps(stage=1, step_ops_per_unit=4 + 4, mixed_step_ops_per_unit=MIXED_STEP_OPS_PER_UNIT),
    PythonOps(
        stage=2,
        backward_hooks_per_tensor=1,
        backward_ops_per_unit=FLATTEN_OPS_PER_UNIT,
        backward_ops_per_tensor=FLATTEN_OPS_PER_TENSOR,
        step_ops_per_unit=2,
        mixed_step_ops_per_unit=MIXED_STEP_OPS_PER_UNIT,
    ),
    PythonOps(
        stage=3,
        backward_hooks_per_tensor=1,
        forward_hooks_per_unit=1,
        forward_hooks_per_block=1,
        backward_hooks_per_block=1,
        backward_ops_per_unit=FLATTEN_OPS_PER_UNIT,
        backward_ops_per_tensor=FLATTEN_OPS_PER_TENSOR,
        mixed_step_ops_per_unit=MIXED_STEP_OPS_PER_UNIT,
    ),
)


def flatten_ops(tensors: int) -> int:
    """Ops of one unit's gradients flattened and averaged (flat.FlatLayout.flatten, then div_)."""
    return FLATTEN_OPS_PER_UNIT + FLATTEN_OPS_PER_TENSOR * tensors
