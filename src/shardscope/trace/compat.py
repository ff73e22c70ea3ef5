"""Every private torch API the trace needs, in this one module, behind a version check with a clear message.

The fake process group (torch.testing._internal.distributed.fake_pg), the fake tensor mode (torch._subclasses),
the storage resize hook, DeviceMesh's flattening of axes, DTensor's shape propagation and what lets
DistributedDataParallel run on fake tensors (its shape check, its reducer's bucket rebuild) are not public and move
between releases; nothing else in shardscope.trace imports them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
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


def flatten_mesh(mesh: Any, name: str) -> Any:
    """One axis made of a DeviceMesh's axes, registered on its root mesh under `name` (so the root can be sliced by
    it), as torchtitan folds cp into FSDP's shard axis (DeviceMesh._flatten, private in torch 2.13)."""
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise TorchVersionError(
            f"context parallelism needs DeviceMesh._flatten (torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, tested with "
            f"{TESTED_TORCH}); found {torch.__version__}"
        )
    return flatten(name)


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


@contextmanager
def dtensor_shape_propagation(around: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """Run every shape propagation of DTensor's inside `around()`.

    To learn the global shape of an op's output, DTensor runs the op on fake tensors of the global shape
    (ShardingPropagator._propagate_tensor_meta_non_cached, torch 2.13). A real rank does that once per kind of call
    and caches the answer; under fake tensors DTensor takes itself to be traced by a compiler (_functional_collectives.
    _are_we_tracing() is true while a FakeTensorMode is active) and propagates anew at every call, so loss parallel's
    handlers (torch/distributed/tensor/parallel/loss.py) would show a replay global-size tensors no rank holds.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:
        raise TorchVersionError(
            f"tensor parallelism needs ShardingPropagator._propagate_tensor_meta_non_cached (torch >= "
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]}, tested with {TESTED_TORCH}); found {torch.__version__}"
        )

    def propagate(propagator: Any, *args: Any, **kwargs: Any) -> Any:
        with around():
            return original(propagator, *args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@contextmanager
def ddp_on_fake_tensors() -> Iterator[None]:
    """Let DistributedDataParallel be built over fake parameters.

    Its constructor checks every rank's parameter shapes by reading the parameters' data
    (torch.distributed.utils._verify_param_shape_across_processes), which fake tensors do not have. In a replay
    every rank is this one, so the check is skipped; the rest of the constructor (buckets, broadcast) runs as is.
    """
    import torch.nn.parallel.distributed as ddp_module

    original = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *_args, **_kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = original


def rebuild_ddp_buckets(ddp: Any) -> bool:
    """Run the DDP reducer's bucket rebuild (done by DDP itself at the second forward) on fake tensors.

    The rebuild writes the new bucket indices into int32 tensors and reads them back in C++ (Reducer::
    sync_bucket_indices); those few index tensors are made real, the buckets themselves stay fake.
    """
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    empty = torch.ops.aten.empty.memory_format

    class RealIndices(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is empty and kwargs.get("dtype") == torch.int32:
                with _disable_current_modes():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)

    with RealIndices():
        return bool(ddp.reducer._rebuild_buckets())
