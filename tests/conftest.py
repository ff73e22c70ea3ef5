"""Fixtures every test directory shares."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from shardscope.schemas import load_schema

# Objects used as maps (keys are data, not names), where any key is allowed.
OPEN_MAPS = ("peak_flops_per_s", "notes")


class SchemaCheck:
    """Validates a document against the checked-in schema its `schema` key names (Draft 2020-12)."""

    def __call__(self, document: dict[str, Any]) -> None:
        """Raises jsonschema.ValidationError, naming the path and the rule, when the document breaks its schema."""
        jsonschema.Draft202012Validator(load_schema(document["schema"])).validate(document)

    def rejects_renamed_keys(self, document: dict[str, Any]) -> int:
        """Renames a key of each object in the document (the first item of each list), one at a time, and asserts the
        schema rejects every such copy; returns how many objects were tried."""
        self(document)
        validator = jsonschema.Draft202012Validator(load_schema(document["schema"]))
        tried = 0
        for path in _object_paths(document):
            changed = copy.deepcopy(document)
            node = changed
            for step in path:
                node = node[step]
            key = next(iter(node))
            node[f"{key}_renamed"] = node.pop(key)
            assert not validator.is_valid(changed), f"{document['schema']}: renaming {(*path, key)} still validates"
            tried += 1
        return tried


def _object_paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths to every non-empty object that is not an open map, descending into the first item of each list."""
    if isinstance(node, dict):
        if node and (not path or path[-1] not in OPEN_MAPS):
            yield path
        for key, value in node.items():
            yield from _object_paths(value, (*path, key))
    elif isinstance(node, list) and node:
        yield from _object_paths(node[0], (*path, 0))


@pytest.fixture
def matches_schema() -> SchemaCheck:
    """Checks documents against their JSON Schemas."""
    return SchemaCheck()
