"""The JSON Schema of a hardware profile file: the dict that TOML parses `--hardware profile.toml` into, as
`presets.hardware.parse_profile` reads it (closed tables, so a misspelt key such as `efficency` fails)."""

from __future__ import annotations

from shardscope.choices import FAMILIES
from shardscope.presets.hardware import COLLECTIVE_OPS, FRAMEWORK_FIELDS, PROFILE_SCHEMA
from shardscope.schemas.parts import BOOLEAN, STRING, Schema, closed, const, enum, mapping, with_defs

NON_NEGATIVE: Schema = {"type": "number", "minimum": 0}
POSITIVE: Schema = {"type": "number", "exclusiveMinimum": 0}


def hardware_schema() -> Schema:
    """A hardware profile file (TOML, `--hardware`), as the dict TOML parses it into."""
    link_table = {"id": STRING, "name": STRING, "bandwidth_bytes_per_s": POSITIVE, "latency_s": NON_NEGATIVE}
    link = {"anyOf": [STRING, closed({**link_table, "source": STRING}, optional=("id", "name", "source"))]}
    op_costs = ("kernel_overhead_s", "backward_op_overhead_s")
    family = closed(dict.fromkeys(op_costs, NON_NEGATIVE), optional=op_costs)
    compute = {
        "matmul_flops_per_s": NON_NEGATIVE,
        "efficiency": {**POSITIVE, "maximum": 1},
        **dict.fromkeys(op_costs, NON_NEGATIVE),
        "optimizer_tensor_overhead_s": NON_NEGATIVE,
        "memory_bandwidth_bytes_per_s": NON_NEGATIVE,
        "families": mapping(enum(FAMILIES), family),
    }
    op = closed({"call_latency_s": NON_NEGATIVE, "bandwidth_bytes_per_s": POSITIVE}, optional=("call_latency_s",))
    network = {
        "algorithm": enum(("ring", "tree", "hierarchical", "auto")),  # HardwareProfile.algorithm
        "call_latency_s": NON_NEGATIVE,
        "overlap": BOOLEAN,
        "intra_node": link,
        "inter_node": link,
        "host": link,
        "ops": mapping(enum(COLLECTIVE_OPS), op),
    }
    document = {
        "schema": const(PROFILE_SCHEMA),
        "name": STRING,
        "source": STRING,
        "compute": closed(compute, optional=compute),
        "framework": closed(dict.fromkeys(FRAMEWORK_FIELDS, NON_NEGATIVE), optional=FRAMEWORK_FIELDS),
        "network": closed(network, optional=[key for key in network if key != "intra_node"]),
    }
    optional = ("name", "source", "compute", "framework")
    return with_defs(PROFILE_SCHEMA, "A hardware profile (presets.hardware.parse_profile).", closed(document, optional))
