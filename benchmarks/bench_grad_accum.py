"""The time model's cost in the number of micro-batches: `estimate --time` and `timeline` with a million of them.

Goal (issue 17): `estimate --time --grad-accum 1000000` answers in under 1 s with under 100 MB of memory; before the
fix its memory grew ~42 KB per micro-batch (24 GB and the kernel's OOM killer at a million). Each command runs in
its own process; its wall time and its peak resident memory (the kernel's ru_maxrss for that child) are printed.
Run: .venv/bin/python benchmarks/bench_grad_accum.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

COMMANDS = (
    ("estimate", "--model", "gpt2", "--seq-len", "1024", "--gpus", "1", "--json", "--time", "--grad-accum", "1000000"),
    ("estimate", "--model", "llama-3-70b", "--gpus", "64", "--time", "--grad-accum", "1000000"),
    ("timeline", "--model", "llama-3-8b", "--gpus", "16", "--strategy", "zero3", "--grad-accum", "1000000"),
    ("estimate", "--model", "gpt2", "--seq-len", "1024", "--gpus", "1", "--json", "--time", "--grad-accum", "1"),
)


def measure(argv: tuple[str, ...]) -> tuple[float, float]:
    """Wall seconds and peak resident MiB of `shardscope ARGV` in a fresh process."""
    start = time.perf_counter()
    with subprocess.Popen([sys.executable, "-m", "shardscope", *argv], stdout=subprocess.DEVNULL) as process:
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"shardscope {' '.join(argv)} exited {process.returncode}")
    return time.perf_counter() - start, usage.ru_maxrss / 1024


def main() -> None:
    print(f"{'command':<100} {'wall s':>7} {'peak MiB':>9}")
    for argv in COMMANDS:
        seconds, mebibytes = measure(argv)
        print(f"{'shardscope ' + ' '.join(argv):<100} {seconds:7.2f} {mebibytes:9.1f}")


if __name__ == "__main__":
    main()
