"""The hardware profile file: every key is known and of its kind, and what the writer writes reads back unchanged
whatever the text in it (hypothesis)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardscope.choices import FAMILIES
from shardscope.cli import main
from shardscope.presets import gpu_preset
from shardscope.presets.hardware import (
    COLLECTIVE_OPS,
    FRAMEWORK_FIELDS,
    HOST_FIELDS,
    OVERHEAD_FIELDS,
    FamilyOpCost,
    HardwareError,
    HardwareProfile,
    HostOverheads,
    InterconnectSpec,
    OpCost,
    default_profile,
)
from shardscope.presets.profile_toml import load_profile, parse_profile, profile_to_toml

GOOD = 'schema = "shardscope.hardware/v2"\n[compute]\nefficiency = 0.4\n[network]\nintra_node = "nvlink4"\n'


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # a misspelt key used to load silently as its default
        (
            ("efficiency = 0.4", "efficency = 0.3"),
            r"\[compute\]: unknown key 'efficency'; allowed: matmul_flops_per_s, ",
        ),
        (('schema = "', 'nmae = "x"\nschema = "'), r"unknown key 'nmae'; allowed: schema, name, source, compute,"),
        (
            ("[network]", "[framework]\nsync_wait = 1e-3\n[network]"),
            r"\[framework\]: unknown key 'sync_wait'; allowed: ddp_",
        ),
        (("[network]", "[network]\noverlapp = false"), r"\[network\]: unknown key 'overlapp'; allowed: algorithm,"),
        (
            ('intra_node = "nvlink4"', "[network.intra_node]\nbandwith_bytes_per_s = 1e9\nlatency_s = 0.0"),
            r"network.intra_node: unknown key 'bandwith_bytes_per_s'; allowed: id, name, bandwidth_bytes_per_s,",
        ),
        (
            ("[network]", "[host_overheads.families.llama]\nkernel_overhead = 1e-6\n[network]"),
            r"\[host_overheads.families.llama\]: unknown key 'kernel_overhead'; allowed: kernel_overhead_s, backward",
        ),
        (
            ('intra_node = "nvlink4"', 'intra_node = "nvlink4"\n[network.ops.all_gather]\nlatency_s = 1e-4'),
            r"\[network.ops.all_gather\]: unknown key 'latency_s'; allowed: call_latency_s, bandwidth_bytes_per_s",
        ),
        # a quoted "false" used to be read as true
        (("[network]", '[network]\noverlap = "false"'), r"\[network\]: overlap = 'false' must be true or false"),
        (("efficiency = 0.4", 'efficiency = "0.4"'), r"\[compute\]: efficiency = '0.4' must be a number"),
        (("efficiency = 0.4", "efficiency = true"), r"\[compute\]: efficiency = True must be a number"),
        (('schema = "', 'name = 5\nschema = "'), r"name = 5 must be a string"),
        (
            ('intra_node = "nvlink4"', "intra_node = 450e9"),
            r"\[network\]: intra_node = 450000000000.0 must be an inter",
        ),
        (("[compute]", "compute = 1\n[network.x]"), r"compute = 1 must be a table"),
        (
            ("[network]", "[host_overheads.families]\nllama = 2e-6\n[network]"),
            r"\[host_overheads.families.llama\] = 2e-06 must be a table",
        ),
    ],
)
def test_a_bad_key_or_value_is_named(change: tuple[str, str], message: str) -> None:
    assert change[0] in GOOD
    with pytest.raises(HardwareError, match=message):
        parse_profile(GOOD.replace(*change, 1))


def test_the_good_profile_loads() -> None:
    assert parse_profile(GOOD).efficiency == 0.4


def test_a_bad_profile_reaches_the_user_as_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(GOOD.replace("efficiency = 0.4", "efficency = 0.3"))
    assert main(["estimate", "--model", "gpt2", "--seq-len", "1024", "--time", "--hardware", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown key 'efficency'" in err and str(bad) in err
    bad.write_bytes(b'schema = "\xff"')
    assert main(["estimate", "--model", "gpt2", "--seq-len", "1024", "--time", "--hardware", str(bad)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_an_emoji_in_the_name_round_trips(tmp_path: Path) -> None:
    profile = dataclasses.replace(default_profile(gpu_preset("h100-80gb")), name="rack 7 \U0001f680", source='a "b"\\')
    path = tmp_path / "profile.toml"
    path.write_text(profile_to_toml(profile), encoding="utf-8")
    assert load_profile(path) == profile


TEXT = st.text()
NON_NEGATIVE = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
POSITIVE = st.floats(min_value=5e-324, allow_nan=False, allow_infinity=False)
LINKS = st.builds(
    InterconnectSpec, id=TEXT, name=TEXT, bandwidth_bytes_per_s=POSITIVE, latency_s=NON_NEGATIVE, source=TEXT
)


@st.composite
def host_overheads(draw: st.DrawFn) -> HostOverheads:
    """Any host extension: every term any finite figure, per-op costs for any families."""
    families = draw(st.lists(st.sampled_from(FAMILIES), unique=True))
    return HostOverheads(
        **{name: draw(NON_NEGATIVE) for name in HOST_FIELDS},
        family_op_costs=tuple(
            FamilyOpCost(family=family, kernel_overhead_s=draw(NON_NEGATIVE), backward_op_overhead_s=draw(NON_NEGATIVE))
            for family in families
        ),
    )


@st.composite
def profiles(draw: st.DrawFn) -> HardwareProfile:
    """Any valid profile: arbitrary text in every string, any finite figure in every number."""
    ops = draw(st.lists(st.sampled_from(COLLECTIVE_OPS), unique=True))
    return HardwareProfile(
        name=draw(TEXT),
        source=draw(TEXT),
        intra_node=draw(LINKS),
        inter_node=draw(LINKS),
        host=draw(LINKS),
        call_latency_s=draw(NON_NEGATIVE),
        algorithm=draw(st.sampled_from(("ring", "tree", "hierarchical", "auto"))),
        overlap=draw(st.booleans()),
        matmul_flops_per_s=draw(NON_NEGATIVE),
        efficiency=draw(st.floats(min_value=5e-324, max_value=1.0)),
        memory_bandwidth_bytes_per_s=draw(NON_NEGATIVE),
        **{name: draw(NON_NEGATIVE) for name in OVERHEAD_FIELDS},
        op_costs=tuple(
            OpCost(op=op, call_latency_s=draw(NON_NEGATIVE), bandwidth_bytes_per_s=draw(POSITIVE)) for op in ops
        ),
        host_overheads=draw(st.none() | host_overheads()),
    )


@settings(max_examples=300, deadline=None)
@given(profiles())
def test_what_the_writer_writes_reads_back_unchanged(profile: HardwareProfile) -> None:
    assert parse_profile(profile_to_toml(profile)) == profile


def test_the_writer_writes_every_framework_field() -> None:
    written = profile_to_toml(default_profile(gpu_preset("h100-80gb")))
    assert all(f"\n{name} = " in written for name in FRAMEWORK_FIELDS)


def test_the_writer_writes_every_host_term_and_none_when_the_profile_has_none() -> None:
    base = default_profile(gpu_preset("h100-80gb"))
    assert base.host_overheads is None and "[host_overheads]" not in profile_to_toml(base)
    written = profile_to_toml(dataclasses.replace(base, host_overheads=HostOverheads(sync_wait_s=1e-3)))
    assert all(f"\n{name} = " in written for name in HOST_FIELDS)
