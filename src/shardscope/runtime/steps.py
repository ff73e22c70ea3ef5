"""The training loop of one rank, its measurement, and the single-process reference it must match.

Steps before the last are timed without the memory tracker (it sees every op and would dominate a tiny model's
step); the last step is measured: bytes by category, the peak and what was live at it, and its collectives.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from shardscope.measure.ledger import CollectiveLedger
from shardscope.measure.storage import storage_bytes
from shardscope.reference_models import build_model, lm_loss, sample_batch
from shardscope.runtime.config import RunConfig
from shardscope.runtime.tracker import MemoryTracker
from shardscope.runtime.trainer import Trainer, broadcast_module, is_mixed, make_optimizer, param_dtype


def make_trainer(config: RunConfig, module: torch.nn.Module) -> Trainer:
    """The strategy object for a config: a teaching strategy or one of torch's engines."""
    from shardscope.runtime.engines import TorchDDP, TorchFSDP2, TorchTensorParallel
    from shardscope.runtime.teaching.ddp import DataParallelBucket
    from shardscope.runtime.teaching.fsdp import FullyShardedTeaching, hsdp_groups
    from shardscope.runtime.teaching.zero import Zero1, Zero2

    training, strategy, shard_group = config.training, config.strategy.canonical_name, config.strategy.shard_group
    if config.strategy.pp > 1:
        from shardscope.reference_models import TransformerLM
        from shardscope.runtime.teaching.pipeline import PipelineTeaching
        from shardscope.runtime.teaching.pipeline_data import pipeline_data_parallel
        from shardscope.runtime.torch_pipeline import TorchPipeline

        assert isinstance(module, TransformerLM)
        if config.strategy.engine == "pytorch":
            return TorchPipeline(module, config.scenario())
        return PipelineTeaching(module, config.scenario(), pipeline_data_parallel(config.scenario()))
    if config.strategy.ep > 1:
        return _expert_parallel_trainer(config, module)
    if config.parallelism.splits_model and config.strategy.engine == "pytorch":
        return TorchTensorParallel(module, config.scenario())
    if config.parallelism.splits_model:
        return _model_parallel_trainer(config, module)
    if config.strategy.engine == "pytorch":
        if strategy in ("ddp", "zero1"):
            return TorchDDP(module, training, zero1=strategy == "zero1")
        return TorchFSDP2(module, training, reshard_after_forward=strategy != "zero2", shard_group=shard_group)
    broadcast_module(module)  # the teaching strategies start every rank from rank 0's weights
    teaching: dict[str, Callable[[], Trainer]] = {
        "ddp": lambda: DataParallelBucket(module, training),
        "zero1": lambda: Zero1(module, training),
        "zero2": lambda: Zero2(module, training),
        "zero3": lambda: FullyShardedTeaching(module, training),
        "hsdp": lambda: FullyShardedTeaching(
            module, training, *hsdp_groups(shard_group, [list(range(config.world_size))])
        ),
    }
    return teaching[strategy]()


def _model_parallel_trainer(config: RunConfig, module: torch.nn.Module) -> Trainer:
    """Tensor and context parallelism: the teaching grid, inside ddp or a teaching ZeRO strategy over the grid's data
    group (the ranks holding the same tp slice; an hsdp shard group is shard_group x cp consecutive ones of them)."""
    from shardscope.reference_models import TransformerLM
    from shardscope.runtime.teaching.fsdp import FullyShardedTeaching, hsdp_groups
    from shardscope.runtime.teaching.model_parallel import ModelParallelTeaching, ProcessGrid, ShardedModelParallel
    from shardscope.runtime.teaching.zero import Zero1, Zero2

    strategy, training = config.strategy, config.training
    assert isinstance(module, TransformerLM)
    tp, cp, sequence_parallel = strategy.tp, strategy.cp, strategy.uses_sequence_parallel
    if strategy.stage == 0:
        return ModelParallelTeaching(module, training, tp=tp, cp=cp, sequence_parallel=sequence_parallel)

    def fully_sharded(grid: ProcessGrid) -> Trainer:
        shard, replica = hsdp_groups(strategy.shard_group * cp, grid.data_ranks)
        return FullyShardedTeaching(module, training, shard or grid.data_group, replica)

    data_parallel: dict[str, Callable[[ProcessGrid], Trainer]] = {
        "zero1": lambda grid: Zero1(module, training, grid.data_group),
        "zero2": lambda grid: Zero2(module, training, grid.data_group),
        "zero3": lambda grid: FullyShardedTeaching(module, training, grid.data_group),
        "hsdp": fully_sharded,
    }
    return ShardedModelParallel(
        module, training, data_parallel[strategy.canonical_name], tp=tp, cp=cp, sequence_parallel=sequence_parallel
    )


