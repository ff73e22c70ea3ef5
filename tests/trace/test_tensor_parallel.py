"""`shardscope trace --tp`: torch's DTensor tensor parallelism (torchtitan's llama plan) then fully_shard, replayed on
fake tensors, against the core's pytorch-engine prediction of the same scenario, and what the trace refuses."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from shardscope.cli import main
from shardscope.core.comm import collective_ledger
from shardscope.core.memory import estimate_memory
from shardscope.core.result import CollectiveRow
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
from shardscope.trace.request import TraceRequest
from shared_traces import SharedTraces, register

torch = pytest.importorskip("torch")
from shardscope.trace.result import TraceResult  # noqa: E402


def _scenario(sequence_parallel: bool = True, checkpointing: str = "none", precision: str = "fp32") -> Scenario:
    """tiny-llama on 4 ranks: fsdp over 2 data-parallel ranks x tp 2, 2 sequences of 32 tokens."""
    return Scenario(
        model=model_preset("tiny-llama"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=4, backend="gloo"),
        training=TrainingSpec(precision=precision, micro_batch_size=2, sequence_length=32, checkpointing=checkpointing),
        strategy=Strategy(name="fsdp", engine="pytorch", tp=2, sequence_parallel=sequence_parallel),
    )


def _request(scenario: Scenario) -> TraceRequest:
    return TraceRequest(scenario=scenario, time_limit_s=240, traced_blocks=0)


# what the module replays by default, replayed side by side (shared_traces.py): with sequence parallelism (the
# module's fixture), loss parallelism without it in bf16-mixed, and full checkpointing without it
register(
    __name__,
    [
        _request(_scenario()),
        _request(_scenario(sequence_parallel=False, precision="bf16-mixed")),
        _request(_scenario(sequence_parallel=False, checkpointing="full")),
    ],
)


def _trace(shared_trace: SharedTraces, scenario: Scenario) -> TraceResult:
    return shared_trace(_request(scenario))


def _calls(rows: tuple[CollectiveRow, ...], group: str | None = None) -> Counter[tuple[str, str, str, int, int]]:
    return Counter(
        {
            (row.phase, row.op, row.group, row.group_size, row.payload_bytes): row.count
            for row in rows
            if group is None or row.group == group
        }
    )


@pytest.fixture(scope="module")
def sequence_parallel(shared_trace: SharedTraces) -> tuple[Scenario, TraceResult]:
    scenario = _scenario()
    return scenario, _trace(shared_trace, scenario)


def test_model_states_per_rank_equal_the_core_exactly(sequence_parallel: tuple[Scenario, TraceResult]) -> None:
    scenario, traced = sequence_parallel
    predicted = estimate_memory(scenario).per_rank
    assert traced.per_rank.parameters_bytes == predicted.parameters_bytes
    assert traced.per_rank.gradients_bytes == predicted.gradients_bytes
    assert traced.per_rank.optimizer_state_bytes == predicted.optimizer_state_bytes
    # one tp rank's shard of half of each split weight, over 2 fsdp ranks: 125,568 bytes (core.params rank_layout)
    assert traced.per_rank.parameters_bytes == 125_568


def test_activations_and_peak_within_one_percent_of_the_core(sequence_parallel: tuple[Scenario, TraceResult]) -> None:
    scenario, traced = sequence_parallel
    predicted = estimate_memory(scenario).per_rank
    assert traced.per_rank.activations_bytes == pytest.approx(predicted.activations_bytes, rel=0.01)
    allocated_peak = predicted.peak_bytes - predicted.overhead_bytes  # the trace has no framework context
    assert traced.per_rank.peak_bytes == pytest.approx(allocated_peak, rel=0.01)


def test_every_collective_named_by_its_mesh_axis_equals_the_core(
    sequence_parallel: tuple[Scenario, TraceResult],
) -> None:
    scenario, traced = sequence_parallel
    assert _calls(traced.ledger) == _calls(collective_ledger(scenario))
    tp = _calls(traced.ledger, "tp")
    activation = 2 * 32 * 64 * 4  # b x s x h fp32: the sequence-parallel all-gathers and reduce-scatters
    # per block 2 in and 2 out, the embedding's scatter and the head's gather: 5 each way, in forward and backward
    assert tp[("forward", "all_gather", "tp", 2, activation)] == 5
    assert tp[("backward", "reduce_scatter", "tp", 2, activation)] == 5
    # loss parallel's three all-reduces of b x s fp32 values, in forward (the loss is part of it)
    assert tp[("forward", "all_reduce", "tp", 2, 2 * 32 * 4)] == 3


def test_flops_are_one_tensor_parallel_rank_s(sequence_parallel: tuple[Scenario, TraceResult]) -> None:
    traced = sequence_parallel[1]
    spec = model_preset("tiny-llama")
    tokens, tp = 2 * 32, 2
    block = (
        2 * spec.hidden_size * spec.num_heads * spec.head_dim + 2 * spec.hidden_size * spec.num_kv_heads * spec.head_dim
    )
    block += 3 * spec.hidden_size * spec.ffn_hidden_size
    matmul_weights = spec.num_layers * block + spec.vocab_size * spec.hidden_size
    attention = spec.num_layers * 4 * 2 * (spec.num_heads // tp) * 32 * 32 * spec.head_dim  # QK^T and PV
    assert traced.flops.forward_flops == 2 * tokens * matmul_weights // tp + attention


def test_loss_parallel_counts_no_global_size_tensors(shared_trace: SharedTraces) -> None:
    # Under fake tensors DTensor re-derives the global shape of loss parallel's log-softmax and NLL outputs at every
    # call, on fake tensors of the whole vocabulary (b x s x 256 fp32, 65,536 B each), where a real rank reads its
    # cache; counted, they made the loss the peak of this case at 881,876 B. A real gloo run of it (`shardscope
    # validate --models tiny-llama --strategies fsdp --engines pytorch --tp 2 --cp 1 --no-sequence-parallel
    # --precisions bf16-mixed`) peaks in the backward of layers.1 at 868,060 B: 1,024 B more than the trace, which
    # are rank 0's batch, there views into the inputs and targets of both data-parallel ranks (4 x 32 int64 tokens,
    # 1,024 B each) where the trace makes this rank's own (512 B each); its activations differ by the same 1,024 B.
    traced = _trace(shared_trace, _scenario(sequence_parallel=False, precision="bf16-mixed"))
    assert traced.peak_moment == "backward: layers.1"
    assert traced.per_rank.peak_bytes == 868_060 - 1_024
    assert traced.per_rank.activations_bytes == 358_660 - 1_024


@pytest.mark.parametrize(
    ("sequence_parallel", "checkpointing"),
    # by default each value of each: without sequence parallelism under full, with it under none (the module's
    # trace above); 'op' under tp is long (test_checkpointing_modes.py traces 'op' by default)
    [
        pytest.param(False, "none", marks=pytest.mark.long),
        pytest.param(True, "full", marks=pytest.mark.long),
        (False, "full"),
        pytest.param(True, "op", marks=pytest.mark.long),
    ],
)
def test_ledger_equals_the_core_with_and_without_sequence_parallelism(
    shared_trace: SharedTraces, sequence_parallel: bool, checkpointing: str
) -> None:
    # without it each region is entered once (Megatron's f); a fully checkpointed block's re-forward stops before
    # its MLP's leaving reduce-scatter or all-reduce (torch.utils.checkpoint's early stop)
    scenario = _scenario(sequence_parallel, checkpointing)
    traced = _trace(shared_trace, scenario)
    assert _calls(traced.ledger) == _calls(collective_ledger(scenario))
    assert traced.per_rank.parameters_bytes == estimate_memory(scenario).per_rank.parameters_bytes


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "tiny-llama", "--gpus", "4", "--cp", "2", "--strategy", "ddp"], "over fully_shard only"),
        (["--model", "tiny-gpt2", "--gpus", "4", "--tp", "2"], "fused c_attn"),
        (["--model", "tiny-llama", "--gpus", "4", "--tp", "2", "--strategy", "ddp"], "DistributedDataParallel"),
        # the branch and the message of ddp's case above (zero stage 0 or 1 under tp), so under -m long
        pytest.param(
            ["--model", "tiny-llama", "--gpus", "4", "--tp", "2", "--strategy", "zero1"],
            "ZeroRedundancyOptimizer",
            marks=pytest.mark.long,
        ),
    ],
)
def test_what_torch_cannot_replay_is_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], refused_in_process: Callable[[TraceRequest], None]
) -> None:
    # the trace worker refuses these before it replays anything: its body runs in this process (tests/trace/conftest.py)
    code = main(["trace", *argv, "--seq-len", "32", "--micro-batch", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert says in err
    # only what the trace's command line can do: it refuses --engine paper
    assert "`shardscope estimate`" in err
    assert "--engine paper" not in err
