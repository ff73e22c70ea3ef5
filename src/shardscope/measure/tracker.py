"""The storage tracker of a measured step, shared by replay (trace) and run (runtime): every storage's life on a
clock its owner advances, and what was live at each tick read back from those lives.

A storage lives from the tick at which it is first tracked to the tick at which it is freed; its label (the
category it counts in) and its size can change along the way (a gradient relabelled after backward, FSDP's
resize_(0) of a gathered parameter). The totals of any tick, the peak, what was live at it and each label's high
water are read from these lives after the step, so a free can be placed where it belongs even when it is reported
late. Who advances the clock is the owner's choice: a real run counts one tick per op of the main thread, a replay
one per change it wants to see (shardscope.runtime.tracker, shardscope.trace.tracker).

The rule for frees (what makes the peak deterministic): a storage freed by the main thread is freed at the tick
where its last reference went away, and is applied at once. A storage whose last reference is dropped by another
thread, a communication backend's worker, is freed right after the last main-thread op that used it (as an input
or an output): such a report is queued and applied on the main thread, so the bookkeeping is never modified by two
threads at once, and `settle` lets late reports arrive before the step is read (runtime/tracker.py tells the case
that needs it: gloo's reduce-scatter).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from shardscope.measure.storage import storages

NEVER = 1 << 62  # the end tick of a storage still alive


@dataclass
class Life:
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


_Value = TypeVar("_Value", int, str)


def _value_at(history: list[tuple[int, _Value]], tick: int, default: _Value) -> _Value:
    value = default
    for when, item in history:
        if when > tick:
            break
        value = item
    return value


class StorageTracker:
    """Live storage bytes by label at every tick, the peak, and what was live at the peak.

    `track` adds a storage (or finds its life), `relabel_life` and `resize` change one, `next_tick` closes the
    current tick. `on_alloc` and `on_free` are told of every life that starts and ends, in order, as it happens
    (a free reported by another thread when it is applied).
    """

    def __init__(self) -> None:
        self._owner = threading.get_ident()
        self._tick = 0
        self._lives: list[Life] = []  # by ident
        self._live: dict[int, Life] = {}  # storage address -> the life of the storage there now
        self._resizable: dict[int, Life] = {}  # ident -> a live life whose size is re-read every tick
        self._freed: collections.deque[tuple[int, int]] = collections.deque()  # (ident, tick) from other threads
        self._summary: _Summary | None = None  # of the last sweep, until something changes

    # --- lives ---------------------------------------------------------------------------------------------
    def track(self, storage: torch.UntypedStorage, label: str, resizable: bool = False) -> Life:
        """The life of a storage, started now under `label` when it is not tracked yet."""
        self._apply_frees()
        key = storage._cdata
        life = self._find(key, storage)
        if life is not None:
            return life
        ident = len(self._lives)
        life = Life(ident=ident, key=key, label=label, resizable=resizable, start=self._tick, last_use=self._tick)
        life.sizes.append((self._tick, storage.nbytes()))
        life.labels.append((self._tick, label))

        def report_free(_ref: weakref.ref[torch.UntypedStorage]) -> None:
            self._report_free(ident)

        life.ref = weakref.ref(storage, report_free)
        self._lives.append(life)
        self._live[key] = life
        self._set_resizable(life, resizable)
        self._summary = None
        self.on_alloc(life)
        return life

    def hold_for_tick(self, nbytes: int, label: str) -> None:
        """Bytes with no storage to follow that are live at the current tick only (what a backend holds for the
        length of one call)."""
        tick = self._tick
        life = Life(ident=len(self._lives), key=-1, label=label, resizable=False, start=tick, end=tick + 1)
        life.sizes.append((tick, nbytes))
        life.labels.append((tick, label))
        self._lives.append(life)
        self._summary = None
        self.on_alloc(life)
        self.on_free(life)

    def life_of(self, storage: torch.UntypedStorage) -> Life | None:
        """The life of a storage being tracked, if it is."""
        return self._find(storage._cdata, storage)

    def register(self, tensors: Iterable[torch.Tensor | None], label: str, resizable: bool = False) -> None:
        """Track the storages of existing tensors under a label (resizable: re-read their size every tick), then
        close the tick."""
        for storage in storages(tensors).values():
            life = self.track(storage, label, resizable)
            self._set_resizable(life, resizable)
            self.relabel_life(life, label)
        self.next_tick()

    def relabel(self, tensors: Iterable[torch.Tensor | None], label: str) -> None:
        """Give already-tracked storages a new label (e.g. gradients made in backward)."""
        self._apply_frees()
        for storage in storages(tensors).values():
            life = self.life_of(storage)
            if life is not None:
                self.relabel_life(life, label)

    def relabel_life(self, life: Life, label: str) -> None:
        if life.label != label:
            life.label = label
            life.labels.append((self._tick, label))
            self._summary = None

    def _set_resizable(self, life: Life, resizable: bool) -> None:
        life.resizable = resizable
        if resizable:
            self._resizable[life.ident] = life
        else:
            self._resizable.pop(life.ident, None)

    def resize(self, life: Life, nbytes: int) -> None:
        """The storage now holds nbytes (resized in place)."""
        if nbytes != life.nbytes:
            life.sizes.append((self._tick, nbytes))
            self._summary = None

    def used(self, storage: torch.UntypedStorage) -> None:
        """The main thread's current op uses this storage (the rule for frees of the module docstring)."""
        life = self.life_of(storage)
        if life is not None:
            life.last_use = self._tick

    def on_alloc(self, life: Life) -> None:
        """A life started (for a subclass that follows the allocation stream)."""

    def on_free(self, life: Life) -> None:
        """A life ended (for a subclass that follows the allocation stream)."""

    def _find(self, key: int, storage: torch.UntypedStorage) -> Life | None:
        """The life of this storage; None for a new one (an address is reused once its storage is freed, possibly
        before a free reported by another thread has been applied)."""
        life = self._live.get(key)
        if life is None or life.ref is None or life.ref() is not storage:
            return None
        return life

    def _report_free(self, ident: int) -> None:
        # Runs on whichever thread dropped the last reference: another thread only appends (atomic), and the main
        # thread applies it when it next touches the bookkeeping.
        if threading.get_ident() == self._owner:
            self._end(ident, self._tick)
        else:
            self._freed.append((ident, self._tick))

    def _end(self, ident: int, tick: int) -> None:
        life = self._lives[ident]
        life.end = max(life.start + 1, tick)
        if self._live.get(life.key) is life:
            del self._live[life.key]
        self._resizable.pop(ident, None)
        self._summary = None
        self.on_free(life)

    def _apply_frees(self) -> None:
        while self._freed:
            ident, tick = self._freed.popleft()
            # Freed by another thread: right after the main thread's last use (the module docstring's rule).
            self._end(ident, min(tick, self._lives[ident].last_use + 1))

    def next_tick(self) -> None:
        """Close the current tick: note the new size of every resizable storage that changed, count one tick."""
        self._apply_frees()
        for life in list(self._resizable.values()):
            storage = life.ref() if life.ref else None
            self.resize(life, storage.nbytes() if storage is not None else 0)
        self._tick += 1

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
    @property
    def tick(self) -> int:
        """The current tick (for a run, the op the main thread dispatches next)."""
        return self._tick

    def live_by_label(self) -> dict[str, int]:
        """Bytes live now, by label."""
        self._apply_frees()
        totals: dict[str, int] = {}
        for life in list(self._live.values()):
            storage = life.ref() if life.ref else None
            nbytes = storage.nbytes() if life.resizable and storage is not None else life.nbytes
            totals[life.label] = totals.get(life.label, 0) + nbytes
        return totals

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

    def totals_by_tick(self) -> Iterator[tuple[int, dict[str, int], int]]:
        """Replay every life tick by tick: (tick, bytes live by label, bytes live) at each closed tick. The dict is
        updated in place from one tick to the next: copy what is kept."""
        self._apply_frees()
        changes: dict[int, list[tuple[int, str]]] = {}
        for life in self._lives:
            for tick, delta, label in life.changes():
                changes.setdefault(tick, []).append((delta, label))
        totals: dict[str, int] = {}
        total = 0
        for tick in range(self._tick):
            for delta, label in changes.get(tick, ()):
                totals[label] = totals.get(label, 0) + delta
                total += delta
            yield tick, totals, total

    def _sweep(self) -> _Summary:
        """The peak, its first tick and each label's high water."""
        self._apply_frees()
        if self._summary is not None and self._summary.tick == self._tick:
            return self._summary
        summary = _Summary(tick=self._tick)
        for tick, totals, total in self.totals_by_tick():
            for label, value in totals.items():
                if value > summary.high_water.get(label, 0):
                    summary.high_water[label] = value
            if total > summary.peak_bytes:
                summary.peak_bytes, summary.peak_tick = total, tick
        self._summary = summary
        return summary

    @property
    def peak_bytes(self) -> int:
        """The most bytes live at any tick."""
        return self._sweep().peak_bytes

    @property
    def high_water(self) -> dict[str, int]:
        """Each label's largest size at any tick (by the label it had then)."""
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


@dataclass
class _Summary:
    tick: int
    peak_bytes: int = 0
    peak_tick: int = 0
    high_water: dict[str, int] = field(default_factory=dict)
