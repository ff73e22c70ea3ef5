"""Replay speed of the caching allocator model (shardscope.core.allocator) on a training-like stream.

The stream: model states allocated once, then steps of forward activations freed in reverse in backward, gathered
buffers and temporaries of mixed sizes in between. Prints events per second for the default allocator and for
expandable segments. Run: PYTHONPATH=src .venv/bin/python benchmarks/bench_allocator.py [--events N]
"""

from __future__ import annotations

import argparse
import random
import time

from shardscope.core.allocator import FREE, AllocatorConfig, Event, replay

MiB = 1 << 20


def training_stream(events: int, seed: int = 0) -> list[Event]:
    """About `events` events shaped like a transformer step: states, then per-block activations and temporaries."""
    rng = random.Random(seed)
    stream: list[Event] = []
    handle = 0
    for _ in range(200):  # parameters and optimizer state, held throughout
        stream.append((handle, rng.choice((4 * MiB, 16 * MiB, 64 * MiB, 2048))))
        handle += 1
    while len(stream) < events:
        saved: list[int] = []
        for _block in range(32):
            for _op in range(20):
                size = rng.choice((rng.randrange(512, 64 * 1024), rng.randrange(1, 8) * MiB, 24 * MiB))
                stream.append((handle, size))
                if rng.random() < 0.5:
                    saved.append(handle)
                else:
                    stream.append((handle, FREE))
                handle += 1
        for kept in reversed(saved):
            stream += [(handle, 3 * MiB), (kept, FREE), (handle, FREE)]
            handle += 1
    return stream[:events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    args = parser.parse_args()
    stream = training_stream(args.events)
    print(f"{len(stream)} events")
    for name, config in (("segments", AllocatorConfig()), ("expandable", AllocatorConfig(expandable_segments=True))):
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            peaks = replay(stream, config)
            best = min(best, time.perf_counter() - started)
        print(
            f"{name:>10}: {best * 1e3:7.1f} ms  {len(stream) / best / 1e6:5.2f} M events/s  "
            f"allocated peak {peaks.allocated_peak_bytes / 2**30:.2f} GiB  "
            f"reserved peak {peaks.reserved_peak_bytes / 2**30:.2f} GiB"
        )


if __name__ == "__main__":
    main()
