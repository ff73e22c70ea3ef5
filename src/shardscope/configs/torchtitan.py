"""torchtitan's job TOML (torchtitan/config/job_config.py; docs/composability.md) onto shardscope's flags."""

from __future__ import annotations

from typing import Any

from shardscope.configs.mapping import ConfigError, ConfigMapping, skip_unread, validate

MODELS = {
    ("llama3", "8b"): "llama-3-8b",
    ("llama3", "70b"): "llama-3-70b",
    ("llama3", "405b"): "llama-3.1-405b",
    ("llama2", "7b"): "llama-2-7b",
    ("llama2", "13b"): "llama-2-13b",
    ("llama2", "70b"): "llama-2-70b",
}
SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved-1f1b"}
PRECISION = {"bfloat16": "bf16-mixed", "float32": "fp32"}


def read_torchtitan(path: str, tree: dict[str, Any], world_size: int) -> ConfigMapping:
    """The settings of a torchtitan job config; world_size (--gpus) resolves data_parallel_shard_degree = -1."""
    validate(path, tree, "torchtitan")
    mapping = ConfigMapping(path, "torchtitan")
    read: set[str] = set()
    model = tree.get("model", {})
    if "name" in model:
        read.update({"model.name", "model.flavor"})
        key = (model["name"].lower(), str(model.get("flavor", "")).lower())
        if key in MODELS:
            mapping.set("model", MODELS[key], f"model.name={model['name']}, model.flavor={model.get('flavor')}")
        else:
            mapping.skip("model.name/flavor", f"{key[0]} {key[1]} has no shardscope preset: give --model or --config")
    _parallelism(mapping, tree.get("parallelism", {}), world_size, read)
    ac = tree.get("activation_checkpoint", {})
    if "mode" in ac:
        read.update({"activation_checkpoint.mode", "activation_checkpoint.selective_ac_option"})
        mode = ac["mode"]
        if mode == "selective":
            option = str(ac.get("selective_ac_option", "2"))
            mode = "op" if option == "op" else f"every:{option}"
        mapping.set("checkpointing", mode, f"activation_checkpoint.mode={ac['mode']}")
    training = tree.get("training", {})
    local = training.get("local_batch_size", training.get("batch_size"))
    if local is not None:
        read.update({"training.local_batch_size", "training.batch_size"})
        mapping.set("micro_batch", local, "training.local_batch_size")
    if "seq_len" in training:
        read.add("training.seq_len")
        mapping.set("seq_len", training["seq_len"], "training.seq_len")
    if "mixed_precision_param" in training:
        read.add("training.mixed_precision_param")
        mapping.set("precision", PRECISION[training["mixed_precision_param"]], "training.mixed_precision_param")
    global_batch = training.get("global_batch_size", -1)
    if global_batch > 0:
        read.add("training.global_batch_size")
        dp = mapping.settings["gpus"] // (mapping.settings["tp"] * mapping.settings["cp"] * mapping.settings["pp"])
        accum, left = divmod(global_batch, (local or 8) * dp)
        if left or accum < 1:
            raise ConfigError(
                f"{path}: training.global_batch_size={global_batch} is not a multiple of local_batch_size x {dp} "
                "data-parallel ranks"
            )
        mapping.set("grad_accum", accum, "training.global_batch_size / (local_batch_size x data-parallel ranks)")
    name = tree.get("optimizer", {}).get("name")
    if isinstance(name, str) and name.lower() in ("adam", "adamw"):
        read.add("optimizer.name")
        mapping.set("optimizer", "adamw", f"optimizer.name={name}")
    skip_unread(mapping, tree, read | set(mapping.unmodelled))
    return mapping


def _parallelism(mapping: ConfigMapping, section: dict[str, Any], world_size: int, read: set[str]) -> None:
    """The mesh: pp x replicate x shard x cp x tp GPUs; shard -1 takes the GPUs left."""
    degrees = {  # job_config.Parallelism's defaults: 1, and -1 (the GPUs left) for the shard degree
        key: section.get(f"{key}_degree", -1 if key == "data_parallel_shard" else 1)
        for key in (
            "data_parallel_replicate",
            "data_parallel_shard",
            "tensor_parallel",
            "pipeline_parallel",
            "context_parallel",
        )
    }
    read.update(f"parallelism.{key}_degree" for key in degrees)
    replicate, shard = degrees["data_parallel_replicate"], degrees["data_parallel_shard"]
    tp, pp, cp = degrees["tensor_parallel"], degrees["pipeline_parallel"], degrees["context_parallel"]
    others = replicate * tp * pp * cp
    if shard == -1:
        shard = world_size // others
        if shard < 1 or shard * others != world_size:
            raise ConfigError(
                f"{mapping.path}: parallelism.data_parallel_shard_degree=-1 leaves no whole degree of {world_size} GPUs"
            )
        mapping.set("gpus", world_size, "parallelism.data_parallel_shard_degree=-1 (the rest of --gpus)")
    else:
        mapping.set("gpus", shard * others, "parallelism: replicate x shard x tp x pp x cp degrees")
    if shard > 1 and replicate > 1:
        mapping.set("strategy", "hsdp", "parallelism.data_parallel_replicate_degree and _shard_degree > 1")
        mapping.set("shard_group", shard, "parallelism.data_parallel_shard_degree")
    elif shard > 1:
        mapping.set("strategy", "fsdp", "parallelism.data_parallel_shard_degree > 1")
    else:
        mapping.set("strategy", "ddp", "parallelism.data_parallel_shard_degree = 1")
    mapping.set("tp", tp, "parallelism.tensor_parallel_degree")
    mapping.set("cp", cp, "parallelism.context_parallel_degree")
    mapping.set("pp", pp, "parallelism.pipeline_parallel_degree")
    schedule = section.get("pipeline_parallel_schedule")
    if schedule is not None:
        read.add("parallelism.pipeline_parallel_schedule")
        if schedule.lower() in SCHEDULES:
            mapping.set("pp_schedule", SCHEDULES[schedule.lower()], "parallelism.pipeline_parallel_schedule")
        else:
            mapping.skip("parallelism.pipeline_parallel_schedule", f"{schedule} is not modelled: give --pp-schedule")
    if section.get("enable_async_tensor_parallel"):
        read.add("parallelism.enable_async_tensor_parallel")
        mapping.skip("parallelism.enable_async_tensor_parallel", "async TP's overlap is not modelled (plain TP is)")
