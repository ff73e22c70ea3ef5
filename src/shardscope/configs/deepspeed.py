"""DeepSpeed's JSON config (https://www.deepspeed.ai/docs/config-json/) onto shardscope's flags."""

from __future__ import annotations

from typing import Any

from shardscope.configs.mapping import ConfigError, ConfigMapping, skip_unread, validate

ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}


def _auto(mapping: ConfigMapping, name: str, flag: str) -> None:
    mapping.skip(name, f'"auto" is resolved by the Hugging Face Trainer, not in this file: give {flag}')


def read_deepspeed(path: str, tree: dict[str, Any], world_size: int) -> ConfigMapping:
    """The settings of a DeepSpeed config; world_size (--gpus) resolves train_batch_size."""
    validate(path, tree, "deepspeed")
    mapping = ConfigMapping(path, "deepspeed")
    mapping.set("engine", "deepspeed", "(a DeepSpeed config)")
    read: set[str] = set()
    zero = tree.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    read.add("zero_optimization.stage")
    mapping.set("strategy", ZERO_STAGES[stage], f"zero_optimization.stage={stage}")
    offload = "none"
    for section, value in (("offload_optimizer", "optimizer"), ("offload_param", "optimizer+params")):
        device = zero.get(section, {}).get("device", "none")
        read.add(f"zero_optimization.{section}.device")
        if device == "cpu":
            offload = value
        elif device == "nvme":
            mapping.skip(f"zero_optimization.{section}.device", "nvme is not modelled (cpu is): give --offload")
    if offload != "none":
        mapping.set("offload", offload, "zero_optimization.offload_optimizer/offload_param.device=cpu")
    bf16 = tree.get("bf16", {}).get("enabled", False)
    fp16 = tree.get("fp16", {}).get("enabled", False)
    read.update({"bf16.enabled", "fp16.enabled"})
    if bf16 == "auto" or fp16 == "auto":
        _auto(mapping, "bf16.enabled/fp16.enabled", "--precision")
    elif bf16 and fp16:
        raise ConfigError(f"{path}: bf16.enabled and fp16.enabled are both true; DeepSpeed takes one")
    else:
        precision = "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32"
        mapping.set("precision", precision, f"bf16.enabled={bool(bf16)}, fp16.enabled={bool(fp16)}".lower())
    _batch(mapping, tree, world_size, read)
    if "activation_checkpointing" in tree:
        read.add("activation_checkpointing")
        mapping.set("checkpointing", "full", "activation_checkpointing (section present)")
        for key in tree["activation_checkpointing"]:
            mapping.skip(f"activation_checkpointing.{key}", "how checkpoints are kept is not modelled")
    kind = tree.get("optimizer", {}).get("type")
    if isinstance(kind, str) and kind.lower() in OPTIMIZERS:
        read.add("optimizer.type")
        mapping.set("optimizer", OPTIMIZERS[kind.lower()], f"optimizer.type={kind}")
    skip_unread(mapping, tree, read | set(mapping.unmodelled))
    return mapping


def _batch(mapping: ConfigMapping, tree: dict[str, Any], world_size: int, read: set[str]) -> None:
    """train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks, as
    DeepSpeed's config checks it; any two give the third."""
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    read.update(names)
    micro, accum, total = (tree.get(name) for name in names)
    for name, value, flag in zip(
        names, (micro, accum, total), ("--micro-batch", "--grad-accum", "--micro-batch"), strict=True
    ):
        if value == "auto":
            _auto(mapping, name, flag)
    micro, accum, total = (None if value == "auto" else value for value in (micro, accum, total))
    if total is not None:
        if accum is None:
            accum = 1 if micro is None else total // (micro * world_size)
        if micro is None:
            micro = total // (accum * world_size)
        if micro < 1 or accum < 1 or micro * accum * world_size != total:
            raise ConfigError(
                f"{mapping.path}: train_batch_size={total} is not train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps x {world_size} GPUs (--gpus)"
            )
    if micro is not None:
        mapping.set(
            "micro_batch",
            micro,
            "train_micro_batch_size_per_gpu" if tree.get(names[0]) == micro else "train_batch_size",
        )
    if accum is not None:
        mapping.set(
            "grad_accum", accum, "gradient_accumulation_steps" if tree.get(names[1]) == accum else "train_batch_size"
        )
