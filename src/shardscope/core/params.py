"""Every parameter tensor a model has, in the order the reference implementation creates them.

The count equals what transformers builds (GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM,
MixtralForCausalLM, Qwen2ForCausalLM) and what shardscope's own reference modules build; shapes follow torch's
nn.Linear convention (out_features, in_features), which is what dim-0 sharding under FSDP2 pads.
Tied embeddings are one tensor, counted once.

Under tensor parallelism of degree tp a rank holds the local slice of each tensor that torch's `parallelize_module`
plans give it, as torchtitan's Llama plan does: column-parallel q/k/v/gate/up and the vocabulary-parallel embedding
and output head split dim 0 (with their biases), row-parallel o/down split dim 1 (their biases replicate), norms and
learned positions replicate; an MoE's router replicates and every expert's SwiGLU splits as a dense MLP does
(expert tensor parallelism). gpt2's fused c_attn splits by heads within q, k and v. FSDP2 then shards the local
tensors' dim 0, so the per-rank layout is the whole story.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from shardscope.specs import ModelSpec, Scenario


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamTensor:
    """One parameter tensor."""

    name: str
    """Its name relative to its unit, e.g. 'attn.q_proj.weight'."""
    shape: tuple[int, ...]
    """Its shape; dim 0 is the one FSDP2 shards."""

    @property
    def numel(self) -> int:
        """Elements in the tensor."""
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ParamLayout:
    """A model's parameters grouped the way FSDP wraps them: a root unit, and one unit per transformer block.

    The sums are computed once at construction, and a layout hashes by identity (one cached layout per model),
    because the planner and the benchmarks evaluate hundreds of thousands of scenarios against one layout.
    """

    root: tuple[ParamTensor, ...]
    """Embeddings, final norm and output head (the root unit)."""
    block: tuple[ParamTensor, ...]
    """The tensors of one transformer block; every block is identical."""
    num_blocks: int
    """How many blocks."""
    root_numel: int = field(init=False)
    """Parameters outside the blocks."""
    block_numel: int = field(init=False)
    """Parameters in one block."""
    total_numel: int = field(init=False)
    """Parameters in the model."""
    largest_unit_numel: int = field(init=False)
    """Parameters in the largest FSDP unit (the root or one block)."""
    largest_tensor_numel: int = field(init=False)
    """Elements in the largest single tensor."""
    tensor_count: int = field(init=False)
    """Parameter tensors in the model."""
    matrix_numel: int = field(init=False)
    """Elements of the 2-D weights other than embeddings (what autocast casts to 16 bits)."""

    def __post_init__(self) -> None:
        root = sum(t.numel for t in self.root)
        block = sum(t.numel for t in self.block)
        matrices = sum(t.numel for t in self.root if len(t.shape) == 2 and not t.name.startswith("embed"))
        matrices += self.num_blocks * sum(t.numel for t in self.block if len(t.shape) == 2)
        derived = {
            "root_numel": root,
            "block_numel": block,
            "total_numel": root + self.num_blocks * block,
            "largest_unit_numel": max(root, block),
            "largest_tensor_numel": max(t.numel for t in self.root + self.block),
            "tensor_count": len(self.root) + self.num_blocks * len(self.block),
            "matrix_numel": matrices,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def tensors(self) -> tuple[ParamTensor, ...]:
        """All tensors in creation order: embeddings, blocks, final norm and head (made once per layout: the
        planner's steps of DDP and ZeRO-1 list a 405B model's thousand tensors at every GPU count)."""
        return _tensors(self)


@cache
def _tensors(layout: ParamLayout) -> tuple[ParamTensor, ...]:
    """`ParamLayout.tensors`, kept by the layout's identity (one layout per model and cut: `param_layout`)."""
    embeddings = tuple(t for t in layout.root if t.name.startswith("embed"))
    tail = tuple(t for t in layout.root if not t.name.startswith("embed"))
    blocks = tuple(
        ParamTensor(name=f"layers.{index}.{t.name}", shape=t.shape)
        for index in range(layout.num_blocks)
        for t in layout.block
    )
    return embeddings + blocks + tail


