"""The storage-level memory tracker of a measured step: every storage's life on a clock of the main thread's ops.

Each op the main thread dispatches is one tick. A storage lives from the tick of the op that first shows it (as an
output, or registered before the step) to the tick at which it is freed, and its size is re-read every tick when it
changes in place (FSDP's resize_(0) trick). The peak, what was live at it and each label's high water are read
from these lives after the step, so a free can be placed where it belongs even when it is reported late.

The rule for frees (what makes the peak deterministic): a storage freed by the main thread is freed at the tick
where its last reference went away. A storage whose last reference is dropped by another thread, a communication
backend's worker, is freed right after the last main-thread op that used it (as an input or an output). That is the
case of gloo's reduce-scatter: ProcessGroupGloo::reduce_scatter_tensor_coalesced clones its whole input in C++
(unseen: below the dispatch mode), all-reduces the clone on a worker thread, and its wait() on the main thread
copies this rank's chunk out (chunk and copy_, seen here). Then the main thread and the worker
(ProcessGroupGloo::runLoop keeps the finished work until its next iteration) race to drop the clone, and when the
worker is last it must take the GIL to release the storage's Python object, so the release was seen whenever the
interpreter switched threads: up to ~40 ops later, after the next block's all-gather output was allocated, so the
same case's measured peak changed from run to run (tests/core/test_backend_peak.py). Without a tracker the
worker frees the clone as soon as the work is done, before the main thread's next allocation; after the copy-out
the rank no longer needs it. Frees reported by other threads are queued and applied on the main thread, so the
bookkeeping is never modified by two threads at once; `settle` lets late reports arrive before the step is read.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardscope.measure.storage import current_label, storages, tensors_in

NEVER = 1 << 62  # the end tick of a storage still alive


@dataclass
class _Life:
    """One storage's life: ticks [start, end), its size and label over time."""

    ident: int
    key: int  # the storage's address (_cdata) while it lives
    label: str
    resizable: bool
    start: int
    end: int = NEVER
    last_use: int = 0
    sizes: list[tuple[int, int]] = field(default_factory=list)  # (tick, bytes) whenever the size changed
    labels: list[tuple[int, str]] = field(default_factory=list)  # (tick, label) whenever the label changed
    ref: weakref.ref[torch.UntypedStorage] | None = None

    @property
    def nbytes(self) -> int:
        return self.sizes[-1][1]

    def size_at(self, tick: int) -> int:
        return _value_at(self.sizes, tick, 0)

    def changes(self) -> list[tuple[int, int, str]]:
        """(tick, bytes added, label) at every tick where this storage's size or label changed, and its end."""
        found: list[tuple[int, int, str]] = []
        size, label = 0, self.labels[0][1]
        for tick in sorted({tick for tick, _ in self.sizes} | {tick for tick, _ in self.labels}):
            if tick >= self.end:
                break
            new_size, new_label = self.size_at(tick), _value_at(self.labels, tick, label)
            if new_label != label:
                found += [(tick, -size, label), (tick, new_size, new_label)]
            elif new_size != size:
                found.append((tick, new_size - size, label))
            size, label = new_size, new_label
        if self.end < NEVER:
            found.append((self.end, -size, label))
        return found


def _value_at(history: list[tuple[int, Any]], tick: int, default: Any) -> Any:
    value = default
    for when, item in history:
        if when > tick:
            break
        value = item
    return value


