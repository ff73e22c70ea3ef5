"""The simulation pinned to values computed before the planner's speed work (issue 5, part 1): building the comm
events once per call, pricing each distinct call once and keeping the schedule as tuples must change no result.

Each pin is (a digest of everything a TimeEstimate reports: step, communication, exposed and compute time, wire bytes,
FLOPs, peak, the ledger and every span's name, stream, category, start, duration and payload; the step time), computed
with the code of commit 26b1dfd. A change that moves any of them by one ulp fails here; a deliberate change of the
model updates the pins and says why in its commit. Since then: torch DDP's per-step cost moved from the first forward
stage to the first backward stage (the ddp and zero1 pytorch spans; no step time changed).
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from timecases import scenario

from shardscope.core.timeline import TimeEstimate, estimate_time
from shardscope.presets.hardware import HardwareProfile, OpCost, default_profile
from shardscope.specs import Scenario

PAIRS = [
    ("ddp", "pytorch"),
    ("ddp", "paper"),
    ("zero1", "pytorch"),
    ("zero1", "paper"),
    ("zero2", "pytorch"),
    ("zero2", "paper"),
    ("zero3", "pytorch"),
    ("zero3", "paper"),
    ("zero3", "deepspeed"),
    ("zero2", "deepspeed"),
    ("hsdp", "pytorch"),
]


def _cpu_profile() -> HardwareProfile:
    """A calibrated-looking gloo profile: serial streams, per-op collective costs, every framework term set."""
    return dataclasses.replace(
        default_profile(scenario().cluster.gpu),
        overlap=False,
        matmul_flops_per_s=8e10,
        efficiency=1.0,
        kernel_overhead_s=5e-6,
        backward_op_overhead_s=6e-6,
        optimizer_tensor_overhead_s=3e-5,
        ddp_step_overhead_s=1.5e-3,
        fsdp_unit_overhead_s=5e-3,
        fsdp_optimizer_tensor_overhead_s=1.3e-4,
        sync_wait_s=6e-4,
        zero_tensor_overhead_s=2e-4,
        op_costs=(
            OpCost(op="all_reduce", call_latency_s=3.4e-4, bandwidth_bytes_per_s=1.2e9),
            OpCost(op="reduce_scatter", call_latency_s=4.3e-4, bandwidth_bytes_per_s=4.3e8),
            OpCost(op="broadcast", call_latency_s=1.3e-4, bandwidth_bytes_per_s=3.5e9),
        ),
    )


def _cases() -> list[tuple[str, Scenario, HardwareProfile | None]]:
    cases: list[tuple[str, Scenario, HardwareProfile | None]] = []
    for strategy, engine in PAIRS:
        for offload in ("none", "optimizer", "optimizer+params"):
            if offload == "optimizer+params" and strategy not in ("zero3", "hsdp"):
                continue
            case = scenario(
                strategy=strategy,
                engine=engine,
                offload=offload,
                shard_group=8 if strategy == "hsdp" else 0,
                grad_accum=2,
                checkpointing="full" if offload != "none" else "none",
            )
            cases.append((f"{strategy}/{engine}/{offload}/8b", case, None))
        tiny = scenario(
            model="tiny-llama",
            strategy=strategy,
            engine=engine,
            world_size=2,
            gpus_per_node=2,
            sequence_length=32,
            precision="fp32",
            shard_group=2 if strategy == "hsdp" else 0,
        )
        cases.append((f"{strategy}/{engine}/tiny-cpu", tiny, _cpu_profile()))
    return cases


def _digest(estimate: TimeEstimate) -> str:
    spans = repr([(s.name, s.stream, s.category, s.start_s, s.duration_s, s.payload_bytes) for s in estimate.spans])
    head = (
        estimate.step_time_s,
        estimate.comm_time_s,
        estimate.exposed_comm_s,
        estimate.compute_time_s,
        estimate.wire_bytes_per_rank,
        estimate.model_flops,
        estimate.peak_flops_per_s,
        repr(estimate.ledger),
    )
    return hashlib.sha256((repr(head) + spans).encode()).hexdigest()[:16]


PINS = {
    "ddp/pytorch/none/8b": ("353d071def3328b3", 0.5166364365903695),
    "ddp/pytorch/optimizer/8b": ("a0478d8a4c29cc7b", 1.609768486512245),
    "ddp/pytorch/tiny-cpu": ("9fd5e9fc99c68c2e", 0.006393706582288557),
    "ddp/paper/none/8b": ("003c4289ab00d50e", 0.478750964751309),
    "ddp/paper/optimizer/8b": ("469295530c6ce9b1", 1.1051183201122452),
    "ddp/paper/tiny-cpu": ("fc8d3809eeca60e7", 0.006233706582288557),
    "zero1/pytorch/none/8b": ("8a62f9829580b695", 0.5531049601867865),
    "zero1/pytorch/optimizer/8b": ("4582c7bbd1fa3a6f", 0.6590175245086602),
    "zero1/pytorch/tiny-cpu": ("2f58492661d6f4b6", 0.013766323729239511),
    "zero1/paper/none/8b": ("084b5a0d8d8ca64e", 0.48330007586772555),
    "zero1/paper/optimizer/8b": ("856193f596012e99", 0.6077647032286615),
    "zero1/paper/tiny-cpu": ("95b8684ce3008bb2", 0.006104195319464692),
    "zero2/pytorch/none/8b": ("27a15e91f692c6e8", 0.4430962742677274),
    "zero2/pytorch/optimizer/8b": ("72a3a23d30718c60", 0.6146246136286646),
    "zero2/pytorch/tiny-cpu": ("008a275124f65727", 0.02677419531946469),
    "zero2/paper/none/8b": ("9e215fa1bbc4df61", 0.44957207586772624),
    "zero2/paper/optimizer/8b": ("436718d0df60e432", 0.5836478576286622),
    "zero2/paper/tiny-cpu": ("023b7d18d7b5affb", 0.007304195319464692),
    "zero3/pytorch/none/8b": ("8dee5fc5edba0429", 0.44437824613683596),
    "zero3/pytorch/optimizer/8b": ("c2bee8009a899ea0", 0.6159065854977732),
    "zero3/pytorch/optimizer+params/8b": ("154f4059f88de1fd", 0.5865833054977733),
    "zero3/pytorch/tiny-cpu": ("da3b976dc55264d1", 0.028610151977242468),
    "zero3/paper/none/8b": ("e723808f2b70fab4", 0.42800137506772673),
    "zero3/paper/optimizer/8b": ("a38248bab0828177", 0.5838456104286627),
    "zero3/paper/optimizer+params/8b": ("6dd8498e2b5ad370", 0.5615606184286627),
    "zero3/paper/tiny-cpu": ("78359c21038abbf5", 0.009728206057242469),
    "zero3/deepspeed/none/8b": ("f91d93adfb815da4", 0.4292833469368353),
    "zero3/deepspeed/optimizer/8b": ("5f959d4f9562327c", 0.5851275822977713),
    "zero3/deepspeed/optimizer+params/8b": ("517de146257b529b", 0.5669581982977712),
    "zero3/deepspeed/tiny-cpu": ("89d9f146b9d9d2fa", 0.01058015197724247),
    "zero2/deepspeed/none/8b": ("f212d824511cf587", 0.44721338786772663),
    "zero2/deepspeed/optimizer/8b": ("2226f751e79553fe", 0.5825982576286626),
    "zero2/deepspeed/tiny-cpu": ("98cd8e6c206498b0", 0.005460595319464693),
    "hsdp/pytorch/none/8b": ("d073dbfed55d969c", 0.5206706344948162),
    "hsdp/pytorch/optimizer/8b": ("e071b949d5a8b4e3", 0.6850112080342369),
    "hsdp/pytorch/optimizer+params/8b": ("e96a79f3b8e1292c", 0.7174202904018194),
    "hsdp/pytorch/tiny-cpu": ("da3b976dc55264d1", 0.028610151977242468),
}


def _id(value: object) -> str:
    return value if isinstance(value, str) else ""


@pytest.mark.parametrize(("name", "case", "profile"), _cases(), ids=_id)
def test_simulation_is_bit_identical_to_the_pinned_results(
    name: str, case: Scenario, profile: HardwareProfile | None
) -> None:
    estimate = estimate_time(case, profile)
    digest, step_time_s = PINS[name]
    assert estimate.step_time_s == step_time_s
    assert _digest(estimate) == digest


def test_every_pin_is_checked() -> None:
    assert sorted(name for name, _, _ in _cases()) == sorted(PINS)
