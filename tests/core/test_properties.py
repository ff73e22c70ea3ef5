"""Properties that must hold for every scenario (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from shardscope.core.memory import estimate_memory
from shardscope.core.params import param_layout
from shardscope.core.sharding import dim0_shards, flat_shard_numel
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, ModelSpec, Overheads, Scenario, Strategy, TrainingSpec

MODELS = st.sampled_from(["tiny-gpt2", "tiny-llama", "tiny-moe", "gpt2", "llama-3-8b", "mixtral-8x7b"])
ENGINES = st.sampled_from(["paper", "pytorch", "deepspeed"])
PRECISIONS = st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp64"])
OPTIMIZERS = st.sampled_from(["adamw", "adam", "sgd", "sgd-momentum"])
SHARDED = {
    "zero1": ("optimizer_state",),
    "zero2": ("optimizer_state", "gradients"),
    "zero3": ("optimizer_state", "gradients", "parameters"),
}


def make(
    model: str, strategy: str, engine: str, world: int, precision: str = "bf16-mixed", optimizer: str = "adamw"
) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=world, gpus_per_node=1024),
        training=TrainingSpec(precision=precision, optimizer=optimizer),
        strategy=Strategy(name=strategy, engine=engine),
        overheads=Overheads(context_bytes=0),
    )


@settings(max_examples=60, deadline=None)
@given(MODELS, st.sampled_from(list(SHARDED)), ENGINES, st.integers(1, 512), PRECISIONS, OPTIMIZERS)
def test_sharded_categories_never_grow_with_more_gpus(
    model: str, strategy: str, engine: str, world: int, precision: str, optimizer: str
) -> None:
    fewer = estimate_memory(make(model, strategy, engine, world, precision, optimizer)).per_rank
    more = estimate_memory(make(model, strategy, engine, 2 * world, precision, optimizer)).per_rank
    for category in SHARDED[strategy]:
        assert more.category_bytes(category) <= fewer.category_bytes(category)


@settings(max_examples=60, deadline=None)
@given(MODELS, st.integers(1, 1024), PRECISIONS, st.sampled_from(["adamw", "adam", "sgd-momentum"]))
def test_paper_stages_are_ordered(model: str, world: int, precision: str, optimizer: str) -> None:
    # Plain SGD has no optimizer state, so stage 1 saves nothing and its padded flat buffers cost a few bytes more
    # than DDP's; with any optimizer state, each stage holds at most what the one below holds.
    states = [
        estimate_memory(make(model, name, "paper", world, precision, optimizer)).per_rank.model_state_bytes
        for name in ("zero3", "zero2", "zero1", "ddp")
    ]
    assert states == sorted(states)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10**13), st.integers(1, 4096))
def test_flat_shards_add_up_to_the_whole(total: int, world: int) -> None:
    shard = flat_shard_numel(total, world)
    assert world * shard >= total > (world - 1) * shard - world


@settings(max_examples=30, deadline=None)
@given(MODELS, st.integers(1, 64))
def test_dim0_shards_of_all_ranks_add_up(model: str, world: int) -> None:
    layout = param_layout(model_preset(model))
    assert sum(dim0_shards(layout, world, rank).local_numel for rank in range(world)) == layout.total_numel


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10**12), st.integers(1, 1024))
def test_paper_zero3_states_of_all_ranks_cover_the_model(total: int, world: int) -> None:
    model = ModelSpec(name="n", family="count", declared_parameters=total)
    scenario = Scenario(
        model=model,
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=world, gpus_per_node=1024),
        strategy=Strategy(name="zero3", engine="paper"),
    )
    per_rank = estimate_memory(scenario).per_rank
    assert per_rank.model_state_bytes * world >= 16 * total
    assert per_rank.model_state_bytes * world < 16 * (total + world) + 4 * world  # and Adam's 4-byte step
