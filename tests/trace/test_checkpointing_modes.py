"""The core's activations and peak under 'op' (torchtitan's selective op policy) and 'every:N' (full checkpointing
of every N-th block) against the trace of the reference model, and a real gloo run of both against the trace.

FSDP2 (zero3) on the two-block presets, where the core follows the top and the bottom block as it does for 'full'.
Not covered, as for 'full': with three blocks or more FSDP2 peaks in a middle block (the next block prefetched, the
shards of the blocks above landed), which the core has no moment for; DDP's rules use the coarse top-block moment,
which over-predicts these modes more than it does 'full'."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardscope.choices import checkpoints_block
from shardscope.core.activations import activation_bytes_per_element
from shardscope.core.memory import estimate_memory
from shardscope.core.result import MemoryBreakdown
from shardscope.runtime import RunConfig, RunResult
from shardscope.specs import Scenario
from shardscope.validate.cases import ValidationCase
from shared_launch import register
from shared_traces import SharedTraces
from shared_traces import register as register_traces

pytest.importorskip("torch")
from shardscope.trace.request import TraceRequest

CASES = [  # by default tiny-llama under each mode in fp32; the other model, attention and precision under -m long
    ("tiny-llama", "fp32", "sdpa", "op"),
    ("tiny-llama", "fp32", "sdpa", "every:2"),
    pytest.param("tiny-gpt2", "fp32", "sdpa", "op", marks=pytest.mark.long),
    pytest.param("tiny-gpt2", "fp32", "sdpa", "every:2", marks=pytest.mark.long),
    pytest.param("tiny-llama", "fp32", "eager", "op", marks=pytest.mark.long),
    pytest.param("tiny-llama", "fp32", "eager", "every:2", marks=pytest.mark.long),
    pytest.param("tiny-llama", "bf16-mixed", "sdpa", "op", marks=pytest.mark.long),
    ("tiny-llama", "fp32", "sdpa", "full"),  # the convention the new modes share
]


def _scenario(model: str, precision: str, attention: str, checkpointing: str) -> Scenario:
    case = ValidationCase(
        model=model, strategy="zero3", engine="pytorch", world_size=2, precision=precision, checkpointing=checkpointing
    )
    scenario = case.scenario()
    return replace(scenario, training=replace(scenario.training, attention=attention))


def _request(scenario: Scenario) -> TraceRequest:
    return TraceRequest(scenario=scenario, time_limit_s=120)


# what the module replays by default, replayed side by side (shared_traces.py): the cases without marks (-m long's
# are pytest.param's with one)
register_traces(__name__, [_request(_scenario(*case)) for case in CASES if not getattr(case, "marks", ())])


def _traced(shared_trace: SharedTraces, scenario: Scenario) -> MemoryBreakdown:
    """Rank 0's traced bytes; a trace is deterministic, so the core's test and the run's share one."""
    return shared_trace(_request(scenario)).per_rank


def _held_by_checkpoints(scenario: Scenario) -> int:
    """The shared tensors that no block saves but a checkpoint holds as its input (the causal mask, and RoPE's cos
    and sin when no block saves them): the trace sees them live, and the core, counting what autograd saves (as
    tests/validate/test_activation_accounting.py checks to the byte), leaves them out, under 'full' as before."""
    model, training = scenario.model, scenario.training
    seq = training.sequence_length
    saved_by_a_block = training.checkpointing != "op" and not all(
        checkpoints_block(training.checkpointing, index) for index in range(model.num_layers)
    )
    mask = 0 if saved_by_a_block and training.attention == "eager" else seq * seq
    rope = 2 * seq * model.head_dim * activation_bytes_per_element(training) if model.family != "gpt2" else 0
    return mask + (0 if saved_by_a_block else rope)


@pytest.mark.parametrize(("model", "precision", "attention", "checkpointing"), CASES)
def test_core_equals_the_trace(
    shared_trace: SharedTraces, model: str, precision: str, attention: str, checkpointing: str
) -> None:
    scenario = _scenario(model, precision, attention, checkpointing)
    core = estimate_memory(scenario, rank=0).per_rank
    trace = _traced(shared_trace, scenario)
    held = _held_by_checkpoints(scenario)
    assert core.activations_bytes == trace.activations_bytes - held
    assert core.peak_bytes == trace.peak_bytes - held


def test_modes_order_as_expected() -> None:
    """op keeps more than full and less than none; every:1 is full; every:2 keeps half the blocks whole."""
    saved = {
        mode: estimate_memory(_scenario("tiny-llama", "fp32", "sdpa", mode), rank=0).per_rank.activations_bytes
        for mode in ("none", "full", "op", "every:1", "every:2")
    }
    assert saved["full"] == saved["every:1"] < saved["op"] < saved["none"]
    assert saved["full"] < saved["every:2"] < saved["none"]


def _run_config(checkpointing: str) -> RunConfig:
    """tiny-llama zero3 on 2 real gloo ranks, fp32, micro-batch 2, seq 32, a hard deadline of 240 s."""
    return RunConfig.from_options(
        model="tiny-llama",
        strategy="zero3",
        engine="pytorch",
        world_size=2,
        precision="fp32",
        checkpointing=checkpointing,
        micro_batch_size=2,
        sequence_length=32,
        timeout_s=240,
    )


register(__name__, {"op": _run_config("op")})  # the case `make test` runs joins the session's 2-rank launch


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("checkpointing", ["op", pytest.param("every:2", marks=pytest.mark.long)])
def test_gloo_run_matches_the_trace(
    shared_trace: SharedTraces, shared_runs: dict[str, dict[str, RunResult]], checkpointing: str
) -> None:
    """tiny-llama zero3 on 2 real gloo ranks (rank 0), fp32, micro-batch 2, seq 32: the run trains under the mode and
    its activations and peak are the trace's to the byte (measured with torch 2.13: op 360,708 B and 1,925,084 B,
    every:2 466,692 B and 2,134,492 B; as tests/trace/test_trace.py finds for zero3 without checkpointing)."""
    from shardscope.runtime import run_training

    scenario = _scenario("tiny-llama", "fp32", "sdpa", checkpointing)
    trace = _traced(shared_trace, scenario)
    shared = shared_runs[__name__].get(checkpointing)
    real = (shared or run_training(_run_config(checkpointing))).per_rank[0]
    assert (trace.activations_bytes, trace.peak_bytes) == (real.activations_bytes, real.peak_bytes), (trace, real)
