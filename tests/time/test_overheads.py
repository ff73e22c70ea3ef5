"""The teaching strategies' hook calls and compute beside async collectives: counted where they happen, applied by
the timeline, measured by calibrate, and absent from old profiles."""

from __future__ import annotations

import dataclasses

import pytest
from timecases import scenario

from shardscope.core.engines.python_ops import hook_calls
from shardscope.core.overheads import async_slowdown_s
from shardscope.core.params import param_layout
from shardscope.core.timeline import estimate_time
from shardscope.presets.hardware import LEGACY_PROFILE_SCHEMA, HardwareError, HostOverheads, PythonOps, default_profile
from shardscope.presets.profile_toml import parse_profile, profile_to_toml


def _tiny(strategy: str, engine: str = "paper"):  # type: ignore[no-untyped-def]
    return scenario(
        model="tiny-gpt2", strategy=strategy, engine=engine, world_size=2, gpus_per_node=2, sequence_length=32
    )


def _teaching_ops() -> tuple[PythonOps, ...]:
    """The teaching strategies' declared hooks and ops (runtime imports torch)."""
    pytest.importorskip("torch")
    from shardscope.runtime.teaching.op_counts import TEACHING_PYTHON_OPS

    return TEACHING_PYTHON_OPS


def _counts(case) -> PythonOps:  # type: ignore[no-untyped-def]
    return HostOverheads(python_ops=_teaching_ops()).python_ops_at(case.strategy.stage)


def _serial(**terms: float):  # type: ignore[no-untyped-def]
    host = HostOverheads(**terms, python_ops=_teaching_ops())  # type: ignore[arg-type]
    return dataclasses.replace(default_profile(scenario().cluster.gpu), overlap=False, host_overheads=host)


def test_hook_calls_follow_the_teaching_strategies_registrations() -> None:
    case = _tiny("ddp")
    layout = param_layout(case.model)
    blocks, tensors = layout.num_blocks, layout.tensor_count
    # DDP and ZeRO-2: one post-accumulate-grad hook per parameter tensor, in backward only
    for strategy in ("ddp", "zero2"):
        calls = hook_calls(_tiny(strategy), _counts(_tiny(strategy)))
        assert sum(calls.values()) == tensors
        assert all(kind == "backward" for kind, _ in calls)
        assert calls[("backward", 1)] == len(layout.block)
    # ZeRO-3: plus a pre-hook per unit and a forward hook per block in forward, a gradient hook per block in backward
    zero3 = hook_calls(_tiny("zero3"), _counts(_tiny("zero3")))
    assert sum(n for (kind, _), n in zero3.items() if kind == "forward") == 1 + 2 * blocks
    assert sum(n for (kind, _), n in zero3.items() if kind == "backward") == tensors + blocks
    # ZeRO-1 reduces after backward without hooks; torch's engines hook from C++ (their own terms)
    assert hook_calls(_tiny("zero1"), _counts(_tiny("zero1"))) == {}
    torch_zero3 = _tiny("zero3", engine="pytorch")
    priced = estimate_time(torch_zero3, _serial(hook_overhead_s=1e-3)).step_time_s
    assert priced == estimate_time(torch_zero3, _serial()).step_time_s


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_each_hook_call_adds_the_measured_cost_to_a_serial_step(strategy: str) -> None:
    case = _tiny(strategy)
    plain = estimate_time(case, _serial()).step_time_s
    hooked = estimate_time(case, _serial(hook_overhead_s=1e-4)).step_time_s
    assert hooked == pytest.approx(plain + 1e-4 * sum(hook_calls(case, _counts(case)).values()), rel=1e-12)


def test_strategies_without_python_hooks_pay_nothing() -> None:
    for case in (_tiny("zero1"), _tiny("ddp", engine="pytorch"), _tiny("zero3", engine="pytorch")):
        plain = estimate_time(case, _serial()).step_time_s
        assert estimate_time(case, _serial(hook_overhead_s=1e-4)).step_time_s == plain


def test_async_windows_run_one_after_another_from_their_issue() -> None:
    # compute tasks of 1 s each; a 0.5 s collective issued after task 0 runs over [1, 1.5); a 3 s one issued after
    # task 1 over [2, 5); the wait is at task 3, so task 1 is overlapped 0.5 s, task 2 1 s, task 3 not charged
    extra = async_slowdown_s([1.0, 1.0, 1.0, 1.0], [(0, 0.5), (1, 3.0)], wait_at=3, slowdown=0.5)
    assert extra == [0.0, 0.25, 0.5, 0.0]
    # a queue: the second starts when the first ends, not at its own issue
    assert async_slowdown_s([1.0, 1.0, 1.0], [(0, 1.5), (0, 0.5)], wait_at=2, slowdown=1.0) == [0.0, 1.0, 0.0]


