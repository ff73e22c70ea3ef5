"""The JSON Schemas (Draft 2020-12) of shardscope's versioned documents, checked in beside this module.

Every document names its schema in its `schema` key ("shardscope.estimate/v1", ...); `load_schema` returns the
schema of that name. The files are generated from the result types by `python -m shardscope.schemas.generate`, and
a test checks that the checked-in files are what it generates and that real outputs of every command validate.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

SCHEMA_FILES = {
    "shardscope.estimate/v1": "estimate.schema.json",
    "shardscope.plan/v1": "plan.schema.json",
    "shardscope.trace/v1": "trace.schema.json",
    "shardscope.run/v1": "run.schema.json",
    "shardscope.validate/v1": "validate.schema.json",
    "shardscope.hardware/v2": "hardware.schema.json",
}
"""Each document's schema name and the file of this package that holds its JSON Schema."""


class UnknownSchemaError(LookupError):
    """A schema name shardscope does not write."""


def load_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of the document named `name`, e.g. 'shardscope.plan/v1'."""
    if name not in SCHEMA_FILES:
        raise UnknownSchemaError(f"schema {name!r} is not known; known: {', '.join(SCHEMA_FILES)}")
    text = resources.files(__name__).joinpath(SCHEMA_FILES[name]).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema
