"""`trace --implementation hf`: transformers' own modeling code, built offline from a config.json on the meta device
and replayed on fake tensors, holds the same parameters as the core counts and shardscope's reference modules, and
its own activations; a model type outside the core's families is traced too."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.core.params import param_layout
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
from shardscope.trace.request import TraceRequest
from shared_traces import SharedTraces, register

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from shardscope.trace.runner import run_in_subprocess  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "data" / "hf-configs"
BATCH, SEQUENCE = 2, 32


def _request(implementation: str, attention: str = "sdpa", attn_implementation: str = "") -> TraceRequest:
    scenario = Scenario(
        model=model_preset("tiny-llama"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=3),
        training=TrainingSpec(precision="fp32", micro_batch_size=BATCH, sequence_length=SEQUENCE, attention=attention),
        strategy=Strategy(name="zero3"),
    )
    return TraceRequest(
        scenario=scenario,
        implementation=implementation,
        attn_implementation=attn_implementation,
        time_limit_s=300,
    )


register(__name__, [_request("hf"), _request("reference")])  # replayed side by side (shared_traces.py)


def test_hf_llama_holds_the_core_parameter_layout_and_its_own_activations(shared_trace: SharedTraces) -> None:
    """transformers' LlamaForCausalLM from tiny-llama's config: FSDP2 shards (dim 0 padded to 3 ranks) of exactly the
    tensors the core counts, and more activations than the reference module (its RMSNorm keeps fp32 copies)."""
    hf = shared_trace(_request("hf"))
    tensors = param_layout(model_preset("tiny-llama")).tensors()
    shards = sum(math.ceil(t.shape[0] / 3) * math.prod(t.shape[1:]) * 4 for t in tensors)
    assert hf.per_rank.parameters_bytes == shards == hf.per_rank.gradients_bytes
    assert hf.per_rank.optimizer_state_bytes == 2 * shards + 4 * len(tensors)  # exp_avg, exp_avg_sq, step
    assert "built by transformers from llama's config.json, attn_implementation=sdpa" in hf.notes
    assert hf.peak_moment.startswith("backward: model.layers.")
    reference = shared_trace(_request("reference"))  # test_trace.py's zero3 padding test reads the same replay
    assert reference.per_rank.parameters_bytes == shards
    assert hf.per_rank.activations_bytes > reference.per_rank.activations_bytes


@pytest.mark.long
def test_eager_attention_keeps_each_layers_probabilities() -> None:
    """eager saves softmax(QK^T) per layer for backward, b x heads x s x s fp32; sdpa's fused kernel does not."""
    sdpa = run_in_subprocess(_request("hf"))
    eager = run_in_subprocess(_request("hf", attention="eager", attn_implementation="eager"))
    spec = model_preset("tiny-llama")
    probabilities = spec.num_layers * BATCH * spec.num_heads * SEQUENCE * SEQUENCE * 4
    assert eager.per_rank.activations_bytes - sdpa.per_rank.activations_bytes >= probabilities
    assert eager.per_rank.parameters_bytes == sdpa.per_rank.parameters_bytes
    assert "attn_implementation=eager" in eager.notes[-1]


@pytest.mark.long
def test_a_model_type_outside_the_core_is_traced_from_its_config(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3 (q and k norms per head) is no family of the core's; ddp on 2 ranks in fp32 holds every parameter."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    path = CONFIGS / "tiny-qwen3.json"
    data = json.loads(path.read_text())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[data.pop("model_type")].from_dict(data))
    numel = sum(param.numel() for param in model.parameters())
    argv = ["trace", "--config", str(path), "--gpus", "2", "--strategy", "ddp", "--precision", "fp32"]
    assert main([*argv, "--seq-len", "32", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["model"] == f"qwen3 ({path})"
    assert document["per_rank"]["parameters_bytes"] == document["per_rank"]["gradients_bytes"] == numel * 4
    assert document["per_rank"]["activations_bytes"] > 0


@pytest.mark.long
@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-moe"])
def test_gpt2_and_mixtral_hold_every_parameter_the_core_counts(preset: str) -> None:
    """transformers' GPT2LMHeadModel (tied head) and MixtralForCausalLM (its experts as 3-D tensors, which the
    reference MoE's data-dependent routing cannot replay on fake tensors), zero3 bf16-mixed on 2 ranks: half of every
    fp32 parameter the core counts (every dim 0 of these presets is even, so FSDP2 pads none). bf16: transformers'
    grouped_mm experts kernel takes bf16 operands only."""
    from shardscope.core.params import count_parameters

    spec = model_preset(preset)
    scenario = Scenario(
        model=spec,
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=2),
        training=TrainingSpec(precision="bf16-mixed", micro_batch_size=BATCH, sequence_length=SEQUENCE),
        strategy=Strategy(name="zero3"),
    )
    result = run_in_subprocess(TraceRequest(scenario=scenario, implementation="hf", time_limit_s=300))
    assert result.per_rank.parameters_bytes == result.per_rank.gradients_bytes == count_parameters(spec) * 4 // 2
    assert result.per_rank.activations_bytes > 0


@pytest.mark.long
def test_a_config_traced_with_the_reference_modules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--config FILE --implementation reference builds shardscope's modules to the file's shape: tiny-llama's."""
    from shardscope.presets.hf_config import hf_config_of

    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_of(model_preset("tiny-llama"))))
    flags = ["--gpus", "3", "--precision", "fp32", "--micro-batch", str(BATCH), "--seq-len", str(SEQUENCE), "--json"]
    assert main(["trace", "--config", str(path), "--implementation", "reference", *flags]) == 0
    document = json.loads(capsys.readouterr().out)
    reference = run_in_subprocess(_request("reference"))
    assert document["per_rank"]["activations_bytes"] == reference.per_rank.activations_bytes
    assert document["per_rank"]["peak_moment"].startswith("backward: layers.")  # not transformers' model.layers
    assert not any("transformers" in note for note in document["notes"])


@pytest.mark.long
@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        ({"model_type": "nosuchmodel"}, [], "model_type 'nosuchmodel' is not one transformers knows"),
        (None, ["--model", "tiny-llama", "--implementation", "hf", "--tp", "2"], "--tp 2 with --implementation hf"),
    ],
)
def test_what_the_worker_refuses_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, str] | None, flags: list[str], message: str
) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        flags = ["--config", str(tmp_path / "config.json")]
    assert main(["trace", *flags, "--gpus", "4", "--seq-len", "32"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
