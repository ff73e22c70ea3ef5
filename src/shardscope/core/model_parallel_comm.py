"""Tensor and context parallelism's calls in a step: what moves between the ranks that split one layer or one sequence.

Tensor parallelism ("Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", Section
3): each block's attention and MLP are a column-parallel then a row-parallel linear, joined by two conjugate
operators. Without sequence parallelism, g all-reduces the row-parallel output in forward (after o_proj and after
down_proj) and f all-reduces the input gradient in backward (before q/k/v and before gate/up): two all-reduces of
b x s x h each way per block. With sequence parallelism ("Reducing Activation Recomputation in Large Transformer
Models", Section 4.2.2) g becomes a reduce-scatter and f an all-gather: per block an all-gather before attention and
before the MLP and a reduce-scatter after each in forward, and their conjugates (a reduce-scatter for each all-gather,
an all-gather for each reduce-scatter) in backward; Megatron-LM's column-parallel linears (the paper engine's, as
the teaching TensorParallelLM runs them) keep only their rank's tokens and all-gather them again in backward, one
more all-gather per entry (core.rank_share). torch's DTensor plan (torchtitan's `apply_tp`) adds:
- the vocabulary-parallel embedding (RowwiseParallel): its output all-reduced, or reduce-scattered to the sequence
  shards under sequence parallelism (an all-gather of the gradient in backward);
- the column-parallel head: its input all-gathered under sequence parallelism (reduce-scattered back in backward),
  or its input gradient all-reduced without it;
- loss parallel (torch.distributed.tensor.parallel.loss_parallel): the log-softmax over vocabulary shards all-reduces
  the max and the sum of exponentials, and the loss the target's logit, each b x s fp32 values (the logits are
  upcast to fp32 for the loss); its backward is local;
- under sequence parallelism the weights every tp rank holds whole (norms, row-parallel biases, the MoE router,
  learned positions) see only their sequence shard, so each one's gradient is all-reduced over tp, one tensor at a
  time after the whole backward (the teaching `TensorParallelLM.sum_replicated_gradients`; Megatron-LM's
  finalize_model_grads reduces them after backward too), in the dtype the gathered weight has (the engine's
  `param_comm_bytes`).
Payloads are b x (s / cp) x h in the working dtype: the unsharded buffer for all-gather and reduce-scatter, as
everywhere in the ledger.

Context parallelism is ring attention ("Ring Attention with Blockwise Transformers for Near-Infinite Context", Liu et
al.), as the teaching implementation (ring_attention.py) and zhuzilin/ring-flash-attention
(`ring_flash_attn_forward` / `_backward`) run it: per attention layer the rank's K and V chunk (b x s/cp tokens x the
rank's kv heads x head_dim) goes round the ring in cp - 1 send/recv steps in forward; backward sends K and V cp - 1
times again and the accumulated dK and dV cp times, so that each chunk's gradient ends where the chunk started. dK
and dV travel in the working dtype, as the teaching implementation sends them (ring-flash-attention accumulates them
in fp32, which would double those sends under 16-bit training). A send and its recv are two ledger rows of the same
payload (the pair batch_isend_irecv issues).

The re-forward repeats what it recomputes, in the backward phase (when it runs, as a run's ledger records it):
under full checkpointing (and on the blocks every:N checkpoints) the block's tensor-parallel calls but the last (the
re-forward stops at the last saved tensor) and its exchange; under 'selective' the attention core, so the exchange
only; under 'op' (torchtitan's policy, core.op_checkpointing) the all-gathers (or all-reduces) whose outputs it
does not save, while the reduce-scatters and the attention kernels are in its save list.
"""

from __future__ import annotations

from shardscope.choices import Trigger, checkpoints_block
from shardscope.core.comm_events import CommEvent, Place, event, every_micro_batch
from shardscope.core.expert_parallel import expert_parallel_events
from shardscope.core.kept import kept
from shardscope.core.model_states import dtype_bytes
from shardscope.core.params import held_ends, param_layout, rank_layout
from shardscope.specs import Scenario

LOSS_PARALLEL_ALL_REDUCES = 3  # the max, the sum of exponentials, the target's logit


CACHED_SHAPES = 256
"""Shapes of step whose calls and tasks the time model keeps (`model_parallel_calls`, `core.step_graph`,
`core.timeline_tasks`): the planner's pipeline questions have a few dozen."""

