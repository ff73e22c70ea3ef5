"""Pipeline parallelism from send and recv: each pipeline rank holds consecutive blocks of the model (its stages) and
runs the forwards and backwards of the step's micro-batches in the order its schedule gives.

The order is core.pipeline_schedule's (`rank_actions`), the one the prediction counts, for GPipe, 1F1B and
interleaved 1F1B; the layer split is core.pipeline's. A forward of stage s > 0 takes the hidden states stage s - 1
sent, a backward of stage s < last the gradient stage s + 1 sent back. As torch's PipelineStage does, every rank
keeps one receive buffer per micro-batch for each activation and gradient it receives, and posts all its receives
when the step starts, so a send never waits for its receiver to reach that action (no schedule can deadlock).

The ranks form a pp x dp x tp grid (model_parallel.ProcessGrid, pp outermost: rank r is pipeline rank
r // (dp x tp)). Under tensor parallelism each stage's blocks, embeddings and head are the tp slices
tensor_parallel.TensorParallelLM makes, and the hidden states between stages are each tp rank's seq/tp tokens under
sequence parallelism (Megatron-LM sends them so too). Gradients accumulate over the micro-batches, and a teaching
data-parallel strategy keeps the rank's parameters over the ranks of its pipeline rank holding the same tp slice
(pipeline_data.py): ddp all-reduces them after the last backward, ZeRO-1/2/3 and HSDP shard them as they would a
whole model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardscope.core.pipeline import PipelineStage, rank_stages
from shardscope.core.pipeline_schedule import Action, rank_actions
from shardscope.measure.storage import measured_as
from shardscope.reference_models import TransformerLM, lm_loss
from shardscope.runtime.teaching.model_parallel import ProcessGrid
from shardscope.runtime.teaching.tensor_parallel import TensorParallelLM, whole_parameters
from shardscope.runtime.trainer import Trainer, broadcast_module
from shardscope.specs import Scenario


class PipelineGrid(ProcessGrid):
    """The pp x dp x tp grid, and a two-rank group with each neighbouring pipeline rank of this rank's column (the
    ranks of the same dp and tp index; the last pipeline rank wraps to the first for interleaved stages)."""

    def __init__(self, *, pp: int, tp: int) -> None:
        super().__init__(cp=1, tp=tp, pp=pp)
        self.column = dist.get_rank() % self.block
        self.pairs: dict[int, dist.ProcessGroup] = {}
        for column in range(self.block):
            for index in range(pp):
                neighbour = (index + 1) % pp
                if neighbour == index or (pp == 2 and index == 1):
                    continue  # one rank, or the pair (0, 1) made already
                group = dist.new_group(sorted([index * self.block + column, neighbour * self.block + column]))
                if column == self.column and self.pp_index in (index, neighbour):
                    self.pairs[neighbour if self.pp_index == index else index] = group

    def global_rank(self, pipeline_rank: int) -> int:
        """The rank holding pipeline rank `pipeline_rank` in this rank's column."""
        return pipeline_rank * self.block + self.column


