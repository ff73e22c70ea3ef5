"""The device check: rank 0 of FSDP2 jobs over a fake process group with real tensors, against the prediction.

The collectives do nothing (torch's fake process group), so what is measured is one rank's real memory and compute:
the model (a preset's shape cut to --blocks blocks), sharded by torch's fully_shard as the pytorch engine assumes
(bf16 compute over fp32 master weights, AdamW with single-tensor kernels, reshard after forward), trained a few
steps on each checkpointing mode and world size. The all-gathered weights are whatever the fake all-gather left in
its output buffer: the numbers trained are meaningless, their sizes and kernels are the real ones.

On a GPU it reports torch.cuda.max_memory_allocated and max_memory_reserved over the last (steady-state) step and
the median step time, beside shardscope's prediction of the allocated peak and of the compute time (the fake
collectives take none), and times the model's own kernels (each linear's three matmuls, the attention core, a
large matmul and a copy as ceilings). On a CPU (what the tests run) the same steps run on CPU tensors and the peak
is shardscope's storage tracker's; there is no reserved figure.

    python benchmarks/gpu_check.py --out gpu_check.json              # a GPU: llama-3-8b, 8 blocks, seq 8192, 8 and 64
    python benchmarks/gpu_check.py --device cpu --model tiny-llama --blocks 2 --seq-len 64 --worlds 2,4
    python benchmarks/gpu_check.py --table gpu_check.json            # saved measurements against today's predictions

docs/accuracy-gpu.md holds the table of the last GPU run, made by `--table` from the measurements it saved.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from shardscope.core.memory import estimate_memory
from shardscope.core.timeline import estimate_time
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, SpecError, Strategy, TrainingSpec
from shardscope.units import format_bytes

CANDIDATE_MODES = ("none", "full", "selective", "op", "every:2")
CASE_TIMEOUT_S = 300
STEPS = 6  # the first allocates optimizer state, the first two warm up; the last is measured; 3..6 are timed


def scenario_for(model: str, blocks: int, seq_len: int, world: int, mode: str, gpu: str) -> Scenario:
    """The predicted scenario: the preset cut to `blocks` blocks, one sequence per rank, fsdp on the pytorch engine."""
    return Scenario(
        model=replace(model_preset(model), num_layers=blocks),
        cluster=ClusterSpec(gpu=gpu_preset(gpu), world_size=world, gpus_per_node=min(world, 8)),
        training=TrainingSpec(
            micro_batch_size=1, sequence_length=seq_len, precision="bf16-mixed", checkpointing=mode, optimizer="adamw"
        ),
        strategy=Strategy(name="fsdp", engine="pytorch"),
    )


def supported_modes() -> list[str]:
    """The candidate checkpointing modes this shardscope accepts."""
    modes = []
    for mode in CANDIDATE_MODES:
        try:
            TrainingSpec(checkpointing=mode)  # type: ignore[arg-type]
        except SpecError:
            continue
        modes.append(mode)
    return modes


def prediction(scenario: Scenario) -> dict[str, Any]:
    """What shardscope predicts for rank 0: the allocated peak and the compute stream's busy time."""
    estimate = estimate_memory(scenario, rank=0)
    return {
        "allocated_peak_bytes": estimate.tensor_peak_bytes,  # tensors only, as torch counts
        "reserved_peak_bytes": estimate.reserved_peak_bytes,
        "compute_time_s": estimate_time(scenario).compute_time_s,
    }


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def measure(scenario: Scenario, device: str, snapshot: Path | None = None) -> dict[str, Any]:
    """Train STEPS steps of rank 0 on real tensors over the fake process group; the last step's memory. With a
    snapshot path (CUDA only), the allocator's whole event stream from the first allocation is saved there in the
    pickle format of torch.cuda.memory._snapshot (PyTorch's memory visualizer opens it)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardscope.reference_models import build_model
    from shardscope.trace.setup import TracedModel, apply_strategy, make_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=scenario.cluster.world_size)
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
    try:
        root = build_model(scenario.model, scenario.training, device="meta", dtype=torch.float32, seed=None)
        traced = TracedModel(
            root=root, blocks=list(root.layers), make_batch=lambda: (None, None), loss=None, engine_notes=[]
        )  # type: ignore[arg-type]
        apply_strategy(traced, scenario, device)
        root.to_empty(device=device)
        with torch.no_grad():
            for param in root.parameters():
                local = param.to_local() if hasattr(param, "to_local") else param
                local.normal_(0.0, 0.02)
        optimizer = make_optimizer(root, scenario)
        shape = (scenario.training.micro_batch_size, scenario.training.sequence_length)
        inputs = torch.randint(0, scenario.model.vocab_size, shape, device=device)
        targets = torch.randint(0, scenario.model.vocab_size, shape, device=device)
        measured = _train(root, optimizer, inputs, targets, device)
        if snapshot:
            torch.cuda.memory._dump_snapshot(str(snapshot))
        return measured
    finally:
        if snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
        dist.destroy_process_group()
        _release(device)


def _train(root: Any, optimizer: Any, inputs: Any, targets: Any, device: str) -> dict[str, Any]:
    import torch

    from shardscope.reference_models import lm_loss
    from shardscope.runtime.tracker import MemoryTracker

    def step() -> None:
        lm_loss(root(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: list[float] = []
    result: dict[str, Any] = {}
    for index in range(STEPS):
        last = index == STEPS - 1
        _synchronize(device)
        if last and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        tracker = MemoryTracker() if last and device != "cuda" else None
        if tracker is not None:
            held = [p.to_local() if hasattr(p, "to_local") else p for p in root.parameters()]
            state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            tracker.register(held, "parameters")
            tracker.register(state, "optimizer_state")
        started = time.perf_counter()
        if tracker is not None:
            with tracker:
                step()
        else:
            step()
        _synchronize(device)
        if index >= 2:
            times.append(time.perf_counter() - started)
        if last:
            if device == "cuda":
                result["allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
                result["reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
            else:
                assert tracker is not None
                result["allocated_peak_bytes"] = tracker.peak_bytes
                result["reserved_peak_bytes"] = None
    # On a CPU the last step runs under the tracker, which slows it: time the untracked ones only.
    timed = times if device == "cuda" else times[:-1]
    result["step_time_s"] = statistics.median(timed)
    return result


def _release(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _time(run: Callable[[], Any], device: str, repeats: int = 10, warmup: int = 3) -> float:
    """Mean seconds of one call, over `repeats` calls after `warmup`."""
    for _ in range(warmup):
        run()
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    _synchronize(device)
    return (time.perf_counter() - started) / repeats


def kernels(scenario: Scenario, device: str) -> list[dict[str, Any]]:
    """Time the model's own kernels in bf16: each linear's forward, input-gradient and weight-gradient matmuls,
    the causal attention core forward and forward + backward, a large square matmul and a device copy."""
    import torch
    import torch.nn.functional as F

    spec, tokens = scenario.model, scenario.training.tokens_per_micro_batch
    q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    linears = {
        "q_proj": (spec.hidden_size, q_width),
        "k_proj": (spec.hidden_size, kv_width),
        "o_proj": (q_width, spec.hidden_size),
        "gate_proj": (spec.hidden_size, spec.ffn_hidden_size),
        "down_proj": (spec.ffn_hidden_size, spec.hidden_size),
        "lm_head": (spec.hidden_size, spec.vocab_size),
    }
    rows = []
    for name, (width_in, width_out) in linears.items():
        x, w, dy = _randn(device, (tokens, width_in), (width_out, width_in), (tokens, width_out))
        flops = 2 * tokens * width_in * width_out
        parts = {
            "forward": (partial(F.linear, x, w), f"{tokens}x{width_out}x{width_in}"),
            "input grad": (partial(torch.matmul, dy, w), f"{tokens}x{width_in}x{width_out}"),
            "weight grad": (partial(torch.matmul, dy.t(), x), f"{width_out}x{width_in}x{tokens}"),
        }
        for part, (run, shape) in parts.items():
            rows.append({"kernel": f"{name} {part}", "m_n_k": shape, "flops": flops, "time_s": _time(run, device)})
    seq, heads, kv_heads, head_dim = scenario.training.sequence_length, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = _randn(device, (1, heads, seq, head_dim), (1, kv_heads, seq, head_dim), (1, kv_heads, seq, head_dim))
    for tensor in (q, k, v):
        tensor.requires_grad_(True)
    attention = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    shape = f"s={seq} h={heads} kv={kv_heads} d={head_dim}"
    causal_forward = 2 * 2 * seq * seq * head_dim * heads // 2  # FlashAttention-2's count, halved by the mask
    rows.append(
        {"kernel": "attention forward", "m_n_k": shape, "flops": causal_forward, "time_s": _time(attention, device)}
    )
    both = _time(lambda: attention().sum().backward(), device)  # backward is 2.5 forwards (FlashAttention-2)
    rows.append(
        {"kernel": "attention forward+backward", "m_n_k": shape, "flops": int(3.5 * causal_forward), "time_s": both}
    )
    side = 8192 if device == "cuda" else 256
    a, b = _randn(device, (side, side), (side, side))
    rows.append(
        {
            "kernel": "square matmul",
            "m_n_k": f"{side}^3",
            "flops": 2 * side**3,
            "time_s": _time(partial(torch.matmul, a, b), device),
        }
    )
    elements = (1 << 30) if device == "cuda" else (1 << 22)
    source, target = _randn(device, (elements,), (elements,))
    copy = _time(partial(target.copy_, source), device)
    rows.append(
        {"kernel": "device copy", "m_n_k": f"{2 * elements} B read and written", "bytes": 4 * elements, "time_s": copy}
    )
    return rows


def _randn(device: str, *shapes: tuple[int, ...]) -> list[Any]:
    import torch

    return [torch.randn(shape, device=device, dtype=torch.bfloat16) for shape in shapes]


GPU_NAMES = (("H200", "h200-141gb"), ("H100 PCIe", "h100-pcie-80gb"), ("H100", "h100-80gb"), ("A100", "a100-80gb"))


def _gpu_preset_of(device: str, given: str) -> str:
    """The preset to predict with: --gpu, or the device's name matched to a preset (h200-141gb on a CPU)."""
    if given:
        return given
    if device != "cuda":
        return "h200-141gb"
    import torch

    name = torch.cuda.get_device_name()
    for part, preset in GPU_NAMES:
        if part in name:
            return preset
    raise SystemExit(f"no GPU preset matches {name!r}: give --gpu PRESET")


