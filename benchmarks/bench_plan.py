"""Speed of the planner: a full plan for llama-3-70b on H100s over up to 1024 GPUs (issue 7: under 2 s), and
llama-3.1-405b at 8192 tokens over up to 8192 GPUs (issue 19: its 16M-token batch is 2048 sequences, so data
parallelism alone stops at 2048 GPUs; the fastest plan must go wider with tensor or context parallelism, under 2 s),
and the same over up to 16384 GPUs, ranked by step time and by cost (issue 20 item 5: both under 2 s), and the two
405B questions again searching pipelines too (`--pp 1,2,4,8,16`, 1F1B and interleaved 1F1B: issue 20), and the 70B cost
question searching pipelines (`--pp 1,2,4,8`: cost-ranked pipelines on few GPUs run many micro-batches, the
planner's slowest kind of question), and mixtral-8x7b's questions with the expert parallelism `plan` searches by
default and without it (`--ep 1`).

Each figure is the median of fresh processes, so every cache starts cold, as it does for a user's command:
- plan(): the search alone, imports excluded;
- CLI: the whole `shardscope plan ...` command, interpreter start and imports included;
- per call: one `estimate_time` of a 70B plan the planner simulates (976 GPUs, two micro-batches), the median of
  repeated calls in one process.
Python's bytecode cache is on, as it is by default for a user: a command reads its modules compiled by the run
before it. It lives in a temporary folder, removed at the end (PYTHONPYCACHEPREFIX), because environments that set
PYTHONDONTWRITEBYTECODE, as this machine's does, would otherwise compile every module on every command (about 0.2 s).
Run: .venv/bin/python benchmarks/bench_plan.py [--runs 5] [--question 405b-16k ...]
Before/after a change, in one run (the machine is shared, so only figures taken side by side compare): put the old
tree's src first on PYTHONPATH for one invocation, e.g. `git archive HEAD src | tar -x -C /tmp/old` then
`PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/bench_plan.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

GOAL_S = 2.0
GOAL_QUESTIONS = ("step-time", "cost", "405b-wide", "405b-16k", "405b-cost")
"""The questions the issues hold to GOAL_S as whole commands (7: a 70B plan; 19: 405B over 8192 GPUs; 20 item 5:
405B over 16384 GPUs by step time and by cost, and ranking by cost, today's 70B question included); the questions
searching pipelines have no stated goal and are printed for comparison."""
WIDE_405B = ["--model", "llama-3.1-405b", "--gpu", "h100-80gb", "--seq-len", "8192", "--global-batch-tokens", "16M"]
BASE = ["--model", "llama-3-70b", "--gpu", "h100-80gb", "--seq-len", "4096", "--max-gpus", "1024"]
MIXTRAL = ["--model", "mixtral-8x7b", "--gpu", "h100-80gb", "--seq-len", "4096", "--global-batch-tokens", "4M"]
QUESTIONS = {
    "step-time": [*BASE, "--global-batch-tokens", "4M"],
    "cost": [*BASE, "--global-batch-tokens", "4M", "--price-per-gpu-hour", "2.5"],
    "min-gpus": [*BASE, "--min-gpus"],
    "405b-wide": [
        *("--model", "llama-3.1-405b", "--gpu", "h100-80gb", "--seq-len", "8192"),
        *("--global-batch-tokens", "16M", "--max-gpus", "8192"),
    ],
    "405b-16k": [*WIDE_405B, "--max-gpus", "16384"],
    "405b-cost": [*WIDE_405B, "--max-gpus", "16384", "--price-per-gpu-hour", "2.5"],
    "405b-pp": [*WIDE_405B, "--max-gpus", "8192", "--pp", "1,2,4,8,16"],
    "405b-16k-pp": [*WIDE_405B, "--max-gpus", "16384", "--pp", "1,2,4,8,16"],
    "cost-pp": [*BASE, "--global-batch-tokens", "4M", "--price-per-gpu-hour", "2.5", "--pp", "1,2,4,8"],
    # mixtral-8x7b: expert parallelism searched by default (ep 1,2,4,8), and without it (--ep 1)
    "mixtral": [*MIXTRAL, "--max-gpus", "256"],
    "mixtral-ep1": [*MIXTRAL, "--max-gpus", "256", "--ep", "1"],
    "mixtral-cost": [*MIXTRAL, "--max-gpus", "1024", "--price-per-gpu-hour", "2.5"],
    "mixtral-cost-ep1": [*MIXTRAL, "--max-gpus", "1024", "--price-per-gpu-hour", "2.5", "--ep", "1"],
}

IN_PROCESS = """
import json, sys, time
from shardscope.cli import build_parser
from shardscope.cli.plan import request_from_args
from shardscope.planner import plan
args = build_parser().parse_args(["plan", *sys.argv[1:]])
request = request_from_args(args)
start = time.perf_counter()
result = plan(request)
elapsed = time.perf_counter() - start
stats = result.stats
best = result.plans[0] if result.plans else None
print(json.dumps({"seconds": elapsed, "candidates": stats.candidates, "memory": stats.memory_evaluations,
                  "fitting": stats.fitting, "simulated": stats.time_evaluations,
                  "best": f"{best.label} on {best.gpus} GPUs" if best else "nothing fits"}))
"""

# Plans the cost question simulates: hsdp and zero3 on 976 H100s, full checkpointing, two micro-batches.
PER_CALL = """
import json, statistics, time
from shardscope.core.timeline import estimate_time
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
cases = [
    Scenario(
        model=model_preset("llama-3-70b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=976, gpus_per_node=8),
        training=TrainingSpec(micro_batch_size=1, sequence_length=4096, grad_accum_steps=2, precision="bf16-mixed",
                              checkpointing="full"),
        strategy=Strategy(name=name, shard_group=group, offload=offload),
    )
    for name, group, offload in (("hsdp", 8, "optimizer"), ("zero3", 0, "none"), ("hsdp", 4, "optimizer+params"))
]
times = []
for _ in range(20):
    for case in cases:
        start = time.perf_counter()
        estimate_time(case)
        times.append(time.perf_counter() - start)
print(json.dumps({"seconds": statistics.median(times[len(cases):])}))
"""

# One pipeline plan the 405B questions estimate: zero1 + TP 8 + PP 16 (1F1B, 16 micro-batches) on 16384 H100s.
PIPELINE_CALL = """
import json, statistics, time
from shardscope.core.memory import estimate_memory
from shardscope.core.timeline import estimate_time
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
case = Scenario(
    model=model_preset("llama-3.1-405b"),
    cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16384, gpus_per_node=8),
    training=TrainingSpec(micro_batch_size=1, sequence_length=8192, grad_accum_steps=16, precision="bf16-mixed",
                          checkpointing="full"),
    strategy=Strategy(name="zero1", tp=8, pp=16),
)
memory, step = [], []
for _ in range(5):
    start = time.perf_counter()
    estimate_memory(case)
    memory.append(time.perf_counter() - start)
    start = time.perf_counter()
    estimate_time(case)
    step.append(time.perf_counter() - start)
print(json.dumps({"memory": statistics.median(memory), "time": statistics.median(step)}))
"""


def measure(question: list[str], runs: int, env: dict[str, str]) -> tuple[float, float, dict[str, float]]:
    """(median seconds of plan(), median seconds of the whole CLI command, the search's counts)."""
    searches, commands, counts = [], [], {}
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", IN_PROCESS, *question], capture_output=True, text=True, env=env)
        counts = json.loads(out.stdout)
        searches.append(counts["seconds"])
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "shardscope", "plan", *question], capture_output=True, env=env)
        commands.append(time.perf_counter() - start)
    return statistics.median(searches), statistics.median(commands), counts


