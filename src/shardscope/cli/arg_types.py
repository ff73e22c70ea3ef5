"""argparse types of the scenario flags: each turns one word of the command line into a value or says, in one line,
what it wanted."""

from __future__ import annotations

import argparse

from shardscope.choices import EngineName, SpecError, engine_name, parse_checkpointing


def engine_word(text: str) -> EngineName:
    """argparse type: an engine, or another word for one ('teaching' is 'paper')."""
    try:
        return engine_name(text)
    except SpecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def checkpointing_mode(text: str) -> str:
    """argparse type: a checkpointing mode, including every:N."""
    try:
        return parse_checkpointing(text)
    except SpecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 ('8', not '0', '-1' or '2.5')."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def layer_list(text: str) -> tuple[int, ...]:
    """--pp-layers: whole numbers of at least 0, comma-separated."""
    words = text.split(",")
    if not all(word.strip().isdigit() and word.strip().isascii() for word in words):
        raise argparse.ArgumentTypeError(f"{text!r} must be whole numbers separated by commas, e.g. 8,8,8,8")
    return tuple(int(word) for word in words)