def _environment(device: str) -> dict[str, Any]:
    import torch

    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device == "cuda" else None,
        "allocator_config": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every (world, mode) and the kernels; the document --out saves."""
    gpu = _gpu_preset_of(args.device, args.gpu)
    modes = args.modes.split(",") if args.modes else supported_modes()
    config = {"model": args.model, "blocks": args.blocks, "seq_len": args.seq_len, "gpu": gpu}
    rows = []
    for world in (int(text) for text in args.worlds.split(",")):
        for mode in modes:
            print(f"{time.strftime('%X')} measuring world {world}, checkpointing {mode}", file=sys.stderr, flush=True)
            rows.append({"world": world, "mode": mode, "measured": _measure_alone(args, world, mode, gpu)})
            if args.out:  # what was measured survives a run stopped at its time limit
                _save(
                    args.out, {"environment": _environment(args.device), "config": config, "rows": rows, "kernels": []}
                )
    timed = []
    if not args.no_kernels:
        print("timing the kernels", file=sys.stderr, flush=True)
        timed = kernels(scenario_for(args.model, args.blocks, args.seq_len, 8, "none", gpu), args.device)
        _release(args.device)
    return {"environment": _environment(args.device), "config": config, "rows": rows, "kernels": timed}


def _measure_alone(args: argparse.Namespace, world: int, mode: str, gpu: str) -> dict[str, Any]:
    """One case in a process of its own, so the caching allocator starts empty: in one process, what an earlier case
    left allocated was measured again (1.46 GB more in the second case of a run on an H200)."""
    with tempfile.TemporaryDirectory(prefix="shardscope-gpu-check-") as folder:
        out = Path(folder) / "case.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--case", f"{world}:{mode}", "--case-out", str(out)]
        command += ["--device", args.device, "--model", args.model, "--blocks", str(args.blocks)]
        command += ["--seq-len", str(args.seq_len), "--gpu", gpu]
        if args.snapshots:
            command += ["--snapshots", str(args.snapshots)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=CASE_TIMEOUT_S, check=False)
        if done.returncode:
            raise SystemExit(f"world {world}, checkpointing {mode} failed: {done.stderr.strip()[-2000:]}")
        measured: dict[str, Any] = json.loads(out.read_text())
        return measured


def _measure_case(args: argparse.Namespace) -> int:
    """The body of one case's process (--case WORLD:MODE --case-out FILE)."""
    world, _, mode = args.case.partition(":")
    scenario = scenario_for(args.model, args.blocks, args.seq_len, int(world), mode, args.gpu)
    snapshot = args.snapshots / f"snapshot-w{world}-{mode.replace(':', '')}.pickle" if args.snapshots else None
    args.case_out.write_text(json.dumps(measure(scenario, args.device, snapshot)))
    return 0


