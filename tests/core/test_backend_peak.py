"""What a collective allocates depends on the library: FSDP2's peaks under NCCL (the trace) and gloo (real runs)."""

from __future__ import annotations

from dataclasses import replace

from shardscope.core.memory import estimate_memory
from shardscope.specs import Scenario
from shardscope.validate.cases import ValidationCase


def _on(scenario: Scenario, backend: str) -> Scenario:
    return replace(scenario, cluster=replace(scenario.cluster, backend=backend))


def test_gloo_reduce_scatter_holds_a_clone_of_its_input() -> None:
    # The top block's reduce-scatter: NCCL holds its bf16 gradients and the fp32 input together at the copy-in
    # (traced 1,439,736 B at 'backward: layers.1'); gloo frees the gradients and clones the input (1,539,832 B,
    # the trace with --backend gloo and the runtime tracker):
    #   shardscope trace --model tiny-gpt2 --gpus 2 --gpus-per-node 2 --precision bf16-mixed --strategy zero3
    #     --engine pytorch --micro-batch 2 --seq-len 32 --context-memory 0 --allocator-headroom 0 [--backend gloo]
    # The core is 128 B under gloo's figure: the gradient shard (99,968 B) lands while the input is live, and the
    # gradients it counts instead are 99,840 B. Before runtime/tracker.py placed gloo's late frees by its rule, the
    # same case measured 1,539,832 B or 1,639,672 B from one run to the next.
    case = ValidationCase(model="tiny-gpt2", strategy="zero3", engine="pytorch", world_size=2, precision="bf16-mixed")
    nccl = estimate_memory(_on(case.scenario(), "nccl"), rank=0)
    gloo = estimate_memory(_on(case.scenario(), "gloo"), rank=0)
    assert nccl.peak_moment == gloo.peak_moment == "top block's reduce-scatter"
    assert nccl.per_rank.peak_bytes == 1_439_736
    assert gloo.per_rank.peak_bytes == 1_539_832 - 128


def test_gloo_adds_nothing_where_the_input_is_no_larger_than_the_gradients() -> None:
    # In fp32 the unsharded gradients and the reduce-scatter input are the same size: the clone replaces them.
    # (gpt2: its LayerNorm saves the same tensors on a GPU and a CPU, where llama's RMSNorm does not.)
    case = ValidationCase(model="tiny-gpt2", strategy="zero3", engine="pytorch", world_size=2, precision="fp32")
    nccl = estimate_memory(_on(case.scenario(), "nccl"), rank=0).per_rank.peak_bytes
    assert estimate_memory(_on(case.scenario(), "gloo"), rank=0).per_rank.peak_bytes == nccl


def test_zero2_holds_the_last_all_gather_output_through_the_output_head() -> None:
    # Without resharding after forward the last block's flat all-gather output lives until the loss runs, which is
    # after lm_head's forward. Traced 2,035,312 B at 'forward: lm_head':
    #   shardscope trace --model tiny-gpt2 --gpus 2 --gpus-per-node 2 --precision fp32 --strategy zero2
    #     --engine pytorch --micro-batch 2 --seq-len 32 --context-memory 0 --allocator-headroom 0
    # The core is 1,020 B under: 1,024 B of int64 ids live in forward only, less the loss's 4 B made later.
    case = ValidationCase(model="tiny-gpt2", strategy="zero2", engine="pytorch", world_size=2, precision="fp32")
    result = estimate_memory(_on(case.scenario(), "nccl"), rank=0)
    assert result.peak_moment == "output head's forward"
    assert result.per_rank.peak_bytes == 2_035_312 - 1_020


def test_moe_mlp_backward_peaks_in_the_last_experts_swiglu_backward() -> None:
    # Measured in one process (tiny-moe layers.0, fp32, full checkpointing, micro-batch 2 x 32 tokens, the block's
    # output and its gradient of 16,384 B each besides): 656,304 B at the last expert's SwiGLU product backward, the
    # other three experts' weight gradients live (scratch: a dispatch mode over `Block.forward` under checkpoint and
    # `y.backward`, as tests/validate/test_activation_accounting.py runs the reference modules). That batch routed
    # 43 of its 128 rows to the last expert (expert 0); the core assumes an even 32, which is 37,040 B less (43 - 32
    # rows each of 2 x 512 B of gradients and, in the three experts before, 2,320 B of saved tensors per row); with
    # the rows that batch routed, the rule is 256 B under.
    from shardscope.core.activations import estimate_activations
    from shardscope.presets import model_preset
    from shardscope.specs import TrainingSpec

    training = TrainingSpec(micro_batch_size=2, sequence_length=32, precision="fp32", checkpointing="full")
    acts = estimate_activations(model_preset("tiny-moe"), training)
    assert acts.block_backward_bytes + 2 * acts.hidden_bytes == 656_304 - 37_040


def test_zero2_checkpointed_peaks_in_the_first_blocks_forward() -> None:
    # The next block's all-gather is prefetched while the first block runs forward, so the root, two blocks and both
    # flat all-gather outputs (887,808 B) are live. Measured 2,709,348 B in forward, rank 0 of the case
    # "tiny-moe zero2 pytorch w4 fp32 ckpt" of
    #   shardscope validate --models tiny-moe --strategies zero2 --engines pytorch --world-sizes 4 --no-trace
    # The core is 4,092 B under: the MoE block's forward working set beyond its output is not counted (and it
    # counts the loss's 4 B, made later).
    case = ValidationCase(
        model="tiny-moe", strategy="zero2", engine="pytorch", world_size=4, precision="fp32", checkpointing="full"
    )
    result = estimate_memory(case.scenario(), rank=0)
    assert result.peak_moment == "first block's forward"
    assert result.per_rank.peak_bytes == 2_709_348 - 4_092
