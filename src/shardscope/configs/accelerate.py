"""Accelerate's config YAML (`accelerate config`; docs: usage_guides/fsdp, package_reference/cli) onto shardscope's
flags."""

from __future__ import annotations

from typing import Any

from shardscope.configs.mapping import ConfigMapping, skip_unread, validate

SHARDING = {
    "FULL_SHARD": "fsdp",
    "1": "fsdp",
    "SHARD_GRAD_OP": "zero2",
    "2": "zero2",
    "NO_SHARD": "ddp",
    "3": "ddp",
    "HYBRID_SHARD": "hsdp",
    "4": "hsdp",
}
PRECISION = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "no": "fp32"}


def read_accelerate(path: str, tree: dict[str, Any], world_size: int) -> ConfigMapping:
    """The settings of an Accelerate config (FSDP, multi-GPU or DeepSpeed)."""
    del world_size
    validate(path, tree, "accelerate")
    mapping = ConfigMapping(path, "accelerate")
    read: set[str] = {"distributed_type"}
    kind = tree.get("distributed_type", "NO")
    processes = tree.get("num_processes")
    if processes is not None:
        read.add("num_processes")
        mapping.set("gpus", processes, "num_processes")
        machines = tree.get("num_machines", 1)
        read.add("num_machines")
        if machines > 1:
            mapping.set("gpus_per_node", max(processes // machines, 1), "num_processes / num_machines")
    if kind == "FSDP":
        fsdp = tree.get("fsdp_config", {})
        version = fsdp.get("fsdp_version", 1)
        read.add("fsdp_config.fsdp_version")
        if version == 2 and "fsdp_reshard_after_forward" in fsdp:
            read.add("fsdp_config.fsdp_reshard_after_forward")
            reshard = fsdp["fsdp_reshard_after_forward"]
            mapping.set(
                "strategy",
                "fsdp" if reshard in (True, "FULL_SHARD") else "zero2",
                f"fsdp_config.fsdp_reshard_after_forward={reshard}",
            )
        elif "fsdp_sharding_strategy" in fsdp:
            read.add("fsdp_config.fsdp_sharding_strategy")
            word = str(fsdp["fsdp_sharding_strategy"])
            mapping.set("strategy", SHARDING[word], f"fsdp_config.fsdp_sharding_strategy={word}")
        else:
            mapping.set("strategy", "fsdp", "distributed_type=FSDP (FULL_SHARD by default)")
        if fsdp.get("fsdp_offload_params"):
            mapping.set("offload", "optimizer+params", "fsdp_config.fsdp_offload_params=true")
        read.add("fsdp_config.fsdp_offload_params")
        if fsdp.get("fsdp_activation_checkpointing"):
            mapping.set("checkpointing", "full", "fsdp_config.fsdp_activation_checkpointing=true")
        read.add("fsdp_config.fsdp_activation_checkpointing")
    elif kind == "MULTI_GPU":
        mapping.set("strategy", "ddp", "distributed_type=MULTI_GPU")
    elif kind == "DEEPSPEED":
        ds = tree.get("deepspeed_config", {})
        stage = ds.get("zero_stage", 0)
        read.add("deepspeed_config.zero_stage")
        mapping.set("engine", "deepspeed", "distributed_type=DEEPSPEED")
        mapping.set("strategy", ("ddp", "zero1", "zero2", "zero3")[stage], f"deepspeed_config.zero_stage={stage}")
        offload = "none"
        for key, value in (("offload_optimizer_device", "optimizer"), ("offload_param_device", "optimizer+params")):
            read.add(f"deepspeed_config.{key}")
            if ds.get(key) == "cpu":
                offload = value
        if offload != "none":
            mapping.set("offload", offload, "deepspeed_config.offload_*_device=cpu")
        if "gradient_accumulation_steps" in ds:
            read.add("deepspeed_config.gradient_accumulation_steps")
            mapping.set("grad_accum", ds["gradient_accumulation_steps"], "deepspeed_config.gradient_accumulation_steps")
    else:
        mapping.skip("distributed_type", f"{kind} is one process: give --strategy")
    precision = tree.get("mixed_precision")
    if precision is not None:
        read.add("mixed_precision")
        if precision in PRECISION:
            mapping.set("precision", PRECISION[precision], f"mixed_precision={precision}")
        else:
            mapping.skip("mixed_precision", f"{precision} is not modelled: give --precision")
    skip_unread(mapping, tree, read | set(mapping.unmodelled))
    return mapping
