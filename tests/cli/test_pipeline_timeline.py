"""`shardscope timeline --pp`: every pipeline rank's schedule drawn stage by stage, its numbers those of
`estimate --pp --time`, its Chrome trace one process per pipeline rank, and its bubble against the formula."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.core.network import CollectiveCost
from shardscope.core.pipeline_schedule import simulate_pipeline
from shardscope.core.pipeline_time import PipelineStep, pipeline_step
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

SCENARIO = ["--model", "llama-3-8b", "--gpus", "16", "--strategy", "fsdp", "--pp", "4", "--grad-accum", "8"]


def llama_pipeline(schedule: str = "1f1b", micro_batches: int = 8) -> Scenario:
    """SCENARIO as the CLI builds it: llama-3-8b, 2048 tokens, fsdp over 4 GPUs x pp 4 on two nodes of H100s."""
    return Scenario(
        model=model_preset("llama-3-8b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16),
        training=TrainingSpec(sequence_length=2048, grad_accum_steps=micro_batches),
        strategy=Strategy(name="fsdp", pp=4, pp_schedule=schedule),  # type: ignore[arg-type]
    )


def test_the_step_time_is_the_one_estimate_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *SCENARIO, "--time", "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)["strategies"][0]
    assert main(["timeline", *SCENARIO, "--json"]) == 0
    timeline = json.loads(capsys.readouterr().out)
    assert timeline["step_time_s"] == estimated["step_time_s"]
    assert timeline["mfu"] == estimated["mfu"]
    assert timeline["communication"] == estimated["communication"]
    step = pipeline_step(llama_pipeline(), default_profile(gpu_preset("h100-80gb")))
    assert timeline["pipeline"]["bubble_fraction"] == step.bubble_fraction
    ranks = timeline["pipeline"]["ranks"]
    assert [len(rank["actions"]) for rank in ranks] == [16, 16, 16, 16]  # a forward and a backward of 8 each
    assert max(rank["end_s"] for rank in ranks) == estimated["step_time_s"]
    assert main(["timeline", *SCENARIO]) == 0
    printed = capsys.readouterr().out
    shown = re.search(r"step time +([\d.]+) ms \(pipeline rank (\d) finishes last\)", printed)
    assert shown and float(shown.group(1)) == round(estimated["step_time_s"] * 1e3, 3)
    assert int(shown.group(2)) == timeline["pipeline"]["last_pipeline_rank"] == 0  # 1F1B: rank 0 drains last
    # llama's first stage holds the embeddings, its last the head, and the messages cost time: more than 3/11 idle
    bubble = re.search(r"bubble +([\d.]+)% .*free messages: ([\d.]+)%\)", printed)
    assert bubble and float(bubble.group(1)) == round(step.bubble_fraction * 100, 1) == 30.7
    assert float(bubble.group(2)) == round(3 / 11 * 100, 1)


def test_the_picture_has_a_row_per_stage_and_the_warm_up_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", *SCENARIO]) == 0
    rows = {
        int(match.group(1)): match.group(2)
        for match in re.finditer(r"^ +stage (\d) \|(.*)\|$", capsys.readouterr().out, re.M)
    }
    assert sorted(rows) == [0, 1, 2, 3]
    assert {len(row) for row in rows.values()} == {125}  # the shortest forward takes three columns of the step
    # 1F1B: stage s waits for s forwards upstream before its first, and stage 3 starts its first backward at once
    assert rows[0].startswith("F0>") and re.match(r"\.{9}F0>+B0<", rows[3]) is not None
    assert [row.index("F0") for row in rows.values()] == sorted(row.index("F0") for row in rows.values())
    assert all(row.count("B") == 8 and row.count("F") == 8 for row in rows.values())


def test_interleaved_rows_name_their_rank(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["timeline", "--model", "llama-3-8b", "--gpus", "2", "--strategy", "ddp", "--pp", "2"]
    assert main([*argv, "--pp-schedule", "interleaved-1f1b", "--grad-accum", "4"]) == 0
    printed = capsys.readouterr().out
    assert [line.split("|")[0].strip() for line in printed.splitlines() if line.strip().startswith("stage ")] == [
        "stage 0 (rank 0)",
        "stage 1 (rank 1)",
        "stage 2 (rank 0)",
        "stage 3 (rank 1)",
    ]
    assert "interleaved-1f1b schedule, 4 stages, 2 per rank, 4 micro-batches" in printed
    assert "free messages: 11.1%)" in printed  # (p - 1)/(V m + p - 1) = 1/9


def test_the_trace_has_a_process_per_pipeline_rank_and_a_thread_per_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pipeline.json"
    assert main(["timeline", *SCENARIO, "--trace", str(out)]) == 0
    assert "a process per pipeline rank, a thread per stage" in capsys.readouterr().out
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    names = {event["pid"]: event["args"]["name"] for event in events if event["name"] == "process_name"}
    assert names == {
        0: "pipeline rank 0 (stage 0: embed+layers 0-7)",
        1: "pipeline rank 1 (stage 1: layers 8-16)",
        2: "pipeline rank 2 (stage 2: layers 17-24)",
        3: "pipeline rank 3 (stage 3: layers 25-31+head)",
    }
    passes = [event for event in events if event["ph"] == "X" and event["cat"] in ("forward", "backward")]
    assert len(passes) == 4 * 2 * 8
    assert all(event["tid"] == event["pid"] == event["args"]["stage"] for event in passes)
    step = pipeline_step(llama_pipeline(), default_profile(gpu_preset("h100-80gb")))
    assert trace["otherData"]["step_time_s"] == step.step_time_s
    assert trace["otherData"]["bubble_fraction"] == step.bubble_fraction
    ends = [max(e["ts"] + e["dur"] for e in events if e["ph"] == "X" and e["pid"] == rank) for rank in range(4)]
    assert max(ends) == pytest.approx(step.step_time_s * 1e6)
    # 1F1B holds at most p - s micro-batches on stage s (Megatron-LM paper, Section 2.2.1)
    held = [max(e["args"]["micro_batches"] for e in events if e["ph"] == "C" and e["pid"] == r) for r in range(4)]
    assert held == [4, 3, 2, 1]


@pytest.mark.parametrize(
    ("schedule", "pp", "virtual", "micro_batches"),
    [("1f1b", 4, 0, 8), ("gpipe", 4, 0, 5), ("1f1b", 8, 0, 16), ("interleaved-1f1b", 4, 2, 8)],
)
def test_the_bubble_of_equal_stages_is_the_formula(schedule: str, pp: int, virtual: int, micro_batches: int) -> None:
    # "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Section 2.2: with equal
    # stages and free messages, the bubble time is (p - 1)(F + B)/V against the ideal m (F + B), so it is
    # (p - 1)/(V m + p - 1) of each rank's time from first to last pass: (p - 1)/(m + p - 1) for GPipe and 1F1B.
    strategy = Strategy(name="ddp", pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual)  # type: ignore[arg-type]
    virtual = strategy.virtual_stages  # 0 asks for the schedule's own: 1 for GPipe and 1F1B
    stages = pp * virtual
    timeline, _ = simulate_pipeline(
        schedule,  # type: ignore[arg-type]
        pp,
        virtual,
        micro_batches,
        [1.0 / virtual] * stages,
        [2.0 / virtual] * stages,
    )
    step = PipelineStep(
        scenario=Scenario(
            model=model_preset("llama-3-8b"),
            cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=pp),
            training=TrainingSpec(grad_accum_steps=micro_batches),
            strategy=strategy,
        ),
        actions=tuple(tuple(actions) for actions in timeline),
        proxies=(),
        after=(),
        send=CollectiveCost(wire_bytes=0, inter_node_bytes=0, time_s=0.0),
    )
    assert step.bubble_fraction == pytest.approx((pp - 1) / (virtual * micro_batches + pp - 1))
    assert step.bubble_fraction == pytest.approx(step.equal_stages_bubble_fraction)
    assert step.span_s == pytest.approx(micro_batches * 3.0 + (pp - 1) * 3.0 / virtual)
    if virtual == 1:
        assert step.bubble_fraction == pytest.approx((pp - 1) / (micro_batches + pp - 1))