class MemoryTracker(TorchDispatchMode):
    """Live storage bytes by label at every op of the main thread, the peak, and what was live at the peak.

    Storages alive before tracking starts are registered with `register` (parameters, gradients, optimizer state,
    buffers). New storages take the label of an enclosing `measured_as`, else the current phase ('forward',
    'backward', 'optimizer'), so after the step their bytes can be read as activations or temporaries.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self._owner = threading.get_ident()
        self._tick = 0
        self._lives: list[_Life] = []  # by ident
        self._live: dict[int, _Life] = {}  # storage address -> the life of the storage there now
        self._freed: collections.deque[tuple[int, int, bool]] = collections.deque()  # (ident, tick, on main)
        self._summary: tuple[int, _Summary] | None = None  # (tick, summary) of the last sweep

    # --- lives ---------------------------------------------------------------------------------------------
    def register(self, tensors: Iterable[torch.Tensor | None], label: str, resizable: bool = False) -> None:
        """Track the storages of existing tensors under a label (resizable: re-read their size on every op)."""
        self._apply_frees()
        for key, storage in storages(tensors).items():
            life = self._find(key, storage)
            if life is None:
                self._add(key, storage, label, resizable)
            else:
                life.resizable = resizable
                self._relabel(life, label)
        self._next_tick()

    def relabel(self, tensors: Iterable[torch.Tensor | None], label: str) -> None:
        """Give already-tracked storages a new label (e.g. gradients made in backward)."""
        self._apply_frees()
        for key, storage in storages(tensors).items():
            life = self._find(key, storage)
            if life is not None:
                self._relabel(life, label)

    def _relabel(self, life: _Life, label: str) -> None:
        if life.label != label:
            life.label = label
            life.labels.append((self._tick, label))

    def _find(self, key: int, storage: torch.UntypedStorage) -> _Life | None:
        """The life of this storage; None for a new one (an address is reused once its storage is freed, possibly
        before that free has been applied)."""
        life = self._live.get(key)
        if life is None or life.ref is None or life.ref() is not storage:
            return None
        return life

    def _add(self, key: int, storage: torch.UntypedStorage, label: str, resizable: bool) -> None:
        ident = len(self._lives)
        life = _Life(ident=ident, key=key, label=label, resizable=resizable, start=self._tick, last_use=self._tick)
        life.sizes.append((self._tick, storage.nbytes()))
        life.labels.append((self._tick, label))
        life.ref = weakref.ref(storage, lambda _ref, ident=ident: self._report_free(ident))
        self._lives.append(life)
        self._live[key] = life

    def _report_free(self, ident: int) -> None:
        # Runs on whichever thread dropped the last reference: only an atomic append here, applied on the main one.
        self._freed.append((ident, self._tick, threading.get_ident() == self._owner))

    def _apply_frees(self) -> None:
        while self._freed:
            ident, tick, on_main = self._freed.popleft()
            life = self._lives[ident]
            # Freed by another thread: right after the main thread's last use (the module docstring's rule).
            life.end = max(life.start + 1, tick if on_main else min(tick, life.last_use + 1))
            if self._live.get(life.key) is life:
                del self._live[life.key]

    def _next_tick(self) -> None:
        """Close the current tick: note the new size of every resizable storage that changed, count one op."""
        for life in list(self._live.values()):
            if life.resizable:
                storage = life.ref() if life.ref else None
                nbytes = storage.nbytes() if storage is not None else 0
                if nbytes != life.nbytes:
                    life.sizes.append((self._tick, nbytes))
        self._tick += 1

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        self.settle()

    def settle(self, wait_s: float = 0.2, quiet_s: float = 0.01) -> None:
        """Let frees still owed by other threads arrive (a worker waiting for the GIL reports while this thread
        sleeps), then apply them: sleeps quiet_s at a time until one passes without a new report, at most wait_s."""
        deadline = time.monotonic() + wait_s
        seen = -1
        while seen != len(self._freed) and time.monotonic() < deadline:
            seen = len(self._freed)
            time.sleep(quiet_s)
        self._apply_frees()

    def backdate_survivors(self, first_label: str, label: str) -> int:
        """Storages first seen under first_label and still alive now existed before the step (a C++ owner, such
        as DDP's reducer, handed them out): count them from the step's start under `label`; returns their bytes."""
        self._apply_frees()
        moved = 0
        for life in self._lives:
            if life.end == NEVER and life.labels[0][1] == first_label and life.label == first_label:
                life.start, life.last_use, life.label = 0, 0, label
                life.sizes = [(0, life.nbytes)]
                life.labels = [(0, label)]
                moved += life.nbytes
        self._summary = None
        return moved

    # --- reading ----------------------------------------------------------------------------------------------
    def live_by_label(self) -> dict[str, int]:
        """Bytes live now, by label."""
        self._apply_frees()
        totals: dict[str, int] = {}
        for life in list(self._live.values()):
            storage = life.ref() if life.ref else None
            nbytes = storage.nbytes() if life.resizable and storage is not None else life.nbytes
            totals[life.label] = totals.get(life.label, 0) + nbytes
        return totals

    @property
    def tick(self) -> int:
        """The current tick: the op the main thread dispatches next."""
        return self._tick

    def live_by_label_at(self, tick: int) -> dict[str, int]:
        """Bytes live at a tick, by the label each storage had then, under the rule for frees: read it after the
        step (a free owed by another thread may be reported after the tick has passed)."""
        self._apply_frees()
        totals: dict[str, int] = {}
        for life in self._lives:
            if life.start <= tick < life.end:
                label = _value_at(life.labels, tick, life.label)
                totals[label] = totals.get(label, 0) + life.size_at(tick)
        return totals

    def _sweep(self) -> _Summary:
        """Replay every life tick by tick: the peak, its first tick and each label's high water."""
        self._apply_frees()
        if self._summary is not None and self._summary[0] == self._tick and not self._freed:
            return self._summary[1]
        changes: dict[int, list[tuple[int, str]]] = {}
        for life in self._lives:
            for tick, delta, label in life.changes():
                changes.setdefault(tick, []).append((delta, label))
        totals: dict[str, int] = {}
        summary = _Summary()
        total = 0
        for tick in range(self._tick):
            for delta, label in changes.get(tick, ()):
                totals[label] = totals.get(label, 0) + delta
                total += delta
            for label, value in totals.items():
                if value > summary.high_water.get(label, 0):
                    summary.high_water[label] = value
            if total > summary.peak_bytes:
                summary.peak_bytes, summary.peak_tick = total, tick
        self._summary = (self._tick, summary)
        return summary

    @property
    def peak_bytes(self) -> int:
        """The most bytes live at any op."""
        return self._sweep().peak_bytes

    @property
    def high_water(self) -> dict[str, int]:
        """Each label's largest size at any op (by the label it had then)."""
        return dict(self._sweep().high_water)

    @property
    def peak_live(self) -> list[tuple[int, int]]:
        """(ident, bytes) of every storage live at the peak."""
        tick = self._sweep().peak_tick
        return [(life.ident, life.size_at(tick)) for life in self._lives if life.start <= tick < life.end]

    def peak_by_final_label(self) -> dict[str, int]:
        """What was live at the peak, by each storage's last label (gradients relabelled after backward count as
        gradients even if the peak came while they were being made)."""
        totals: dict[str, int] = {}
        for ident, nbytes in self.peak_live:
            label = self._lives[ident].label
            totals[label] = totals.get(label, 0) + nbytes
        return totals

    # --- the dispatch hook ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._apply_frees()
        for tensor in tensors_in(tree_flatten((args, kwargs))[0]):
            storage = tensor.untyped_storage()
            used = self._find(storage._cdata, storage)
            if used is not None:
                used.last_use = self._tick
        out = func(*args, **(kwargs or {}))
        label = current_label() or self.phase
        for tensor in tensors_in(out):
            storage = tensor.untyped_storage()
            made = self._find(storage._cdata, storage)
            if made is not None:
                made.last_use = self._tick
            elif storage.nbytes() > 0 or label == "buffers":
                self._add(storage._cdata, storage, label, resizable=label == "buffers")
        self._apply_frees()
        self._next_tick()
        return out


@dataclass
class _Summary:
    peak_bytes: int = 0
    peak_tick: int = 0
    high_water: dict[str, int] = field(default_factory=dict)
