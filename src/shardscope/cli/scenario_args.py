"""Command-line flags that describe a scenario, shared by estimate, trace, timeline and plan, and their reading."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from shardscope.choices import (
    ATTENTION,
    OFFLOADS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    STRATEGIES,
    StrategyName,
    parse_choice,
)
from shardscope.cli.arg_types import checkpointing_mode, engine_word, layer_list, positive_int
from shardscope.cli.errors import CliError
from shardscope.configs.args import add_from_arguments, plans, print_source
from shardscope.mesh import DATA_PARALLEL_PRESETS, comparable_strategies
from shardscope.presets import gpu_preset, gpu_preset_names, model_preset, model_preset_names, with_memory
from shardscope.presets.hf_config import read_hf_config
from shardscope.specs import (
    MAX_PARAMETERS,
    ClusterSpec,
    GpuSpec,
    ModelSpec,
    Overheads,
    Scenario,
    Strategy,
    TrainingSpec,
)
from shardscope.units import parse_bytes, parse_count

DEFAULT_SEQUENCE_LENGTH = TrainingSpec().sequence_length
"""--seq-len when not given, the same for every command (the TrainingSpec default), or a model's learned positions
when it has fewer (gpt2: 1024)."""


def add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """--model PRESET | --config config.json | --params N."""
    group = parser.add_mutually_exclusive_group()  # required is checked in model_from_args: --from may name it
    parser.set_defaults(model_required=required)
    add_from_arguments(parser)
    group.add_argument("--model", metavar="PRESET", help=f"a model preset: {', '.join(model_preset_names())}")
    group.add_argument(
        "--config",
        metavar="PATH",
        help="a Hugging Face config.json (gpt2, llama, mistral, mixtral, qwen2); read locally, never downloaded",
    )
    group.add_argument(
        "--params",
        metavar="N",
        help="only a parameter count (7.5B, 70e9, 6738415616): model states only, activations are not estimated",
    )


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """--gpus-per-node, --gpu and --gpu-memory: the GPU type, shared by the commands with and without a world size."""
    parser.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (default %(default)s)")
    parser.add_argument(
        "--gpu",
        metavar="PRESET",
        default="h100-80gb",
        help=f"GPU preset (default %(default)s): {', '.join(gpu_preset_names())}",
    )
    parser.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="replace the --gpu preset's memory, e.g. 64GiB or 80GB; its FLOP/s, memory bandwidth and links stay the "
        "preset's, so --time works with it",
    )


def add_cluster_arguments(parser: argparse.ArgumentParser, default_gpus: int = 8) -> None:
    """--gpus, --backend and the GPU type."""
    parser.add_argument("--gpus", type=positive_int, default=default_gpus, help="world size (default %(default)s)")
    parser.add_argument(
        "--backend",
        default="nccl",
        help="collectives library: nccl, or gloo for CPU processes (gloo's reduce-scatter clones its input)",
    )
    add_gpu_arguments(parser)


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """Precision, optimizer, sequence length and attention: fixed in `plan`, shared by every scenario command."""
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed", help="default %(default)s")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default %(default)s")
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help=f"tokens per sequence (default {DEFAULT_SEQUENCE_LENGTH}, or the model's learned positions when fewer)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION,
        default="sdpa",
        help="eager materialises the score matrix; sdpa is the fused flash kernel (default sdpa)",
    )


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The step's settings and the batch shape and checkpointing that `plan` searches instead."""
    add_step_arguments(parser)
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per rank (default 1)")
    parser.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per step (default 1)")
    parser.add_argument(
        "--checkpointing",
        type=checkpointing_mode,
        default="none",
        metavar="MODE",
        help="none; full (recompute each block); selective (the attention core, Megatron's); op (torchtitan's "
        "selective op policy: save matmul and attention outputs, recompute every other matmul and the rest); "
        "every:N (full on every N-th block) (default %(default)s)",
    )


