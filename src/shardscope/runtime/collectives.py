"""The tensor collectives under their current names: torch 2.13 renamed all_gather_into_tensor to all_gather_single
and reduce_scatter_tensor to reduce_scatter_single (the old names warn, FutureWarning); older releases have only
the old ones. Both names call the same c10d op, so what is measured does not change."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
