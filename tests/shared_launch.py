"""Runs that test modules (tests/distributed, tests/trace) hand to one launch per world size for the whole session
(start-up paid once).

A module registers its runs by name when it is imported (`register`); the session's `shared_runs` fixture
(tests/conftest.py) launches, per world size, the runs of every module that has a selected test using it, and gives each
module back its own results. A run's result does not depend on the runs launched beside it (each builds its own
model, trainer and memory tracker: runtime/steps.py), as the modules' own suites already assumed, and each launch keeps
a hard deadline: the sum of its runs' timeouts (runtime/launch.py)."""

from __future__ import annotations

from collections.abc import Mapping

from shardscope.runtime import RunConfig

REGISTERED: dict[str, dict[str, RunConfig]] = {}
"""Module name -> its runs by name, in the order registered."""


def register(module: str, configs: Mapping[str, RunConfig]) -> None:
    """Hand a module's runs to the session's shared launches (module: the test module's __name__)."""
    REGISTERED[module] = dict(configs)
