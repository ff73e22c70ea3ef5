"""What the tracer and the runtime change in, or read from, torch.distributed.pipelining's stages and schedules: the
phase of every message, the recorder's phases and saved activations, the first step's metadata vote, send Works that
hold what they sent, and the stages' receive buffers.

The fake process group completes every send and recv without moving data (a recv leaves its buffer as it was),
which is all the steady-state step needs: its receive buffers are fake tensors whose shapes the stage knows from the
static input and output metadata `trace.pipeline` gives it. Only the schedule's first-step warm-up cannot run as
written: it votes over the pipeline whether every stage was given complete static metadata, by sending a 1 or 0
from stage to stage and reading the product back with .item(), which a fake tensor has no value for and a fake recv
never fills. Every stage here is built with complete static metadata and no DTensor, so every real rank votes 1 and
the answer is STATIC: `static_warm_up` sets that answer instead of voting. It changes the first step only, which is
not measured (the last step is).

A real process group's send Work (gloo's and nccl's) keeps the tensor it sends alive until the Work object itself is
dropped, and the schedules keep some of their Works past the wait: Schedule1F1B keeps the last warm-up send's Works
in `send_work` until its steady phase ends, so the first stage holds that micro-batch's output after its backward.
The fake process group's Works hold nothing, so `sends_held_by_their_works` makes each Work the schedule gets hold
the tensors it sends, as a real one does.

Private torch attributes used (torch 2.13, torch/distributed/pipelining/): PipelineStage._inference_mode,
_PipelineSchedule._warmup_p2p, _PipelineSchedule._compute_loss, schedules._batch_p2p, and the stage's args_recv_info /
grad_recv_info buffers (labelled `buffers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardscope.trace.tracker import StepRecorder

Progress = Callable[[str], None]


def watch_messages(stage: Any, phases: dict[int, str]) -> None:
    """Remember, for each tensor the stage hands the schedule to send or receive, which phase asked for it (a
    message's phase is the one of the op list the stage made it in, get_fwd_* or get_bwd_*, not when the schedule
    fires it: CollectiveLedger.message_phases)."""
    for method, phase in (
        ("get_fwd_recv_ops", "forward"),
        ("get_fwd_send_ops", "forward"),
        ("get_bwd_recv_ops", "backward"),
        ("get_bwd_send_ops", "backward"),
    ):
        original = getattr(stage, method)

        def wrapped(chunk: int, original: Any = original, phase: str = phase) -> Any:
            ops = original(chunk)
            for op in ops:
                phases[id(op.tensor)] = phase
            return ops

        setattr(stage, method, wrapped)


def watch_phases(stage: Any, recorder: StepRecorder, pp_rank: int, progress: Progress) -> None:
    """Tell the recorder whether the stage runs a forward or a backward (categories and the peak's moment), and
    take the saved activations after every forward: what is live in `activations` once a forward has returned is
    what the micro-batches in flight keep for their backward (their saved tensors and the stage outputs torch's
    stage caches for it)."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
        recorder.phase, recorder.where = "forward", f"stage {stage.stage_index} forward {chunk}"
        progress(f"pipeline rank {pp_rank}: stage {stage.stage_index} forward of micro-batch {chunk}")
        output = forward(chunk, *args, **kwargs)
        if recorder.recording and not stage.is_last:
            recorder.saved_activations = max(recorder.saved_activations, recorder.live["activations"])
        return output

    def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
        recorder.phase, recorder.where = "backward", f"stage {stage.stage_index} backward {chunk}"
        return backward(chunk, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def watch_loss(schedule: Any, recorder: StepRecorder) -> None:
    """The last stage's forward ends with its loss: take the saved activations there, less the loss itself."""
    compute = schedule._compute_loss

    def compute_loss(*args: Any, **kwargs: Any) -> Any:
        recorder.phase = "loss"
        loss = compute(*args, **kwargs)
        recorder.end_forward(loss)
        recorder.phase = "forward"
        return loss

    schedule._compute_loss = compute_loss


def static_warm_up(schedule: Any) -> None:
    """Replace the schedule's metadata vote by its known answer (see the module docstring)."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warm_up(stages: list[Any], _has_backward: bool, _p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warm_up


class _SendingWork:
    """A fake process group's Work with the tensors its batch sends, kept as long as the Work is."""

    def __init__(self, work: Any, sent: list[torch.Tensor]) -> None:
        self.work, self.sent = work, sent

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)


@contextmanager
def sends_held_by_their_works() -> Iterator[None]:
    """Every Work the pipelining schedules get from a batch of sends and receives holds the batch's sent tensors
    (see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    batch = schedules._batch_p2p

    def holding(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        sent = [op.tensor for op in p2p_ops if op.op is dist.isend]
        return [_SendingWork(work, sent) for work in batch(p2p_ops, desc)]

    schedules._batch_p2p = holding
    try:
        yield
    finally:
        schedules._batch_p2p = batch


def receive_buffers(stages: list[Any]) -> list[torch.Tensor]:
    """The receive buffers torch's PipelineStages keep for the step (activations and gradients), once made."""
    found = []
    for stage in stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            found += [info.buffer for info in infos if getattr(info, "buffer", None) is not None]
    return found
