"""The teaching strategies' own ops (declared in runtime.teaching.op_counts, placed by core.engines.python_ops)
against the ops their code dispatches, counted with a dispatch mode over real steps on a one-rank gloo group; and
what the timeline charges for them."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from timecases import scenario

import shardscope
from shardscope.core.engines.python_ops import bookkeeping_ops
from shardscope.core.timeline import estimate_time
from shardscope.presets.hardware import HostOverheads, default_profile

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from shardscope.runtime.teaching.op_counts import TEACHING_PYTHON_OPS  # noqa: E402 (after the torch check)

TEACHING_HOST = HostOverheads(python_ops=TEACHING_PYTHON_OPS)

# from the package, not the checkout, so the test holds against an installed copy
TEACHING = str(Path(shardscope.__file__).parent / "runtime" / "teaching")
# the frames torch puts between an op's caller and a dispatch mode's __torch_dispatch__
DISPATCH_MACHINERY = ("/torch/_dynamo/", "/torch/_compile.py", "/torch/utils/_python_dispatch.py")


class TeachingOps(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[misc]
    """Counts the aten ops called straight from shardscope.runtime.teaching's code: not the model's (called from
    reference_models.py), not autograd's (from torch.autograd), not the optimizer's or a collective's own (from
    torch.optim, torch.distributed)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        frame = sys._getframe(1)
        while frame.f_back is not None and any(part in frame.f_code.co_filename for part in DISPATCH_MACHINERY):
            frame = frame.f_back
        if frame.f_code.co_filename.startswith(TEACHING) and func.namespace == "aten":
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _counted_step(strategy: str, precision: str) -> tuple[int, int]:
    """(ops in forward and backward, ops in the optimizer step) of the third step of the teaching strategy."""
    from shardscope.reference_models import build_model
    from shardscope.runtime.config import RunConfig
    from shardscope.runtime.steps import make_trainer, model_dtype, rank_batch

    config = RunConfig.from_options(
        model="tiny-gpt2", strategy=strategy, engine="teaching", world_size=1, steps=3, precision=precision,
        micro_batch_size=2, sequence_length=32,
    )  # fmt: skip
    trainer = make_trainer(config, build_model(config.model_spec, config.training, dtype=model_dtype(config), seed=0))
    for step in range(3):
        inputs, targets = rank_batch(config, step, 0, "cpu")
        with TeachingOps() as before_step:
            trainer.backward(trainer.loss(inputs, targets))
        with TeachingOps() as in_step:
            trainer.step()
    return before_step.count, in_step.count


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("strategy", "precision"),
    [("ddp", "fp32"), ("zero1", "fp32"), ("zero1", "bf16-mixed"), ("zero2", "fp32"), ("zero3", "fp32")],
)
def test_bookkeeping_ops_are_the_ops_the_teaching_code_dispatches(strategy: str, precision: str) -> None:
    before_step, in_step = _counted_step(strategy, precision)
    case = scenario(model="tiny-gpt2", strategy=strategy, engine="paper", world_size=2, precision=precision)
    predicted = bookkeeping_ops(case, TEACHING_HOST.python_ops_at(case.strategy.stage))
    assert before_step + in_step == sum(predicted.values())
    if strategy in ("zero2", "zero3"):  # placed where they run: in the backward of the unit's stage
        assert before_step == sum(ops for (kind, _), ops in predicted.items() if kind == "backward")


def test_the_timeline_charges_each_bookkeeping_op_once() -> None:
    case = scenario(model="tiny-gpt2", strategy="zero2", engine="paper", world_size=2, gpus_per_node=2)
    base = dataclasses.replace(default_profile(case.cluster.gpu), overlap=False)
    priced = dataclasses.replace(
        base, host_overheads=dataclasses.replace(TEACHING_HOST, bookkeeping_op_overhead_s=1e-5)
    )
    extra = estimate_time(case, priced).step_time_s - estimate_time(case, base).step_time_s
    assert extra == pytest.approx(
        sum(bookkeeping_ops(case, TEACHING_HOST.python_ops_at(case.strategy.stage)).values()) * 1e-5, rel=1e-9
    )
    torch_case = dataclasses.replace(case, strategy=dataclasses.replace(case.strategy, engine="pytorch"))
    assert estimate_time(torch_case, priced).step_time_s == estimate_time(torch_case, base).step_time_s