_calls: dict[tuple[object, ...], tuple[CommEvent, ...]] = {}


def model_parallel_shape(scenario: Scenario, weight_bytes: int, regathers_in_backward: bool) -> tuple[object, ...]:
    """All that a step's tp, cp and ep calls depend on: the model, the training (micro-batches, tokens,
    checkpointing), the three degrees, sequence parallelism and the two arguments of `model_parallel_events`; not
    the data-parallel strategy nor the GPU count (tests/core/test_step_graph.py)."""
    strategy = scenario.strategy
    return (
        scenario.model,
        scenario.training,
        strategy.tp,
        strategy.cp,
        strategy.ep,
        strategy.uses_sequence_parallel,
        weight_bytes,
        regathers_in_backward,
    )


def model_parallel_calls(
    scenario: Scenario, weight_bytes: int, regathers_in_backward: bool = False
) -> tuple[CommEvent, ...]:
    """`model_parallel_events`, kept per `model_parallel_shape`: the planner asks the same calls of every family,
    offload and GPU count of a shape, and a 405B pipeline rank's step has thousands."""
    shape = model_parallel_shape(scenario, weight_bytes, regathers_in_backward)
    return kept(
        _calls,
        shape,
        lambda: tuple(_model_parallel_events(scenario, weight_bytes, regathers_in_backward)),
        CACHED_SHAPES,
    )


def model_parallel_events(
    scenario: Scenario, weight_bytes: int, regathers_in_backward: bool = False
) -> list[CommEvent]:
    """Every tp, cp and ep call of one step (none when all three are 1; ep's in core/expert_parallel.py);
    `weight_bytes` is the element size of the gathered weights, whose replicated gradients sequence parallelism
    reduces; `regathers_in_backward`: sequence parallelism as Megatron-LM runs it, whose column-parallel linears
    all-gather their input again in backward (core.rank_share), where torch's keep the gathered input."""
    return list(model_parallel_calls(scenario, weight_bytes, regathers_in_backward))


def _model_parallel_events(scenario: Scenario, weight_bytes: int, regathers_in_backward: bool) -> list[CommEvent]:
    strategy = scenario.strategy
    if strategy.tp == 1 and strategy.cp == 1 and strategy.ep == 1:
        return []
    first = _tensor_parallel(scenario, 0, weight_bytes, regathers_in_backward)
    first += _context_parallel(scenario, 0)
    first += expert_parallel_events(scenario, 0)
    return every_micro_batch(first, scenario.training.grad_accum_steps)


def _recomputes(scenario: Scenario, block: int) -> str:
    """What block `block`'s re-forward runs again: 'block' (all of it), 'attention' (the core), 'unsaved' (every op
    outside the op policy's save list; it replays the block and serves saved ops from its cache) or '' (nothing)."""
    checkpointing = scenario.training.checkpointing
    if checkpoints_block(checkpointing, block):
        return "block"
    return {"selective": "attention", "op": "unsaved"}.get(checkpointing, "")


