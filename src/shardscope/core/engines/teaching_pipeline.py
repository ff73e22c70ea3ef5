"""ZeRO-1, ZeRO-2 and ZeRO-3 inside the teaching pipeline: the moments of a pipeline rank's step, the 'paper'
engine's `pipeline_moments` for the strategies that reduce-scatter every micro-batch (ZeRO-2 and ZeRO-3), and the
moments ZeRO-1 and ZeRO-2 add for their shard-sized buffers.

The rule, from runtime/teaching/pipeline.py, pipeline_data.py, zero.py and fsdp.py. The schedule runs one action at a
time, so a moment holds the micro-batches in flight (their saved activations, `PipelineLoad.in_flight_bytes`) and
the work of the one action running then, never two actions' work at once. Each micro-batch's backward lands every
unit's gradients, flattens them and reduce-scatters them into the rank's persistent shard before the next action
starts, so no gradient outlives the backward that made it. Under ZeRO-3 the root unit stays gathered from the step's
first forward to its last backward (`root_held_for_step`) and a block is gathered only while it runs. The moments:
- end of forward: the root gathered, and on the head stage the loss's spike;
- start of backward (the head stage's): the gradients of the log-softmax instead of the spike;
- the top block's backward: the head's activations freed, the block's working set and its gathered units;
- a block's reduce-scatter: that block's stored activations freed as well, with its per-parameter gradients, their
  flat copy (a buffer: `_landed` makes it inside measured_as('buffers')) and the units gathered there (under ZeRO-3
  the block itself, still gathered, and the root);
- the root's reduce-scatter: on the first stage the embeddings' dense gradient and its flat copy, on the head stage
  (without the embeddings) the final norm's and head's gradients and their flat copy after the head's backward;
- the optimizer step.
ZeRO-1 and ZeRO-2 (runtime/teaching/zero.py) make one shard-sized buffer per unit, unit after unit, once a step: ZeRO-1
the output of each unit's reduce-scatter after the last backward (`reduce_accumulated`), both the send buffer of each
unit's all-gather after the update (`_all_gather_params`). Each is made while the previous unit's is still bound, so
two neighbouring units' shards are live at once: two more moments, beside the step's receive buffers.
"""

from __future__ import annotations

from itertools import pairwise

from shardscope.core.engines.base import LOSS_GRAD_BYTES, Moment, as_live_bytes
from shardscope.core.engines.pipeline_load import PipelineLoad
from shardscope.core.model_states import dtype_bytes
from shardscope.core.pipeline import layout_of
from shardscope.core.sharding import flat_shard_numel
from shardscope.specs import Scenario


