"""--from FILE: each format round-trips (a config written for a scenario reads back to that scenario's flags), the
fields shardscope does not model are listed, and flags on the command line override the file.

Schemas the test configs follow:
- DeepSpeed: https://www.deepspeed.ai/docs/config-json/ (zero_optimization.stage, offload_optimizer/offload_param
  device, bf16/fp16 enabled, train_batch_size = micro x accumulation x data-parallel ranks)
- torchtitan: torchtitan/config/job_config.py (v0.2.0, https://raw.githubusercontent.com/pytorch/torchtitan/v0.2.0/
  torchtitan/config/job_config.py) and its llama3_8b.toml
- Accelerate: https://huggingface.co/docs/accelerate/usage_guides/fsdp (the `accelerate config` FSDP YAML, with
  fsdp_sharding_strategy given as a name or as its number 1-4)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardscope.cli import build_parser, main

DATA = Path(__file__).parent.parent / "data" / "configs"


def parsed(*argv: str) -> Any:
    return build_parser(argv[0]).parse_args(list(argv))


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """A TOML document of flat tables (tomllib reads TOML; the stdlib writes none)."""
    lines = []
    for table, fields in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("stage", "strategy", "device", "offload"),
    [
        (0, "ddp", "none", "none"),
        (1, "zero1", "cpu", "optimizer"),
        (2, "zero2", "none", "none"),
        (3, "zero3", "cpu", "optimizer+params"),
    ],
)
def test_deepspeed_round_trip(tmp_path: Path, stage: int, strategy: str, device: str, offload: str) -> None:
    config = {
        "train_batch_size": 48,
        "train_micro_batch_size_per_gpu": 3,
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": device}},
        "activation_checkpointing": {"partition_activations": True},
        "optimizer": {"type": "SGD"},
    }
    if offload == "optimizer+params":
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}  # type: ignore[index]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = parsed("estimate", "--model", "gpt2", "--gpus", "4", "--from", str(path))
    assert (args.strategy, args.offload, args.engine) == (strategy, offload, "deepspeed")
    assert (args.micro_batch, args.grad_accum) == (3, 4)  # 48 = 3 x 4 x 4 GPUs
    assert (args.precision, args.checkpointing, args.optimizer) == ("fp16-mixed", "full", "sgd")
    assert "activation_checkpointing.partition_activations" in args.config_source.unmodelled


def test_torchtitan_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        toml_text(
            {
                "model": {"name": "llama3", "flavor": "405B"},
                "training": {
                    "local_batch_size": 2,
                    "global_batch_size": 96,
                    "seq_len": 4096,
                    "mixed_precision_param": "float32",
                },
                "parallelism": {
                    "data_parallel_replicate_degree": 2,
                    "data_parallel_shard_degree": 3,
                    "tensor_parallel_degree": 4,
                    "context_parallel_degree": 2,
                    "pipeline_parallel_degree": 2,
                    "pipeline_parallel_schedule": "Interleaved1F1B",
                },
                "activation_checkpoint": {"mode": "selective", "selective_ac_option": "3"},
                "metrics": {"log_freq": 10},
            }
        )
    )
    args = parsed("estimate", "--from", str(path))
    assert args.model == "llama-3.1-405b"
    assert (args.gpus, args.strategy, args.shard_group) == (96, "hsdp", 3)  # 2 x 3 x 4 x 2 x 2
    assert (args.tp, args.cp, args.pp, args.pp_schedule) == (4, 2, 2, "interleaved-1f1b")
    assert (args.micro_batch, args.grad_accum, args.seq_len) == (2, 8, 4096)  # 96 / (2 x 6 data-parallel ranks)
    assert (args.precision, args.checkpointing) == ("fp32", "every:3")
    assert args.config_source.unmodelled == {"metrics.log_freq": "not modelled"}


def test_torchtitan_shard_minus_one_takes_the_rest_of_gpus() -> None:
    args = parsed("estimate", "--gpus", "16", "--from", str(DATA / "torchtitan_llama3_8b.toml"))
    assert (args.model, args.gpus, args.strategy, args.checkpointing, args.seq_len) == (
        "llama-3-8b",
        16,
        "fsdp",
        "op",
        8192,
    )


@pytest.mark.parametrize(
    ("fsdp", "strategy"),
    [
        ({"fsdp_sharding_strategy": "FULL_SHARD"}, "fsdp"),
        ({"fsdp_sharding_strategy": 2}, "zero2"),
        ({"fsdp_sharding_strategy": "NO_SHARD"}, "ddp"),
        ({"fsdp_sharding_strategy": "HYBRID_SHARD"}, "hsdp"),
        ({"fsdp_version": 2, "fsdp_reshard_after_forward": True}, "fsdp"),
        ({"fsdp_version": 2, "fsdp_reshard_after_forward": False}, "zero2"),
    ],
)
def test_accelerate_round_trip(tmp_path: Path, fsdp: dict[str, Any], strategy: str) -> None:
    config = {
        "distributed_type": "FSDP",
        "num_processes": 32,
        "num_machines": 4,
        "mixed_precision": "fp16",
        "fsdp_config": {
            **fsdp,
            "fsdp_offload_params": True,
            "fsdp_activation_checkpointing": True,
            "fsdp_use_orig_params": True,
        },
    }
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    args = parsed("estimate", "--model", "gpt2", "--from", str(path))
    assert (args.gpus, args.gpus_per_node, args.strategy) == (32, 8, strategy)
    assert (args.offload, args.checkpointing, args.precision) == ("optimizer+params", "full", "fp16-mixed")
    assert args.config_source.unmodelled == {"fsdp_config.fsdp_use_orig_params": "not modelled"}


def test_command_line_flags_override_the_file() -> None:
    path = str(DATA / "deepspeed_zero3_offload.json")
    after = parsed("estimate", "--model", "gpt2", "--from", path, "--strategy", "zero1", "--micro-batch", "5")
    before = parsed("estimate", "--model", "gpt2", "--strategy", "zero1", "--micro-batch", "5", "--from", path)
    for args in (after, before):
        assert (args.strategy, args.micro_batch, args.grad_accum) == ("zero1", 5, 4)


def test_explicit_flags_at_their_default_values_override_the_file() -> None:
    """A flag given on the command line wins even when it repeats its default (the file says zero3, bf16-mixed,
    micro-batch 2, grad-accum 4 and offload optimizer), before or after --from."""
    path = str(DATA / "deepspeed_zero3_offload.json")
    given = ["--precision", "fp32", "--micro-batch", "1", "--grad-accum", "1", "--offload", "none", "--gpus", "8"]
    for argv in (["--from", path, *given], [*given, "--from", path]):
        args = parsed("estimate", "--model", "gpt2", *argv)
        assert (args.precision, args.micro_batch, args.grad_accum, args.offload) == ("fp32", 1, 1, "none")
        assert (args.strategy, args.engine) == ("zero3", "deepspeed")  # not given: the file's
        unmodelled = args.config_source.unmodelled
        assert unmodelled["train_micro_batch_size_per_gpu"] == "--micro-batch on the command line overrides it"
        assert unmodelled["zero_optimization.offload_optimizer/offload_param.device=cpu"] == (
            "--offload on the command line overrides it"
        )
    defaults = parsed("estimate", "--model", "gpt2", "--micro-batch", "1", "--from", path)
    assert (defaults.micro_batch, defaults.precision) == (1, "bf16-mixed")


def test_a_model_flag_keeps_the_file_model_out() -> None:
    args = parsed("estimate", "--params", "7B", "--from", str(DATA / "torchtitan_llama3_8b.toml"))
    assert (args.model, args.params) == (None, "7B")
    assert args.config_source.unmodelled["model.name=llama3, model.flavor=8B"] == (
        "--params on the command line overrides it"
    )


def test_auto_values_are_reported_as_needing_a_flag() -> None:
    args = parsed("estimate", "--model", "gpt2", "--from", str(DATA / "deepspeed_hf_auto.json"))
    assert (args.strategy, args.micro_batch) == ("zero2", 1)
    assert "give --micro-batch" in args.config_source.unmodelled["train_micro_batch_size_per_gpu"]


def test_estimate_prints_the_mapping_and_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--from", str(DATA / "torchtitan_70b_hsdp_tp.toml")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "model.name=llama3, model.flavor=70B -> --model llama-3-70b" in err
    assert "parallelism.enable_async_tensor_parallel: async TP's overlap is not modelled" in err
    assert "hsdp(4)+tp8" in out


def test_from_format_forces_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "config.txt"
    path.write_text('{"distributed_type": "MULTI_GPU", "num_processes": 4}')  # JSON is YAML too
    args = parsed("estimate", "--model", "gpt2", "--from-format", "accelerate", "--from", str(path))
    assert (args.strategy, args.gpus, args.config_source.format) == ("ddp", 4, "accelerate")


def test_plan_keeps_the_model_and_step_and_searches_the_rest() -> None:
    args = parsed("plan", "--global-batch-tokens", "1M", "--from", str(DATA / "torchtitan_llama3_8b.toml"))
    assert (args.model, args.seq_len, args.precision) == ("llama-3-8b", 8192, "bf16-mixed")
    unmodelled = args.config_source.unmodelled
    assert unmodelled["activation_checkpoint.mode=selective"] == "shardscope plan searches --checkpointing itself"
    assert "parallelism.tensor_parallel_degree" in unmodelled


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["estimate", "--model", "gpt2", "--json"], "shardscope.estimate/v1"),
        (["plan", "--model", "gpt2", "--global-batch-tokens", "64K", "--top", "1", "--json"], "shardscope.plan/v1"),
        (["timeline", "--model", "gpt2", "--json"], ""),
        (
            ["trace", "--model", "tiny-gpt2", "--gpus", "8", "--offload", "none", "--engine", "pytorch", "--json"],
            "shardscope.trace/v1",
        ),
    ],
)
def test_json_output_carries_the_source(argv: list[str], name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from shardscope.schemas import load_schema

    jsonschema = pytest.importorskip("jsonschema")
    path = str(DATA / "deepspeed_zero3_offload.json")
    assert main([*argv, "--seq-len", "32" if "trace" in argv else "1024", "--from", path]) == 0
    document = json.loads(capsys.readouterr().out)
    if name:  # timeline's JSON is `estimate --time`'s entry, without a versioned schema of its own
        jsonschema.validate(document, load_schema(name))
    assert document["source"]["format"] == "deepspeed"
    source = document["source"]
    if name != "shardscope.plan/v1":
        assert {"field": "zero_optimization.stage=3", "flag": "--strategy", "value": "zero3"} in source["mapping"]
    else:  # plan searches the strategy itself
        assert source["unmodelled"]["zero_optimization.stage=3"] == "shardscope plan searches --strategy itself"
    assert document["source"]["unmodelled"]["gradient_clipping"] == "not modelled"


def test_torchtitan_shard_degree_defaults_to_the_gpus_left(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(toml_text({"parallelism": {"tensor_parallel_degree": 2}}))  # job_config.py: shard degree -1
    args = parsed("estimate", "--model", "gpt2", "--gpus", "8", "--from", str(path))
    assert (args.gpus, args.strategy, args.tp) == (8, "fsdp", 2)


def test_report_that_plans_prints_the_mapping_and_names_what_it_searches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    path = str(DATA / "deepspeed_zero3_offload.json")
    argv = ["report", "--model", "gpt2", "--global-batch-tokens", "64K", "--seq-len", "1024", "--from", path]
    assert main([*argv, "--output", str(tmp_path / "page.html")]) == 0
    err = capsys.readouterr().err
    assert "optimizer.type=AdamW -> --optimizer adamw" in err
    assert "zero_optimization.stage=3: shardscope report searches --strategy itself" in err
