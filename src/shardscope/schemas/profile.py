"""The JSON Schema of a hardware profile file: the dict that TOML parses `--hardware profile.toml` into, as
`presets.profile_toml.parse_profile` reads it (closed tables, so a misspelt key such as `efficency` fails).

The keys of every table are the reader's own key tables (`presets.profile_toml`), so the schema and the reader cannot
disagree on which keys exist; this module adds only what a key's kind does not say (bounds, the nested tables)."""

from __future__ import annotations

from collections.abc import Mapping

from shardscope.choices import FAMILIES
from shardscope.presets.hardware import COLLECTIVE_OPS, PROFILE_SCHEMA
from shardscope.presets.profile_toml import (
    COMPUTE_KEYS,
    COUNT,
    FAMILY_KEYS,
    FLAG,
    FRAMEWORK_KEYS,
    HOST_KEYS,
    LINK_KEYS,
    NETWORK_KEYS,
    NUMBER,
    OP_KEYS,
    PYTHON_OPS_KEYS,
    STAGE_KEYS,
    TEXT,
    TOP_KEYS,
)
from shardscope.schemas.parts import BOOLEAN, STRING, Schema, closed, const, enum, mapping, with_defs

NON_NEGATIVE: Schema = {"type": "number", "minimum": 0}
POSITIVE: Schema = {"type": "number", "exclusiveMinimum": 0}
_BY_KIND: dict[str, Schema] = {
    NUMBER: NON_NEGATIVE,
    TEXT: STRING,
    FLAG: BOOLEAN,
    COUNT: {"type": "integer", "minimum": 0},
}


def _properties(keys: Mapping[str, str], refined: Mapping[str, Schema]) -> dict[str, Schema]:
    """Every key of a reader's table, with the schema of its kind or the refined one; a kind without a plain schema
    (a nested table, a link) must be refined."""
    return {key: refined[key] if key in refined else _BY_KIND[kind] for key, kind in keys.items()}


def hardware_schema() -> Schema:
    """A hardware profile file (TOML, `--hardware`), as the dict TOML parses it into."""
    link_table = _properties(LINK_KEYS, {"bandwidth_bytes_per_s": POSITIVE})
    link = {"anyOf": [STRING, closed(link_table, optional=("id", "name", "source"))]}
    family = closed(_properties(FAMILY_KEYS, {}), optional=FAMILY_KEYS)
    compute = _properties(COMPUTE_KEYS, {"efficiency": {**POSITIVE, "maximum": 1}})
    python_ops = closed(_properties(PYTHON_OPS_KEYS, {}), optional=PYTHON_OPS_KEYS)
    host = _properties(
        HOST_KEYS,
        {"families": mapping(enum(FAMILIES), family), "python_ops": mapping(enum(tuple(STAGE_KEYS)), python_ops)},
    )
    op = closed(_properties(OP_KEYS, {"bandwidth_bytes_per_s": POSITIVE}), optional=("call_latency_s",))
    network = _properties(
        NETWORK_KEYS,
        {
            "algorithm": enum(("ring", "tree", "hierarchical", "auto")),  # HardwareProfile.algorithm
            "intra_node": link,
            "inter_node": link,
            "host": link,
            "ops": mapping(enum(COLLECTIVE_OPS), op),
        },
    )
    document = _properties(
        TOP_KEYS,
        {
            "schema": const(PROFILE_SCHEMA),
            "compute": closed(compute, optional=compute),
            "framework": closed(_properties(FRAMEWORK_KEYS, {}), optional=FRAMEWORK_KEYS),
            "host_overheads": closed(host, optional=host),
            "network": closed(network, optional=[key for key in network if key != "intra_node"]),
        },
    )
    optional = ("name", "source", "compute", "framework", "host_overheads")
    description = "A hardware profile (presets.profile_toml.parse_profile)."
    return with_defs(PROFILE_SCHEMA, description, closed(document, optional))
