"""Per-stage memory, ledger and time of a pipeline, hand-computed for tiny-llama, and the estimate document's
`per_stage`."""

import json
from dataclasses import replace

import jsonschema

from shardscope.cli import main
from shardscope.core.engines.base import LOSS_GRAD_BYTES, activations_for
from shardscope.core.memory import estimate_memory
from shardscope.core.params import param_layout
from shardscope.core.pipeline_time import pipeline_ledger
from shardscope.core.result import estimate_document
from shardscope.core.timeline import estimate_time
from shardscope.presets import gpu_preset, model_preset
from shardscope.schemas import load_schema
from shardscope.specs import ClusterSpec, Overheads, Scenario, Strategy, TrainingSpec


def tiny(schedule: str = "1f1b", micro_batches: int = 4, layers: int = 2, **strategy: object) -> Scenario:
    """tiny-llama (2 layers, hidden 64, vocab 256) in fp32 with SGD and momentum over pp 2 x dp 1 (paper engine)."""
    return Scenario(
        model=replace(model_preset("tiny-llama"), num_layers=layers),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=2),
        training=TrainingSpec(
            sequence_length=32, grad_accum_steps=micro_batches, precision="fp32", optimizer="sgd-momentum"
        ),
        strategy=Strategy(**{"name": "ddp", "engine": "paper", "pp": 2, "pp_schedule": schedule, **strategy}),  # type: ignore[arg-type]
    )


# tiny-llama by hand: a block is two norms (64 each), q and o (64 x 64), k and v (32 x 64: 2 KV heads of 16), gate,
# up and down (176 x 64); the embedding and the untied head are 256 x 64 each, the final norm 64.
BLOCK = 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64
EMBEDDING = HEAD = 256 * 64
STAGE_NUMEL = (EMBEDDING + BLOCK, BLOCK + 64 + HEAD)  # torchtitan's split of 2 layers on 2 stages: 1 and 1
BOUNDARY = 32 * 64 * 4  # one micro-batch's hidden states in fp32


def test_each_stage_holds_its_own_layers_states_and_receive_buffers() -> None:
    assert param_layout(model_preset("tiny-llama")).block_numel == BLOCK == 46208
    estimate = estimate_memory(tiny())
    for entry, numel in zip(estimate.per_stage, STAGE_NUMEL, strict=True):
        per_rank = entry.per_rank
        # ddp (nothing sharded), fp32 weights and gradients, one fp32 momentum per parameter, no step counter (SGD)
        assert (per_rank.parameters_bytes, per_rank.gradients_bytes, per_rank.optimizer_state_bytes) == (4 * numel,) * 3
        # torch's PipelineStage keeps one receive buffer per micro-batch: activations on stage 1, gradients on stage 0
        assert per_rank.buffers_bytes == 4 * BOUNDARY
    assert [entry.stages for entry in estimate.per_stage] == [("embed+layer 0",), ("layer 1+head",)]


def test_stage_activations_are_its_share_times_the_micro_batches_in_flight() -> None:
    scenario = tiny()
    acts = activations_for(scenario, autocast=False)
    block = acts.stored_blocks_bytes // 2
    # each stage that runs blocks makes its own rotary tables and causal mask (shared_bytes)
    shared = acts.shared_bytes
    assert shared == 2 * 32 * 16 * 4  # RoPE cos and sin (sequence x head_dim, fp32); sdpa saves no mask
    embedding = acts.saved_bytes - acts.stored_blocks_bytes - shared - acts.head_bytes
    one_f_one_b = estimate_memory(scenario).per_stage
    assert [entry.in_flight for entry in one_f_one_b] == [(2,), (1,)]  # min(p - s, m)
    # stage 0 keeps the output it sent (its backward starts there); stage 1's first block saves its input, which is
    # the receive buffer (a buffer, not an activation)
    hidden = acts.hidden_bytes
    assert hidden == BOUNDARY
    assert one_f_one_b[0].per_rank.activations_bytes == 2 * (block + shared + embedding + hidden)
    assert one_f_one_b[1].per_rank.activations_bytes == block + shared + acts.head_bytes - hidden
    gpipe = estimate_memory(tiny("gpipe")).per_stage
    assert [entry.in_flight for entry in gpipe] == [(4,), (4,)]
    assert gpipe[1].per_rank.activations_bytes == 4 * (block + shared + acts.head_bytes - hidden)


