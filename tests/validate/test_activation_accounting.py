"""The core's per-op activation accounting equals, to the byte, what autograd saves when shardscope's reference
modules run forward (single process, saved-tensor hooks, storages deduplicated, parameters excluded).

'op' is not here: what its policy keeps is cached by torch's selective-checkpoint mode, not saved through autograd's
hooks; tests/trace/test_checkpointing_modes.py checks it against the trace."""

import itertools
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from shardscope.core.activations import estimate_activations  # noqa: E402
from shardscope.presets import model_preset  # noqa: E402
from shardscope.reference_models import build_model, lm_loss, sample_batch  # noqa: E402
from shardscope.specs import ModelSpec, TrainingSpec  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16-mixed": torch.bfloat16}
CASES = list(
    itertools.product(
        ("tiny-gpt2", "tiny-llama", "tiny-moe"),
        ("sdpa", "eager"),
        ("fp32", "bf16-mixed"),
        ("none", "full", "selective", "every:2"),
    )
)


def saved_bytes(model: str | ModelSpec, training: TrainingSpec, autocast: bool = False) -> int:
    spec = model_preset(model) if isinstance(model, str) else model
    module = build_model(spec, training, dtype=torch.float32 if autocast else DTYPES[training.precision])
    parameters = {p.untyped_storage()._cdata for p in module.parameters()}
    ids, targets = sample_batch(spec, training, num_sequences=training.micro_batch_size)
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters:
            seen[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lm_loss(module(ids), targets)
        else:
            lm_loss(module(ids), targets)
    return sum(seen.values())


@pytest.mark.parametrize(("model_name", "attention", "precision", "checkpointing"), CASES)
def test_saved_activations_match_the_reference_modules(
    model_name: str, attention: str, precision: str, checkpointing: str
) -> None:
    training = TrainingSpec(
        micro_batch_size=2, sequence_length=32, precision=precision, attention=attention, checkpointing=checkpointing
    )
    predicted = estimate_activations(model_preset(model_name), training).saved_bytes
    assert predicted == saved_bytes(model_name, training)


def test_fp64_and_a_longer_sequence() -> None:
    training = TrainingSpec(micro_batch_size=2, sequence_length=64, precision="fp64", attention="eager")
    assert estimate_activations(model_preset("tiny-llama"), training).saved_bytes == saved_bytes("tiny-llama", training)


@pytest.mark.parametrize(
    ("model_name", "attention", "checkpointing"),
    list(
        itertools.product(
            ("tiny-gpt2", "tiny-llama", "tiny-moe"), ("sdpa", "eager"), ("none", "full", "selective", "every:2")
        )
    ),
)
def test_autocast_over_fp32_weights(model_name: str, attention: str, checkpointing: str) -> None:
    # torch's DDP under bf16-mixed: fp32 weights, torch.autocast computing in bf16.
    training = TrainingSpec(
        micro_batch_size=2, sequence_length=32, precision="bf16-mixed", attention=attention, checkpointing=checkpointing
    )
    predicted = estimate_activations(model_preset(model_name), training, autocast=True).saved_bytes
    assert predicted == saved_bytes(model_name, training, autocast=True)


@pytest.mark.parametrize(
    ("top_k", "factor", "precision", "autocast", "checkpointing"),
    [
        (top_k, factor, precision, autocast, checkpointing)
        for top_k, factor in ((2, 1.25), (1, 0.75), (1, 0.0))
        for precision, autocast in (("fp32", False), ("bf16-mixed", False), ("bf16-mixed", True))
        for checkpointing in ("none", "full", "selective", "every:2")
    ],
)
def test_top_1_and_the_capacity_rule(
    top_k: int, factor: float, precision: str, autocast: bool, checkpointing: str
) -> None:
    # tiny-moe under GShard's capacity rule, top-2 (4 experts x 2 sequences x ceil(1.25 x 32 x 2 / 4) = 20 padded
    # rows each) and top-1 with tokens dropped (4 x 2 x ceil(0.75 x 32 / 4) = 6 rows each, of 16 an even share
    # would bring); and top-1 dropless (64 rows in all, which routing shares out)
    spec = replace(model_preset("tiny-moe"), experts_per_token=top_k, capacity_factor=factor)
    training = TrainingSpec(micro_batch_size=2, sequence_length=32, precision=precision, checkpointing=checkpointing)
    assert spec.expert_rows(2, 32) == {(2, 1.25): 160, (1, 0.75): 48, (1, 0.0): 64}[(top_k, factor)]
    predicted = estimate_activations(spec, training, autocast=autocast).saved_bytes
    assert predicted == saved_bytes(spec, training, autocast=autocast)
