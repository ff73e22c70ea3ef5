"""Which of a pipeline rank's stages have their FSDP units gathered and which have run a backward as each action of
its schedule starts, and the most activations in flight each such state meets: FSDP2's moments inside torch's
pipelining (core.engines.fsdp2_pipeline) are weighed at these actions. They depend on the schedule's shape, whether
a forward reshards its units, and each stage's activations per micro-batch alone, so they are kept per shape: the
planner's scenarios of one shape share them whatever their sharding, and a walk of the order is made once.
"""

from __future__ import annotations

from shardscope.core.engines.pipeline_load import CACHED_ORDERS, RankSchedule
from shardscope.core.kept import kept

ActionState = tuple[bool, int, int, int]
"""A forward or backward (True) of a stage, with the stages whose units are gathered and those that have run a
backward as it starts (sets of stages as bits, `stage_bit`)."""


def stage_bit(stage: int) -> int:
    """A stage's bit in a set of stages."""
    return 1 << stage


FullestActions = tuple[tuple[ActionState, int, int], ...]
"""(state, most activations in flight there, the micro-batch of the first action meeting them), in the step's order."""


HELD_SEND = -1
"""The key, among the stages in flight, of the stage outputs and input gradients send Works keep (`_held_sends`)."""


def fullest_actions(
    schedule: RankSchedule, reshards: bool, weights: tuple[tuple[int, int], ...], output_bytes: int
) -> FullestActions:
    """For each state an action of the schedule starts in, in the step's order: the most activations in flight it
    meets (its own forward's included, `weights` per micro-batch of each stage, the step's own not, and the output
    of `output_bytes` each send Work holds: `_held_sends`), and the micro-batch of the first
    action that meets them: every moment grows with the activations alone, so these actions hold each moment's
    largest. Kept per shape and weights: the planner's scenarios that differ in how the data-parallel ranks shard
    their states share them."""
    key = (schedule, reshards, weights, output_bytes)
    return kept(_fullest_kept, key, lambda: _walk_fullest(schedule, reshards, weights, output_bytes), CACHED_FULLEST)


CACHED_FULLEST = 16384
_fullest_kept: dict[tuple[RankSchedule, bool, tuple[tuple[int, int], ...], int], FullestActions] = {}


def _walk_fullest(
    schedule: RankSchedule, reshards: bool, weights: tuple[tuple[int, int], ...], output_bytes: int
) -> FullestActions:
    """`fullest_actions`, computed."""
    per_stage = dict(weights) | {HELD_SEND: output_bytes}
    fullest: dict[ActionState, tuple[int, int, int]] = {}
    for key, counts, micro_batch, place in _action_states(schedule, reshards):
        held = 0
        for stage, count in counts:  # a loop, not sum() over a generator: this runs for every action of every shape
            held += count * per_stage[stage]
        if key not in fullest or held > fullest[key][0]:
            fullest[key] = (held, micro_batch, place)
    in_order = sorted(fullest.items(), key=lambda item: item[1][2])
    return tuple((key, held, micro_batch) for key, (held, micro_batch, _) in in_order)


_StatesMet = tuple[tuple[ActionState, tuple[tuple[int, int], ...], int, int], ...]


def _action_states(schedule: RankSchedule, reshards: bool) -> _StatesMet:
    """Each distinct (state, micro-batches in flight per stage) an action of the schedule starts in, with the
    micro-batch and place of the first action there: what `fullest_actions` weighs, whatever the activations. Kept
    per shape: one walk of the order (a few hundred actions at most) serves every scenario of the shape."""
    return kept(_states_kept, (schedule, reshards), lambda: _walk_action_states(schedule, reshards), CACHED_ORDERS)


_states_kept: dict[tuple[RankSchedule, bool], _StatesMet] = {}


def _held_sends(schedule: RankSchedule) -> tuple[int, ...]:
    """How many stage outputs and input gradients the rank's send Works keep alive, beyond what the moments count
    already (a micro-batch's output while it is in flight; the input gradient a backward sends while the stage's
    next backward runs), as each of its actions starts. A Work holds the tensor it sent until it is dropped (gloo's,
    measured by tests/distributed/test_torch_pipeline_run.py; the trace holds them under every backend, NCCL's not
    measured yet), and torch 2.13's schedules (torch/distributed/pipelining/schedules.py) drop them:
    - Schedule1F1B: its `send_work` keeps the warm-up's second-to-last forward send until the 1B1F phase ends, so on
      a stage of w >= 2 warm-ups (w = min(micro-batches, pp - stage)) micro-batch w - 2's output outlives its
      backward up to the backward of micro-batch m - w, the phase's last; its backward sends are dropped at once;
    - ScheduleGPipe and ScheduleInterleaved1F1B: only as the step ends (`fwd_sends_to_wait`, `bwd_sends_to_wait`;
      `send_ops`), so each output a stage sent outlives its micro-batch's backward and each input gradient its own."""
    actions, last = schedule.actions, schedule.pp * schedule.virtual - 1
    if schedule.schedule == "1f1b":
        warmup = min(schedule.micro_batches, schedule.pp - schedule.rank)
        if warmup < 2:
            return (0,) * len(actions)
        backwards = {action.micro_batch: place for place, action in enumerate(actions) if action.backward}
        start, end = backwards[warmup - 2], backwards[schedule.micro_batches - warmup]
        return tuple(1 if start < place <= end else 0 for place in range(len(actions)))
    held, sent, backwarded = [], 0, set()
    for action in actions:
        # the stage's previous input gradient is the backward's own `sending` term (core.engines.fsdp2_pipeline)
        counted = 1 if action.backward and action.stage in backwarded and action.stage > 0 else 0
        held.append(sent - counted)
        if action.backward:
            sent += (action.stage < last) + (action.stage > 0)  # its output, now past its backward; its gradient
            backwarded.add(action.stage)
    return tuple(held)


def _walk_action_states(schedule: RankSchedule, reshards: bool) -> _StatesMet:
    """`_action_states`, computed."""
    gathered = backwarded = 0
    in_flight: dict[int, int] = {}
    seen: dict[tuple[ActionState, tuple[tuple[int, int], ...]], tuple[int, int]] = {}
    for place, (action, held) in enumerate(zip(schedule.actions, _held_sends(schedule), strict=True)):
        index = action.stage
        in_flight[HELD_SEND] = held
        if not action.backward:
            in_flight[index] = in_flight.get(index, 0) + 1
        state = ((action.backward, index, gathered, backwarded), tuple(sorted(in_flight.items())))
        seen.setdefault(state, (action.micro_batch, place))
        if action.backward:
            in_flight[index] -= 1
            backwarded |= stage_bit(index)
        gathered = gathered | stage_bit(index) if action.backward or not reshards else gathered & ~stage_bit(index)
    return tuple((key, counts, micro_batch, place) for (key, counts), (micro_batch, place) in seen.items())
