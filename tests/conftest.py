"""Fixtures every test directory shares."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest

from shardscope.schemas import load_schema

if TYPE_CHECKING:
    from shardscope.runtime import RunResult
    from shared_traces import SharedTraces

# Objects used as maps (keys are data, not names), where any key is allowed.
OPEN_MAPS = ("peak_flops_per_s", "notes")

Document = dict[str, Any]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cases marked `long` (many ranks, or one of several similar parametrizations) stay out of the default run, so
    `make test` keeps to its time; `pytest -m long` runs them, and `shardscope validate` runs the whole matrix."""
    if "long" in (config.getoption("markexpr") or "").replace("not long", ""):
        return
    skip = pytest.mark.skip(reason="long case: run with `pytest -m long`")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


def _validator(document: Document) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(load_schema(document["schema"]))


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
def matches_schema() -> Callable[[Document], None]:
    """Validates a document against the checked-in JSON Schema its `schema` key names (Draft 2020-12); raises
    jsonschema.ValidationError, naming the path and the rule, when it breaks it."""
    return lambda document: _validator(document).validate(document)


@pytest.fixture
def rejects_renamed_keys() -> Callable[[Document], int]:
    """Validates a document, then renames a key of each of its objects (the first item of each list), one at a time,
    and asserts the schema rejects every such copy; returns how many objects were tried."""

    def check(document: Document) -> int:
        validator = _validator(document)
        validator.validate(document)
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

    return check


@pytest.fixture(scope="session")
def shared_runs(request: pytest.FixtureRequest) -> dict[str, dict[str, RunResult]]:
    """Module name -> its registered runs' results (shared_launch.py): one launch per world size for every module
    with a selected test that uses this fixture. Results are frozen dataclasses, read-only to the tests."""
    from shardscope.runtime import run_suite
    from shared_launch import REGISTERED

    wanted = {item.module.__name__ for item in request.session.items if "shared_runs" in item.fixturenames}
    runs = [
        (module, name, config)
        for module in REGISTERED
        if module in wanted
        for name, config in REGISTERED[module].items()
    ]
    found: dict[str, dict[str, RunResult]] = {module: {} for module in wanted}
    for world in sorted({config.world_size for _, _, config in runs}):
        launch = [run for run in runs if run[2].world_size == world]
        for (module, name, _), result in zip(launch, run_suite([run[2] for run in launch]), strict=True):
            found[module][name] = result
    return found


@pytest.fixture(scope="session")
def shared_trace(request: pytest.FixtureRequest) -> SharedTraces:
    """Each trace once for the whole session (shared_traces.py): the first time a test asks for a registered one, the
    registered traces of every module with a selected test that uses this fixture replay side by side."""
    from shared_traces import REGISTERED, SharedTraces

    wanted = {item.module.__name__ for item in request.session.items if "shared_trace" in item.fixturenames}
    return SharedTraces(each for module in REGISTERED if module in wanted for each in REGISTERED[module])
