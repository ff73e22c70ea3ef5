"""The teaching expert parallelism ends where one process ends, and sends what the core predicts.

4 gloo ranks train tiny-moe (4 experts, top-2) with ep 2 inside the teaching DDP (DataParallelBucket) for 3 AdamW
steps in float64: the experts gathered over each expert group and every dense weight equal the model trained in one
process on the whole batch (DESIGN.md: parity in float64 within 1e-10); each rank holds the parameters of
core.params' layout for one expert-parallel rank (2 of the 4 experts); and the last step's all-to-alls (counts,
dispatch, combine, and backward's two) are those of core.expert_parallel, call for call. Their payload is the send
buffer: tokens x top-k x hidden for the forward dispatch and the backward combine whatever the routing, byte for
byte; the forward combine and the backward dispatch send back what the rank received, which routing decides, so those
are checked summed over the expert group (the rows an expert group receives are the rows it sent). Activations,
measured by the run's own measured step, are checked summed over each expert group too (within 0.1%, see below).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from shardscope.core.comm import collective_ledger
from shardscope.core.params import param_layout
from shardscope.presets import gpu_preset, model_preset
from shardscope.procs.functions import run_function
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

pytestmark = pytest.mark.distributed
WORLD, STEPS, MICRO_BATCH, SEQUENCE = 4, 3, 2, 16
TRAINING = TrainingSpec(micro_batch_size=MICRO_BATCH, sequence_length=SEQUENCE, precision="fp64")


def expert_parallel_rank(rank: int, world: int, port: int, options: dict[str, Any]) -> dict[str, Any]:
    """Train with expert parallelism inside the teaching DDP and in one process; this rank's differences, parameters
    and all-to-alls."""
    import torch.distributed as dist

    from shardscope.measure.ledger import CollectiveLedger
    from shardscope.reference_models import build_model, lm_loss, sample_batch
    from shardscope.runtime.lesson_impl import init_process_group
    from shardscope.runtime.steps import _measured_step
    from shardscope.runtime.teaching.ddp import DataParallelBucket
    from shardscope.runtime.teaching.expert_data_parallel import ExpertDataParallel
    from shardscope.runtime.trainer import make_optimizer

    init_process_group(rank, world, port=port, timeout=60)
    spec = model_preset(options["model"])
    batches = [sample_batch(spec, TRAINING, num_sequences=world * MICRO_BATCH, step=step) for step in range(STEPS)]
    single = build_model(spec, TRAINING, dtype=torch.float64, seed=0)
    optimizer = make_optimizer(list(single.parameters()), TRAINING)
    single_losses = []
    for inputs, targets in batches:
        loss = lm_loss(single(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        single_losses.append(float(loss))
    # ranks start from different weights (seed 0 is rank 0's), so a missing broadcast shows up
    model = build_model(spec, TRAINING, dtype=torch.float64, seed=rank)
    trainer = ExpertDataParallel(
        model,
        TRAINING,
        lambda units, groups: DataParallelBucket(model, TRAINING, units=units, unit_groups=groups),
        ep=options["ep"],
    )
    mine = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    losses, ledger, measured, kept = [], CollectiveLedger(), {}, []
    forward = trainer.loss

    def keeping_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = forward(inputs, targets)
        kept.append(loss.detach().clone())
        return loss

    trainer.loss = keeping_loss  # type: ignore[method-assign]
    for step, (inputs, targets) in enumerate(batches):
        ledger.recording = step == STEPS - 1
        with ledger:
            if ledger.recording:  # the run's own measured step: categories by the storage tracker
                measured = _measured_step(trainer, inputs[mine], targets[mine], ledger)
            else:
                trainer.backward(trainer.loss(inputs[mine], targets[mine]))
                trainer.step()
        mean = kept[-1]
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    whole = trainer.full_parameters()
    report = {
        "max_abs_diff": max(float((whole[name] - p).abs().max()) for name, p in single.named_parameters()),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, single_losses, strict=True)),
        "activations_bytes": measured["activations_bytes"],
        "parameters_bytes": sum(flat.numel() * flat.element_size() for flat in trainer.data.flat_params),
        "gradients_bytes": sum(flat.numel() * flat.element_size() for flat in trainer.data.flat_grads),
        "all_to_all": [[row.phase, row.group_size, row.payload_bytes] for row in ledger.rows if row.op == "all_to_all"],
    }
    dist.barrier()
    dist.destroy_process_group()
    return report


def predicted_all_to_alls(model: str, ep: int) -> list[list[Any]]:
    """core's all-to-all rows for the same step: fsdp over the 4 ranks (ep borrows from dp_shard)."""
    scenario = Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=WORLD, gpus_per_node=WORLD, backend="gloo"),
        training=TRAINING,
        strategy=Strategy(name="fsdp", engine="paper", ep=ep),
    )
    rows = [r for r in collective_ledger(scenario) if r.op == "all_to_all"]
    assert rows and all(r.group == "ep" for r in rows)
    return sorted([r.phase, r.group_size, r.payload_bytes, r.count] for r in rows)