def _linear(name: str, out_features: int, in_features: int, bias: bool) -> tuple[ParamTensor, ...]:
    weight = ParamTensor(name=f"{name}.weight", shape=(out_features, in_features))
    if not bias:
        return (weight,)
    return weight, ParamTensor(name=f"{name}.bias", shape=(out_features,))


def _gpt2_block(model: ModelSpec, tp: int) -> tuple[ParamTensor, ...]:
    hidden, ffn, width = model.hidden_size, model.ffn_hidden_size // tp, model.hidden_size // tp
    return (
        ParamTensor(name="ln_1.weight", shape=(hidden,)),
        ParamTensor(name="ln_1.bias", shape=(hidden,)),
        *_linear("attn.c_attn", 3 * width, hidden, bias=True),
        *_linear("attn.c_proj", hidden, width, bias=True),
        ParamTensor(name="ln_2.weight", shape=(hidden,)),
        ParamTensor(name="ln_2.bias", shape=(hidden,)),
        *_linear("mlp.c_fc", ffn, hidden, bias=True),
        *_linear("mlp.c_proj", hidden, ffn, bias=True),
    )


def _llama_attention(model: ModelSpec, tp: int) -> tuple[ParamTensor, ...]:
    hidden = model.hidden_size
    q_width = model.num_heads // tp * model.head_dim
    kv_width = model.num_kv_heads // tp * model.head_dim
    bias = model.attention_bias
    return (
        *_linear("attn.q_proj", q_width, hidden, bias),
        *_linear("attn.k_proj", kv_width, hidden, bias),
        *_linear("attn.v_proj", kv_width, hidden, bias),
        *_linear("attn.o_proj", hidden, q_width, bias=False),
    )


def _swiglu(prefix: str, hidden: int, ffn: int) -> tuple[ParamTensor, ...]:
    return (
        *_linear(f"{prefix}.gate_proj", ffn, hidden, bias=False),
        *_linear(f"{prefix}.up_proj", ffn, hidden, bias=False),
        *_linear(f"{prefix}.down_proj", hidden, ffn, bias=False),
    )