def add_rules_arguments(parser: argparse.ArgumentParser) -> None:
    """--engine and the overhead assumptions: whose rules apply, shared by every scenario command and `plan`."""
    parser.add_argument(
        "--engine",
        type=engine_word,
        default="pytorch",
        help="whose memory rules: paper (the ZeRO paper, as the teaching strategies run it; 'teaching' is another "
        "word for it), pytorch (DDP/ZeroRedundancyOptimizer/FSDP2), deepspeed (DeepSpeed 0.19.6's estimators); "
        "default pytorch",
    )
    parser.add_argument(
        "--context-memory",
        metavar="SIZE",
        default="512MiB",
        help="assumed framework context per GPU (default %(default)s)",
    )
    parser.add_argument(
        "--allocator-headroom",
        type=float,
        default=None,
        metavar="FRACTION",
        help="override the caching allocator model: take the reserved peak as the allocated peak x (1 + FRACTION) "
        "(default: the model's reserved peak)",
    )


def add_strategy_arguments(parser: argparse.ArgumentParser, many: bool = True) -> None:
    """--strategy, --shard-group, --engine, --offload, overhead assumptions."""
    if many:
        parser.add_argument(
            "--strategy",
            default="all",
            help="ddp, zero1, zero2, zero3, fsdp, hsdp, a comma list, "
            "or all (default: all; hsdp is included when --shard-group is given or the job spans "
            "nodes)",
        )
    else:
        parser.add_argument("--strategy", default="zero3", help="ddp, zero1, zero2, zero3, fsdp or hsdp")
    parser.add_argument("--shard-group", type=positive_int, help="hsdp: ranks per shard group")
    parser.add_argument("--offload", choices=OFFLOADS, default="none", help="default %(default)s")
    add_model_parallel_arguments(parser)
    add_rules_arguments(parser)


def add_model_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """--tp, --cp, --sequence-parallel / --no-sequence-parallel, and the pipeline's --pp, --pp-schedule,
    --pp-virtual-stages and --pp-layers."""
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor parallel degree: GPUs that split each layer's weights, innermost, inside a node (default 1); "
        "the data-parallel strategy applies over --gpus / (tp x cp)",
    )
    parser.add_argument(
        "--cp", type=positive_int, default=1, help="context parallel degree: GPUs that split each sequence (default 1)"
    )
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism in the norms between tp ranks (default: on when --tp is more than 1)",
    )
    parser.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="expert parallel degree (MoE models): GPUs that split each MoE layer's experts, borrowed from the "
        "data-parallel shard x cp GPUs, or ddp's replicas (default 1; predicted by estimate, timeline and report, run "
        "by --engine paper without tp, cp or pp; trace has no torch engine to replay it)",
    )
    add_capacity_argument(parser)
    parser.add_argument(
        "--pp",
        type=positive_int,
        default=1,
        help="pipeline parallel degree: GPUs that each hold consecutive layers, outermost (default 1); "
        "--grad-accum is the pipeline's micro-batches",
    )
    parser.add_argument(
        "--pp-schedule", choices=PIPELINE_SCHEDULES, default="1f1b", help="pipeline schedule (default %(default)s)"
    )
    parser.add_argument(
        "--pp-virtual-stages",
        type=positive_int,
        default=0,
        metavar="V",
        help="interleaved-1f1b only: stages per pipeline rank (default 2)",
    )
    parser.add_argument(
        "--pp-layers",
        type=layer_list,
        default=(),
        metavar="A,B,...",
        help="transformer layers of each pipeline stage, first to last (default: torchtitan's split, which counts "
        "the embeddings and the output head as one layer each)",
    )


def add_capacity_argument(parser: argparse.ArgumentParser) -> None:
    """--capacity-factor: an MoE model's capacity rule (ModelSpec.capacity_factor), applied by model_from_args."""
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=0.0,
        metavar="F",
        help="MoE models: each expert takes ceil(F x seq-len x top-k / experts) rows per sequence, padded, and drops "
        "the routed tokens past them (GShard's capacity rule); 0, the default, routes dropless",
    )


