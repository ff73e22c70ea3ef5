"""One rank of a real run: the same code under shardscope's launcher (gloo) and under torchrun (nccl on GPUs).

    torchrun --nnodes 2 --nproc-per-node 8 -m shardscope.runtime.worker --model tiny-llama --strategy zero3 \
        --engine pytorch --run-dir /shared/run1

Every rank trains, measures its last step, and sends its numbers to rank 0, which checks parity against a
single process and writes `result.json` into the run directory. Workers end with barrier, destroy_process_group
and os._exit, and ask the kernel to kill them if their parent dies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from shardscope.procs.rank import LAUNCHER_PID_ENV, Status, die_with_parent, report_failure
from shardscope.runtime.config import RunConfig
from shardscope.specs import SpecError


def parse_config(argv: list[str]) -> tuple[list[RunConfig], Path]:
    """RunConfig fields as flags (--world-size is taken from the environment under torchrun) and --run-dir; or
    --suite FILE, a JSON list of RunConfig objects run one after another in the same process group."""
    parser = argparse.ArgumentParser(prog="python -m shardscope.runtime.worker")
    defaults = RunConfig().options()
    for name, default in defaults.items():
        kind = (
            _flag_bool if isinstance(default, bool) else _flag_layers if isinstance(default, tuple) else type(default)
        )
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    parser.add_argument("--run-dir", type=Path, default=Path("shardscope-run"))
    parser.add_argument("--suite", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.suite:
        return [RunConfig.from_options(**values) for values in json.loads(args.suite.read_text())], args.run_dir
    values = {name: getattr(args, name) for name in defaults}
    values["world_size"] = int(os.environ.get("WORLD_SIZE", values["world_size"]))
    return [RunConfig.from_options(**values)], args.run_dir


def _flag_bool(text: str) -> bool:
    """A bool flag's value as options() writes it ('True' or 'False')."""
    if text not in ("True", "False"):
        raise SpecError(f"{text!r} is not True or False")
    return text == "True"


def _flag_layers(text: str) -> tuple[int, ...]:
    """--pp-layers as options() writes it: whole numbers separated by commas ('' for the default split)."""
    words = [word for word in text.strip("()").replace(" ", "").split(",") if word]
    if not all(word.isdigit() for word in words):
        raise SpecError(f"{text!r} is not whole numbers separated by commas")
    return tuple(int(word) for word in words)


def inject_fault(config: RunConfig, rank: int) -> None:
    """Tests only: make one rank raise, exit or hang at its first forward."""
    kind, _, target = config.fault.partition(":")
    if not kind or int(target) != rank:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if kind == "exit":
        os._exit(3)
    time.sleep(10**6)


def init_distributed(config: RunConfig, rank: int, run_dir: Path, timeout_s: float) -> str:
    """Join the process group, whose collectives give up after timeout_s; returns the device type the run uses."""
    import torch
    import torch.distributed as dist

    backend = config.resolved_backend()
    if backend == "gloo" and not dist.is_gloo_available():
        raise RuntimeError("this torch build has no gloo backend")
    device = "cpu"
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = "cuda"
    init = f"file://{run_dir.resolve()}/rendezvous" if config.rendezvous == "file" else "env://"
    dist.init_process_group(
        backend,
        init_method=init,
        rank=rank,
        world_size=config.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return device


def run_rank(configs: list[RunConfig], rank: int, run_dir: Path, status: Status) -> None:
    """Join once, then for each config: train, measure, check parity on rank 0. Rank 0 writes result.json, a list
    with one entry per config (several configs share one launch, so tests pay the start-up once)."""
    import torch
    import torch.distributed as dist

    from shardscope.runtime.steps import reference_parameters, train_and_measure

    torch.set_num_threads(1)  # N ranks share a few cores; more threads only fight
    status("rendezvous")
    # The launcher's deadline for the suite is the sum of the timeouts; a collective that gave up sooner would end the
    # launch blaming a healthy rank that waited for a hung one (the launcher names the hung one at its deadline).
    device = init_distributed(configs[0], rank, run_dir, sum(config.timeout_s for config in configs))
    results = []
    for index, config in enumerate(configs):
        prefix = f"run {index + 1}/{len(configs)} " if len(configs) > 1 else ""
        measured = train_and_measure(
            config,
            rank,
            device,
            lambda stage, p=prefix: status(p + stage),
            status.collective,
            fault=lambda c=config: inject_fault(c, rank),
        )
        status(prefix + "parity")
        full = measured.pop("full_parameters")
        gathered: list[Any] = [None] * config.world_size
        dist.gather_object(measured, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            reference = reference_parameters(config, device)
            diff = max(
                float((full[name].detach().double().cpu() - value.detach().double().cpu()).abs().max())
                for name, value in reference.items()
            )
            results.append({"config": config.options(), "ranks": gathered, "max_abs_diff": diff})
    if rank == 0:
        (run_dir / "result.json").write_text(json.dumps(results))
        if LAUNCHER_PID_ENV not in os.environ:  # under torchrun nobody else turns it into the document
            write_run_documents(configs, results, run_dir)
    status("done")
    dist.barrier()
    dist.destroy_process_group()


def write_run_documents(configs: list[RunConfig], results: list[dict[str, Any]], run_dir: Path) -> None:
    """Under torchrun: `run.json`, the shardscope.run/v1 document (a list of them for a suite), and a line per run."""
    from shardscope.runtime.api import result_from_launch

    documents = [result_from_launch(c, raw).to_json() for c, raw in zip(configs, results, strict=True)]
    (run_dir / "run.json").write_text(json.dumps(documents[0] if len(documents) == 1 else documents, indent=1))
    for document in documents:
        peak = document["per_rank"][0]["peak_bytes"]
        print(
            f"shardscope: {document['strategy']} ({document['engine']}) on {document['world_size']} ranks: rank 0 "
            f"peak {peak:,} B, parity {document['parity']['max_abs_diff']:.1e}; wrote {run_dir / 'run.json'}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    """Entry point for one rank; never returns (os._exit), so gloo cannot abort at interpreter exit."""
    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    try:
        configs, run_dir = parse_config(sys.argv[1:] if argv is None else argv)
    except SpecError as error:  # bad flags under torchrun: one line per rank, exit 2
        print(f"shardscope worker rank {rank}: {error}", file=sys.stderr, flush=True)
        os._exit(2)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        run_rank(configs, rank, run_dir, Status(run_dir, rank))  # reporting (and its heartbeat) before torch loads
    except BaseException as error:
        report_failure(run_dir, rank, error)
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
