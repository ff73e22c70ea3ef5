"""Every number `estimate --json` prints, compared with the output of an earlier commit.

A refactor that must change no number (issue 16) is checked with this: the 13 published model presets x 6 strategies x
3 engines on 8 and 64 GPUs, plus variants that reach the other branches of the core (gloo, checkpointing, gradient
accumulation, offload, fp32, a bare parameter count), pipelines of every schedule (with tensor parallelism, and longer
than the time model's exactly simulated micro-batches), expert parallelism, and two `plan` questions searching
pipelines. The earlier commit runs from a temporary `git worktree`; every
value of its documents must equal the current tree's (new keys are allowed, changed or missing ones are not).
Run: .venv/bin/python benchmarks/compare_estimates.py --against REF      (REF: a commit, e.g. HEAD~3 or main)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PRESETS = (
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3-8b",
    "llama-3-70b",
    "llama-3.1-405b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen2.5-7b",
)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
ENGINES = ("paper", "pytorch", "deepspeed")
VARIANTS = (
    ("--backend", "gloo", "--gpus-per-node", "4"),
    ("--checkpointing", "full"),
    ("--checkpointing", "selective", "--attention", "eager"),
    ("--grad-accum", "3", "--micro-batch", "2"),
    ("--offload", "optimizer"),
    ("--precision", "fp32", "--optimizer", "sgd-momentum"),
)
VARIANT_MODELS = ("gpt2", "llama-3-8b", "mixtral-8x7b", "tiny-gpt2", "tiny-llama", "tiny-moe")
PIPELINE_MODELS = ("llama-3-8b", "llama-3.1-405b")
PIPELINES = (
    ("--gpus", "32", "--pp", "4", "--grad-accum", "8"),
    ("--gpus", "16", "--pp", "4", "--pp-schedule", "gpipe", "--tp", "2", "--grad-accum", "6"),
    ("--gpus", "64", "--pp", "8", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "24", "--checkpointing", "full"),
    ("--gpus", "8", "--pp", "2", "--tp", "2", "--grad-accum", "20", "--micro-batch", "2"),
)
EXPERTS = (("mixtral-8x7b", "64", "8", "8"), ("tiny-moe", "4", "2", "2"))
PLANS = (
    ("--model", "llama-3-8b", "--max-gpus", "64", "--pp", "1,2,4", "--global-batch-tokens", "1M"),
    (
        "--model",
        "llama-3-8b",
        "--max-gpus",
        "32",
        "--pp",
        "1,2,4",
        "--global-batch-tokens",
        "1M",
        "--price-per-gpu-hour",
        "2",
    ),
)


def _seq_len(model: str, default: list[str]) -> list[str]:
    """gpt2-family models run at their max_positions (learned positions end at the table, and a longer --seq-len is
    refused); the others at `default`."""
    from shardscope.presets import model_preset

    spec = model_preset(model)
    return ["--seq-len", str(spec.max_positions)] if spec.family == "gpt2" else default


def cases() -> list[list[str]]:
    """The argument lists of every compared `estimate` call."""
    out: list[list[str]] = []
    for gpus in ("8", "64"):
        group = "4" if gpus == "8" else "8"
        for strategy in STRATEGIES:
            shard = ["--shard-group", group] if strategy == "hsdp" else []
            for engine in ENGINES:
                base = ["--gpus", gpus, "--strategy", strategy, *shard, "--engine", engine]
                out += [
                    ["--model", model, *_seq_len(model, ["--seq-len", "4096"]), *base, "--time"] for model in PRESETS
                ]
                out += [
                    ["--model", model, *_seq_len(model, []), *base, *v, "--time"]
                    for model in VARIANT_MODELS
                    for v in VARIANTS
                ]
                out.append(["--params", "7B", *base])  # no shape: memory only
    for strategy in STRATEGIES:
        shard = ["--shard-group", "2"] if strategy == "hsdp" else []
        for engine in ENGINES:
            out += [
                [
                    "--model",
                    model,
                    "--seq-len",
                    "2048",
                    "--strategy",
                    strategy,
                    *shard,
                    "--engine",
                    engine,
                    *p,
                    "--time",
                ]
                for model in PIPELINE_MODELS
                for p in PIPELINES
            ]
            out += [
                ["--model", model, "--gpus", gpus, "--ep", ep, "--strategy", strategy, "--engine", engine]
                + (["--shard-group", group] if strategy == "hsdp" else [])
                + ["--seq-len", "1024", "--time"]
                for model, gpus, ep, group in EXPERTS
            ]
    return out


def plan_cases() -> list[list[str]]:
    """The argument lists of every compared `plan` call (their `stats` are the search's own counts, not compared)."""
    return [list(question) for question in PLANS]


def dump() -> dict[str, Any]:
    """Each case's JSON document (or its error line) under the case's arguments."""
    from shardscope.cli import main

    results: dict[str, Any] = {}
    for argv in cases():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["estimate", *argv, "--json"])
        key = " ".join(argv)
        results[key] = json.loads(out.getvalue()) if code == 0 else {"exit": code, "error": err.getvalue().strip()}
    for argv in plan_cases():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["plan", *argv, "--json"])
        document = json.loads(out.getvalue()) if code == 0 else {"exit": code, "error": err.getvalue().strip()}
        document.pop("stats", None)
        results["plan " + " ".join(argv)] = document
    return results


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Where `new` does not hold `old`'s value (keys only in `new` are allowed)."""
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{path}: was an object"]
        return [d for key in old for d in differences(old[key], new.get(key, _MISSING), f"{path}.{key}")]
    if isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            return [f"{path}: list changed"]
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if old == new and type(old) is type(new) else [f"{path}: {old!r} -> {new!r}"]


