"""The engines' rules, one object per engine behind one protocol (`base.EngineRules`), in one registry.

An engine is whose rules apply to a strategy: 'paper' (the ZeRO paper's accounting, which shardscope's teaching
strategies allocate exactly), 'pytorch' (DDP, ZeroRedundancyOptimizer, FSDP2) and 'deepspeed' (DeepSpeed's
estimators). Everything that differs between engines is a method of their rules object; no code outside this package
switches on an engine's name.
"""

from __future__ import annotations

from shardscope.choices import EngineName
from shardscope.core.engines.base import EngineRules
from shardscope.core.engines.deepspeed import DeepSpeedRules
from shardscope.core.engines.paper import PaperRules
from shardscope.core.engines.pytorch import PyTorchRules
from shardscope.specs import Scenario

ENGINE_RULES: dict[EngineName, EngineRules] = {
    "paper": PaperRules(),
    "pytorch": PyTorchRules(),
    "deepspeed": DeepSpeedRules(),
}


def rules_for(scenario: Scenario) -> EngineRules:
    """The rules of the scenario's engine."""
    return ENGINE_RULES[scenario.strategy.engine]
