"""Every private torch API the trace needs, in this one module, behind a version check with a clear message.

The fake process group (torch.testing._internal.distributed.fake_pg), the fake tensor mode (torch._subclasses),
the FSDP2-based `replicate` (torch.distributed._composable.replicate_with_fsdp) and the storage resize hook are
not public and move between releases; nothing else in shardscope.trace imports them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

MIN_TORCH = (2, 9)
TESTED_TORCH = "2.13"


class TorchVersionError(RuntimeError):
    """The installed torch lacks an API the trace needs."""


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def require_torch() -> None:
    """Raise TorchVersionError naming the needed version when the private APIs are missing."""
    if _version() < MIN_TORCH:
        raise TorchVersionError(
            f"shardscope trace needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (tested with "
            f"{TESTED_TORCH}); found {torch.__version__}"
        )
    try:
        for name in (
            "torch.distributed._composable.replicate_with_fsdp",
            "torch.testing._internal.distributed.fake_pg",
            "torch._subclasses.fake_tensor",
        ):
            importlib.import_module(name)
    except ImportError as error:
        raise TorchVersionError(
            f"shardscope trace needs torch's fake process group and fake tensors (torch >= "
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]}, tested with {TESTED_TORCH}); found "
            f"{torch.__version__}: {error}"
        ) from None


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group of world_size ranks that only pretends to communicate (this process is `rank`)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def fake_tensor_mode() -> Any:
    """A FakeTensorMode that accepts the meta-device modules FSDP hands it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """The exceptions fake tensors raise on an op whose output depends on the data (nonzero, item, ...)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    return DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException


def fsdp_replicate() -> Callable[..., Any]:
    """torch's FSDP2-based `replicate` (DDP semantics on the fully_shard machinery; runs on fake tensors)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


@contextmanager
def storage_resize_hook(on_resize: Callable[[torch.UntypedStorage, int, int], None]) -> Iterator[None]:
    """Call on_resize(storage, old_bytes, new_bytes) on every UntypedStorage.resize_.

    FSDP2 frees and re-allocates gathered parameters by resizing their storage in place, which no dispatch mode
    sees, so the tracker learns of it here.
    """
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        old = storage.nbytes()
        result = original(storage, size)
        on_resize(storage, old, storage.nbytes())
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


def resolve_group_size(group: Any) -> int:
    """Ranks in a process group, given by name (functional collectives) or as the boxed object c10d ops receive."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, str):
        return int(_resolve_process_group(group).size())
    return int(dist.ProcessGroup.unbox(group).size())