def _llama_block(model: ModelSpec, tp: int, ep: int) -> tuple[ParamTensor, ...]:
    hidden, ffn = model.hidden_size, model.ffn_hidden_size // tp
    if model.family == "moe":
        # Mixtral: a router (gate) and num_experts SwiGLU experts (Mixtral of Experts), num_experts / ep of them on
        # one expert-parallel rank (core/expert_parallel.py).
        experts = model.num_experts // ep
        mlp: tuple[ParamTensor, ...] = (
            *_linear("moe.router", model.num_experts, hidden, bias=False),
            *(t for expert in range(experts) for t in _swiglu(f"moe.experts.{expert}", hidden, ffn)),
        )
    else:
        mlp = _swiglu("mlp", hidden, ffn)
    return (
        ParamTensor(name="input_norm.weight", shape=(hidden,)),
        *_llama_attention(model, tp),
        ParamTensor(name="post_attention_norm.weight", shape=(hidden,)),
        *mlp,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StageModel(ModelSpec):
    """The part of a model one pipeline rank holds (core.pipeline): `num_layers` of its blocks, and of the root the
    embeddings where it holds the first stage and the final norm and output head where it holds the last. A tied
    head is then the last stage's own copy of the embedding's weight, as Megatron-LM keeps the word embeddings on
    the first and the last stage."""

    holds_embedding: bool = True
    """It holds the first stage: the embeddings."""
    holds_head: bool = True
    """It holds the last stage: the final norm and the output head."""

    def __post_init__(self) -> None:
        # a pipeline rank may hold no block (its stages hold the embeddings or the head only): the rest of the shape
        # is checked as a whole model's
        values = {name: getattr(self, name) for name in ModelSpec.__dataclass_fields__}
        ModelSpec(**{**values, "num_layers": max(1, self.num_layers)})


def held_ends(model: ModelSpec) -> tuple[bool, bool]:
    """(the embeddings, the final norm and output head): which ends of the model a pipeline rank's StageModel
    holds; a whole model holds both."""
    if isinstance(model, StageModel):
        return model.holds_embedding, model.holds_head
    return True, True


def _root(model: ModelSpec, tp: int) -> tuple[ParamTensor, ...]:
    tensors = _whole_root(model, tp)
    if not isinstance(model, StageModel) or (model.holds_embedding and model.holds_head):
        return tensors
    embedding = [t for t in tensors if t.name.startswith("embed")]
    head = [t for t in tensors if not t.name.startswith("embed")]
    if model.tie_embeddings:
        head.append(ParamTensor(name="lm_head.weight", shape=tensors[0].shape))
    return tuple((embedding if model.holds_embedding else []) + (head if model.holds_head else []))


def _whole_root(model: ModelSpec, tp: int) -> tuple[ParamTensor, ...]:
    hidden, vocab = model.hidden_size, model.vocab_size // tp
    tensors = [ParamTensor(name="embed_tokens.weight", shape=(vocab, hidden))]
    if model.family == "gpt2":
        tensors.append(ParamTensor(name="embed_positions.weight", shape=(model.max_positions, hidden)))
        tensors += [ParamTensor(name="norm.weight", shape=(hidden,)), ParamTensor(name="norm.bias", shape=(hidden,))]
    else:
        tensors.append(ParamTensor(name="norm.weight", shape=(hidden,)))
    if not model.tie_embeddings:
        tensors.append(ParamTensor(name="lm_head.weight", shape=(vocab, hidden)))
    return tuple(tensors)


@cache
def param_layout(model: ModelSpec, tp: int = 1, ep: int = 1) -> ParamLayout:
    """The parameter tensors of a shaped model (not for family 'count') that one of `tp` tensor-parallel and `ep`
    expert-parallel ranks holds (the whole model for tp 1 and ep 1); `Scenario` has checked that tp divides the
    widths it splits and ep the experts."""
    if not model.has_shape:
        raise ValueError(f"model {model.name!r} has only a parameter count, no shape")
    block = _gpt2_block(model, tp) if model.family == "gpt2" else _llama_block(model, tp, ep)
    return ParamLayout(root=_root(model, tp), block=block, num_blocks=model.num_layers)


def rank_layout(scenario: Scenario) -> ParamLayout:
    """The parameter tensors one rank of the scenario holds before data-parallel sharding (its tp slice, and its
    experts under expert parallelism)."""
    return param_layout(scenario.model, scenario.strategy.tp, scenario.strategy.ep)


@cache
def _rank_facts(model: ModelSpec, tp: int, ep: int) -> tuple[int, ParamLayout | None]:
    if not model.has_shape:
        return model.declared_parameters, None
    layout = param_layout(model, tp, ep)
    return layout.total_numel, layout


def rank_facts(scenario: Scenario) -> tuple[int, ParamLayout | None]:
    """The parameters one tensor-parallel rank holds before data-parallel sharding, and their layout (None without
    a shape), in one cache lookup for hot paths."""
    return _rank_facts(scenario.model, scenario.strategy.tp, scenario.strategy.ep)


@cache
def count_parameters(model: ModelSpec) -> int:
    """Exact parameter count: from the shape, or the declared count for family 'count'."""
    if not model.has_shape:
        return model.declared_parameters
    return param_layout(model).total_numel


@cache
def head_numel(layout: ParamLayout) -> int:
    """Parameters whose gradients backward makes first: the final norm and the output head (the tied embedding)."""
    tail = sum(t.numel for t in layout.root if not t.name.startswith("embed"))
    tied = bool(layout.root) and not any(t.name.startswith("lm_head") for t in layout.root)
    return tail + (layout.root[0].numel if tied else 0)
