"""Every closed set of words shardscope accepts, as a `Literal` type (so mypy catches a misspelt value) and the tuple
of its values derived from it (so argparse, validation messages and loops share one list)."""

from __future__ import annotations

from functools import cache
from typing import Literal, TypeVar, get_args


class SpecError(ValueError):
    """A spec field holds a value that is not allowed; the message names the field, the value and what is allowed."""


Family = Literal["gpt2", "llama", "moe", "count"]
Precision = Literal["fp32", "fp64", "bf16-mixed", "fp16-mixed", "bf16"]
OptimizerName = Literal["adamw", "adam", "sgd", "sgd-momentum"]
Checkpointing = Literal["none", "full", "selective", "op"]
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
Trigger = Literal[
    "before_forward",
    "before_backward",
    "after_backward",
    "after_step",
    "during_forward",
    "during_recompute",
    "during_backward",
]
CommGroup = Literal["world", "shard", "replica", "experts", "host", "tp", "cp", "pp", "ep"]
LedgerGroup = Literal["dp", "tp", "cp", "host", "pp", "ep"]
"""The mesh dimension a ledger row runs on: 'dp' the data-parallel ranks holding one tensor-parallel slice
(dp_replicate x dp_shard x cp, or a shard or replica group of them), 'tp', 'cp', 'host' (a GPU-host copy), 'pp'
(a point-to-point message between neighbouring pipeline stages), or 'ep' (the ranks that split the experts)."""
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
"""The order a pipeline runs its micro-batches in, as torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B do."""

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
LEDGER_GROUPS: tuple[LedgerGroup, ...] = get_args(LedgerGroup)
PIPELINE_SCHEDULES: tuple[PipelineSchedule, ...] = get_args(PipelineSchedule)

Word = TypeVar("Word", bound=str)


def parse_choice(what: str, word: str, allowed: tuple[Word, ...]) -> Word:
    """`word` as one of `allowed`; SpecError naming `what`, the word and the allowed ones otherwise."""
    for value in allowed:
        if word == value:
            return value
    raise SpecError(f"{what}={word!r} is not known; allowed: {', '.join(allowed)}")


EVERY_PREFIX = "every:"
"""`every:N`: full checkpointing of every N-th block; not a `Literal` word, so it has its own parser."""


def parse_checkpointing(word: str, what: str = "checkpointing") -> str:
    """`word` as a checkpointing mode: one of CHECKPOINTING or `every:N` with N a whole number of at least 1
    written without sign or leading zeros; SpecError naming `what` and the word otherwise."""
    if word in CHECKPOINTING:
        return word
    count = word[len(EVERY_PREFIX) :] if word.startswith(EVERY_PREFIX) else ""
    if count.isdigit() and count.isascii() and not count.startswith("0"):
        return word
    raise SpecError(f"{what}={word!r} is not known; allowed: {', '.join(CHECKPOINTING)}, or every:N with N >= 1")


def checkpoint_every(checkpointing: str) -> int:
    """How often a whole block is checkpointed: 1 under 'full', N under 'every:N', 0 otherwise."""
    if checkpointing == "full":
        return 1
    return int(checkpointing[len(EVERY_PREFIX) :]) if checkpointing.startswith(EVERY_PREFIX) else 0


def checkpoints_block(checkpointing: str, index: int) -> bool:
    """Whether block `index` (0 at the bottom) is checkpointed whole. torchtitan's selective layer AC counts the
    blocks it wraps from 1 and wraps one when `count % ac_freq == 0`, so `every:N` wraps blocks N-1, 2N-1, ...
    (torchtitan/distributed/activation_checkpoint.py, `_apply_layer_sac`, at commit dfb1a6ad9 of 2026-03-04; the
    layer option was removed on 2026-03-23 by 114151ad4)."""
    every = checkpoint_every(checkpointing)
    return every > 0 and (index + 1) % every == 0


@cache
def checkpointed_blocks(checkpointing: str, num_layers: int) -> tuple[bool, ...]:
    """`checkpoints_block` of each of `num_layers` blocks, bottom first, kept: the time model prices every block of
    every batch a planner search weighs."""
    return tuple(checkpoints_block(checkpointing, index) for index in range(num_layers))


ENGINE_ALIASES: dict[str, EngineName] = {"teaching": "paper"}
"""Other words for an engine: `run --engine teaching` runs the code the 'paper' engine predicts."""


def engine_name(word: str) -> EngineName:
    """The engine a word names (an engine or one of its aliases); SpecError naming the word otherwise."""
    if word in ENGINE_ALIASES:
        return ENGINE_ALIASES[word]
    return parse_choice("engine", word, ENGINES)


def require_choice(owner: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    """SpecError naming `owner.name`, the value and the allowed words when the value is not one of them."""
    if value not in allowed:
        raise SpecError(f"{owner}.{name}={value!r} is not known; allowed: {', '.join(allowed)}")


def require_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> None:
    """SpecError naming `owner.name` and the value when it is not a whole number between `low` and `high`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{owner}.{name}={value!r} must be a whole number")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise SpecError(f"{owner}.{name}={value} must be {bound}")
