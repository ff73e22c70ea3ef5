"""calibrate: a real two-rank gloo sweep with a hard timeout, and the fit on synthetic timings."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from shardscope.calibrate import Sample, calibrate, fit_samples
from shardscope.presets.hardware import parse_profile, profile_to_toml


def test_fit_recovers_a_known_alpha_beta_model() -> None:
    call, step, bandwidth = 50e-6, 20e-6, 2e9
    samples = []
    for op, fraction, steps in (("all_reduce", 1.0, 2), ("all_gather", 0.5, 1), ("reduce_scatter", 0.5, 1)):
        for payload in (2**12, 2**16, 2**20, 2**24):
            seconds = call + steps * step + fraction * payload / bandwidth
            samples.append(Sample(op=op, payload_bytes=payload, world_size=2, seconds=seconds))
    fitted = fit_samples(samples)
    assert fitted[0] == pytest.approx(call, rel=1e-6)
    assert fitted[1] == pytest.approx(step, rel=1e-6)
    assert fitted[2] == pytest.approx(bandwidth, rel=1e-6)
    assert fitted[3] < 1e-9


@pytest.mark.distributed
def test_calibrate_two_gloo_ranks_writes_a_readable_profile() -> None:
    # hard timeout: calibrate kills both ranks after timeout_s and raises TimeoutError
    result = calibrate(world_size=2, payloads=(2**12, 2**16, 2**20), repeats=3, timeout_s=90)
    assert len(result.samples) == 9
    assert all(sample.seconds > 0 for sample in result.samples)
    profile = result.profile
    assert profile.intra_node.bandwidth_bytes_per_s > 1e6
    assert profile.matmul_flops_per_s > 1e8
    assert profile.overlap is False
    assert parse_profile(profile_to_toml(profile)) == profile
