"""The one table from c10d ops to collective ledger rows, and the dispatch mode that keeps a run's ledger.

Collectives are read at the c10d ops, which is where dist.all_reduce, DDP's reducer and FSDP2 all end up, so
torch's own engines are counted exactly like ours, on a real process group and on the fake one of a replay; point-to-
point send and recv too (ring attention's, a pipeline's), one row per call with the bytes of the tensor it moves.
Payload follows core.result.CollectiveRow: the full buffer for all_reduce and broadcast, the unsharded (gathered)
size for all_gather and reduce_scatter, per rank per call.

A row's group (dp, tp or cp) is found by the ranks the call ran over: `name_axes` learns the ranks of each axis of
this rank's DeviceMesh; a group of other ranks (the world's, DDP's) is 'dp'. DTensor's redistributions (tensor
parallelism's all-gathers, reduce-scatters and all-reduces) reach the dispatch mode as the functional collectives
they are made of, on local tensors, so they are counted like any other call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardscope.choices import LedgerGroup
from shardscope.core.result import CollectiveRow, merge_ledger
from shardscope.measure.storage import holds_dtensor, tensors_in

# c10d op -> (ledger op, index of the argument that holds the full, unsharded buffer); the group is the boxed
# ProcessGroup among the arguments
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
    "send": ("send", 0),  # point to point (ring attention's exchange): the tensor sent or received
    "recv_": ("recv", 0),
    "alltoall_base_": ("all_to_all", 1),  # all_to_all_single: the send buffer, as core/expert_parallel.py counts
    "alltoall_": ("all_to_all", 1),
}
# functional collective (its group is named by its last string argument) -> (ledger op, whether the payload, its
# first argument, is one rank's part of the gathered buffer)
_FUNCTIONAL_OPS = {
    "all_reduce": ("all_reduce", False),
    "all_reduce_": ("all_reduce", False),
    "all_gather_into_tensor": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "broadcast": ("broadcast", False),
}


def _payload(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def _group_by_name(group_name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group  # private: this module's only one

    return _resolve_process_group(group_name)


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group, in order."""
    return tuple(torch.distributed.get_process_group_ranks(group))


AXIS_GROUPS: dict[str, LedgerGroup] = {"tp": "tp", "cp": "cp", "pp": "pp"}
"""Ledger group of a DeviceMesh axis by its name; every other axis (dp, replicate, shard) is data parallel."""


def collective_entry(func: Any, args: tuple[Any, ...]) -> tuple[str, Any, int] | None:
    """(ledger op, process group, payload bytes) when func is a collective the ledger counts, else None."""
    namespace = getattr(func, "namespace", "")
    if namespace not in ("c10d", "_c10d_functional"):
        return None
    name = func._schema.name.split("::")[-1]
    if namespace == "c10d" and name in _C10D_OPS:
        op, where = _C10D_OPS[name]
        boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
        group = _group_by_name(torch.distributed.ProcessGroup.unbox(boxed).group_name)
        return op, group, _payload(args[where])
    if namespace == "_c10d_functional" and name in _FUNCTIONAL_OPS:
        op, gathered = _FUNCTIONAL_OPS[name]
        group = _group_by_name(next(a for a in reversed(args) if isinstance(a, str)))
        return op, group, _payload(args[0]) * (group.size() if gathered else 1)
    return None


class CollectiveLedger(TorchDispatchMode):
    """Every collective while active, as ledger rows under the current phase."""

    def __init__(self, on_call: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.phase = "setup"
        self.rows: list[CollectiveRow] = []
        self.recording = True
        self.calls_started = 0  # every c10d op entered, recorded or not: a hung rank has started fewer
        self.on_call = on_call
        self.axes: dict[tuple[int, ...], LedgerGroup] = {}
        """Ledger group by the ranks of each axis of this rank's mesh (`name_axes`)."""
        self.message_phases: dict[int, str] = {}
        """The phase of a send or recv by the id of the tensor it moves, where the phase of the call is not the
        message's: torch's pipeline schedules batch one forward's send with another backward's receive."""

    def name_axes(self, mesh: Any) -> None:
        """Learn the ranks of each axis of a DeviceMesh (this rank's row of it), so its calls get the axis's group."""
        for axis in mesh.mesh_dim_names or ():
            self.axes[group_ranks(mesh.get_group(axis))] = AXIS_GROUPS.get(axis, "dp")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if holds_dtensor(args) or holds_dtensor(kwargs):
            return NotImplemented  # DTensor runs it as local ops and collectives, which come back here
        if func.namespace == "c10d" and self.on_call is not None:
            self.calls_started += 1
            self.on_call(self.calls_started)
        out = func(*args, **(kwargs or {}))
        if self.recording:
            self.record(func, args, self.phase)
        return out

    def record(self, func: Any, args: tuple[Any, ...], phase: str) -> None:
        """Add a row when func is a collective."""
        entry = collective_entry(func, args)
        if entry is not None:
            op, group, payload = entry
            if op in ("send", "recv") and self.message_phases:
                phase = next((self.message_phases.get(id(t), phase) for t in tensors_in(args[0])), phase)
            ranks = group_ranks(group)
            axis = self.axes.get(ranks, "dp")
            # a pipeline's message goes between two neighbouring stages, whichever group torch's schedule names
            size = 2 if axis == "pp" and op in ("send", "recv") else len(ranks)
            self.rows.append(
                CollectiveRow(
                    phase=phase,
                    op=op,
                    group=axis,
                    group_size=size,
                    payload_bytes=payload,
                    count=1,
                )
            )

    def merged(self) -> tuple[CollectiveRow, ...]:
        """The rows added up by phase, op, group size and payload."""
        return merge_ledger(self.rows)
