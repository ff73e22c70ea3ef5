"""The teaching tensor, sequence and context parallelism end where one process ends, element for element.

4 gloo ranks train a tiny llama (or gpt2) for 3 AdamW steps in float64 on a dp x cp x tp grid; every rank compares
each of its parameters with its slice of the same model trained in one process on the whole batch (DESIGN.md:
parity in float64 within 1e-10), and the whole parameters gathered over tp with the whole model. Each rank holds
the tensors and shapes the core predicts for a tp rank, and ring attention sends and receives what it should.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardscope.core.params import param_layout
from shardscope.presets import model_preset
from shardscope.procs.functions import run_function

pytestmark = pytest.mark.distributed
WORLD = 4
STEPS = 3
MICRO_BATCH = 2
SEQUENCE = 16
FP64 = 8


class PointToPoint(TorchDispatchMode):
    """(phase, op, group size, bytes) of every c10d send and recv while active (the ledger counts collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.rows: list[tuple[str, str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name in ("c10d.send.default", "c10d.recv_.default"):
            group = next(a for a in args if isinstance(a, torch.ScriptObject))
            size = torch.distributed.ProcessGroup.unbox(group).size()
            payload = sum(t.numel() * t.element_size() for t in args[0])
            self.rows.append((self.phase, name.split(".")[1].rstrip("_"), size, payload))
        return func(*args, **(kwargs or {}))


def parity_rank(rank: int, world: int, port: int, options: dict[str, Any]) -> dict[str, Any]:
    """Each case of options['cases'] (model, tp, cp, sequence_parallel) in turn; per case this rank's largest difference
    from one process, its parameter elements and its losses."""
    import torch.distributed as dist

    from shardscope.reference_models import build_model, lm_loss, sample_batch
    from shardscope.runtime.lesson_impl import init_process_group
    from shardscope.runtime.teaching.model_parallel import ModelParallelTeaching
    from shardscope.runtime.teaching.tensor_parallel import shard_of
    from shardscope.runtime.trainer import make_optimizer
    from shardscope.specs import TrainingSpec

    init_process_group(rank, world, port=port, timeout=60)
    training = TrainingSpec(micro_batch_size=MICRO_BATCH, sequence_length=SEQUENCE, precision="fp64")
    reports = []
    for model_name, tp, cp, sequence_parallel in options["cases"]:
        spec = model_preset(model_name)
        dp = world // (tp * cp)
        batches = [sample_batch(spec, training, num_sequences=dp * MICRO_BATCH, step=step) for step in range(STEPS)]
        single = build_model(spec, training, dtype=torch.float64, seed=0)
        optimizer = make_optimizer(list(single.parameters()), training)
        single_losses = []
        for inputs, targets in batches:
            loss = lm_loss(single(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            single_losses.append(float(loss))
        # ranks start from different weights (seed 0 is rank 0's), so a missing broadcast shows up
        model = build_model(spec, training, dtype=torch.float64, seed=rank)
        trainer = ModelParallelTeaching(model, training, tp=tp, cp=cp, sequence_parallel=sequence_parallel)
        mine = slice(trainer.grid.dp_index * MICRO_BATCH, (trainer.grid.dp_index + 1) * MICRO_BATCH)
        losses, sent = [], PointToPoint()
        for inputs, targets in batches:
            sent.rows.clear()  # keep the last step's
            with sent:
                sent.phase = "forward"
                loss = trainer.loss(inputs[mine], targets[mine])
                sent.phase = "backward"
                trainer.backward(loss)
            trainer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the tp ranks of a cell hold the same loss: the world mean is the batch's
            losses.append(float(mean) / world)
        expected = dict(single.named_parameters())
        largest = max(
            float((param - shard_of(name, expected[name], trainer.grid.tp_index, tp)).abs().max())
            for name, param in model.named_parameters()
        )
        whole = trainer.full_parameters()
        largest_whole = max(float((whole[name] - p).abs().max()) for name, p in single.named_parameters())
        reports.append(
            {
                "max_abs_diff": largest,
                "max_abs_diff_whole": largest_whole,
                "shapes": {name: list(p.shape) for name, p in model.named_parameters()},
                "point_to_point": [[*row, count] for row, count in Counter(sent.rows).items()],
                "loss_diff": max(abs(a - b) for a, b in zip(losses, single_losses, strict=True)),
            }
        )
    dist.barrier()
    dist.destroy_process_group()
    return {"cases": reports}


def ring_passes(model: str, tp: int, cp: int) -> list[list[Any]]:
    """Ring attention's sends and receives in one step, per layer: K and V (the rank's KV heads, not repeated for
    grouped-query attention) passed on cp - 1 times in forward; in backward K and V again cp - 1 times and their
    gradients cp times (the last pass takes each home). Nothing for cp 1."""
    if cp == 1:
        return []
    spec = model_preset(model)
    kv_bytes = 2 * MICRO_BATCH * spec.num_kv_heads // tp * SEQUENCE // cp * spec.head_dim * FP64
    layers = spec.num_layers
    return sorted(
        [phase, op, cp, kv_bytes, count * layers]
        for phase, count in (("forward", cp - 1), ("backward", 2 * cp - 1))
        for op in ("send", "recv")
    )


def check(cases: list[tuple[str, int, int, bool]], timeout_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch of `cases` with a hard deadline; the ranks import parity_rank from this file's directory."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    reports = run_function(parity_rank, WORLD, {"cases": cases}, timeout_s=timeout_s)
    for index, (model, tp, cp, _sp) in enumerate(cases):
        for rank in range(WORLD):
            report = reports[rank]["cases"][index]
            assert report["max_abs_diff"] <= 1e-10, (cases[index], rank, report)
            assert report["max_abs_diff_whole"] <= 1e-10, (cases[index], rank, report)
            assert report["loss_diff"] <= 1e-10, (cases[index], rank, report)
            # the tensors and shapes the core predicts a tp rank holds (torch's DTensor plan)
            predicted = {t.name: list(t.shape) for t in param_layout(model_preset(model), tp).tensors()}
            assert report["shapes"] == predicted, (cases[index], rank)
            assert sorted(report["point_to_point"]) == ring_passes(model, tp, cp), (cases[index], rank)


@pytest.mark.slow
@pytest.mark.long  # by default the teaching grid's tp and cp keep float64 parity in test_sharded_model_parallel.py
# (fsdp and zero2 x tp 2, zero1 x tp 2 x cp 2) and run inside ddp in test_model_parallel_prediction.py
def test_tensor_parallel_inside_data_parallel_matches_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    check([("tiny-llama", 2, 1, False)], timeout_s=60, monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(
    "case",
    [
        ("tiny-llama", 2, 1, True),
        ("tiny-llama", 2, 2, False),
        ("tiny-llama", 2, 2, True),
        ("tiny-llama", 1, 4, False),
        ("tiny-gpt2", 2, 1, False),
        ("tiny-gpt2", 2, 2, True),
    ],
    ids=["tp2-dp2-sequence-parallel", "tp2-cp2", "tp2-cp2-sequence-parallel", "cp4", "gpt2-tp2-dp2", "gpt2-tp2-cp2-sp"],
)
def test_sequence_and_context_parallel_match_one_process(
    case: tuple[str, int, int, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    check([case], timeout_s=60, monkeypatch=monkeypatch)
