"""The degrees a plan request asks for that no plan can use, and why (`skipped_degrees`), and why a search that
found no candidate at all had nothing to search (`nothing_to_search`): `shardscope plan` names the first beside its
answer and refuses the second in one line, where "nothing fits" would blame the memory budget."""

from __future__ import annotations

from shardscope.planner.request import PlanRequest


def skipped_degrees(request: PlanRequest) -> list[tuple[str, str]]:
    """(axis, why) of each tensor, context, pipeline and expert parallel degree of the request that the model, a node
    or the sequence rules out (`planner.space` leaves them out of the search)."""
    model, sequence, node = request.model, request.sequence_length, request.gpus_per_node
    widths = (
        ("attention heads", model.num_heads),
        ("KV heads", model.num_kv_heads),
        ("FFN width", model.ffn_hidden_size),
        ("vocabulary", model.vocab_size),
    )
    skipped = []
    for tp in request.tensor_parallel:
        undivided = [f"{width:,} {what}" for what, width in widths if width % tp]
        if tp > node:
            skipped.append(("tp", f"tp {tp} is more than a node's {node} GPUs"))
        elif undivided:
            skipped.append(("tp", f"tp {tp} does not divide {model.name}'s {undivided[0]}"))
    skipped += [
        ("cp", f"cp {cp} does not cut the {sequence}-token sequence into 2 x {cp} chunks")
        for cp in request.context_parallel
        if sequence % (2 * cp)
    ]
    skipped += [
        ("pp", f"pp {pp} is more stages than {model.name}'s {model.num_layers} layers")
        for pp in request.pipeline_parallel
        if pp > model.num_layers
    ]
    if model.family == "moe":
        skipped += [
            ("ep", f"ep {ep} does not divide {model.name}'s {model.num_experts} experts")
            for ep in request.expert_parallel
            if model.num_experts % ep
        ]
    return skipped


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
