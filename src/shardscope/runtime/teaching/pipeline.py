"""Pipeline parallelism from send and recv: each pipeline rank holds consecutive blocks of the model (its stages) and
runs the forwards and backwards of the step's micro-batches in the order its schedule gives.

The order is core.pipeline_schedule's (`rank_actions`), the one the prediction counts, for GPipe, 1F1B and
interleaved 1F1B; the layer split is core.pipeline's. A forward of stage s > 0 takes the hidden states stage s - 1
sent, a backward of stage s < last the gradient stage s + 1 sent back. As torch's PipelineStage does, every rank
keeps one receive buffer per micro-batch for each activation and gradient it receives, and posts all its receives
when the step starts, so a send never waits for its receiver to reach that action (no schedule can deadlock).
Gradients accumulate over the micro-batches; after the last backward the data-parallel ranks of each pipeline rank
(pp is the outermost mesh dimension: rank r is pipeline rank r // dp) all-reduce them unit by unit, as DDP does on
its last micro-batch (the others run under no_sync).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardscope.core.pipeline import PipelineStage, rank_stages
from shardscope.core.pipeline_schedule import Action, rank_actions
from shardscope.measure.storage import measured_as
from shardscope.reference_models import TransformerLM, lm_loss
from shardscope.runtime.teaching.ddp import FlatBufferTrainer, flat_buffers
from shardscope.runtime.teaching.flat import ShardOptimizer
from shardscope.runtime.trainer import broadcast_module
from shardscope.specs import Scenario

ROOT_NAMES = ("embed_tokens", "embed_positions", "norm", "lm_head")


class PipelineGrid:
    """This rank's place in the pp x dp grid: its data group (the ranks of its pipeline rank) and a two-rank group
    with each neighbouring pipeline rank of its column (the last wraps to the first for interleaved stages)."""

    def __init__(self, pp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.pp, self.dp = pp, world // pp
        self.pp_index, self.dp_index = rank // self.dp, rank % self.dp
        self.data_group: dist.ProcessGroup | None = None
        for index in range(pp):  # every rank creates every group, in the same order
            group = dist.new_group([index * self.dp + d for d in range(self.dp)])
            if index == self.pp_index:
                self.data_group = group
        self.pairs: dict[int, dist.ProcessGroup] = {}
        for column in range(self.dp):
            for index in range(pp):
                neighbour = (index + 1) % pp
                if neighbour == index or (pp == 2 and index == 1):
                    continue  # one rank, or the pair (0, 1) made already
                group = dist.new_group(sorted([index * self.dp + column, neighbour * self.dp + column]))
                if column == self.dp_index and self.pp_index in (index, neighbour):
                    self.pairs[neighbour if self.pp_index == index else index] = group

    def global_rank(self, pipeline_rank: int) -> int:
        """The rank holding pipeline rank `pipeline_rank` in this rank's column."""
        return pipeline_rank * self.dp + self.dp_index


class PipelineRankModule(nn.Module):
    """The parts of a reference model one pipeline rank holds: the embeddings (first stage), its stages' blocks in
    `layers` (so the flat-buffer units are its root part and its blocks), the final norm and head (last stage)."""

    def __init__(self, model: TransformerLM, stages: tuple[PipelineStage, ...]) -> None:
        super().__init__()
        self.spec, self.checkpointing, self.stages = model.spec, model.checkpointing, stages
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

    def run_stage(self, stage: PipelineStage, x: torch.Tensor) -> torch.Tensor:
        """The stage's forward: token ids in on the first stage, hidden states in elsewhere; logits out of the last."""
        if stage.embedding:
            ids, x = x, self.embed_tokens(x)
            if self.spec.family == "gpt2":
                x = x + self.embed_positions(torch.arange(ids.shape[1], device=ids.device))
        context = self._context(x.shape[1], x)
        start = self.first_local[stage.index]
        for offset in range(stage.layers):
            x = self._run_block(stage.first_layer + offset, self.layers[start + offset], x, context)
        return self.lm_head(self.norm(x)) if stage.head else x

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


class PipelineTeaching(FlatBufferTrainer):
    """A pipeline over pp ranks inside ddp over the rest: the rank's parameters and gradients in flat per-unit
    buffers (gradients accumulate there over the micro-batches), one all-reduce per unit after the last backward."""

    def __init__(self, module: TransformerLM, scenario: Scenario) -> None:
        strategy, training = scenario.strategy, scenario.training
        self.world_size, self.micro_batches = dist.get_world_size(), training.grad_accum_steps
        self.grid = PipelineGrid(strategy.pp)
        broadcast_module(module)  # every rank starts from rank 0's weights and keeps its stages of them
        self.stages = {stage.index: stage for stage in rank_stages(scenario, self.grid.pp_index)}
        self.last_stage = strategy.pipeline_stages - 1
        self.module = PipelineRankModule(module, tuple(self.stages.values()))
        self.actions = rank_actions(
            strategy.pp_schedule, strategy.pp, strategy.virtual_stages, self.micro_batches, self.grid.pp_index
        )
        self.layouts, self.flat_params, self.flat_grads = flat_buffers(self.module)
        self.optimizer = ShardOptimizer(self.flat_params, training)
        self.receive_buffers = self._receive_buffers(scenario)
        self.ledger_axes = {tuple(dist.get_process_group_ranks(g)): "pp" for g in self.grid.pairs.values()}

    def _receive_buffers(self, scenario: Scenario) -> dict[tuple[int, bool, int], torch.Tensor]:
        """One buffer per micro-batch for each hidden state (stage > 0) and gradient (stage < last) this rank
        receives, keyed by (stage, backward, micro-batch); kept from step to step, as torch's PipelineStage does."""
        training, model = scenario.training, scenario.model
        shape = (training.micro_batch_size, training.sequence_length, model.hidden_size)
        dtype = self.flat_params[0].dtype
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
        work = dist.isend(tensor.detach(), dst=peer, group=group, tag=self._tag(stage, backward, micro_batch))
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
        out = self.module.run_stage(stage, x)
        if stage.head:
            out = lm_loss(out, targets) / self.micro_batches  # the mean over micro-batches, as one big batch
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
        """The backwards ran in `loss`; average the accumulated gradients over the data group, unit by unit, the
        blocks last to first then the root (DDP's bucket order)."""
        if self.grid.dp == 1:
            return
        for grads in [*self.flat_grads[1:][::-1], self.flat_grads[0]] if self._has_root else self.flat_grads[::-1]:
            dist.all_reduce(grads, group=self.grid.data_group)
            grads.div_(self.grid.dp)

    @property
    def _has_root(self) -> bool:
        return self.layouts[0].unit.name == "root"

    def held(self) -> dict[str, list[torch.Tensor]]:
        held = super().held()
        held["buffers"] = list(self.receive_buffers.values())
        return held

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model by name: each pipeline rank's own, gathered to all."""
        own = {
            self.module.global_name(name): param.detach().clone()
            for name, param in self.module.named_parameters()
            if self.grid.dp_index == 0
        }
        everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(everyone, own)
        return {name: tensor for piece in everyone for name, tensor in piece.items()}
