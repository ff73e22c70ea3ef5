"""The step simulation: overlap, exposed communication, throughput, the Chrome trace."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from timecases import scenario

from shardscope.core.chrome_trace import chrome_trace
from shardscope.core.compute import model_flops_per_step
from shardscope.core.timeline import estimate_time
from shardscope.presets.hardware import HostOverheads, default_profile, interconnect_preset
from shardscope.specs import Scenario


def _profile(overlap: bool = True, inter: str = "ib-ndr"):  # type: ignore[no-untyped-def]
    base = default_profile(scenario().cluster.gpu)
    return dataclasses.replace(base, overlap=overlap, inter_node=interconnect_preset(inter))


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp", "hsdp"])
def test_overlap_lies_between_the_longest_stream_and_the_serial_sum(strategy: str) -> None:
    case = scenario(strategy=strategy, shard_group=8 if strategy == "hsdp" else 0)
    serial = estimate_time(case, _profile(overlap=False))
    overlapped = estimate_time(case, _profile(overlap=True))
    assert serial.step_time_s == pytest.approx(serial.compute_time_s + serial.comm_time_s)
    assert serial.exposed_comm_s == pytest.approx(serial.comm_time_s)
    assert overlapped.step_time_s <= serial.step_time_s + 1e-12
    assert overlapped.step_time_s >= max(overlapped.compute_time_s, overlapped.comm_time_s) - 1e-12


def test_fsdp_prefetch_hides_most_gathers_on_a_fast_network() -> None:
    estimate = estimate_time(scenario(strategy="fsdp", sequence_length=4096), _profile())
    assert estimate.exposed_comm_s < 0.2 * estimate.comm_time_s


def test_a_slow_network_makes_the_step_network_bound() -> None:
    fast = estimate_time(scenario(strategy="fsdp"), _profile(inter="ib-ndr"))
    slow = estimate_time(scenario(strategy="fsdp"), _profile(inter="ethernet-10g"))
    assert slow.step_time_s > 2 * fast.step_time_s
    assert slow.exposed_comm_s > 0.5 * slow.comm_time_s
    assert slow.mfu < fast.mfu


def test_ddp_bucket_all_reduces_start_during_backward() -> None:
    estimate = estimate_time(scenario(strategy="ddp"), _profile())
    backward_end = max(s.end_s for s in estimate.spans if s.category == "backward")
    first_bucket = min(s.start_s for s in estimate.spans if s.category == "all_reduce")
    assert first_bucket < backward_end


def test_throughput_and_mfu_follow_from_the_step_time() -> None:
    case = scenario(strategy="zero2", grad_accum=2)
    estimate = estimate_time(case)
    tokens = 16 * 2 * 2048
    assert estimate.tokens_per_s == pytest.approx(tokens / estimate.step_time_s)
    assert estimate.mfu == pytest.approx(model_flops_per_step(case) / estimate.step_time_s / 989.4e12)
    assert 0 < estimate.mfu < 0.78  # the per-op model: below Hopper's measured matmul ceiling
    given = dataclasses.replace(default_profile(case.cluster.gpu), efficiency=0.5, per_op_kernels=False)
    assert 0 < estimate_time(case, given).mfu < 0.5  # a given efficiency caps it
    data = estimate.to_json()
    communication = data["communication"]
    assert isinstance(communication, dict)
    assert set(communication) == {"ledger", "wire_bytes_per_rank", "time_s", "exposed_time_s"}
    assert {"step_time_s", "tokens_per_s", "mfu"} <= set(data)


def test_recomputation_lengthens_backward() -> None:
    plain = estimate_time(scenario(strategy="fsdp"))
    full = estimate_time(scenario(strategy="fsdp", checkpointing="full"))
    assert full.compute_time_s == pytest.approx(plain.compute_time_s * 4 / 3, rel=0.05)
    assert any(span.category == "recompute" for span in full.spans)


def test_chrome_trace_is_valid_trace_event_json() -> None:
    trace = chrome_trace(estimate_time(scenario(strategy="fsdp", model="tiny-llama")))
    text = json.dumps(trace)
    events = json.loads(text)["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in complete} == {0, 1}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert any(e["ph"] == "M" and e["args"]["name"] == "comm stream" for e in events)


def test_chrome_trace_carries_memory_by_category_near_the_predicted_peak() -> None:
    from shardscope.core.memory import estimate_memory

    case = scenario(strategy="zero3", model="tiny-llama")
    estimate, memory = estimate_time(case), estimate_memory(case)
    assert not [event for event in chrome_trace(estimate)["traceEvents"] if event["name"].startswith("memory")]
    trace = chrome_trace(estimate, memory)
    counters = [event for event in trace["traceEvents"] if event["name"] == "memory by category (bytes)"]
    times = [event["ts"] for event in counters]
    assert times == sorted(times) and times[0] == 0 and times[-1] == pytest.approx(estimate.step_time_s * 1e6)
    assert set(counters[0]["args"]) >= {"parameters", "optimizer_state", "gradients", "activations", "temporary"}
    peak = memory.per_rank.peak_bytes
    assert trace["otherData"]["peak_bytes"] == peak  # type: ignore[index]
    # the curve is an approximation laid along the compute spans (core.memory_curve): close to the peak, not equal
    assert 0.7 * peak <= max(sum(event["args"].values()) for event in counters) <= 1.3 * peak
    held = counters[0]["args"]["parameters"] + counters[0]["args"]["optimizer_state"]
    assert held == memory.per_rank.parameters_bytes + memory.per_rank.optimizer_state_bytes


def test_core_time_model_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import shardscope.core.timeline, shardscope.core.chrome_trace, shardscope.cli.timeline\n"
        "import shardscope.presets.hardware\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_framework_overheads_add_per_unit_per_step_and_per_tensor() -> None:
    from shardscope.core.engines import rules_for
    from shardscope.core.params import param_layout

    def optimizer_tensors(case: Scenario) -> int:
        return rules_for(case).optimizer_tensors(case)

    case = scenario(model="tiny-llama", strategy="zero3", world_size=2, gpus_per_node=2, sequence_length=32)
    base = dataclasses.replace(_profile(overlap=False), fsdp_unit_overhead_s=0.0, ddp_step_overhead_s=0.0)
    plain = estimate_time(case, base).step_time_s
    units = case.model.num_layers + 1
    costly = dataclasses.replace(
        base, fsdp_unit_overhead_s=1e-3, host_overheads=HostOverheads(fsdp_optimizer_tensor_overhead_s=1e-4)
    )
    tensors = len(param_layout(case.model).tensors())
    assert optimizer_tensors(case) == tensors
    assert estimate_time(case, costly).step_time_s == pytest.approx(plain + units * 1e-3 + tensors * 1e-4)
    teaching = dataclasses.replace(case, strategy=dataclasses.replace(case.strategy, engine="paper"))
    assert estimate_time(teaching, costly).step_time_s == pytest.approx(estimate_time(teaching, base).step_time_s)
    assert optimizer_tensors(teaching) == units  # one flat shard per unit
    ddp = scenario(model="tiny-llama", strategy="ddp", world_size=2, gpus_per_node=2, sequence_length=32)
    with_ddp = dataclasses.replace(base, ddp_step_overhead_s=2e-3)
    assert estimate_time(ddp, with_ddp).step_time_s == pytest.approx(estimate_time(ddp, base).step_time_s + 2e-3)


def test_sync_wait_is_paid_once_per_synchronisation_point() -> None:
    from shardscope.core.comm import comm_events

    case = scenario(model="tiny-llama", strategy="zero1", engine="paper", world_size=2, gpus_per_node=2)
    base = _profile(overlap=False)
    waiting = dataclasses.replace(base, host_overheads=HostOverheads(sync_wait_s=1e-3))
    places = {(e.micro_batch, e.stage, e.trigger) for e in comm_events(case)}
    assert len(places) == 2  # every unit reduce-scattered after backward, every unit gathered after the step
    assert estimate_time(case, waiting).step_time_s == pytest.approx(estimate_time(case, base).step_time_s + 2e-3)


def test_the_optimizer_step_overhead_is_paid_once_per_step_whatever_the_tensor_count() -> None:
    base = _profile(overlap=False)
    cold = dataclasses.replace(base, host_overheads=HostOverheads(optimizer_step_overhead_s=3e-4))
    for engine, accum in (("pytorch", 1), ("paper", 1), ("pytorch", 4)):  # 28 tensors, 3 flat units; micro-batches
        case = scenario(model="tiny-gpt2", strategy="ddp", engine=engine, world_size=2, gpus_per_node=2)
        case = dataclasses.replace(case, training=dataclasses.replace(case.training, grad_accum_steps=accum))
        plain, slow = estimate_time(case, base), estimate_time(case, cold)
        assert slow.step_time_s == pytest.approx(plain.step_time_s + 3e-4)
        optimizer = [span for span in slow.spans if span.category == "optimizer"]
        assert len(optimizer) == 1


def test_a_family_with_its_own_per_op_costs_is_priced_with_them() -> None:
    from shardscope.core.compute import stage_flops
    from shardscope.presets.hardware import FamilyOpCost

    base = dataclasses.replace(
        _profile(overlap=False), kernel_overhead_s=2e-5, backward_op_overhead_s=1e-5, optimizer_tensor_overhead_s=1e-6
    )
    cheaper = FamilyOpCost(family="llama", kernel_overhead_s=1e-5, backward_op_overhead_s=5e-6)
    priced = dataclasses.replace(base, host_overheads=HostOverheads(family_op_costs=(cheaper,)))
    llama = scenario(model="tiny-llama", strategy="ddp", world_size=2, gpus_per_node=2, sequence_length=32)
    stages = stage_flops(llama.model, llama.training)
    saved = sum(1e-5 * s.forward_kernels + 5e-6 * s.backward_kernels for s in stages)
    assert estimate_time(llama, priced).step_time_s == pytest.approx(estimate_time(llama, base).step_time_s - saved)
    gpt2 = scenario(model="tiny-gpt2", strategy="ddp", world_size=2, gpus_per_node=2, sequence_length=32)
    assert estimate_time(gpt2, priced).step_time_s == estimate_time(gpt2, base).step_time_s


def test_async_all_reduces_wait_for_the_later_rank_once_per_step() -> None:
    from shardscope.core.comm import comm_events

    case = scenario(model="tiny-llama", strategy="ddp", engine="paper", world_size=2, gpus_per_node=2)
    base = _profile(overlap=False)
    waiting = dataclasses.replace(base, host_overheads=HostOverheads(sync_wait_s=1e-3))
    places = {(e.micro_batch, e.stage, e.trigger) for e in comm_events(case) if e.row.op == "all_reduce"}
    assert len(places) == 3  # one async all-reduce per unit, each issued after its unit's backward
    assert estimate_time(case, waiting).step_time_s == pytest.approx(estimate_time(case, base).step_time_s + 1e-3)


def test_zero_redundancy_optimizer_pays_its_overhead_on_every_tensor() -> None:
    from shardscope.core.params import param_layout

    case = scenario(model="tiny-gpt2", strategy="zero1", world_size=2, gpus_per_node=2, sequence_length=32)
    base = _profile(overlap=False)
    costly = dataclasses.replace(base, host_overheads=HostOverheads(zero_tensor_overhead_s=1e-4))
    tensors = len(param_layout(case.model).tensors())
    assert estimate_time(case, costly).step_time_s == pytest.approx(
        estimate_time(case, base).step_time_s + tensors * 1e-4
    )