def teaching_pipeline_moments(scenario: Scenario, load: PipelineLoad) -> list[Moment]:
    """The moments of the rank's step (see the module docstring); the gradients a backward makes before their
    reduce-scatter are temporaries, beside the rank's persistent shard."""
    states, acts = load.states, load.activations
    head = any(stage.head for stage in load.stages)
    embedding = any(stage.embedding for stage in load.stages)
    # a rank of several stages may meet its most micro-batches in flight at another stage than the one running
    alone = len(load.stages) == 1
    head_freed = acts.head_bytes if head and alone else 0
    held = (states.parameters_bytes, states.gradients_bytes, states.optimizer_state_bytes)
    persistent = load.receive_bytes + states.persistent_buffers_bytes
    in_flight = load.in_flight_bytes + load.step_activations

    def live(name: str, activations: int, buffers: int, temporary: int) -> Moment:
        return name, as_live_bytes((*held, activations, persistent + buffers, temporary))

    forward_spike = acts.loss_forward_spike_bytes if head else 0
    gathered_root = states.forward_buffers_bytes
    moments = [live("end of forward", in_flight, gathered_root, states.forward_temporary_bytes + forward_spike)]
    if head:
        backward_spike = acts.loss_backward_spike_bytes + LOSS_GRAD_BYTES
        moments.append(live("start of backward", in_flight, gathered_root, backward_spike))
    # the root's gradients are reduce-scattered as its last one lands: on a rank holding one end of the model, before
    # its blocks' backward (the head stage's final norm and head) or after it (the embeddings), so none wait while a
    # block runs; a rank holding both ends keeps the head's (paper._in_flight's backward gradients) until the
    # embeddings' land
    head_gradients = states.backward_grads_bytes if head and embedding else 0
    element = dtype_bytes(scenario.training.precision)
    block = _block_numel(scenario, load)
    if block:
        # the gradient flowing into the top block: from the final norm on the head stage, else the receive buffer
        flowing = acts.hidden_bytes + LOSS_GRAD_BYTES if head else 0
        working = flowing + acts.block_backward_bytes + head_gradients
        moments.append(live("top block's backward", in_flight - head_freed, states.backward_buffers_bytes, working))
        # the block's stored input stays where it is a receive buffer (counted with the buffers, not in the weight)
        received = 0 if embedding else acts.hidden_bytes
        after_block = in_flight - head_freed - (acts.stored_block_bytes - received)
        # a block's per-parameter gradients and their flat copy, beside the units gathered in its backward
        block_flat = _padded(block, load.shard_degree) * element
        scattering = head_gradients + block * element
        gathered = states.backward_buffers_bytes + block_flat
        moments.append(live("a block's reduce-scatter", after_block, gathered, scattering))
    root = _root_numel(scenario, load)
    root_flat = _padded(root, load.shard_degree) * element
    if embedding:
        # the embeddings' dense gradient lands last, after the micro-batch's every block: the root's per-parameter
        # gradients and their flat copy, the micro-batch's activations freed
        freed = load.weights[0][1] if alone else 0
        moments.append(live("the root's reduce-scatter", in_flight - freed, gathered_root + root_flat, root * element))
    elif head:
        # the final norm's weight gradient lands the head stage's root, beside the gradient of the norm's input
        flowing = acts.hidden_bytes + LOSS_GRAD_BYTES
        scattering = root * element + flowing
        moments.append(live("the root's reduce-scatter", in_flight - head_freed, gathered_root + root_flat, scattering))
    moments.append(live("optimizer step", 0, 0, states.optimizer_temporary_bytes))
    return moments


def shard_buffer_moments(scenario: Scenario, load: PipelineLoad) -> list[Moment]:
    """ZeRO-1's reduce-scatters after the last backward (gloo's reduce-scatter also clones the unit's whole flat
    gradients, ProcessGroupGloo::reduce_scatter_tensor_coalesced, made below the tracker's dispatch mode and seen as
    a temporary) and ZeRO-1's and ZeRO-2's all-gathers after the update: two neighbouring units' shards at once."""
    states, degree = load.states, load.shard_degree
    element = dtype_bytes(scenario.training.precision)
    root = _root_numel(scenario, load)
    block, layers = _block_numel(scenario, load), sum(stage.layers for stage in load.stages)
    shards = ([flat_shard_numel(root, degree)] if root else []) + [flat_shard_numel(block, degree)] * layers
    neighbours = max((a + b for a, b in pairwise(shards)), default=sum(shards)) * element
    held = (states.parameters_bytes, states.gradients_bytes, states.optimizer_state_bytes)
    persistent = load.receive_bytes + states.persistent_buffers_bytes
    gather = ("all-gathers after the update", as_live_bytes((*held, 0, persistent + neighbours, 0)))
    if scenario.strategy.stage != 1:
        return [gather]
    clone = max(_padded(root, degree), _padded(block, degree)) * element if scenario.cluster.backend == "gloo" else 0
    reduce = as_live_bytes((*held, 0, persistent + neighbours, clone))
    return [("reduce-scatters after the last backward", reduce), gather]


def _root_numel(scenario: Scenario, load: PipelineLoad) -> int:
    """The rank's root unit: the embeddings and the final norm and head of its stages."""
    return sum(layout_of(scenario, stage).root_numel for stage in load.stages)


def _block_numel(scenario: Scenario, load: PipelineLoad) -> int:
    """One block of the rank's (0 where it holds none)."""
    with_layers = [stage for stage in load.stages if stage.layers]
    return layout_of(scenario, with_layers[0]).block_numel if with_layers else 0


def _padded(numel: int, degree: int) -> int:
    """A flat buffer of `numel` elements padded to a multiple of the shard degree."""
    return flat_shard_numel(numel, degree) * degree
