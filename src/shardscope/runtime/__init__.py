"""Real runs on torch.distributed: reference models, teaching strategies, torch's engines, measurement, launch.

Everything here imports torch; nothing outside runtime, trace, validate and lesson imports this package eagerly.
"""
