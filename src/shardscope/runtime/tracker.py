"""The memory tracker of a real run: shardscope.measure.tracker's storage tracker with one tick per op of the main
thread, as a dispatch mode.

A storage lives from the tick of the op that first shows it (as an output, or registered before the step) to the
tick at which it is freed, and a storage made inside `measured_as('buffers')` has its size re-read every tick
(FSDP's resize_(0) trick). Each op notes the storages it uses, for the rule for frees of storages another thread
releases (measure/tracker.py). That is the case of gloo's reduce-scatter: ProcessGroupGloo::
reduce_scatter_tensor_coalesced clones its whole input in C++ (unseen: below the dispatch mode), all-reduces the
clone on a worker thread, and its wait() on the main thread copies this rank's chunk out (chunk and copy_, seen
here). Then the main thread and the worker (ProcessGroupGloo::runLoop keeps the finished work until its next
iteration) race to drop the clone, and when the worker is last it must take the GIL to release the storage's Python
object, so the release was seen whenever the interpreter switched threads: up to ~40 ops later, after the next
block's all-gather output was allocated, so the same case's measured peak changed from run to run
(tests/core/test_backend_peak.py). Without a tracker the worker frees the clone as soon as the work is done, before
the main thread's next allocation; after the copy-out the rank no longer needs it.
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardscope.measure.storage import current_label, holds_dtensor, tensors_in
from shardscope.measure.tracker import StorageTracker


class MemoryTracker(StorageTracker, TorchDispatchMode):
    """Live storage bytes by label at every op of the main thread, the peak, and what was live at the peak.

    Storages alive before tracking starts are registered with `register` (parameters, gradients, optimizer state,
    buffers). New storages take the label of an enclosing `measured_as`, else the current phase ('forward',
    'backward', 'optimizer'), so after the step their bytes can be read as activations or temporaries.
    """

    def __init__(self) -> None:
        StorageTracker.__init__(self)
        TorchDispatchMode.__init__(self)
        self.phase = "forward"

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        self.settle()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if holds_dtensor(args) or holds_dtensor(kwargs):
            return NotImplemented  # DTensor runs it as local ops and collectives, which come back here
        for tensor in tensors_in(tree_flatten((args, kwargs))[0]):
            self.used(tensor.untyped_storage())
        out = func(*args, **(kwargs or {}))
        label = current_label() or self.phase
        for tensor in tensors_in(out):
            storage = tensor.untyped_storage()
            if self.life_of(storage) is not None:
                self.used(storage)
            elif storage.nbytes() > 0 or label == "buffers":
                self.track(storage, label, resizable=label == "buffers")
        self.next_tick()
        return out