def test_compute_beside_teaching_ddp_all_reduces_is_slowed() -> None:
    case = _tiny("ddp")
    plain = estimate_time(case, _serial())
    slowed = estimate_time(case, _serial(async_compute_slowdown=0.5))
    all_reduces = [span for span in plain.spans if span.category == "all_reduce"]
    # the blocks' all-reduces overlap the backward after them; the root's, issued last, overlaps nothing
    overlapped = sum(span.duration_s for span in all_reduces[:-1])
    later_backward = sum(
        span.duration_s for span in plain.spans if span.category == "backward" and span.start_s > all_reduces[0].start_s
    )
    expected = 0.5 * min(overlapped, later_backward)
    assert 0 < slowed.step_time_s - plain.step_time_s <= expected + 1e-12
    assert slowed.compute_time_s > plain.compute_time_s  # the compute is what slows, not the collective
    assert slowed.comm_time_s == plain.comm_time_s
    # blocking collectives (the teaching ZeRO stages) have nothing in flight beside compute
    zero3 = _tiny("zero3")
    assert (
        estimate_time(zero3, _serial(async_compute_slowdown=0.5)).schedule == estimate_time(zero3, _serial()).schedule
    )


def test_profiles_written_before_the_terms_load_with_zero() -> None:
    old = f"""schema = "{LEGACY_PROFILE_SCHEMA}"
name = "old"
[compute]
kernel_overhead_s = 5e-6
[framework]
sync_wait_s = 1e-3
[network]
intra_node = "nvlink4"
"""
    profile = parse_profile(old)
    assert profile.host_terms.sync_wait_s == 1e-3  # a v1 file's flat [framework] key lands in the extension
    assert profile.host_terms.hook_overhead_s == 0.0
    assert profile.host_terms.async_compute_slowdown == 0.0
    host = HostOverheads(sync_wait_s=1e-3, hook_overhead_s=2e-6, async_compute_slowdown=0.25)
    written = dataclasses.replace(profile, host_overheads=host)
    assert parse_profile(profile_to_toml(written)) == written


def test_a_first_version_profile_that_prices_hooks_is_refused_with_how_to_regenerate() -> None:
    old = (
        f'schema = "{LEGACY_PROFILE_SCHEMA}"\n[framework]\nhook_overhead_s = 2e-6\n[network]\nintra_node = "nvlink4"\n'
    )
    with pytest.raises(HardwareError, match=r"without saying how many they run; regenerate it with `shardscope calib"):
        parse_profile(old)


def test_calibrate_maps_the_measurements_to_the_profile_terms() -> None:
    pytest.importorskip("torch")
    from shardscope.calibrate import framework_overheads
    from shardscope.presets.hardware import OpCost

    costs = {op: OpCost(op=op, call_latency_s=1e-4, bandwidth_bytes_per_s=1e9) for op in ("all_reduce", "all_gather")}
    costs["reduce_scatter"] = OpCost(op="reduce_scatter", call_latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    raw = {
        "forward_op_s": 5e-6,
        "backward_op_s": 6e-6,
        "optimizer_tensor_s": 3e-5,
        "fsdp_optimizer_tensor_s": 1.3e-4,
        "ddp_extra_s": 1e-3,
        "fsdp_extra_s": 8e-3,
        "hook_s": 1.5e-6,
        "async_slowdown": 0.3,
    }
    terms = framework_overheads(raw, costs, 2)
    assert terms["hook_overhead_s"] == 1.5e-6
    assert terms["async_compute_slowdown"] == 0.3
    del raw["hook_s"], raw["async_slowdown"]
    assert framework_overheads(raw, costs, 2)["hook_overhead_s"] == 0.0  # not measured: not modelled


def test_the_hook_benchmark_divides_by_the_hook_calls_it_makes() -> None:
    pytest.importorskip("torch")
    import torch

    from shardscope.calibrate.hooks import hook_calls_per_step, hooked_stack, measure_hook_s
    from shardscope.calibrate.overheads import FRAMEWORK_WIDTH

    calls: list[object] = []
    stack = hooked_stack(lambda *args: calls.append(args))
    stack(torch.randn(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH)).sum().backward()
    assert len(calls) == hook_calls_per_step()
    seconds = measure_hook_s(repeats=3)
    assert 0.0 <= seconds < 1e-3  # a hook is microseconds of work, never a millisecond