_MISSING = object()


def dump_at(ref: str) -> dict[str, Any]:
    """The documents the commit `ref` prints, from a temporary worktree removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="shardscope-compare-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref],
            check=True,
            text=True,
            capture_output=True,
        )
        try:
            env = {**os.environ, "PYTHONPATH": str(tree / "src")}
            out = Path(tmp) / "old.json"
            subprocess.run([sys.executable, __file__, "--dump", str(out)], check=True, env=env, cwd=tmp)
            return json.loads(out.read_text())
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REF", help="the commit to compare with")
    parser.add_argument("--dump", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dump:
        Path(args.dump).write_text(json.dumps(dump()))
        return 0
    if not args.against:
        parser.error("--against REF is required")
    old, new = dump_at(args.against), dump()
    changed = {key: differences(old[key], new.get(key, _MISSING)) for key in old}
    changed = {key: diffs for key, diffs in changed.items() if diffs}
    values = sum(_count_leaves(doc) for doc in old.values())
    for key, diffs in list(changed.items())[:20]:
        print(f"estimate {key}:\n  " + "\n  ".join(diffs[:5]))
    groups: dict[str, int] = {}
    for key in changed:
        words = key.split()
        if "--strategy" not in words:
            groups["plan"] = groups.get("plan", 0) + 1
            continue
        group = f"{words[words.index('--strategy') + 1]} {words[words.index('--engine') + 1]}"
        groups[group] = groups.get(group, 0) + 1
    if groups:
        print("cases that differ by strategy and engine: " + ", ".join(f"{g} {n}" for g, n in sorted(groups.items())))
    errors = sum(1 for doc in old.values() if "exit" in doc)
    print(
        f"{len(old)} cases ({errors} of them refused with exit 2), {values} values compared with {args.against}: "
        f"{len(changed)} cases differ"
    )
    return 1 if changed else 0


def _count_leaves(value: Any) -> int:
    if isinstance(value, dict):
        return sum(_count_leaves(v) for v in value.values())
    if isinstance(value, list):
        return sum(_count_leaves(v) for v in value)
    return 1


if __name__ == "__main__":
    sys.exit(main())
