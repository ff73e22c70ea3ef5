"""The classic lesson API, made correct: a memory calculator on top of the core, and the runtime demos.

Nothing here imports torch at module level, so `from shardscope.lesson import memory_calculator` works without it.
"""

from __future__ import annotations

from typing import Any

from shardscope.core.activations import estimate_activations
from shardscope.core.sharding import flat_shard_numel
from shardscope.specs import ModelSpec, TrainingSpec
from shardscope.units import GB

LESSON_SHARDING = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
LESSON_OPTIMIZERS = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}
FP32_BYTES = 4


def memory_calculator(
    params_billions: float,
    precision_bytes: int = 2,
    optimizer: str = "adam",
    num_gpus: int = 1,
    sharding: str = "none",
    sequence_length: int = 2048,
    batch_size_per_gpu: int = 1,
    hidden_dim: int | None = None,
    num_layers: int | None = None,
    master_weights: bool = False,
) -> dict[str, Any]:
    """Per-GPU training memory in GB (1e9 bytes), the lesson's contract.

    Weights and gradients take `precision_bytes` per parameter; the optimizer keeps its moments in fp32 (Adam: 2,
    SGD with momentum: 1, SGD: 0) and, with `master_weights=True`, an fp32 master copy too (the ZeRO paper's
    2 + 2 + 12 bytes per parameter for mixed-precision Adam). `sharding` divides what each stage shards by the GPU
    count: 'none' (data parallel), 'zero1' (optimizer state), 'zero2' (and gradients), 'zero3' or 'fsdp' (and
    weights). Activations are counted only when `hidden_dim` and `num_layers` are given (per-layer accounting of
    shardscope's core, fused attention, no checkpointing; the output head is not included).

    The lesson's example, a 70B model on 8 GPUs with 'fsdp', is (2 + 2 + 8) x 70e9 / 8 = 105 GB per GPU.
    """
    if sharding not in LESSON_SHARDING:
        raise ValueError(f"sharding={sharding!r} is not known; allowed: {', '.join(LESSON_SHARDING)}")
    if optimizer not in LESSON_OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not known; allowed: {', '.join(LESSON_OPTIMIZERS)}")
    if not params_billions > 0:
        raise ValueError(f"params_billions={params_billions} must be more than 0")
    for name, value in (
        ("precision_bytes", precision_bytes),
        ("num_gpus", num_gpus),
        ("sequence_length", sequence_length),
        ("batch_size_per_gpu", batch_size_per_gpu),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number of at least 1")
    if (hidden_dim is None) != (num_layers is None):
        raise ValueError("give both hidden_dim and num_layers to count activations, or neither")

    parameters = round(params_billions * 1e9)
    stage = LESSON_SHARDING[sharding]
    shard = flat_shard_numel(parameters, num_gpus)
    optimizer_per_param = LESSON_OPTIMIZERS[optimizer] * FP32_BYTES + (FP32_BYTES if master_weights else 0)
    weights = (shard if stage >= 3 else parameters) * precision_bytes
    gradients = (shard if stage >= 2 else parameters) * precision_bytes
    optimizer_state = (shard if stage >= 1 else parameters) * optimizer_per_param
    activations = 0
    if hidden_dim is not None and num_layers is not None:
        activations = _activation_bytes(hidden_dim, num_layers, precision_bytes, sequence_length, batch_size_per_gpu)
    per_gpu = weights + gradients + optimizer_state + activations
    return {
        "weights_gb": weights / GB,
        "optimizer_gb": optimizer_state / GB,
        "gradients_gb": gradients / GB,
        "activations_gb": activations / GB,
        "per_gpu_total_gb": per_gpu / GB,
        "total_across_gpus_gb": per_gpu * num_gpus / GB,
        "fits_on_80gb": per_gpu <= 80 * GB,
    }


def _activation_bytes(
    hidden_dim: int, num_layers: int, precision_bytes: int, sequence_length: int, batch_size: int
) -> int:
    """Saved activations of the transformer blocks, from the core's per-op accounting of a gpt2-style block."""
    precision = {2: "bf16-mixed", 4: "fp32", 8: "fp64"}.get(precision_bytes)
    if precision is None:
        raise ValueError(f"precision_bytes={precision_bytes} must be 2, 4 or 8 to count activations")
    head_dim = 64 if hidden_dim % 64 == 0 else hidden_dim
    model = ModelSpec(
        name="lesson",
        family="gpt2",
        hidden_size=hidden_dim,
        num_layers=num_layers,
        num_heads=hidden_dim // head_dim,
        num_kv_heads=hidden_dim // head_dim,
        head_dim=head_dim,
        ffn_hidden_size=4 * hidden_dim,
        vocab_size=1,
        max_positions=sequence_length,
    )
    training = TrainingSpec(micro_batch_size=batch_size, sequence_length=sequence_length, precision=precision)
    return num_layers * estimate_activations(model, training).block_bytes


# --- The runtime half of the lesson (torch is imported only when one of these names is first used) ---
_RUNTIME_NAMES = (
    "init_process_group",
    "broadcast_module",
    "all_reduce_grads_",
    "MinimalDDP",
    "fsdp_round_trip_sketch",
    "run_distributed_demo",
)


def __getattr__(name: str) -> Any:
    """init_process_group, broadcast_module, all_reduce_grads_, MinimalDDP, fsdp_round_trip_sketch and
    run_distributed_demo live in shardscope.runtime (torch); importing shardscope.lesson does not import torch."""
    if name == "broadcast_module":
        from shardscope.runtime.trainer import broadcast_module

        return broadcast_module
    if name in _RUNTIME_NAMES:
        from shardscope.runtime import lesson_impl

        return getattr(lesson_impl, name)
    raise AttributeError(f"module 'shardscope.lesson' has no attribute {name!r}")
