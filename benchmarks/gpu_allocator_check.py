"""On a CUDA device: torch's own allocation stream, replayed through shardscope.core.allocator, against what torch
reports (torch.cuda.max_memory_allocated() and max_memory_reserved()).

Each workload runs in a fresh process (nothing cached before it) with the allocator's history recorded; its
'alloc' and 'free_completed' entries are the stream the model replays, over the whole run and over the last step.
Run on a GPU machine: PYTHONPATH=src python3 benchmarks/gpu_allocator_check.py  (add --expandable for
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from typing import Any

WORKLOADS = ("random", "transformer-fp32", "transformer-bf16")
MiB = 1 << 20


def _random_stream(torch: Any) -> None:
    rng = random.Random(0)
    live: list[Any] = []
    for _ in range(20_000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))
        else:
            size = rng.choice(
                (rng.randrange(1, 1 * MiB), rng.randrange(1 * MiB, 10 * MiB), rng.randrange(10, 100) * MiB)
            )
            live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        if len(live) > 200:
            live.pop(0)


def _transformer(torch: Any, bf16: bool, mark_last_step: Any) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True) for _ in range(8)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 32000)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(3):
        if step == 2:
            mark_last_step()
        inputs = torch.randn(8, 512, 1024, device="cuda")
        targets = torch.randint(0, 32000, (8, 512), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del inputs, targets, logits, loss
    torch.cuda.synchronize()


def run_one(name: str) -> dict[str, Any]:
    """Run one workload in this process and compare."""
    import torch

    from shardscope.core.allocator import AllocatorConfig, events_from_memory_trace, replay

    torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=2_000_000)
    marks: dict[str, Any] = {}

    def mark_last_step() -> None:
        torch.cuda.synchronize()
        marks["entries"] = len(torch.cuda.memory._snapshot()["device_traces"][0])
        marks["before"] = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    if name == "random":
        _random_stream(torch)
    else:
        _transformer(torch, name.endswith("bf16"), mark_last_step)
    torch.cuda.synchronize()
    measured = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    streams = sorted({entry.get("stream", 0) for entry in trace if entry["action"] == "alloc"})
    config = AllocatorConfig(
        expandable_segments="expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    )
    events = events_from_memory_trace(trace)
    window = len(events_from_memory_trace(trace[: marks["entries"]])) if "entries" in marks else 0
    whole = replay(events, config)
    last = replay(events, config, window_start=window)
    result = {
        "workload": name,
        "expandable": config.expandable_segments,
        "events": len(events),
        "trace_entries": len(trace),
        "streams": len(streams),
        "ooms": sum(1 for entry in trace if entry["action"] == "oom"),
        "segment_frees": sum(1 for entry in trace if entry["action"] in ("segment_free", "segment_unmap")),
        "torch_last_step": measured,
        "model_last_step": {"allocated": last.allocated_peak_bytes, "reserved": last.reserved_peak_bytes},
        "model_whole_run": {"allocated": whole.allocated_peak_bytes, "reserved": whole.reserved_peak_bytes},
    }
    if "before" in marks:
        result["torch_before_last_step"] = {"allocated": marks["before"][0], "reserved": marks["before"][1]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOADS, help="run one workload in this process (internal)")
    parser.add_argument("--expandable", action="store_true", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    args = parser.parse_args()
    if args.workload:
        print(json.dumps(run_one(args.workload)))
        return 0
    env = dict(os.environ)
    if args.expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    for name in WORKLOADS:
        done = subprocess.run(
            [sys.executable, __file__, "--workload", name], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-3000:]}")
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        torch_peaks, model_peaks = row["torch_last_step"], row["model_last_step"]
        print(json.dumps(row))
        print(
            f"{name:>17} expandable={row['expandable']}: allocated torch {torch_peaks['allocated']:,} model "
            f"{model_peaks['allocated']:,} ({model_peaks['allocated'] - torch_peaks['allocated']:+,}); reserved torch "
            f"{torch_peaks['reserved']:,} model {model_peaks['reserved']:,} "
            f"({model_peaks['reserved'] - torch_peaks['reserved']:+,})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