class PipelineRankModule(nn.Module):
    """The parts of a reference model one pipeline rank holds: the embeddings (first stage), its stages' blocks in
    `layers` (so the flat-buffer units are its root part and its blocks), the final norm and head (last stage);
    their tp slices when `parallel` split the model."""

    def __init__(
        self, model: TransformerLM, stages: tuple[PipelineStage, ...], parallel: TensorParallelLM | None
    ) -> None:
        super().__init__()
        self.spec, self.checkpointing, self.stages, self.parallel = model.spec, model.checkpointing, stages, parallel
        if stages[0].embedding:
            self.embed_tokens = model.embed_tokens
            if hasattr(model, "embed_positions"):
                self.embed_positions = model.embed_positions
        self.layers = nn.ModuleList(
            model.layers[stage.first_layer + i] for stage in stages for i in range(stage.layers)
        )
        if stages[-1].head:
            self.norm, self.lm_head = model.norm, model.lm_head
        self.first_local = {stage.index: sum(s.layers for s in stages[:k]) for k, stage in enumerate(stages)}

    _context = TransformerLM._context
    _run_block = TransformerLM._run_block

    def forward(self, stage: PipelineStage, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The stage's forward: token ids in on the first stage, hidden states elsewhere; the mean loss of the
        micro-batch out of the last, its hidden states out of the others."""
        sequence_length = targets.shape[1]
        if stage.embedding:
            positions = torch.arange(sequence_length, device=x.device)
            if self.parallel is not None:
                x = self.parallel.embed(x, positions)
            else:
                x = self.embed_tokens(x)
                if self.spec.family == "gpt2":
                    x = x + self.embed_positions(positions)
        context = self._context(sequence_length, x)
        start = self.first_local[stage.index]
        for offset in range(stage.layers):
            x = self._run_block(stage.first_layer + offset, self.layers[start + offset], x, context)
        if not stage.head:
            return x
        if self.parallel is not None:
            return self.parallel.head_loss(x, targets)
        return lm_loss(self.lm_head(self.norm(x)), targets)

    def global_name(self, name: str) -> str:
        """A parameter's name in the whole model (its block's index there)."""
        if not name.startswith("layers."):
            return name
        _, local, rest = name.split(".", 2)
        index = int(local)
        for stage in self.stages:
            start = self.first_local[stage.index]
            if start <= index < start + stage.layers:
                return f"layers.{stage.first_layer + index - start}.{rest}"
        raise KeyError(name)


class PipelineTeaching(Trainer):
    """A pipeline over pp ranks, each stage's layers split over tp, inside a data-parallel strategy over the rest:
    `data_parallel` makes the teaching strategy (pipeline_data.py) that holds and updates the rank's parameters."""

    def __init__(
        self,
        module: TransformerLM,
        scenario: Scenario,
        data_parallel: Callable[[nn.Module, PipelineGrid], Trainer],
    ) -> None:
        strategy, training = scenario.strategy, scenario.training
        self.world_size, self.micro_batches = dist.get_world_size(), training.grad_accum_steps
        self.grid = PipelineGrid(pp=strategy.pp, tp=strategy.tp)
        broadcast_module(module)  # every rank starts from rank 0's weights and keeps its stages of them
        parallel = None
        if strategy.tp > 1:
            parallel = TensorParallelLM(module, self.grid.tp_group, strategy.uses_sequence_parallel)
        self.stages = {stage.index: stage for stage in rank_stages(scenario, self.grid.pp_index)}
        self.last_stage = strategy.pipeline_stages - 1
        self.module = PipelineRankModule(module, tuple(self.stages.values()), parallel)
        self.actions = rank_actions(
            strategy.pp_schedule, strategy.pp, strategy.virtual_stages, self.micro_batches, self.grid.pp_index
        )
        self.data = data_parallel(self.module, self.grid)
        self.receive_buffers = self._receive_buffers(scenario, next(self.module.parameters()).dtype)
        self.ledger_axes = {tuple(dist.get_process_group_ranks(g)): "pp" for g in self.grid.pairs.values()}
        if strategy.tp > 1:
            self.ledger_axes[tuple(dist.get_process_group_ranks(self.grid.tp_group))] = "tp"

    def _receive_buffers(self, scenario: Scenario, dtype: torch.dtype) -> dict[tuple[int, bool, int], torch.Tensor]:
        """One buffer per micro-batch for each hidden state (stage > 0) and gradient (stage < last) this rank
        receives, keyed by (stage, backward, micro-batch); kept from step to step, as torch's PipelineStage does."""
        training, strategy = scenario.training, scenario.strategy
        tokens = training.sequence_length // (strategy.tp if strategy.uses_sequence_parallel else 1)
        shape = (training.micro_batch_size, tokens, scenario.model.hidden_size)
        buffers = {}
        with measured_as("buffers"):
            for stage in self.stages.values():
                for micro_batch in range(self.micro_batches):
                    if stage.index > 0:
                        buffers[stage.index, False, micro_batch] = torch.zeros(shape, dtype=dtype)
                    if stage.index < self.last_stage:
                        buffers[stage.index, True, micro_batch] = torch.zeros(shape, dtype=dtype)
        return buffers

    def _peer(self, stage: int) -> tuple[int, dist.ProcessGroup]:
        """The global rank holding `stage` in this column and the pair group shared with it."""
        pipeline_rank = stage % self.grid.pp
        return self.grid.global_rank(pipeline_rank), self.grid.pairs[pipeline_rank]

    def _tag(self, sender_stage: int, backward: bool, micro_batch: int) -> int:
        """One tag per message: which boundary (by its lower stage), which way, which micro-batch."""
        lower = sender_stage - 1 if backward else sender_stage
        return 2 * (lower * self.micro_batches + micro_batch) + backward

    def _post_receives(self) -> dict[tuple[int, bool, int], dist.Work]:
        works = {}
        for (stage, backward, micro_batch), buffer in self.receive_buffers.items():
            sender = stage + 1 if backward else stage - 1
            peer, group = self._peer(sender)
            self.phase("backward" if backward else "forward")  # a gradient's receive belongs to a backward
            work = dist.irecv(buffer, src=peer, group=group, tag=self._tag(sender, backward, micro_batch))
            assert work is not None
            works[stage, backward, micro_batch] = work
        return works

    def _send(self, tensor: torch.Tensor, stage: int, to_stage: int, backward: bool, micro_batch: int) -> None:
        peer, group = self._peer(to_stage)
        # contiguous: a sequence-parallel stage's output is a view of its reduce-scatter's (sequence dim first) output
        work = dist.isend(
            tensor.detach().contiguous(), dst=peer, group=group, tag=self._tag(stage, backward, micro_batch)
        )
        assert work is not None
        work.wait()  # the receiver posted its receive at the start of its step: this returns once it is there

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the step's schedule (every forward and backward of the micro-batches); returns the mean loss on the
        ranks of the last stage (zero elsewhere)."""
        size = inputs.shape[0] // self.micro_batches
        receives = self._post_receives()
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        total = torch.zeros((), dtype=torch.float64)
        for action in self.actions:
            self.phase("backward" if action.backward else "forward")
            run = self._backward if action.backward else self._forward
            total += run(
                action,
                inputs[action.micro_batch * size : (action.micro_batch + 1) * size],
                targets[action.micro_batch * size : (action.micro_batch + 1) * size],
                receives,
                saved,
            )
        return total

    def _forward(
        self,
        action: Action,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        receives: dict[tuple[int, bool, int], dist.Work],
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
    ) -> float:
        stage, micro_batch = self.stages[action.stage], action.micro_batch
        if stage.embedding:
            x = inputs
        else:
            receives[stage.index, False, micro_batch].wait()
            x = self.receive_buffers[stage.index, False, micro_batch].detach().requires_grad_()
        out = self.module(stage, x, targets)
        if stage.head:
            out = out / self.micro_batches  # the mean over micro-batches, as one big batch
        else:
            self._send(out, stage.index, stage.index + 1, False, micro_batch)
        saved[stage.index, micro_batch] = (x, out)
        return float(out) if stage.head else 0.0

    def _backward(
        self,
        action: Action,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        receives: dict[tuple[int, bool, int], dist.Work],
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
    ) -> float:
        stage, micro_batch = self.stages[action.stage], action.micro_batch
        x, out = saved.pop((stage.index, micro_batch))
        if stage.head:
            out.backward()
        else:
            receives[stage.index, True, micro_batch].wait()
            out.backward(self.receive_buffers[stage.index, True, micro_batch])
        if not stage.embedding:
            assert x.grad is not None
            self._send(x.grad, stage.index, stage.index - 1, True, micro_batch)
        return 0.0

    def phase(self, name: str) -> None:
        """Tell a listener (the run's measurement) which phase the next action is in."""
        if self.phase_listener is not None:
            self.phase_listener(name)

    def backward(self, loss: torch.Tensor) -> None:
        """The backwards ran in `loss`; the data-parallel strategy reduces what they accumulated."""
        self.data.reduce_accumulated()

    def step(self) -> None:
        self.data.step()

    def held(self) -> dict[str, list[torch.Tensor]]:
        held = self.data.held()
        held["buffers"] = [*held["buffers"], *self.receive_buffers.values()]
        return held

    def resizable_buffers(self) -> list[torch.Tensor]:
        return self.data.resizable_buffers()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model by name: each pipeline rank's own, put together from its tp slices,
        gathered to all."""
        own = whole_parameters(self.data.full_parameters(), self.grid.tp_group)
        named = {self.module.global_name(name): tensor for name, tensor in own.items()}
        everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(everyone, named if self.grid.column == 0 else {})
        return {name: tensor for piece in everyone for name, tensor in piece.items()}
