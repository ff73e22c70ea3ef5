"""Tensor and context parallelism inside data parallelism: a dp x cp x tp grid of ranks, tp innermost.

Rank r sits at dp_index = r // (cp*tp), cp_index = r // tp % cp, tp_index = r % tp (picotron's process group
manager, torchtitan's ParallelDims order; a pipeline adds pp outermost, each pipeline rank a grid of its own). The
tp ranks of a cell share its tokens and split its weights; the cp ranks of a row split the tokens of the same
sequences; the dp ranks take different sequences. So the ranks with the same tp_index hold the same shard and have
seen different tokens: their gradients are averaged over that data group, by one all-reduce per tensor
(`ModelParallelTeaching`, DDP), or by a teaching ZeRO strategy that flattens and shards the tp slices over it as it
would a whole model (`ShardedModelParallel`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardscope.reference_models import TransformerLM
from shardscope.ring_attention import use_ring_attention, zigzag_positions
from shardscope.runtime.teaching.ddp import FlatBufferTrainer, flat_buffers
from shardscope.runtime.teaching.flat import ShardOptimizer
from shardscope.runtime.teaching.tensor_parallel import TensorParallelLM, whole_parameters
from shardscope.runtime.trainer import SplitInsideDataParallel, Trainer, broadcast_module
from shardscope.specs import TrainingSpec


class ProcessGrid:
    """This rank's place in the pp x dp x cp x tp grid and its groups (pp outermost, tp innermost; pp is 1 but for
    the teaching pipeline, whose neighbouring stages pair up in pipeline.PipelineGrid). Every rank creates every
    group, in the same order, as torch.distributed requires."""

    def __init__(self, *, cp: int, tp: int, pp: int = 1) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % (pp * cp * tp):
            raise ValueError(f"pp({pp}) * cp({cp}) * tp({tp}) must divide the world size({world})")
        self.pp, self.dp, self.cp, self.tp = pp, world // (pp * cp * tp), cp, tp
        self.block = self.dp * cp * tp  # the ranks of one pipeline rank
        self.pp_index, within = divmod(rank, self.block)
        self.dp_index, self.cp_index, self.tp_index = within // (cp * tp), within // tp % cp, within % tp
        starts = [p * self.block for p in range(pp)]
        cells = [(s + d * cp * tp + c * tp) for s in starts for d in range(self.dp) for c in range(cp)]
        self.tp_group = self._mine([[cell + t for t in range(tp)] for cell in cells])
        rows = [(s + d * cp * tp + t) for s in starts for d in range(self.dp) for t in range(tp)]
        self.cp_group = self._mine([[row + c * tp for c in range(cp)] for row in rows])
        # dp x cp, dp-major: the ranks of one pipeline rank holding one tp slice
        self.data_ranks = [list(range(s + t, s + self.block, tp)) for s in starts for t in range(tp)]
        self.data_group = self._mine(self.data_ranks)

    @staticmethod
    def _mine(rank_lists: list[list[int]]) -> dist.ProcessGroup:
        mine: dist.ProcessGroup | None = None
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        assert mine is not None
        return mine


class TensorContextParallel:
    """The model-parallel side of a grid rank: rank 0's whole model broadcast to the world, then the rank's tp slice
    kept (and the attention made a ring over cp); the loss of the rank's tokens, and whole parameters from slices."""

    def __init__(
        self, module: TransformerLM, training: TrainingSpec, *, tp: int, cp: int, sequence_parallel: bool
    ) -> None:
        self.grid = ProcessGrid(cp=cp, tp=tp)
        tokens_per_rank = training.sequence_length // cp
        if sequence_parallel and tokens_per_rank % tp:
            raise ValueError(f"sequence parallelism needs tp({tp}) to divide the tokens per cp rank({tokens_per_rank})")
        self.module, self.sequence_length = module, training.sequence_length
        broadcast_module(module)  # every rank starts from rank 0's weights and keeps its slice of them
        self.parallel = TensorParallelLM(module, self.grid.tp_group, sequence_parallel)
        if cp > 1:
            use_ring_attention(module, self.grid.cp_group)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of this rank's tokens of its data-parallel micro-batch (whole sequences)."""
        # made each step, as the reference model's position ids are: gpt2's position embedding saves them
        positions = zigzag_positions(self.sequence_length, self.grid.cp, self.grid.cp_index).to(inputs.device)
        loss: torch.Tensor = self.module(inputs[:, positions], targets[:, positions], positions)
        return loss

    def whole(self, slices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter put back together from the tp ranks' slices (called on every rank)."""
        return whole_parameters(slices, self.grid.tp_group)


class ModelParallelTeaching(FlatBufferTrainer):
    """A reference model trained with tp (optionally sequence-parallel) and cp inside dp, from collectives. The
    rank's slices sit in flat per-unit buffers, as DataParallelBucket's (the gradients live from step to step, one
    optimizer step counter per unit); after backward the data group averages each gradient slice."""

    def __init__(
        self, module: TransformerLM, training: TrainingSpec, *, tp: int, cp: int = 1, sequence_parallel: bool = False
    ) -> None:
        self.module, self.world_size = module, dist.get_world_size()
        self.split = TensorContextParallel(module, training, tp=tp, cp=cp, sequence_parallel=sequence_parallel)
        self.grid = self.split.grid
        self.layouts, self.flat_params, self.flat_grads = flat_buffers(module)
        self.optimizer = ShardOptimizer(self.flat_params, training)  # under mixed precision, on an fp32 master copy

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.split.loss(inputs, targets)

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        data_ranks = self.grid.dp * self.grid.cp
        for param in self.module.parameters():
            if param.grad is not None and data_ranks > 1:
                dist.all_reduce(param.grad, group=self.grid.data_group)
                param.grad.div_(data_ranks)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.split.whole(dict(self.module.named_parameters()))


class ShardedModelParallel(SplitInsideDataParallel):
    """tp and cp inside a sharded data-parallel strategy (ZeRO-1/2/3, HSDP): the teaching strategy, made by
    `data_parallel` over the grid's data group, flattens and shards the rank's tp slices as it would a whole model."""

    def __init__(
        self,
        module: TransformerLM,
        training: TrainingSpec,
        data_parallel: Callable[[ProcessGrid], Trainer],
        *,
        tp: int,
        cp: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        self.module, self.world_size = module, dist.get_world_size()
        self.split = TensorContextParallel(module, training, tp=tp, cp=cp, sequence_parallel=sequence_parallel)
        self.grid = self.split.grid
        self.data = data_parallel(self.grid)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.split.loss(inputs, targets)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.split.whole(self.data.full_parameters())
