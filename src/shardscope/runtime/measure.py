"""Measurement on one rank: a storage-level memory tracker and a ledger of every collective, both dispatch modes.

Memory is counted by storage, never by tensor, so views and tied weights count once. The tracker sees every storage
an aten op creates while it is active, frees through weak references, and storages that change size in place (FSDP's
resize_(0) trick) by re-reading their size on every op. Collectives are counted at the c10d ops, which is where
dist.all_reduce, DDP's reducer and FSDP2 all end up, so torch's own engines are counted exactly like ours.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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


@dataclass
class _Tracked:
    ident: int
    nbytes: int
    label: str
    resizable: bool
    ref: weakref.ref[torch.UntypedStorage] | None = None


class MemoryTracker(TorchDispatchMode):
    """Live storage bytes by label at every op, the peak, and what was live at the peak.

    Storages alive before tracking starts are registered with `register` (parameters, gradients, optimizer state,
    buffers). New storages take the label of an enclosing `measured_as`, else the current phase ('forward',
    'backward', 'optimizer'), so after the step their bytes can be read as activations or temporaries.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self._live: dict[int, _Tracked] = {}  # storage _cdata -> record
        self._final_label: dict[int, str] = {}  # ident -> label, kept after the storage dies
        self._next_ident = 0
        self._fixed_bytes = 0  # sum of non-resizable live records
        self.peak_bytes = 0
        self.peak_live: list[tuple[int, int]] = []  # (ident, bytes) at the peak
        self.high_water: dict[str, int] = {}

    def register(self, tensors: Iterable[torch.Tensor | None], label: str, resizable: bool = False) -> None:
        """Track the storages of existing tensors under a label (resizable: re-read their size on every op)."""
        for key, storage in storages(tensors).items():
            if key in self._live:
                self.relabel_key(key, label, resizable)
            else:
                self._add(key, storage, label, resizable)
        self._sample()

    def relabel(self, tensors: Iterable[torch.Tensor | None], label: str) -> None:
        """Give already-tracked storages a new label (e.g. gradients made in backward)."""
        for key in storages(tensors):
            if key in self._live:
                self.relabel_key(key, label, self._live[key].resizable)

    def relabel_key(self, key: int, label: str, resizable: bool) -> None:
        record = self._live[key]
        if not record.resizable:
            self._fixed_bytes -= record.nbytes
        record.label, record.resizable = label, resizable
        if not resizable:
            self._fixed_bytes += record.nbytes
        self._final_label[record.ident] = label

    def _add(self, key: int, storage: torch.UntypedStorage, label: str, resizable: bool) -> None:
        record = _Tracked(ident=self._next_ident, nbytes=storage.nbytes(), label=label, resizable=resizable)
        self._next_ident += 1
        record.ref = weakref.ref(storage, lambda _ref, key=key, ident=record.ident: self._free(key, ident))
        self._live[key] = record
        self._final_label[record.ident] = label
        if not resizable:
            self._fixed_bytes += record.nbytes

    def _free(self, key: int, ident: int) -> None:
        record = self._live.get(key)
        if record is not None and record.ident == ident:
            del self._live[key]
            if not record.resizable:
                self._fixed_bytes -= record.nbytes

    def live_bytes(self) -> int:
        """Bytes of all tracked storages now."""
        resizable = 0
        for record in list(self._live.values()):  # a weakref callback may drop entries mid-loop
            if record.resizable:
                storage = record.ref() if record.ref else None
                record.nbytes = storage.nbytes() if storage is not None else 0
                resizable += record.nbytes
        return self._fixed_bytes + resizable

    def live_by_label(self) -> dict[str, int]:
        """Bytes live now, by label."""
        self.live_bytes()
        totals: dict[str, int] = {}
        for record in list(self._live.values()):  # a weakref callback may drop entries mid-loop
            totals[record.label] = totals.get(record.label, 0) + record.nbytes
        return totals

    def _sample(self) -> None:
        by_label = self.live_by_label()
        for label, value in by_label.items():
            self.high_water[label] = max(self.high_water.get(label, 0), value)
        live = sum(by_label.values())
        if live > self.peak_bytes:
            self.peak_bytes = live
            self.peak_live = [(record.ident, record.nbytes) for record in list(self._live.values())]

    def peak_by_final_label(self) -> dict[str, int]:
        """What was live at the peak, by each storage's last label (gradients relabelled after backward count as
        gradients even if the peak came while they were being made)."""
        totals: dict[str, int] = {}
        for ident, nbytes in self.peak_live:
            label = self._final_label.get(ident, "unknown")
            totals[label] = totals.get(label, 0) + nbytes
        return totals

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        label = _label.get() or self.phase
        for tensor in _tensors_in(out):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key not in self._live and (storage.nbytes() > 0 or label == "buffers"):
                self._add(key, storage, label, resizable=label == "buffers")
        self._sample()
        return out


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)  # a DTensor's storage is a wrapper; its shard is real
        if local.device.type != "meta":
            yield local
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item)


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
    return sum(t.numel() * t.element_size() for t in _tensors_in(value))


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