def test_the_pytorch_engine_holds_what_torchs_pipeline_stage_holds() -> None:
    """The same scenario under engine 'pytorch': torch's PipelineStage caches each in-flight micro-batch's stage
    output (hidden states, or the last stage's logits) and its schedule holds the whole step's token ids and targets
    (tests/trace/test_pipeline_trace.py checks these against torch's PipelineStage replayed on fake tensors)."""
    scenario = tiny(engine="pytorch")
    acts = activations_for(scenario, autocast=False)
    block = acts.stored_blocks_bytes // 2
    ids = 32 * 8  # one micro-batch's int64 token ids (first stage) or targets (last stage), held for the whole step
    shared = acts.saved_bytes - acts.stored_blocks_bytes - acts.head_bytes - 2 * ids
    assert shared == acts.shared_bytes + 4  # RoPE's tables and the loss's fp32 total weight, per stage with blocks
    # the last stage's input is its receive buffer (counted in buffers), not an activation
    first = block + shared + acts.hidden_bytes
    last = block + shared + acts.logits_bytes - acts.hidden_bytes + acts.head_bytes
    assert acts.logits_bytes == 32 * 256 * 4  # tokens x vocab, fp32
    one_f_one_b = estimate_memory(scenario).per_stage
    assert [entry.in_flight for entry in one_f_one_b] == [(2,), (1,)]  # min(p - s, m)
    assert one_f_one_b[0].per_rank.activations_bytes == 2 * first + 4 * ids
    assert one_f_one_b[1].per_rank.activations_bytes == last + 4 * ids
    gpipe = estimate_memory(tiny("gpipe", engine="pytorch")).per_stage
    assert [entry.in_flight for entry in gpipe] == [(4,), (4,)]
    assert gpipe[1].per_rank.activations_bytes == 4 * last + 4 * ids
    # against the paper engine (the teaching pipeline) on the last stage: per micro-batch the cached logits and the
    # loss's total weight, and the step's 4 micro-batches of targets held whole
    paper = estimate_memory(tiny("gpipe")).per_stage
    assert (
        gpipe[1].per_rank.activations_bytes - paper[1].per_rank.activations_bytes
        == 4 * (acts.logits_bytes + 4) + 4 * ids
    )


def test_per_rank_and_fits_are_the_busiest_stages() -> None:
    estimate = estimate_memory(tiny("gpipe"))
    peaks = [entry.per_rank.peak_bytes for entry in estimate.per_stage]
    assert estimate.per_rank.peak_bytes == max(peaks)
    assert estimate.rank == peaks.index(max(peaks))  # one GPU per pipeline rank here
    assert estimate_memory(tiny("gpipe"), rank=0).per_rank == estimate.per_stage[0].per_rank


def test_the_ledger_has_a_send_and_a_recv_per_micro_batch_and_boundary() -> None:
    rows = {(row.phase, row.op): (row.group, row.payload_bytes, row.count) for row in pipeline_ledger(tiny(), 0)}
    assert rows == {("forward", "send"): ("pp", BOUNDARY, 4), ("backward", "recv"): ("pp", BOUNDARY, 4)}
    interleaved = tiny("interleaved-1f1b", layers=4)
    last = {(row.phase, row.op): row.count for row in pipeline_ledger(interleaved, 1)}
    # rank 1 holds stages 1 and 3 (the last): stage 1 sends forward, both receive activations and send gradients
    assert last == {("forward", "send"): 4, ("forward", "recv"): 8, ("backward", "send"): 8, ("backward", "recv"): 4}


def test_the_step_time_includes_the_bubble_and_the_pipeline_messages() -> None:
    few, many = estimate_time(tiny(micro_batches=2)), estimate_time(tiny(micro_batches=8))
    assert any(row.group == "pp" and row.op == "send" for row in few.ledger)
    # the bubble is a smaller share of a longer pipeline: time per micro-batch falls with m
    assert many.step_time_s / 8 < few.step_time_s / 2
    assert few.step_time_s >= few.compute_time_s


