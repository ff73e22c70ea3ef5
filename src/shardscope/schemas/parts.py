"""JSON Schema building blocks, and the objects several documents share, derived from the types that write them.

A document object is closed (`additionalProperties: false`, every key required unless named optional), so a renamed
or misspelt key fails validation; only maps keyed by data (bytes by category, FLOP/s by dtype) are open.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from shardscope.choices import CHECKPOINTING, EVERY_PREFIX, LEDGER_GROUPS, PIPELINE_SCHEDULES
from shardscope.core.result import CATEGORIES, OPS, PHASES
from shardscope.mesh import Parallelism
from shardscope.specs import ModelSpec, TrainingSpec

Schema = dict[str, Any]

STRING: Schema = {"type": "string"}
NUMBER: Schema = {"type": "number"}
BOOLEAN: Schema = {"type": "boolean"}
BYTES: Schema = {"type": "integer", "minimum": 0}
COUNT: Schema = {"type": "integer", "minimum": 0}
DEGREE: Schema = {"type": "integer", "minimum": 1}
STRINGS: Schema = {"type": "array", "items": STRING}
CHECKPOINTING_MODE: Schema = {
    "type": "string",
    "pattern": f"^({'|'.join(CHECKPOINTING)}|{EVERY_PREFIX}[1-9][0-9]*)$",
    "description": "A checkpointing mode (choices.parse_checkpointing): a named one, or every:N.",
}


def enum(values: Iterable[str]) -> Schema:
    """One of `values`."""
    return {"enum": list(values)}


def const(value: str) -> Schema:
    """Exactly `value`."""
    return {"const": value}


def array(items: Schema) -> Schema:
    """A list of `items`."""
    return {"type": "array", "items": items}


def nullable(schema: Schema) -> Schema:
    """`schema`, or null."""
    return {"anyOf": [schema, {"type": "null"}]}


def ref(name: str) -> Schema:
    """A shared object of `DEFS`, by name."""
    if name not in DEFS:
        raise KeyError(f"no shared schema {name!r}; known: {', '.join(DEFS)}")
    return {"$ref": f"#/$defs/{name}"}


def closed(properties: Mapping[str, Schema], optional: Iterable[str] = (), description: str = "") -> Schema:
    """An object with exactly these keys, all required but the optional ones."""
    optional = set(optional)
    unknown = optional - set(properties)
    if unknown:
        raise KeyError(f"optional keys {sorted(unknown)} are not properties")
    schema: Schema = {"type": "object"}
    if description:
        schema["description"] = description
    schema["properties"] = dict(properties)
    schema["required"] = [key for key in properties if key not in optional]
    schema["additionalProperties"] = False
    return schema


def mapping(keys: Schema, values: Schema) -> Schema:
    """An object used as a map: keys matching `keys`, every value matching `values`."""
    return {"type": "object", "propertyNames": keys, "additionalProperties": values}


def field_schema(annotation: Any) -> Schema:
    """The JSON Schema of a dataclass field's type (plain scalars and Literal choices)."""
    if typing.get_origin(annotation) is Literal:
        return enum(typing.get_args(annotation))
    scalars: dict[Any, Schema] = {bool: BOOLEAN, int: COUNT, float: NUMBER, str: STRING}
    if annotation not in scalars:
        raise TypeError(f"no JSON Schema for a field of type {annotation!r}; describe it by hand")
    return scalars[annotation]


def dataclass_properties(cls: type) -> dict[str, Schema]:
    """A frozen dataclass's fields as JSON Schema properties, in field order (what `asdict` writes)."""
    hints = typing.get_type_hints(cls)
    return {item.name: field_schema(hints[item.name]) for item in dataclasses.fields(cls) if item.init}


DEFS: dict[str, Schema] = {
    "parallelism": closed(
        {
            **{item.name: DEGREE for item in dataclasses.fields(Parallelism)},
            "pp_schedule": enum(PIPELINE_SCHEDULES),
            "pp_virtual_stages": DEGREE,
        },
        optional=("pp_schedule", "pp_virtual_stages"),
        description="The degrees of the device mesh (Parallelism.to_json); their product, ep aside, is the world size; "
        "a prediction with pp > 1 adds the pipeline's schedule and its stages per pipeline rank.",
    ),
    "per_rank": closed(
        {**{f"{category}_bytes": BYTES for category in CATEGORIES}, "total_bytes": BYTES, "peak_bytes": BYTES},
        description="Bytes one rank holds by category, their sum and the peak (MemoryBreakdown.to_json).",
    ),
    "collective": closed(
        {
            "phase": enum(PHASES),
            "op": enum(OPS),
            "group": enum(LEDGER_GROUPS),
            "group_size": DEGREE,
            "payload_bytes": BYTES,
            "count": COUNT,
        },
        description="One ledger row: collectives of one shape in a step (CollectiveRow.to_json).",
    ),
    "model": closed(
        {**dataclass_properties(ModelSpec), "parameters": COUNT},
        description="The model's shape (ModelSpec) and its parameter count.",
    ),
    "gpu": closed(
        {
            "id": STRING,
            "name": STRING,
            "memory_bytes": BYTES,
            "peak_flops_per_s": mapping(STRING, NUMBER),
            "source": STRING,
        },
        description="One accelerator (GpuSpec.to_json): memory, and datasheet peak FLOP/s by dtype.",
    ),
    "training": closed(
        {**dataclass_properties(TrainingSpec), "checkpointing": CHECKPOINTING_MODE},
        description="What one step does (TrainingSpec).",
    ),
    "failure_mode": closed(
        {"kind": STRING, "severity": NUMBER, "message": STRING},
        description="A way a plan goes wrong and how close it is (FailureMode.to_json).",
    ),
}
"""Objects that more than one document holds, by the name documents refer to them with."""


def with_defs(title: str, description: str, document: Schema) -> Schema:
    """A complete Draft 2020-12 schema: `document` with the shared objects it refers to as `$defs`."""
    used: list[str] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            target = node.get("$ref", "")
            name = target.removeprefix("#/$defs/")
            if target and name not in used:
                used.append(name)
                collect(DEFS[name])
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(document)
    schema: Schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title}
    schema["description"] = description
    schema.update(document)
    if used:
        schema["$defs"] = {name: DEFS[name] for name in sorted(used)}
    return schema
