"""Storages, not tensors: views and tied weights count once, a DTensor by its local shard. And the label a
storage created inside `measured_as` takes (e.g. 'buffers' for a gathered unit)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_label: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardscope_label", default=None)


@contextlib.contextmanager
def measured_as(label: str) -> Iterator[None]:
    """Storages created inside count as `label`; a no-op when nothing measures."""
    token = _label.set(label)
    try:
        yield
    finally:
        _label.reset(token)


def current_label() -> str | None:
    """The label of the innermost enclosing `measured_as`, if any."""
    return _label.get()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, the tensor an AsyncCollectiveTensor (what a functional
    collective returns on a real process group, until it is waited on) wraps, or the tensor itself. A wrapper's
    own storage holds no bytes of its own: counting it would count the collective's output twice."""
    inner = getattr(tensor, "_local_tensor", None)
    if inner is None and type(tensor).__name__ == "AsyncCollectiveTensor":
        inner = getattr(tensor, "elem", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def holds_dtensor(value: Any) -> bool:
    """Whether an op's arguments hold a DTensor. A dispatch mode that measures returns NotImplemented for such an op:
    DTensor then runs it as the ops on local shards and the collectives it desugars to (its redistributions, loss
    parallel's reductions), which reach the mode, so a replay and a run see each byte and each call."""
    if isinstance(value, torch.Tensor):
        return hasattr(value, "_local_tensor")
    if isinstance(value, list | tuple):
        return any(holds_dtensor(item) for item in value)
    if isinstance(value, dict):
        return any(holds_dtensor(item) for item in value.values())
    return False


def storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, torch.UntypedStorage]:
    """Distinct storages of tensors (DTensors by their local shard), keyed by the storage's identity."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = local_tensor(tensor).untyped_storage()
        found[storage._cdata] = storage
    return found


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind tensors (padding and whole flat buffers included)."""
    return sum(storage.nbytes() for storage in storages(tensors).values())


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The real tensors in an op's arguments or result (DTensors by their local shard; meta tensors skipped)."""
    if isinstance(value, torch.Tensor):
        local = local_tensor(value)  # a DTensor's storage is a wrapper; its shard is real
        if local.device.type != "meta":
            yield local
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
