"""Real runs on torch.distributed: reference models, teaching strategies, torch's engines, measurement, launch.

Everything here imports torch; nothing outside runtime, trace, validate and lesson imports this package eagerly.
"""

from shardscope.runtime.api import Parity, RunResult, run_suite, run_training
from shardscope.runtime.config import RunConfig, RunError

__all__ = ["Parity", "RunConfig", "RunError", "RunResult", "run_suite", "run_training"]