def per_call_s(env: dict[str, str]) -> float:
    """Median seconds of one estimate_time of a 70B plan, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PER_CALL], capture_output=True, text=True, check=True, env=env)
    seconds: float = json.loads(out.stdout)["seconds"]
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per figure (median)")
    parser.add_argument("--question", action="append", choices=list(QUESTIONS), help="only these (repeatable)")
    options = parser.parse_args(argv)
    runs, asked = options.runs, options.question or list(QUESTIONS)
    with tempfile.TemporaryDirectory(prefix="bench-plan-pycache-") as pycache:
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        return report(runs, asked, {**env, "PYTHONPYCACHEPREFIX": pycache})


def report(runs: int, asked: list[str], env: dict[str, str]) -> int:
    """Print every figure; 0 when every goal is met."""
    with open("/proc/loadavg") as file:
        print(f"load average at start: {file.read().split()[0]}")
    print(f"shardscope plan QUESTION: median of {runs} fresh processes; 70B questions: {' '.join(BASE)} ...\n")
    widths = {"question": -16, "plan() s": 9, "CLI s": 7, "candidates": 11, "memory": 7, "fit": 5, "simulated": 10}
    print(" ".join(name.ljust(-width) if width < 0 else name.rjust(width) for name, width in widths.items()))
    commands: dict[str, float] = {}
    for name, question in ((name, QUESTIONS[name]) for name in asked):
        search, command, counts = measure(question, runs, env)
        commands[name] = command
        print(
            f"{name:<16} {search:9.3f} {command:7.3f} {counts['candidates']:11.0f} {counts['memory']:7.0f} "
            f"{counts['fitting']:5.0f} {counts['simulated']:10.0f}  fastest: {counts['best']}"
        )
    print(
        f"\nestimate_time of a 70B plan (976 GPUs, 2 micro-batches): {per_call_s(env) * 1e3:.2f} ms per call (median)"
    )
    out = subprocess.run([sys.executable, "-c", PIPELINE_CALL], capture_output=True, text=True, check=True, env=env)
    pipeline = json.loads(out.stdout)
    print(
        f"a 405B pipeline plan (zero1+tp8+pp16, 1f1b, 16 micro-batches, 16384 GPUs), median of 5 calls: "
        f"estimate_memory {pipeline['memory'] * 1e3:.1f} ms, estimate_time {pipeline['time'] * 1e3:.1f} ms"
    )
    goals = {name: seconds for name, seconds in commands.items() if name in GOAL_QUESTIONS}
    for name, seconds in goals.items():
        verdict = "meets" if seconds < GOAL_S else "MISSES"
        print(f"{GOAL_S:.0f} s goal, {name}: whole command {seconds:.2f} s, {verdict}")
    with open("/proc/loadavg") as file:
        print(f"load average at end: {file.read().split()[0]}")
    return 0 if all(seconds < GOAL_S for seconds in goals.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