def pipeline_degrees(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline settings of the command line as Strategy fields (`run` asks its engine whether it runs them:
    runtime/config.py MODEL_PARALLEL_REFUSALS, EXPERT_PARALLEL_REFUSALS)."""
    return {
        "pp": args.pp,
        "pp_schedule": args.pp_schedule,
        "pp_virtual_stages": args.pp_virtual_stages,
        "pp_layers": args.pp_layers,
        "ep": args.ep,
    }


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The ModelSpec named by --model, --config or --params (or the --from file), under --capacity-factor."""
    if args.model_required and not any(getattr(args, name, None) is not None for name in ("model", "config", "params")):
        raise CliError("one of the arguments --model --config --params is required (or a --from file that names it)")
    if plans(args, args.command):  # a plan builds no scenario here; the others print once their scenarios are valid
        print_source(args)
    if getattr(args, "config", None) is not None:
        if not args.config:
            raise CliError("--config '' is empty; give the path of a Hugging Face config.json")
        return with_capacity(read_hf_config(args.config), args)
    if getattr(args, "params", None) is not None:
        if not args.params.strip():
            raise CliError(f"--params {args.params!r} is empty; give a parameter count such as 7.5B or 70e9")
        count = parse_count(args.params)
        if not 1 <= count <= MAX_PARAMETERS:
            raise CliError(f"--params {args.params} is outside 1 to {MAX_PARAMETERS:.0e} parameters")
        return with_capacity(
            ModelSpec(name=f"{args.params} parameters", family="count", declared_parameters=count, source="--params"),
            args,
        )
    return with_capacity(model_preset(args.model), args)


def with_capacity(model: ModelSpec, args: argparse.Namespace) -> ModelSpec:
    """The model under --capacity-factor (an MoE model's capacity rule), when the command has the flag and it is
    given."""
    factor = getattr(args, "capacity_factor", 0.0)
    if not factor:
        return model
    if model.family != "moe":
        raise CliError(f"--capacity-factor {factor:g}: {model.name} has no experts to route to (MoE models only)")
    return replace(model, capacity_factor=factor)


def sequence_length_from_args(args: argparse.Namespace, model: ModelSpec, command: str) -> int:
    """--seq-len, checked against the model's positions: an error where they are learned (gpt2 has no position past
    its table), a warning on stderr where rotary positions extend past the context the model was trained at. Not
    given: DEFAULT_SEQUENCE_LENGTH, or the learned positions when fewer."""
    learned = model.max_positions if model.family == "gpt2" else 0
    if args.seq_len is None:
        return min(DEFAULT_SEQUENCE_LENGTH, learned) if learned else DEFAULT_SEQUENCE_LENGTH
    sequence_length: int = args.seq_len
    if not model.max_positions or sequence_length <= model.max_positions:
        return sequence_length
    if model.family == "gpt2":
        raise CliError(
            f"--seq-len {sequence_length} is more than {model.name}'s {model.max_positions} learned positions "
            f"(max_positions); give --seq-len {model.max_positions} or less"
        )
    print(
        f"shardscope {command}: warning: --seq-len {sequence_length} is more than {model.name}'s max_positions "
        f"{model.max_positions}; rotary positions extend, but the model was not trained at this length",
        file=sys.stderr,
    )
    return sequence_length


def gpu_from_args(args: argparse.Namespace) -> GpuSpec:
    """The GpuSpec of --gpu, with its memory replaced by --gpu-memory when that is given."""
    gpu = gpu_preset(args.gpu)
    if args.gpu_memory:
        memory = parse_bytes(args.gpu_memory)
        if memory < 1:
            raise CliError(f"--gpu-memory {args.gpu_memory} must be more than 0 bytes")
        return with_memory(gpu, memory, args.gpu_memory)
    return gpu


def strategy_names(args: argparse.Namespace, cluster: ClusterSpec) -> list[StrategyName]:
    """The strategies asked for; 'all' expands to the four stages plus hsdp where a shard group exists."""
    text: str = args.strategy
    if text == "all":
        grouped = bool(args.shard_group) or cluster.num_nodes > 1
        return list(comparable_strategies(grouped))
    words = [word.strip() for word in text.split(",") if word.strip()]
    if not words:
        raise CliError("--strategy is empty; give ddp, zero1, zero2, zero3, fsdp, hsdp, a comma list or all")
    return [parse_choice("Strategy.name", word, STRATEGIES) for word in words]


def step_from_args(args: argparse.Namespace, model: ModelSpec) -> TrainingSpec:
    """The step settings `plan` keeps fixed (sequence length, precision, optimizer, attention), the rest at their
    defaults."""
    return TrainingSpec(
        sequence_length=sequence_length_from_args(args, model, args.command),
        precision=args.precision,
        optimizer=args.optimizer,
        attention=args.attention,
    )


def training_from_args(args: argparse.Namespace, model: ModelSpec) -> TrainingSpec:
    """The whole step: the shared settings, the batch shape and checkpointing."""
    return replace(
        step_from_args(args, model),
        micro_batch_size=args.micro_batch,
        grad_accum_steps=args.grad_accum,
        checkpointing=args.checkpointing,
    )


def overheads_from_args(args: argparse.Namespace) -> Overheads:
    """--context-memory and --allocator-headroom."""
    return Overheads(context_bytes=parse_bytes(args.context_memory), allocator_headroom=args.allocator_headroom)


def scenarios_from_args(args: argparse.Namespace, names: Sequence[StrategyName] | None = None) -> list[Scenario]:
    """One Scenario per strategy named on the command line."""
    model = model_from_args(args)
    cluster = ClusterSpec(
        gpu=gpu_from_args(args), world_size=args.gpus, gpus_per_node=args.gpus_per_node, backend=args.backend
    )
    training = training_from_args(args, model)
    overheads = overheads_from_args(args)
    scenarios = []
    degrees = {"tp": args.tp, "cp": args.cp, "sequence_parallel": args.sequence_parallel, **pipeline_degrees(args)}
    replica = args.tp * args.cp
    group = args.shard_group or max(min(cluster.ranks_per_node // replica, args.gpus // (replica * args.pp)), 1)
    compared = Strategy(name="zero3", engine=args.engine, offload=args.offload, **degrees)
    for word in names or strategy_names(args, cluster):
        name = parse_choice("Strategy.name", word, STRATEGIES)
        if args.strategy == "all":  # a comparison: parameters are only offloaded where they are sharded
            strategy = compared.sibling(name, group)
        else:
            preset = DATA_PARALLEL_PRESETS[name]
            strategy = Strategy(
                name=name,
                engine=args.engine,
                shard_group=group if preset.groups_replicate else 0,
                offload=args.offload,
                **degrees,
            )
        scenarios.append(
            Scenario(model=model, cluster=cluster, training=training, strategy=strategy, overheads=overheads)
        )
    if args.ep > 1 and args.command == "trace":  # the scenarios are valid: their errors came first
        raise CliError(
            f"--ep {args.ep}: trace replays torch's own engines, which have no expert parallelism; estimate, timeline "
            "and report predict it, and run --engine paper runs it"
        )
    for warning in scenarios[0].warnings:
        print(f"shardscope {args.command}: warning: {warning}", file=sys.stderr)
    if args.shard_group and not any(scenario.strategy.preset.groups_replicate for scenario in scenarios):
        raise CliError(
            f"--shard-group {args.shard_group} is used only by hsdp, and --strategy {args.strategy} does not include it"
        )
    print_source(args)
    return scenarios