def _expert_parallel_trainer(config: RunConfig, module: torch.nn.Module) -> Trainer:
    """Expert parallelism inside a teaching data-parallel strategy: the strategy made over the world (hsdp: its
    shard and replica groups) from the units ExpertDataParallel cuts, the experts' over their own groups."""
    from shardscope.reference_models import TransformerLM
    from shardscope.runtime.teaching.ddp import DataParallelBucket
    from shardscope.runtime.teaching.expert_data_parallel import DataParallel, ExpertDataParallel
    from shardscope.runtime.teaching.fsdp import FullyShardedTeaching, hsdp_groups
    from shardscope.runtime.teaching.zero import Zero1, Zero2

    strategy, training, shard_group = config.strategy, config.training, config.scenario().shard_degree
    assert isinstance(module, TransformerLM)
    shard, replica = (None, None)
    if strategy.preset.groups_replicate:
        shard, replica = hsdp_groups(shard_group, [list(range(config.world_size))])
    data_parallel: dict[str, DataParallel] = {
        "ddp": lambda units, groups: DataParallelBucket(module, training, units=units, unit_groups=groups),
        "zero1": lambda units, groups: Zero1(module, training, units=units, unit_groups=groups),
        "zero2": lambda units, groups: Zero2(module, training, units=units, unit_groups=groups),
        "zero3": lambda units, groups: FullyShardedTeaching(module, training, units=units, unit_groups=groups),
        "hsdp": lambda units, groups: FullyShardedTeaching(
            module, training, shard, replica, units=units, unit_groups=groups
        ),
    }
    return ExpertDataParallel(
        module, training, data_parallel[strategy.canonical_name], ep=strategy.ep, shard_group=shard_group
    )


def model_dtype(config: RunConfig) -> torch.dtype:
    """Teaching strategies store 16-bit weights under mixed precision; torch's engines keep fp32 and cast."""
    if is_mixed(config.training) and config.strategy.engine == "pytorch":
        return torch.float32
    return param_dtype(config.training)


