"""The peak floors of the search's points (`core.peak_floor`), their parts kept: a setting's states' part once per
setting, a micro-batch's saved activations once per batch and cut, so a point is weighed without building its
scenario. The search estimates a point's memory only where its floor leaves it a chance to fit or to be its family's
closest miss; at 405B most points break the budget by their floor alone."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardscope.core.peak_floor import HeldFloor, held_floor, saved_activations_bytes
from shardscope.core.rank_share import RankShare, rank_share
from shardscope.planner.space import family_of
from shardscope.specs import Scenario, TrainingSpec


@dataclass(frozen=True, slots=True)
class SettingFloor:
    """The floor's parts of one setting: a strategy and offload at one shape, without a pipeline."""

    family: str
    """The family of its points (`planner.space.family_of`)."""
    held: HeldFloor
    """Its states' part, the same at every micro-batch and checkpointing."""
    point: Scenario
    """One of its points: the others differ from it only in their batch."""
    share: RankShare
    """The rank's cut of the activations, the same at every point of the setting."""


class PeakFloors:
    """The floors of a search's points, their activations kept by what they read beyond the request's model."""

    def __init__(self) -> None:
        self._saved: dict[tuple[object, ...], int] = {}

    @staticmethod
    def setting(point: Scenario) -> SettingFloor:
        """The floor's parts of the setting of `point`."""
        held = held_floor(point)
        return SettingFloor(family=family_of(point), held=held, point=point, share=rank_share(point, held.megatron))

    def point_bytes(self, setting: SettingFloor, training: TrainingSpec) -> int:
        """The floor under the peak of the setting's point of batch `training`, given with one micro-batch a step
        (`planner.space.point_training`): a micro-batch's activations do not read how many a step runs
        (core/activations.py), so every count shares them."""
        held = setting.held
        key = (training, setting.share, held.autocast, setting.point.cluster.gpu_kernels)
        saved = self._saved.get(key)
        if saved is None:
            point = dataclasses.replace(setting.point, training=training)
            saved = self._saved[key] = saved_activations_bytes(point, held)
        return held.peak_floor_bytes(saved)
