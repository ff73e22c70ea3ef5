"""Measurement on one rank: labels and storage counting for the memory tracker (`runtime/tracker.py`), and a
ledger of every collective, a dispatch mode.

Memory is counted by storage, never by tensor, so views and tied weights count once. Collectives are counted at the
c10d ops, which is where dist.all_reduce, DDP's reducer and FSDP2 all end up, so torch's own engines are counted
exactly like ours.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardscope.core.result import CollectiveRow, merge_ledger

_label: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardscope_label", default=None)


@contextlib.contextmanager
def measured_as(label: str) -> Iterator[None]:
    """Storages created inside count as `label` (e.g. 'buffers' for a gathered unit); a no-op when nothing measures."""
    token = _label.set(label)
    try:
        yield
    finally:
        _label.reset(token)


def current_label() -> str | None:
    """The label of the innermost enclosing `measured_as`, if any."""
    return _label.get()


def storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, torch.UntypedStorage]:
    """Distinct storages of tensors (DTensors by their local shard), keyed by the storage's identity."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        found[storage._cdata] = storage
    return found


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind tensors (padding and whole flat buffers included)."""
    return sum(storage.nbytes() for storage in storages(tensors).values())


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The real tensors in an op's arguments or result (DTensors by their local shard; meta tensors skipped)."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)  # a DTensor's storage is a wrapper; its shard is real
        if local.device.type != "meta":
            yield local
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)


# c10d op -> (ledger op, where the payload is: the argument that holds the full, unsharded buffer)
_C10D_OPS = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
}


def _payload(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


class CollectiveLedger(TorchDispatchMode):
    """Every collective while active, as ledger rows under the current phase (all_gather and reduce_scatter counted
    by their unsharded buffer, all_reduce and broadcast by the buffer)."""

    def __init__(self, on_call: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.phase = "setup"
        self.rows: list[CollectiveRow] = []
        self.recording = True
        self.calls_started = 0  # every collective entered, recorded or not: a hung rank has started fewer
        self.on_call = on_call

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d" and self.on_call is not None:
            self.calls_started += 1
            self.on_call(self.calls_started)
        out = func(*args, **(kwargs or {}))
        if self.recording and func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            if name in _C10D_OPS:
                op, where = _C10D_OPS[name]
                boxed = next(a for a in args if isinstance(a, torch.ScriptObject))  # the ProcessGroup comes first
                group = torch.distributed.ProcessGroup.unbox(boxed)
                self.rows.append(
                    CollectiveRow(
                        phase=self.phase,
                        op=op,
                        group_size=int(group.size()),
                        payload_bytes=_payload(args[where]),
                        count=1,
                    )
                )
        return out

    def merged(self) -> tuple[CollectiveRow, ...]:
        """The rows added up by phase, op, group size and payload."""
        return merge_ledger(self.rows)