def _save(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=1) + "\n")


def _error(measured: float | None, predicted: float | None) -> str:
    if not measured or predicted is None:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    return format_bytes(value, "GiB") if value >= 1 << 30 else f"{value / (1 << 20):,.1f} MiB"


def table(document: dict[str, Any]) -> str:
    """The saved measurements against today's predictions, as markdown."""
    config, env = document["config"], document["environment"]
    allocator = f", PYTORCH_CUDA_ALLOC_CONF={env['allocator_config']}" if env.get("allocator_config") else ""
    lines = [
        f"Measured on {env['device']} ({env['date']}, torch {env['torch']}{allocator}): {config['model']} cut to "
        f"{config['blocks']} blocks, sequence {config['seq_len']}, micro-batch 1, bf16-mixed, AdamW, fsdp "
        "(fully_shard, reshard after forward), rank 0 of a fake process group; predicted for GPU preset "
        f"{config['gpu']}, pytorch engine.",
        "",
        "| world | checkpointing | allocated peak | predicted | error | reserved peak | predicted reserved | "
        "step time | predicted compute | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in document["rows"]:
        scenario = scenario_for(
            config["model"], config["blocks"], config["seq_len"], row["world"], row["mode"], config["gpu"]
        )
        measured, predicted = row["measured"], prediction(scenario)
        lines.append(
            f"| {row['world']} | {row['mode']} | {_size(measured['allocated_peak_bytes'])} | "
            f"{_size(predicted['allocated_peak_bytes'])} | "
            f"{_error(measured['allocated_peak_bytes'], predicted['allocated_peak_bytes'])} | "
            f"{_size(measured['reserved_peak_bytes'])} | {_size(predicted['reserved_peak_bytes'])} | "
            f"{measured['step_time_s'] * 1e3:.1f} ms | {predicted['compute_time_s'] * 1e3:.1f} ms | "
            f"{_error(measured['step_time_s'], predicted['compute_time_s'])} |"
        )
    if not document["kernels"]:
        return "\n".join(lines) + "\n"
    lines += ["", "| kernel | m x n x k | time | rate |", "|---|---|---|---|"]
    for kernel in document["kernels"]:
        seconds = kernel["time_s"]
        rate = (
            f"{kernel['flops'] / seconds / 1e12:.1f} TFLOP/s"
            if "flops" in kernel
            else f"{kernel['bytes'] / seconds / 1e9:.0f} GB/s"
        )
        lines.append(f"| {kernel['kernel']} | {kernel['m_n_k']} | {seconds * 1e3:.3f} ms | {rate} |")
    return "\n".join(lines) + "\n"


def trace_table(document: dict[str, Any]) -> str:
    """Saved measurements against shardscope's trace (torch's engines on fake CPU tensors) of the same scenario."""
    from shardscope.trace.request import TraceRequest
    from shardscope.trace.runner import run_in_subprocess

    config = document["config"]
    lines = [
        "| world | checkpointing | allocated peak | traced | error | reserved peak | traced reserved | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in document["rows"]:
        scenario = scenario_for(
            config["model"], config["blocks"], config["seq_len"], row["world"], row["mode"], config["gpu"]
        )
        traced = run_in_subprocess(TraceRequest(scenario=scenario, traced_blocks=0))
        allocated, reserved = row["measured"]["allocated_peak_bytes"], row["measured"]["reserved_peak_bytes"]
        lines.append(
            f"| {row['world']} | {row['mode']} | {_size(allocated)} | {_size(traced.per_rank.peak_bytes)} | "
            f"{_error(allocated, traced.per_rank.peak_bytes)} | {_size(reserved)} | "
            f"{_size(traced.reserved_peak_bytes)} | {_error(reserved, traced.reserved_peak_bytes)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--worlds", default="8,64")
    parser.add_argument("--modes", default="", help="comma list (default: every mode this shardscope accepts)")
    parser.add_argument("--gpu", default="", help="GPU preset to predict with (default: matched to the device)")
    parser.add_argument("--out", type=Path, help="save the measurements as JSON")
    parser.add_argument("--markdown", type=Path, help="save the table as markdown")
    parser.add_argument("--table", type=Path, help="print the table of saved measurements; measure nothing")
    parser.add_argument("--snapshots", type=Path, help="CUDA: save each case's allocator snapshot in this folder")
    parser.add_argument("--no-kernels", action="store_true", help="skip timing the kernels")
    parser.add_argument("--trace", action="store_true", help="with --table: also trace each case (needs torch)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # WORLD:MODE, in a process of its own
    parser.add_argument("--case-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        return _measure_case(args)
    if args.snapshots and args.device != "cuda":
        parser.error("--snapshots needs --device cuda (the CUDA caching allocator records them)")
    document = json.loads(args.table.read_text()) if args.table else run_check(args)
    if args.out:
        _save(args.out, document)
    text = table(document) + ("\n" + trace_table(document) if args.trace else "")
    if args.markdown:
        args.markdown.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
