"""Build the model on the meta device and apply the strategy with torch's engines, before any fake tensor exists.

Three model sources: shardscope's reference modules from a ModelSpec, transformers' own modeling code from a
Hugging Face config.json (`--implementation hf`, trace/hf_model.py), or a user's factory `package.module:function`
returning (module, sample batch). Strategies map to
torch's own engines, as the runtime runs them: zero3/fsdp/hsdp -> fully_shard (hsdp on a 2-D mesh), zero2 ->
fully_shard without resharding after forward (torch's SHARD_GRAD_OP), ddp -> DistributedDataParallel, zero1 -> DDP
with ZeroRedundancyOptimizer (shardscope.trace.ddp wraps the model once its fake parameters exist).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardscope.core.engines.pytorch import runs_on_ddp
from shardscope.specs import Scenario
from shardscope.trace.compat import flatten_mesh
from shardscope.trace.gpu_kernels import use_gpu_kernels
from shardscope.trace.request import TraceRequest

DTYPES = {
    "fp32": torch.float32,
    "fp64": torch.float64,
    "bf16-mixed": torch.float32,
    "fp16-mixed": torch.float32,
    "bf16": torch.bfloat16,
}
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class TraceSetupError(RuntimeError):
    """The model or strategy cannot be set up for a trace; the message says why and what to do."""


@dataclass(slots=True)
class TracedModel:
    """A model ready to shard: the root, its repeated blocks, how to make a batch and how to take the loss."""

    root: nn.Module
    blocks: list[nn.Module]
    make_batch: Callable[[], tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    engine_notes: list[str]
    mesh: Any = None
    """The DeviceMesh apply_strategy sharded it over (None for ddp and zero1, on the world's group)."""


def _reference_model(request: TraceRequest, num_blocks: int | None) -> TracedModel:
    from shardscope.reference_models import build_model, lm_loss

    scenario = request.scenario
    spec = scenario.model if num_blocks is None else replace(scenario.model, num_layers=num_blocks)
    training = scenario.training
    root = build_model(spec, training, device="meta", dtype=DTYPES[training.precision], seed=None)
    if scenario.cluster.gpu_kernels:
        use_gpu_kernels(root)
    shape = (training.micro_batch_size, training.sequence_length)

    def make_batch() -> tuple[Any, Any]:
        ids = torch.randint(0, spec.vocab_size, shape)
        return ids, torch.randint(0, spec.vocab_size, shape)

    return TracedModel(
        root=root,
        blocks=list(root.layers),
        make_batch=make_batch,
        loss=lambda logits, targets: lm_loss(logits, targets),
        engine_notes=[],
    )


def largest_module_list(root: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the ModuleList holding the most parameters."""
    lists = [module for module in root.modules() if isinstance(module, nn.ModuleList)]
    if not lists:
        return []
    best = max(lists, key=lambda modules: sum(p.numel() for p in modules.parameters()))
    return list(best)


def load_factory(path: str) -> Callable[[], Any]:
    """Import `package.module:function`; a missing module or name raises TraceSetupError naming it."""
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise TraceSetupError(f"cannot import module {module_name!r} of factory {path!r}: {error}") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise TraceSetupError(f"module {module_name!r} has no function {function_name!r} (factory {path!r})")
    return factory  # type: ignore[no-any-return]


def _to_fake_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="cpu")
    if isinstance(value, dict):
        return {key: _to_fake_like(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_fake_like(item) for item in value)
    return value


def _call(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, tuple | list):
        return module(*batch)
    return module(batch)


def _factory_loss(outputs: Any, _targets: Any) -> torch.Tensor:
    value = getattr(outputs, "loss", None)
    if value is None:
        value = getattr(outputs, "logits", outputs)
    if isinstance(value, tuple | list):
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TraceSetupError(
            f"the factory's module returned {type(value).__name__}, not a tensor or an object with .loss or .logits"
        )
    return value if value.dim() == 0 else value.float().mean()


def _factory_model(request: TraceRequest) -> TracedModel:
    factory = load_factory(request.factory)
    with torch.device("meta"):
        made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise TraceSetupError(f"factory {request.factory!r} must return (torch.nn.Module, sample batch)")
    root, batch = made
    root.to(DTYPES[request.scenario.training.precision])

    class _Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = root

        def forward(self, batch: Any) -> Any:
            return _call(self.model, batch)

    wrapper = _Root()
    return TracedModel(
        root=wrapper,
        blocks=largest_module_list(root),
        make_batch=lambda: (_to_fake_like(batch), None),
        loss=_factory_loss,
        engine_notes=[
            "the factory's own forward runs as written; --checkpointing, --attention, "
            "--micro-batch and --seq-len do not apply"
        ],
    )


def model_depth(request: TraceRequest) -> int | None:
    """Blocks of the request's model, or None when its depth cannot be changed (a factory's module)."""
    if request.factory:
        return None
    if request.implementation == "hf":
        from shardscope.trace.hf_model import hf_depth

        return hf_depth(request)
    return request.scenario.model.num_layers


def build_traced_model(request: TraceRequest, num_blocks: int | None = None) -> TracedModel:
    """The model of a request on the meta device, cut to num_blocks blocks when given (not for a factory)."""
    if request.factory:
        return _factory_model(request)
    if request.implementation == "hf":
        from shardscope.trace.hf_model import hf_model

        return hf_model(request, num_blocks)
    return _reference_model(request, num_blocks)


def make_mesh(scenario: Scenario, device: str = "cpu") -> Any:
    """The scenario's DeviceMesh, of the device type given: a 1-D ("dp",) mesh over the world, hsdp's 2-D
    (replicate, shard), and under context and tensor parallelism the same with a "cp" and then a "tp" axis inside
    (tp innermost: ranks next to each other share one replica, inside a node, as torchtitan's ParallelDims lays it
    out)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = scenario.parallelism
    if scenario.strategy.preset.groups_replicate:
        shape, names = [mesh.dp_replicate, mesh.dp_shard], ["replicate", "shard"]
    else:
        shape, names = [mesh.data_parallel], ["dp"]
    for axis, degree in (("cp", mesh.cp), ("tp", mesh.tp)):
        if degree > 1:
            shape, names = [*shape, degree], [*names, axis]
    return init_device_mesh(device, tuple(shape), mesh_dim_names=tuple(names))


def sharding_mesh(mesh: Any, scenario: Scenario) -> Any:
    """The part of the scenario's mesh fully_shard shards and replicates over: every axis but tp, with cp folded into
    the shard axis (the cp ranks hold the same weights and see different tokens: torchtitan's dp_shard_cp)."""
    axes = ("replicate", "shard") if scenario.strategy.preset.groups_replicate else ("dp",)
    if scenario.strategy.cp == 1:
        return mesh[axes]
    shard_cp = f"{axes[-1]}_cp"
    flatten_mesh(mesh[(axes[-1], "cp")], shard_cp)
    return mesh[(*axes[:-1], shard_cp)]


def split_model(root: nn.Module, mesh: Any, scenario: Scenario) -> tuple[str, Any]:
    """Split a reference model over the mesh's tp axis (torch's DTensor plan, trace/tensor_parallel.py) and its cp
    axis (the teaching ring attention, trace/context_parallel.py), in place. Returns what was applied, for the
    engine's name ('' for neither), and the SequenceSplit that picks a rank's tokens under cp (else None)."""
    from shardscope.reference_models import TransformerLM
    from shardscope.trace.context_parallel import SequenceSplit
    from shardscope.trace.tensor_parallel import parallelize

    strategy = scenario.strategy
    applied, split = "", None
    if strategy.tp > 1:
        parallelize(root, mesh["tp"], strategy.uses_sequence_parallel)
        sequence = " + sequence parallel" if strategy.uses_sequence_parallel else ""
        applied += f"torch DTensor tensor parallel{sequence} + loss parallel, "
    if strategy.cp > 1:
        assert isinstance(root, TransformerLM)
        split = SequenceSplit(root, mesh.get_group("cp"), scenario.training.sequence_length)
        applied += f"teaching ring attention over cp {strategy.cp} (send/recv), "
    return applied, split


def apply_strategy(traced: TracedModel, scenario: Scenario, device: str = "cpu") -> str:
    """Wrap each block and the root with torch's engine for the strategy; returns the engine's name. ddp and
    zero1 are wrapped later, on fake parameters (DistributedDataParallel broadcasts them as it is built). Under
    tensor and context parallelism the model is split over the mesh's tp and cp axes first (split_model), then
    sharded over the data-parallel axes and cp, as torchtitan does. The device is the mesh's (benchmarks/gpu_check.py
    shards real CUDA tensors over the fake process group)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    strategy, training = scenario.strategy, scenario.training
    if runs_on_ddp(scenario):
        return "torch DistributedDataParallel" + (" + ZeroRedundancyOptimizer" if strategy.stage == 1 else "")
    mesh = traced.mesh = make_mesh(scenario, device)
    name, split = split_model(traced.root, mesh, scenario)
    if split is not None:
        whole_batch = traced.make_batch
        traced.make_batch = lambda: split.rank_tokens(*whole_batch())
    compute = COMPUTE_DTYPES.get(training.precision)
    policy = (
        MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
    )
    reshard = strategy.reshard_after_forward and strategy.stage == 3
    shards = sharding_mesh(mesh, scenario)
    for unit in traced.blocks:
        fully_shard(unit, mesh=shards, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(traced.root, mesh=shards, mp_policy=policy, reshard_after_forward=reshard)
    return f"{name}torch fully_shard (reshard_after_forward={reshard})"


def make_optimizer(root: nn.Module, scenario: Scenario) -> torch.optim.Optimizer:
    """The scenario's optimizer with foreach=False (foreach kernels report wrong state on fake tensors); for zero1
    inside torch's ZeroRedundancyOptimizer, as the runtime's TorchDDP."""
    name = scenario.training.optimizer
    params = [param for param in root.parameters() if param.requires_grad]
    kinds: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
        "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
        "adam": (torch.optim.Adam, {"lr": 1e-3}),
        "sgd": (torch.optim.SGD, {"lr": 1e-2}),
        "sgd-momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    }
    cls, options = kinds[name]
    if runs_on_ddp(scenario) and scenario.strategy.stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, cls, foreach=False, **options)
    return cls(params, foreach=False, **options)
