"""The expert parallel degrees a plan searches by default (`default_expert_degrees`), which degrees a plan request asks
for can split its model (the rules `planner.space` searches by, stated once here), why the others cannot
(`skipped_degrees`), and why a search that found no candidate at all had nothing to search (`nothing_to_search`):
`shardscope plan` names the skipped degrees beside its answer and refuses an empty search in one line, where "nothing
fits" would blame the memory budget."""

from __future__ import annotations

from shardscope.planner.request import PlanRequest
from shardscope.specs import ModelSpec


def default_expert_degrees(model: ModelSpec, gpus_per_node: int) -> tuple[int, ...]:
    """The expert parallel degrees `plan` and `report`'s planning search unless --ep names them: 1, and on a
    mixture-of-experts model every power of 2 up to a node's GPUs that divides its experts (an expert group inside a
    node, where the all-to-alls run over its links)."""
    degrees = [1]
    while model.family == "moe" and degrees[-1] * 2 <= gpus_per_node and model.num_experts % (degrees[-1] * 2) == 0:
        degrees.append(degrees[-1] * 2)
    return tuple(degrees)


def tp_ruled_out(request: PlanRequest, tp: int) -> str:
    """Why tensor parallelism of `tp` splits no plan of the request ('' when it may): it stays within a node and
    divides the heads, the KV heads, the FFN width and the vocabulary."""
    model, node = request.model, request.gpus_per_node
    if tp > node:
        return f"tp {tp} is more than a node's {node} GPUs"
    widths = (
        ("attention heads", model.num_heads),
        ("KV heads", model.num_kv_heads),
        ("FFN width", model.ffn_hidden_size),
        ("vocabulary", model.vocab_size),
    )
    undivided = [f"{width:,} {what}" for what, width in widths if width % tp]
    return f"tp {tp} does not divide {model.name}'s {undivided[0]}" if undivided else ""


def cp_ruled_out(request: PlanRequest, cp: int) -> str:
    """Why context parallelism of `cp` splits no plan ('' when it may): it cuts the sequence into 2 x cp chunks."""
    sequence = request.sequence_length
    return f"cp {cp} does not cut the {sequence}-token sequence into 2 x {cp} chunks" if sequence % (2 * cp) else ""


def pp_ruled_out(request: PlanRequest, pp: int) -> str:
    """Why a pipeline of `pp` ranks splits no plan ('' when it may): each of its stages holds a layer at least."""
    model = request.model
    return f"pp {pp} is more stages than {model.name}'s {model.num_layers} layers" if pp > model.num_layers else ""


def ep_ruled_out(request: PlanRequest, ep: int) -> str:
    """Why expert parallelism of `ep` splits no plan of a mixture-of-experts model ('' when it may): it divides the
    experts (the GPUs it borrows are the space's to check, per strategy and GPU count)."""
    model = request.model
    return f"ep {ep} does not divide {model.name}'s {model.num_experts} experts" if model.num_experts % ep else ""


def skipped_degrees(request: PlanRequest) -> list[tuple[str, str]]:
    """(axis, why) of each tensor, context, pipeline and expert parallel degree of the request that the model, a node
    or the sequence rules out."""
    rules = (
        ("tp", request.tensor_parallel, tp_ruled_out),
        ("cp", request.context_parallel, cp_ruled_out),
        ("pp", request.pipeline_parallel, pp_ruled_out),
        ("ep", request.expert_parallel if request.model.family == "moe" else (), ep_ruled_out),
    )
    return [(axis, why) for axis, degrees, rule in rules for degree in degrees if (why := rule(request, degree))]


def nothing_to_search(request: PlanRequest) -> str:
    """Why a search found no candidate: every degree of one kind is skipped, else no GPU count up to the cap holds
    the degrees (tp x cp x pp GPUs a model replica, ep within the data-parallel GPUs) and reaches the global batch."""
    asked = {
        "tp": request.tensor_parallel,
        "cp": request.context_parallel,
        "pp": request.pipeline_parallel,
        "ep": request.expert_parallel,
    }
    skipped = skipped_degrees(request)
    exhausted = [why for axis, why in skipped if sum(kind == axis for kind, _ in skipped) == len(asked[axis])]
    if exhausted:
        return "nothing to search: " + "; ".join(exhausted)
    degrees = ", ".join(f"{axis} {','.join(map(str, values))}" for axis, values in asked.items() if values != (1,))
    reach = (
        f" and reaches {request.global_batch_tokens:,} tokens a step within {request.batch_tolerance:.0%}"
        if request.global_batch_tokens
        else ""
    )
    replica = f"a model replica of {degrees}" if degrees else "a model replica"
    return f"nothing to search: no GPU count up to {request.max_gpus} holds {replica}{reach}"
