"""Read one c10d op seen by the dispatch mode as a collective ledger entry (op, group size, payload bytes).

Payload follows core.result.CollectiveRow: the full buffer for all_reduce and broadcast, the unsharded (gathered)
size for all_gather and reduce_scatter, per rank per call.
"""

from __future__ import annotations

from typing import Any

import torch

from shardscope.trace.compat import resolve_group_size

c10d = torch.ops.c10d
functional = torch.ops._c10d_functional


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(item) for item in value)
    return 0


def _group_size(group: Any) -> int:
    return int(group.size()) if hasattr(group, "size") else resolve_group_size(group)


# op overload -> (ledger op, index of the process group argument, index of the argument whose bytes are the payload)
_IN_PLACE: dict[Any, tuple[str, int, int]] = {
    c10d.allreduce_.default: ("all_reduce", 1, 0),
    c10d.broadcast_.default: ("broadcast", 1, 0),
    c10d._allgather_base_.default: ("all_gather", 2, 0),
    c10d.allgather_.default: ("all_gather", 2, 0),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 2, 1),
    c10d.reduce_scatter_.default: ("reduce_scatter", 2, 1),
    c10d.allreduce_coalesced_.default: ("all_reduce", 1, 0),
}
# functional collectives name their group by size argument: (ledger op, size index, payload index, gathered)
_FUNCTIONAL: dict[Any, tuple[str, int, int, bool]] = {
    functional.all_reduce.default: ("all_reduce", -1, 0, False),
    functional.all_reduce_.default: ("all_reduce", -1, 0, False),
    functional.all_gather_into_tensor.default: ("all_gather", 1, 0, True),
    functional.reduce_scatter_tensor.default: ("reduce_scatter", 2, 0, False),
    functional.broadcast.default: ("broadcast", -1, 0, False),
}


def collective_entry(func: Any, args: tuple[Any, ...]) -> tuple[str, int, int] | None:
    """(op, group_size, payload_bytes) when func is a collective, else None."""
    if func in _IN_PLACE:
        op, group_index, payload_index = _IN_PLACE[func]
        return op, _group_size(args[group_index]), _nbytes(args[payload_index])
    if func in _FUNCTIONAL:
        op, size_index, payload_index, gathered = _FUNCTIONAL[func]
        group_name = args[-1] if isinstance(args[-1], str) else args[-2]
        size = resolve_group_size(group_name) if size_index < 0 else int(args[size_index])
        payload = _nbytes(args[payload_index]) * (size if gathered else 1)
        return op, size, payload
    return None


def is_collective(func: Any) -> bool:
    """The op is a collective the ledger counts."""
    return func in _IN_PLACE or func in _FUNCTIONAL