def _tensor_parallel(scenario: Scenario, micro_batch: int, weight_bytes: int, regathers: bool) -> list[CommEvent]:
    tp = scenario.strategy.tp
    if tp == 1:
        return []
    model, training = scenario.model, scenario.training
    sequence_parallel = scenario.strategy.uses_sequence_parallel
    tokens = training.micro_batch_size * training.sequence_length // scenario.strategy.cp
    activation = tokens * model.hidden_size * dtype_bytes(training.precision)
    head = model.num_layers + 1
    embedding_held, head_held = held_ends(model)  # a pipeline rank makes the calls of the ends it holds only
    events: list[CommEvent] = []

    def call(phase: str, op: str, payload: int, stage: int, trigger: Trigger, what: str) -> None:
        events.append(event(phase, op, tp, payload, "tp", (micro_batch, stage, trigger), f"{op} tp {phase} {what}"))

    # Per block, forward and backward alike: g and f (attention, then MLP), each a gather and a scatter under
    # sequence parallelism (backward's are the conjugates, in reverse order: the same four calls).
    block_calls = ("all_gather", "reduce_scatter") * 2 if sequence_parallel else ("all_reduce",) * 2
    unsaved = ("all_gather",) * 2 if sequence_parallel else ("all_reduce",) * 2  # reduce-scatters are in the save list
    # Megatron-LM's entry reduce-scatters its input's gradient, then all-gathers the input again for the weights'.
    regather = regathers and sequence_parallel
    entry_backward = ("reduce_scatter", "all_gather") if regather else ("reduce_scatter",)
    block_backward = (("all_gather", *entry_backward) * 2) if sequence_parallel else block_calls

    if embedding_held:
        call(
            "forward", "reduce_scatter" if sequence_parallel else "all_reduce", activation, 0, "during_forward", "embed"
        )
    for block in range(1, model.num_layers + 1):
        for op in block_calls:
            call("forward", op, activation, block, "during_forward", f"block {block - 1}")
    loss_values = tokens * (8 if training.precision == "fp64" else 4)  # the logits upcast to fp32 (fp64 kept)
    head_input = entry_backward if sequence_parallel else ("all_reduce",)  # the all-gather's conjugate, or f
    if head_held:
        if sequence_parallel:
            call("forward", "all_gather", activation, head, "during_forward", "head")
        for _ in range(LOSS_PARALLEL_ALL_REDUCES):
            call("forward", "all_reduce", loss_values, head, "during_forward", "loss")
        for op in head_input:
            call("backward", op, activation, head, "during_backward", "head")
    for block in reversed(range(1, model.num_layers + 1)):
        recomputed = _recomputes(scenario, block - 1)
        # A whole block's re-forward stops at its last saved tensor (torch.utils.checkpoint's early stop): the MLP's
        # leaving g, whose output nothing saves, is not run again (traced, and measured on the teaching grid).
        again = {"block": block_calls[:-1], "unsaved": unsaved}.get(recomputed, ())
        for op in again:
            call("backward", op, activation, block, "during_recompute", f"block {block - 1} (recompute)")
        for op in block_backward:
            call("backward", op, activation, block, "during_backward", f"block {block - 1}")
    if sequence_parallel:
        if embedding_held:
            call("backward", "all_gather", activation, 0, "during_backward", "embed")
        for name, numel in _replicated(scenario):
            call("backward", "all_reduce", numel * weight_bytes, 0, "after_backward", f"gradient of {name}")
    return events


def _replicated(scenario: Scenario) -> list[tuple[str, int]]:
    """(name, elements) of each weight every tp rank holds whole: the same shape in its slice as in the model."""
    whole, sliced = param_layout(scenario.model, 1, scenario.strategy.ep), rank_layout(scenario)
    pairs = zip(whole.tensors(), sliced.tensors(), strict=True)
    return [(tensor.name, tensor.numel) for tensor, mine in pairs if tensor.shape == mine.shape]


def _context_parallel(scenario: Scenario, micro_batch: int) -> list[CommEvent]:
    """Ring attention's K/V exchange in every block."""
    cp, tp = scenario.strategy.cp, scenario.strategy.tp
    if cp == 1:
        return []
    model, training = scenario.model, scenario.training
    kv_elements = 2 * training.micro_batch_size * training.sequence_length // cp * model.num_kv_heads // tp
    kv_elements *= model.head_dim
    kv = kv_elements * dtype_bytes(training.precision)  # dK and dV are the same size, in the same dtype
    events: list[CommEvent] = []

    def exchange(phase: str, payload: int, steps: int, at: Place, what: str) -> None:
        for _ in range(steps):
            for op in ("send", "recv"):
                events.append(event(phase, op, cp, payload, "cp", at, f"{op} cp {phase} {what}"))

    for block in range(1, model.num_layers + 1):
        exchange("forward", kv, cp - 1, (micro_batch, block, "during_forward"), f"K/V block {block - 1}")
    for block in reversed(range(1, model.num_layers + 1)):
        if _recomputes(scenario, block - 1) in ("block", "attention"):
            at: Place = (micro_batch, block, "during_recompute")
            exchange("backward", kv, cp - 1, at, f"K/V block {block - 1} (recompute)")
        at = (micro_batch, block, "during_backward")
        exchange("backward", kv, cp - 1, at, f"K/V block {block - 1}")
        exchange("backward", kv, cp, at, f"dK/dV block {block - 1}")
    return events
