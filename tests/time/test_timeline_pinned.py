"""The simulation pinned to values computed before the planner's speed work (issue 5, part 1): building the comm
events once per call, pricing each distinct call once and keeping the schedule as tuples must change no result.

Each pin is (a digest of everything a TimeEstimate reports: step, communication, exposed and compute time, wire bytes,
FLOPs, peak, the ledger and every span's name, stream, category, start, duration and payload; the step time), computed
with the code of commit 26b1dfd. A change that moves any of them by one ulp fails here; a deliberate change of the
model updates the pins and says why in its commit. Since then: torch DDP's per-step cost moved from the first forward
stage to the first backward stage (the ddp and zero1 pytorch spans; no step time changed).;
torch's optimizers priced at one memory pass per op, 20 fp32 accesses per element for AdamW, where 7 (a fused kernel)
was assumed (every optimizer span but DeepSpeed's, whose FusedAdam is fused, and the step times after it).;
async collectives (the DDP gradient all-reduces) wait for the later rank once per step, not once each (ddp/paper).;
the datasheet profile of a GPU preset prices each op at its kernel ceiling (core.kernels): the 8b pins above keep
the global-efficiency model (per_op_kernels off, as --efficiency gives) and still hold bit for bit; the `8b-kernels`
pins are the per-op model's, computed with presets/gpu_kernels.json as first committed (Hopper ceilings measured by
benchmarks/gpu_kernels.py on an H200; CPU offload's optimizer step at the DGX H100 host's memory bandwidth).
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from timecases import scenario

from shardscope.core.result import CollectiveRow
from shardscope.core.timeline import TimeEstimate, estimate_time
from shardscope.presets.hardware import HardwareProfile, HostOverheads, OpCost, default_profile
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
        host_overheads=HostOverheads(
            fsdp_optimizer_tensor_overhead_s=1.3e-4, sync_wait_s=6e-4, zero_tensor_overhead_s=2e-4
        ),
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
            efficiency = dataclasses.replace(default_profile(case.cluster.gpu), per_op_kernels=False)
            cases.append((f"{strategy}/{engine}/{offload}/8b", case, efficiency))
            cases.append((f"{strategy}/{engine}/{offload}/8b-kernels", case, None))
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


class _PinnedRow:
    """A ledger row printed as CollectiveRow printed itself when the pins were taken (before rows had a group): the
    pinned cases have tp = cp = 1, so every row is on the data-parallel group and the digests still hold."""

    def __init__(self, row: CollectiveRow) -> None:
        assert row.group in ("dp", "host")
        self.row = row

    def __repr__(self) -> str:
        row = self.row
        return (
            f"CollectiveRow(phase={row.phase!r}, op={row.op!r}, group_size={row.group_size!r}, "
            f"payload_bytes={row.payload_bytes!r}, count={row.count!r})"
        )


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
        repr(tuple(_PinnedRow(row) for row in estimate.ledger)),
    )
    return hashlib.sha256((repr(head) + spans).encode()).hexdigest()[:16]


PINS = {
    "ddp/pytorch/none/8b": ("7c3863ebc8f1ad47", 0.6412852679026083),
    "ddp/pytorch/optimizer/8b": ("95c2680d28835144", 1.7344173178244837),
    "ddp/pytorch/tiny-cpu": ("21cc1f54c07b18b0", 0.0063956507303482586),
    "ddp/paper/none/8b": ("8353e76c45825a7f", 0.6033997960635478),
    "ddp/paper/optimizer/8b": ("eab6c2b21da9daf7", 1.229767151424484),
    "ddp/paper/tiny-cpu": ("ebd2d35b361b9ca4", 0.005035650730348259),
    "zero1/pytorch/none/8b": ("d91d4f457966d069", 0.5608955121438011),
    "zero1/pytorch/optimizer/8b": ("4ed154581a453414", 0.6668080764656752),
    "zero1/pytorch/tiny-cpu": ("929701f9a02c8600", 0.013767295803269361),
    "zero1/paper/none/8b": ("fa63b84a4ad21d12", 0.4910906278247405),
    "zero1/paper/optimizer/8b": ("7f070be778b735cb", 0.6155552551856764),
    "zero1/paper/tiny-cpu": ("b0ad18f60831323e", 0.006105167393494542),
    "zero2/pytorch/none/8b": ("e415caa758ebc543", 0.45088682622474235),
    "zero2/pytorch/optimizer/8b": ("affa86c05e70d9a0", 0.6224151655856796),
    "zero2/pytorch/tiny-cpu": ("1e66a279d0f5978e", 0.026775167393494545),
    "zero2/paper/none/8b": ("40c0338225a87359", 0.4573626278247412),
    "zero2/paper/optimizer/8b": ("9585ff64dd289e4c", 0.5914384095856772),
    "zero2/paper/tiny-cpu": ("564df3b7a3006e7e", 0.007305167393494542),
    "zero3/pytorch/none/8b": ("b86af8e654add4e1", 0.4521687980938509),
    "zero3/pytorch/optimizer/8b": ("7db4dcf1ed9aad64", 0.6236971374547882),
    "zero3/pytorch/optimizer+params/8b": ("65d5fd2a73b96305", 0.5943738574547882),
    "zero3/pytorch/tiny-cpu": ("67ef6005758c4160", 0.02861112405127232),
    "zero3/paper/none/8b": ("e053f0e21183ffc0", 0.4357919270247417),
    "zero3/paper/optimizer/8b": ("773fbc433df51fef", 0.5916361623856776),
    "zero3/paper/optimizer+params/8b": ("9a8998096b58ca60", 0.5693511703856776),
    "zero3/paper/tiny-cpu": ("66bb1034bbe44e01", 0.009729178131272321),
    "zero3/deepspeed/none/8b": ("f91d93adfb815da4", 0.4292833469368353),
    "zero3/deepspeed/optimizer/8b": ("5f959d4f9562327c", 0.5851275822977713),
    "zero3/deepspeed/optimizer+params/8b": ("517de146257b529b", 0.5669581982977712),
    "zero3/deepspeed/tiny-cpu": ("89d9f146b9d9d2fa", 0.01058015197724247),
    "zero2/deepspeed/none/8b": ("f212d824511cf587", 0.44721338786772663),
    "zero2/deepspeed/optimizer/8b": ("2226f751e79553fe", 0.5825982576286626),
    "zero2/deepspeed/tiny-cpu": ("98cd8e6c206498b0", 0.005460595319464693),
    "hsdp/pytorch/none/8b": ("bfdffa95524ac404", 0.5362517384088461),
    "hsdp/pytorch/optimizer/8b": ("9d9d862b6251b03f", 0.7005923119482668),
    "hsdp/pytorch/optimizer+params/8b": ("396c63a22711076d", 0.7330013943158493),
    "hsdp/pytorch/tiny-cpu": ("67ef6005758c4160", 0.02861112405127232),
    "ddp/pytorch/none/8b-kernels": ("3e05c766771090fb", 0.6074251102178551),
    "ddp/pytorch/optimizer/8b-kernels": ("0fef4b82960ffe1b", 4.368768029568854),
    "ddp/paper/none/8b-kernels": ("40dceb88f52f04e0", 0.5435134544917799),
    "ddp/paper/optimizer/8b-kernels": ("b5547073659be618", 3.850979948406588),
    "zero1/pytorch/none/8b-kernels": ("17a58947b907ab1a", 0.5022872109358468),
    "zero1/pytorch/optimizer/8b-kernels": ("e3e5323a332ef77e", 0.7231074317852388),
    "zero1/paper/none/8b-kernels": ("ad998da6c924a90b", 0.40647893282842296),
    "zero1/paper/optimizer/8b-kernels": ("7afcf006446975ae", 0.6718546105052402),
    "zero2/pytorch/none/8b-kernels": ("3807a0ab3b33d9b5", 0.3662067609324642),
    "zero2/pytorch/optimizer/8b-kernels": ("7b399a21c803f5d9", 0.6786461506092809),
    "zero2/paper/none/8b-kernels": ("f5a9b10b486d88f6", 0.3727281427297702),
    "zero2/paper/optimizer/8b-kernels": ("5d3c447d841e2485", 0.6477377649052408),
    "zero3/pytorch/none/8b-kernels": ("3b38f177924e42c7", 0.37531803939486236),
    "zero3/pytorch/optimizer/8b-kernels": ("34524ff58fb60f62", 0.6819255105852859),
    "zero3/pytorch/optimizer+params/8b-kernels": ("b84b34e406035294", 0.6526022305852859),
    "zero3/paper/none/8b-kernels": ("9cf537ad269bd917", 0.35111186173246406),
    "zero3/paper/optimizer/8b-kernels": ("b96bcc0a86584208", 0.6478671474092812),
    "zero3/paper/optimizer+params/8b-kernels": ("ce1b20d5f6590ade", 0.6261591842557102),
    "zero3/deepspeed/none/8b-kernels": ("e7449ec7b0308491", 0.345528250198782),
    "zero3/deepspeed/optimizer/8b-kernels": ("2a09fac021d1e96c", 0.6511465073852862),
    "zero3/deepspeed/optimizer+params/8b-kernels": ("9bc76a8c6104ee57", 0.6335541522317152),
    "zero2/deepspeed/none/8b-kernels": ("060a3b62575add96", 0.36152927331873697),
    "zero2/deepspeed/optimizer/8b-kernels": ("4bae9f49c4b30278", 0.6466881649052412),
    "hsdp/pytorch/none/8b-kernels": ("0727276b8844aa96", 0.5051816755596539),
    "hsdp/pytorch/optimizer/8b-kernels": ("6503e583e169c313", 0.9423190168623157),
    "hsdp/pytorch/optimizer+params/8b-kernels": ("9e3b58e2c3c3d510", 1.044061685708745),
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