def test_the_estimate_document_carries_per_stage_and_the_pipeline(capsys: object) -> None:
    document = estimate_document([estimate_memory(tiny("interleaved-1f1b", layers=4, pp_layers=(2, 1, 1, 0)))])
    jsonschema.validate(document, load_schema("shardscope.estimate/v1"))
    entry = document["strategies"][0]
    assert entry["parallelism"]["pp"] == 2
    assert (entry["parallelism"]["pp_schedule"], entry["parallelism"]["pp_virtual_stages"]) == ("interleaved-1f1b", 2)
    assert [stage["stages"] for stage in entry["per_stage"]] == [["embed+layers 0-1", "layer 3"], ["layer 2", "head"]]
    busiest = max(entry["per_stage"], key=lambda s: s["per_rank"]["peak_bytes"])["per_rank"]
    # the reserved peak is the busiest rank's alone (the allocator model replays one rank's stream)
    assert {key: value for key, value in entry["per_rank"].items() if key != "reserved_peak_bytes"} == busiest
    assert entry["per_rank"]["reserved_peak_bytes"] >= busiest["peak_bytes"] - busiest["overhead_bytes"]


def test_the_cli_prints_the_stage_layout_and_json(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["estimate", "--model", "llama-3-8b", "--gpus", "16", "--strategy", "fsdp", "--pp", "4", "--grad-accum", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fsdp+pp4(1f1b)" in out
    assert "stages by pipeline rank: 0: embed+layers 0-7" in out and "3: layers 25-31+head" in out
    assert main([*argv, "--json", "--time"]) == 0
    document = json.loads(capsys.readouterr().out)
    jsonschema.validate(document, load_schema("shardscope.estimate/v1"))
    assert len(document["strategies"][0]["per_stage"]) == 4


def test_without_a_pipeline_the_document_is_unchanged() -> None:
    entry = estimate_document([estimate_memory(tiny(pp=1))])["strategies"][0]
    assert "per_stage" not in entry and "pp_schedule" not in entry["parallelism"]
    assert entry["parallelism"]["pp"] == 1


def test_a_tied_head_is_a_copy_on_the_last_stage() -> None:
    gpt2 = Scenario(
        model=model_preset("gpt2"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=2),
        training=TrainingSpec(sequence_length=1024, grad_accum_steps=2, precision="fp32", optimizer="sgd"),
        strategy=Strategy(name="ddp", engine="paper", pp=2),
    )
    first, last = (entry.per_rank.parameters_bytes for entry in estimate_memory(gpt2).per_stage)
    # gpt2: 12 blocks split 6 and 6; the first stage adds the token (50257 x 768) and position (1024 x 768)
    # embeddings, the last the final LayerNorm (2 x 768) and its own copy of the tied 50257 x 768 head, in fp32.
    assert first - last == 4 * (1024 * 768 - 2 * 768)


def test_a_stage_of_only_the_head_peaks_at_the_start_of_its_backward() -> None:
    """`--pp-layers 2,0` leaves the last stage the final norm and head alone, so its largest work is the start of the
    loss's backward: the log-softmax's gradient beside the logits' (64 tokens x 256 x 8 bytes each in fp64), larger
    than the loss's forward spike. Measured on gloo, `shardscope run --model tiny-llama --strategy zero1 --engine paper
    --world-size 4 --pp 2 --pp-layers 2,0 --grad-accum 4 --json` (torch 2.13.0): 993,308 B at that stage's peak; the
    prediction is 985,096 B, and was 854,020 B (-14%) while only the forward spike was counted."""
    scenario = Scenario(
        model=model_preset("tiny-llama"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=4, backend="gloo"),
        training=TrainingSpec(micro_batch_size=2, sequence_length=32, grad_accum_steps=4, precision="fp64"),
        strategy=Strategy(name="zero1", engine="paper", pp=2, pp_layers=(2, 0)),
        overheads=Overheads(context_bytes=0),
    )
    head = estimate_memory(scenario).per_stage[1]
    logits = 2 * 32 * 256 * 8
    assert head.stages == ("head",)
    assert head.peak_moment == "1 micro-batches in flight"
    assert head.per_rank.temporary_bytes == 2 * logits + LOSS_GRAD_BYTES
    assert head.per_rank.peak_bytes == 985_096
