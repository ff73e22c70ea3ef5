"""Every closed set of words shardscope accepts, as a `Literal` type (so mypy catches a misspelt value) and the tuple
of its values derived from it (so argparse, validation messages and loops share one list)."""

from __future__ import annotations

from typing import Literal, TypeVar, get_args


class SpecError(ValueError):
    """A spec field holds a value that is not allowed; the message names the field, the value and what is allowed."""


Family = Literal["gpt2", "llama", "moe", "count"]
Precision = Literal["fp32", "fp64", "bf16-mixed", "fp16-mixed", "bf16"]
OptimizerName = Literal["adamw", "adam", "sgd", "sgd-momentum"]
Checkpointing = Literal["none", "full", "selective"]
Attention = Literal["eager", "sdpa"]
StrategyName = Literal["ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"]
Offload = Literal["none", "optimizer", "optimizer+params"]
EngineName = Literal["paper", "pytorch", "deepspeed"]
Backend = Literal["nccl", "gloo"]
CollectiveOp = Literal[
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "all_to_all",
    "send",
    "recv",
    "host_to_device",
    "device_to_host",
]
Trigger = Literal["before_forward", "before_backward", "after_backward", "after_step"]
CommGroup = Literal["world", "shard", "replica", "host"]

FAMILIES: tuple[Family, ...] = get_args(Family)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)
CHECKPOINTING: tuple[Checkpointing, ...] = get_args(Checkpointing)
ATTENTION: tuple[Attention, ...] = get_args(Attention)
STRATEGIES: tuple[StrategyName, ...] = get_args(StrategyName)
OFFLOADS: tuple[Offload, ...] = get_args(Offload)
ENGINES: tuple[EngineName, ...] = get_args(EngineName)
BACKENDS: tuple[Backend, ...] = get_args(Backend)
COLLECTIVE_OPS: tuple[CollectiveOp, ...] = get_args(CollectiveOp)
TRIGGERS: tuple[Trigger, ...] = get_args(Trigger)
COMM_GROUPS: tuple[CommGroup, ...] = get_args(CommGroup)

Word = TypeVar("Word", bound=str)


def parse_choice(what: str, word: str, allowed: tuple[Word, ...]) -> Word:
    """`word` as one of `allowed`; SpecError naming `what`, the word and the allowed ones otherwise."""
    for value in allowed:
        if word == value:
            return value
    raise SpecError(f"{what}={word!r} is not known; allowed: {', '.join(allowed)}")


ENGINE_ALIASES: dict[str, EngineName] = {"teaching": "paper"}
"""Other words for an engine: `run --engine teaching` runs the code the 'paper' engine predicts."""


def engine_name(word: str) -> EngineName:
    """The engine a word names (an engine or one of its aliases); SpecError naming the word otherwise."""
    if word in ENGINE_ALIASES:
        return ENGINE_ALIASES[word]
    return parse_choice("engine", word, ENGINES)
