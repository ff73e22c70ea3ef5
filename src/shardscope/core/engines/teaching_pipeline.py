"""ZeRO-2 and ZeRO-3 inside the teaching pipeline: the moments of a pipeline rank's step, the 'paper' engine's
`pipeline_moments` for the strategies that reduce-scatter every micro-batch.

The rule, from runtime/teaching/pipeline.py, pipeline_data.py, zero.py and fsdp.py. The schedule runs one action at a
time, so a moment holds the micro-batches in flight (their saved activations, `PipelineLoad.in_flight_bytes`) and
the work of the one action running then, never two actions' work at once. Each micro-batch's backward lands every
unit's gradients, flattens them and reduce-scatters them into the rank's persistent shard before the next action
starts, so no gradient outlives the backward that made it. Under ZeRO-3 the root unit stays gathered from the step's
first forward to its last backward (`root_held_for_step`) and a block is gathered only while it runs. The moments:
- end of forward: the root gathered, and on the head stage the loss's spike;
- start of backward (the head stage's): the gradients of the log-softmax instead of the spike;
- the top block's backward: the head's activations freed, the block's working set and its gathered units;
- a block's reduce-scatter: that block's stored activations freed as well, with its per-parameter and flat
  gradients and the units gathered there;
- the root's reduce-scatter on the first stage: the embeddings' dense gradient and its flat copy;
- the optimizer step.
"""

from __future__ import annotations

from shardscope.core.engines.base import LOSS_GRAD_BYTES, Moment, PipelineLoad, as_live_bytes
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
    if any(stage.layers for stage in load.stages):
        # the gradient flowing into the top block: from the final norm on the head stage, else the receive buffer
        flowing = acts.hidden_bytes + LOSS_GRAD_BYTES if head else 0
        working = flowing + acts.block_backward_bytes + head_gradients
        moments.append(live("top block's backward", in_flight - head_freed, states.backward_buffers_bytes, working))
        # the block's stored input stays where it is a receive buffer (counted with the buffers, not in the weight)
        received = 0 if embedding else acts.hidden_bytes
        after_block = in_flight - head_freed - (acts.stored_block_bytes - received)
        # a block's per-parameter gradients and their flat copy (paper._in_flight's boundary gradients, less the head's)
        block_gradients = states.boundary_grads_bytes - states.backward_grads_bytes
        scattering = head_gradients + block_gradients
        moments.append(live("a block's reduce-scatter", after_block, states.boundary_buffers_bytes, scattering))
    if embedding:
        # the embeddings' dense gradient lands last, after the micro-batch's every block: the root's per-parameter
        # gradients and their flat copy, the micro-batch's activations freed
        root = sum(layout_of(scenario, stage).root_numel for stage in load.stages)
        padded = flat_shard_numel(root, load.shard_degree) * load.shard_degree
        element = dtype_bytes(scenario.training.precision)
        freed = load.weights[load.stages[0].index] if alone else 0
        moments.append(live("the root's reduce-scatter", in_flight - freed, gathered_root, (root + padded) * element))
    moments.append(live("optimizer step", 0, 0, states.optimizer_temporary_bytes))
    return moments
