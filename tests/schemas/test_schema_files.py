"""The checked-in JSON Schemas are valid Draft 2020-12 schemas and are exactly what the result types generate."""

from __future__ import annotations

import jsonschema
import pytest

from shardscope.schemas import SCHEMA_FILES, UnknownSchemaError, load_schema
from shardscope.schemas.generate import BUILDERS, main


def test_checked_in_files_are_what_the_types_generate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check"]) == 0, capsys.readouterr().out + " (run `python -m shardscope.schemas.generate`)"
    assert set(BUILDERS) == set(SCHEMA_FILES)


@pytest.mark.parametrize("name", SCHEMA_FILES)
def test_each_schema_is_valid_and_named_by_its_documents(name: str) -> None:
    schema = load_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["title"] == name
    assert schema["properties"]["schema"] == {"const": name}
    assert schema["additionalProperties"] is False


def test_an_unknown_schema_is_named() -> None:
    with pytest.raises(UnknownSchemaError, match=r"'shardscope\.nope/v1' is not known"):
        load_schema("shardscope.nope/v1")


@pytest.mark.parametrize("name", [name for name in SCHEMA_FILES if name != "shardscope.hardware/v2"])
def test_every_result_document_carries_the_six_degrees(name: str) -> None:
    parallelism = load_schema(name)["$defs"]["parallelism"]
    assert parallelism["required"] == ["dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"]
    assert parallelism["additionalProperties"] is False