def rank_batch(config: RunConfig, step: int, rank: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch: its data-parallel rank's sequences, every micro-batch of them
    (the pp, tp and cp ranks of one data-parallel rank share them; a cp rank keeps its chunks of them)."""
    size, mesh = config.training.micro_batch_size * config.training.grad_accum_steps, config.parallelism
    inputs, targets = sample_batch(
        config.model_spec, config.training, num_sequences=size * mesh.data_parallel, step=step
    )
    index = rank % (config.world_size // mesh.pp) // (mesh.tp * mesh.cp)
    return inputs[index * size : (index + 1) * size].to(device), targets[index * size : (index + 1) * size].to(device)


def _measured_step(
    trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor, ledger: CollectiveLedger
) -> dict[str, Any]:
    held = trainer.held()
    tracker = MemoryTracker()
    tracker.register(held["parameters"], "parameters")
    tracker.register(held["gradients"], "gradients")
    tracker.register(held["optimizer_state"], "optimizer_state")
    tracker.register(held["buffers"], "buffers", resizable=True)
    tracker.register(trainer.resizable_buffers(), "buffers", resizable=True)
    on_cuda = inputs.is_cuda
    if on_cuda:  # the caching allocator's own high-water mark of this step, the measured peak on GPUs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    action_ends: list[int] = []

    def next_action(phase: str) -> None:  # a pipeline runs its forwards and backwards inside loss(), one by one
        action_ends.append(tracker.tick)
        tracker.phase = ledger.phase = phase

    trainer.phase_listener = next_action
    with tracker:
        tracker.phase = ledger.phase = "forward"
        loss = trainer.loss(inputs, targets)
        forward_end, loss_bytes = tracker.tick, storage_bytes([loss])
        tracker.phase = ledger.phase = "backward"
        trainer.backward(loss)
        del loss
        after_backward = trainer.held()
        tracker.relabel(after_backward["gradients"], "gradients")
        gradients = storage_bytes(after_backward["gradients"])
        tracker.phase = ledger.phase = "optimizer"
        trainer.step()
    # Read after the step, when every free is placed (a late one from gloo's worker thread may fall before it).
    activations = tracker.live_by_label_at(forward_end).get("forward", 0) - loss_bytes
    if action_ends:  # a pipeline: what its forwards kept at the worst moment between two actions
        activations = max(tracker.live_by_label_at(tick).get("forward", 0) for tick in action_ends)
    trainer.phase_listener = None
    held = trainer.held()
    tracker.relabel(held["optimizer_state"], "optimizer_state")
    hidden = trainer.hidden_buffer_bytes()
    # DDP's buckets were allocated by its reducer (C++) before this step; the tracker first sees them in backward,
    # when the reducer copies a gradient into one. Count them from the start, once (not again as hidden bytes).
    if hidden and tracker.backdate_survivors("backward", "buffers") == hidden:
        hidden = 0
    at_peak = tracker.peak_by_final_label()
    tracked_peak = tracker.peak_bytes + hidden
    if on_cuda:
        torch.cuda.synchronize()
    return {
        "parameters_bytes": storage_bytes(held["parameters"]),
        "gradients_bytes": max(gradients, storage_bytes(held["gradients"])),
        "optimizer_state_bytes": storage_bytes(held["optimizer_state"]),
        "activations_bytes": activations,
        "buffers_bytes": tracker.high_water.get("buffers", 0) + hidden,
        "temporary_bytes": at_peak.get("backward", 0) + at_peak.get("optimizer", 0),
        # On CUDA: torch.cuda.max_memory_allocated over the step (what the allocator handed out, the run's batch
        # included); the storage tracker's figure stays beside it. On CPU the tracker is the measurement.
        "peak_bytes": torch.cuda.max_memory_allocated() if on_cuda else tracked_peak,
        "tracked_peak_bytes": tracked_peak,
        "peak_composition": {**at_peak, "hidden_buffers": hidden},
    }


def train_and_measure(
    config: RunConfig,
    rank: int,
    device: str,
    status: Callable[[str], None],
    on_collective: Callable[[int], None],
    fault: Callable[[], None],
) -> dict[str, Any]:
    """Build, wrap, train `steps` steps; returns this rank's measurement and its full parameters."""
    module = build_model(
        config.model_spec, config.training, device=device, dtype=model_dtype(config), seed=config.seed + rank
    )
    ledger = CollectiveLedger(on_call=on_collective)
    with ledger:
        status("setup")
        trainer = make_trainer(config, module)
    mesh = getattr(trainer, "mesh", None)  # torch's tensor parallelism: its rows named by mesh axis, as the trace's
    if mesh is not None:
        ledger.name_axes(mesh)
    ledger.axes.update(getattr(trainer, "ledger_axes", {}))  # a teaching pipeline's pairs of neighbouring ranks
    ledger.message_phases = getattr(trainer, "message_phases", {})  # torch's pipeline batches sends and receives
    step_times: list[float] = []
    memory: dict[str, Any] = {}
    measured_time = 0.0
    for step in range(config.steps):
        last = step == config.steps - 1
        ledger.recording = last
        inputs, targets = rank_batch(config, step, rank, device)
        status(f"step {step + 1}/{config.steps}")
        # The ledger's Python hook on every op would slow the timed steps; it watches the first step (a hang there
        # is attributed by collectives entered) and the measured last one.
        with ledger if step == 0 or last else contextlib.nullcontext():
            if step == 0:
                fault()
            started = time.perf_counter()
            if last:
                memory = _measured_step(trainer, inputs, targets, ledger)
                measured_time = time.perf_counter() - started
            else:
                loss = trainer.loss(inputs, targets)
                trainer.backward(loss)
                trainer.step()
                step_times.append(time.perf_counter() - started)
    ledger.recording = False
    full = {name: tensor.detach().clone() for name, tensor in trainer.full_parameters().items()}
    timed = step_times[1:] if len(step_times) > 1 else step_times or [measured_time]
    return {
        "rank": rank,
        "memory": memory,
        "ledger": [row.to_json() for row in ledger.merged()],
        "step_time_s": statistics.median(timed),
        "full_parameters": full,
    }


def reference_parameters(config: RunConfig, device: str) -> dict[str, torch.Tensor]:
    """Single-process training on each step's whole global batch from rank 0's weights: what every strategy must
    end with. Mixed precision is compared against fp32 training (its difference is reported, not expected ~0)."""
    dtype = torch.float64 if config.training.precision == "fp64" else torch.float32
    module = build_model(config.model_spec, config.training, device=device, dtype=dtype, seed=config.seed)
    optimizer = make_optimizer(list(module.parameters()), config.training)
    for step in range(config.steps):
        inputs, targets = sample_batch(
            config.model_spec,
            config.training,
            num_sequences=config.training.micro_batch_size
            * config.training.grad_accum_steps
            * config.parallelism.data_parallel,
            step=step,
        )
        lm_loss(module(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(module.named_parameters())
