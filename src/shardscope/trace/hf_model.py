"""The model a Hugging Face user trains, built by transformers from its config.json on the meta device, offline.

`--implementation hf` replays transformers' own modeling code (its RMSNorm upcasts, rotary embeddings, attention
implementations, MoE experts kernels, dropout where the config has it) instead of shardscope's reference modules.
The config comes from a local config.json (`--config`) or, for a preset, from the preset's file in
shardscope/presets/hf_configs (presets.hf_config.preset_hf_config). Nothing is downloaded: the Hub is switched off
(HF_HUB_OFFLINE) before transformers is imported, and the config class is built from the JSON object directly.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shardscope.choices import checkpoint_every
from shardscope.presets.hf_config import ConfigError, load_hf_config, preset_hf_config
from shardscope.trace.request import TraceRequest
from shardscope.trace.setup import DTYPES, TracedModel, TraceSetupError, largest_module_list

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""Environment that keeps huggingface_hub and transformers off the network (their documented switches)."""


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _config_object(request: TraceRequest) -> tuple[dict[str, Any], str]:
    """The config.json object and where it came from (the file, or the preset's name)."""
    if request.config_path:
        try:
            return load_hf_config(request.config_path), request.config_path
        except ConfigError as error:
            raise TraceSetupError(str(error)) from None
    model = request.scenario.model
    try:
        return preset_hf_config(model), f"the config.json of {model.name}"
    except ConfigError as error:
        raise TraceSetupError(f"--implementation hf: {error}") from None


def hf_config(request: TraceRequest, num_blocks: int | None) -> Any:
    """transformers' config object of the request's model, cut to num_blocks blocks when given."""
    os.environ.update(OFFLINE)
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        raise TraceSetupError("--implementation hf needs transformers (pip install 'shardscope[hf]')") from None
    data, where = _config_object(request)
    data = dict(data)
    model_type = data.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise TraceSetupError(f"{where}: model_type {model_type!r} is not one transformers knows")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise TraceSetupError(
            f"{where}: transformers cannot read it as a {model_type} config: {_first_line(error)}"
        ) from None
    if num_blocks is not None:
        config.num_hidden_layers = num_blocks
        if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (gemma, qwen2/3)
            config.layer_types = config.layer_types[:num_blocks]
    return config


def hf_depth(request: TraceRequest) -> int:
    """Blocks of the request's Hugging Face model, as its config states them."""
    config = hf_config(request, None)
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < 1:
        raise TraceSetupError(f"the {config.model_type} config has no num_hidden_layers; cannot trace its blocks")
    return depth


def attention_kernel(request: TraceRequest) -> str:
    """The attn_implementation transformers is asked for: --attn-implementation, else the scenario's --attention
    (eager and sdpa are spelt alike in both)."""
    return request.attn_implementation or request.scenario.training.attention


def hf_model(request: TraceRequest, num_blocks: int | None) -> TracedModel:
    """The Hugging Face model of the request, in training mode, with whole-block checkpointing when asked."""
    config = hf_config(request, num_blocks)
    from transformers import AutoModelForCausalLM

    from shardscope.reference_models import lm_loss

    training = request.scenario.training
    kernel = attention_kernel(request)
    try:
        with torch.device("meta"):
            root = AutoModelForCausalLM.from_config(
                config, dtype=DTYPES[training.precision], attn_implementation=kernel
            )
    except (ImportError, ValueError) as error:  # a kernel that is not installed, or a model with no causal LM head
        raise TraceSetupError(
            f"transformers cannot build {config.model_type} with {kernel}: {_first_line(error)}"
        ) from None
    root.train()
    whole = checkpoint_every(training.checkpointing) == 1  # 'full' or 'every:1': every block
    if whole:
        root.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shape = (training.micro_batch_size, training.sequence_length)
    vocab = int(config.vocab_size)

    def make_batch() -> tuple[Any, Any]:
        return torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)

    notes = [f"built by transformers from {config.model_type}'s config.json, attn_implementation={kernel}"]
    if not (whole or training.checkpointing == "none"):
        notes.append(
            f"checkpointing {training.checkpointing} is not applied to a transformers model; traced without it"
        )
    return TracedModel(
        root=root,
        blocks=largest_module_list(root),
        make_batch=make_batch,
        loss=lambda outputs, targets: lm_loss(outputs.logits, targets),
        engine_notes=notes,
    )