def predicted_activations(model: str, ep: int) -> int:
    """What core predicts one rank saves for backward (the paper engine's activations, the same under every stage)."""
    from shardscope.core.engines import rules_for

    scenario = Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=WORLD, gpus_per_node=WORLD, backend="gloo"),
        training=TRAINING,
        strategy=Strategy(name="fsdp", engine="paper", ep=ep),
    )
    return rules_for(scenario).rank_memory(scenario, 0).activations.saved_bytes


def check(model: str, ep: int, timeout_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    reports = run_function(expert_parallel_rank, WORLD, {"model": model, "ep": ep}, timeout_s=timeout_s)
    layout_bytes = param_layout(model_preset(model), 1, ep).total_numel * 8
    expected = predicted_all_to_alls(model, ep)
    layers, counts_bytes = model_preset(model).num_layers, model_preset(model).num_experts * 8
    rows_bytes = max(row[2] for row in expected)
    for rank in range(WORLD):
        report = reports[rank]
        assert report["max_abs_diff"] <= 1e-10, (rank, report)
        assert report["loss_diff"] <= 1e-10, (rank, report)
        assert report["parameters_bytes"] == report["gradients_bytes"] == layout_bytes, (rank, report)
        calls = report["all_to_all"]
        forward = [payload for phase, size, payload in calls if phase == "forward" and size == ep]
        backward = [payload for phase, size, payload in calls if phase == "backward" and size == ep]
        # per layer, in program order: forward counts, dispatch, combine; backward combine, dispatch
        assert len(calls) == len(forward) + len(backward) == sum(row[3] for row in expected), (rank, calls)
        assert forward[0::3] == [counts_bytes] * layers and forward[1::3] == [rows_bytes] * layers, (rank, calls)
        assert backward[0::2] == [rows_bytes] * layers, (rank, calls)
    for first in range(0, WORLD, ep):  # each expert group sends back as many rows as it was sent
        group = [reports[rank]["all_to_all"] for rank in range(first, first + ep)]
        for phase, steps, offset in (("forward", 3, 2), ("backward", 2, 1)):
            sent = sum(sum([p for ph, _, p in calls if ph == phase][offset::steps]) for calls in group)
            assert sent == ep * layers * rows_bytes, (first, phase, group)
        # Activations follow the rows each rank's experts received, which routing decides (tiny-moe ep 2: 1,152,688
        # to 1,275,760 bytes per rank against 1,213,704 predicted), but an expert group's total does not: measured
        # 2,428,448 against 2,427,408 (260 bytes per layer and rank not attributed).
        total = sum(reports[rank]["activations_bytes"] for rank in range(first, first + ep))
        assert total == pytest.approx(ep * predicted_activations(model, ep), rel=0.001), (
            first,
            total,
            ep * predicted_activations(model, ep),
        )


@pytest.mark.slow
@pytest.mark.long  # by default ep 2 inside fsdp in test_expert_data_parallel_run.py: parity, all-to-alls, bytes
def test_ep2_inside_dp2_matches_one_process_and_the_predicted_all_to_alls(monkeypatch: pytest.MonkeyPatch) -> None:
    # tiny-moe, ep 2: per rank 32,832 root + 2 x (12,672 dense + 2 experts x 24,576) = 156,480 parameters (of
    # 254,784); per layer forward one all-to-all of 4 int64 counts (32 bytes) and two of 2 x 16 tokens x 2 x 64
    # fp64 values (32,768 bytes), backward two more of 32,768 bytes
    assert param_layout(model_preset("tiny-moe"), 1, 2).total_numel == 156_480
    assert predicted_all_to_alls("tiny-moe", 2) == [
        ["backward", 2, 32_768, 4],
        ["forward", 2, 32, 2],
        ["forward", 2, 32_768, 4],
    ]
    check("tiny-moe", 2, timeout_s=180, monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.long
def test_ep4_one_expert_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    check("tiny-moe", 4, timeout_s=180, monkeypatch=monkeypatch)
