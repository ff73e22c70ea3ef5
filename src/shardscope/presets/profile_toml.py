"""The hardware profile's TOML file, read and written (`--hardware profile.toml`, `shardscope calibrate --out`).

Written by `shardscope calibrate` or by hand:

    schema = "shardscope.hardware/v2"
    name = "my cluster"
    source = "where the numbers come from"
    [compute]
    matmul_flops_per_s = 0.0        # 0: the GPU preset's datasheet peak for the step's dtype
    efficiency = 0.5                # fraction of that peak a training step reaches
    per_op_kernels = false          # true: each op at its kernel ceiling (core.kernels) where the GPU has them
    kernel_overhead_s = 0.0         # launch/dispatch cost per forward op (aten op)
    backward_op_overhead_s = 0.0    # the same per backward op (autograd node work included)
    optimizer_tensor_overhead_s = 0.0   # per parameter tensor of a single-tensor optimizer step
    memory_bandwidth_bytes_per_s = 0.0  # 0: the GPU preset's datasheet figure
    [framework]                     # optional: engine bookkeeping beyond ops and collectives
    ddp_step_overhead_s = 0.0       # DistributedDataParallel per step (reducer, hooks)
    fsdp_unit_overhead_s = 0.0      # FSDP2 per unit per step (pre/post hooks, copy-in/out, DTensor views)
    [host_overheads]                # optional (HostOverheads): a CPU host's own costs; absent: all 0
    fsdp_optimizer_tensor_overhead_s = 0.0  # per DTensor parameter of the optimizer step
    sync_wait_s = 0.0               # wait for the later rank at each blocking collective after compute
    optimizer_step_overhead_s = 0.0 # per optimizer step: its first call after the rest of the step (cold caches)
    zero_tensor_overhead_s = 0.0    # ZeroRedundancyOptimizer per parameter tensor
    hook_overhead_s = 0.0           # per Python hook call (module forward hooks, post-accumulate-grad hooks)
    bookkeeping_op_overhead_s = 0.0 # per op the teaching strategies dispatch from Python (flatten, slice, div_)
    async_compute_slowdown = 0.0    # extra time per second of an async collective in flight beside compute
    [host_overheads.families.llama] # optional, per model family: replaces the two per-op costs of [compute]
    kernel_overhead_s = 0.0
    backward_op_overhead_s = 0.0
    [host_overheads.python_ops.stage_3]  # optional, per ZeRO stage: the hooks and ops the priced code runs
    backward_hooks_per_tensor = 1   # (presets.hardware.PythonOps; calibrate writes the teaching strategies')
    [network]
    algorithm = "ring"              # ring, tree, hierarchical or auto
    call_latency_s = 8.4e-6
    overlap = true                  # communication runs concurrently with compute
    intra_node = "nvlink4"          # a preset id, or a table {name, bandwidth_bytes_per_s, latency_s}
    inter_node = "ib-ndr"
    host = "pcie5-x16"
    [network.ops.reduce_scatter]    # optional, per op: replaces call_latency_s and the link bandwidth
    call_latency_s = 3.2e-4
    bandwidth_bytes_per_s = 6e8

Every field added after the first version is optional and defaults to 0 (not modelled). A file of the first schema
(shardscope.hardware/v1, the host terms flat in [framework] and the families under [compute]) still loads: the reader
moves those keys into [host_overheads] first (`_from_v1`); the writer writes v2 only. A v1 file that prices the
teaching strategies' hooks or bookkeeping ops (every calibrated one) is refused with one line saying to run
`shardscope calibrate` again: v2 keeps the counts of those hooks and ops beside their prices, and v1 has none.
An unknown key, or a value of the wrong kind, is an error that names it: a misspelt key would otherwise load silently
as its default, and a quoted "false" as true.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shardscope.presets.hardware import (
    DEFAULT_EFFICIENCY,
    FRAMEWORK_FIELDS,
    HOST_FIELDS,
    LEGACY_PROFILE_SCHEMA,
    PROFILE_SCHEMA,
    PYTHON_OP_COUNTS,
    FamilyOpCost,
    HardwareError,
    HardwareProfile,
    HostOverheads,
    InterconnectSpec,
    OpCost,
    PythonOps,
    interconnect_preset,
)

NUMBER, TEXT, FLAG, TABLE, LINK = "a number", "a string", "true or false", "a table", "an interconnect id or a table"
COUNT = "a whole number"
_IS_KIND: dict[str, Callable[[object], bool]] = {
    NUMBER: lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    TEXT: lambda value: isinstance(value, str),
    FLAG: lambda value: isinstance(value, bool),
    TABLE: lambda value: isinstance(value, dict),
    LINK: lambda value: isinstance(value, str | dict),
    COUNT: lambda value: isinstance(value, int) and not isinstance(value, bool),
}
# every key a profile file may hold, by table, and the kind of its value
TOP_KEYS = {
    "schema": TEXT,
    "name": TEXT,
    "source": TEXT,
    "compute": TABLE,
    "framework": TABLE,
    "host_overheads": TABLE,
    "network": TABLE,
}
COMPUTE_KEYS = {
    "matmul_flops_per_s": NUMBER,
    "efficiency": NUMBER,
    "per_op_kernels": FLAG,
    "kernel_overhead_s": NUMBER,
    "backward_op_overhead_s": NUMBER,
    "optimizer_tensor_overhead_s": NUMBER,
    "memory_bandwidth_bytes_per_s": NUMBER,
}
FRAMEWORK_KEYS = dict.fromkeys(FRAMEWORK_FIELDS, NUMBER)
HOST_KEYS = {**dict.fromkeys(HOST_FIELDS, NUMBER), "families": TABLE, "python_ops": TABLE}
PYTHON_OPS_KEYS = dict.fromkeys(PYTHON_OP_COUNTS, COUNT)
STAGE_KEYS = {f"stage_{stage}": TABLE for stage in range(4)}
NETWORK_KEYS = {
    "algorithm": TEXT,
    "call_latency_s": NUMBER,
    "overlap": FLAG,
    "intra_node": LINK,
    "inter_node": LINK,
    "host": LINK,
    "ops": TABLE,
}
LINK_KEYS = {"id": TEXT, "name": TEXT, "bandwidth_bytes_per_s": NUMBER, "latency_s": NUMBER, "source": TEXT}
FAMILY_KEYS = {"kernel_overhead_s": NUMBER, "backward_op_overhead_s": NUMBER}
OP_KEYS = {"call_latency_s": NUMBER, "bandwidth_bytes_per_s": NUMBER}


def _table(value: object, allowed: Mapping[str, str], where: str) -> dict[str, Any]:
    """The table `value`, once every key is one of `allowed` and holds a value of its kind: a misspelt key would
    otherwise load silently as its default, and a quoted "false" as true."""
    if not isinstance(value, dict):
        raise HardwareError(f"{where} = {value!r} must be a table")
    for key, item in value.items():
        if key not in allowed:
            raise HardwareError(f"{where}: unknown key {key!r}; allowed: {', '.join(allowed)}")
        if not _IS_KIND[allowed[key]](item):
            raise HardwareError(f"{where}: {key} = {item!r} must be {allowed[key]}")
    return value


def _link(value: object, where: str) -> InterconnectSpec:
    if isinstance(value, str):
        return interconnect_preset(value)
    if not isinstance(value, dict):
        raise HardwareError(f"{where} must be an interconnect id or a table with bandwidth_bytes_per_s and latency_s")
    table = _table(value, LINK_KEYS, where)
    missing = [key for key in ("bandwidth_bytes_per_s", "latency_s") if key not in table]
    if missing:
        raise HardwareError(f"{where} is missing {missing[0]!r}")
    return InterconnectSpec(
        id=table.get("id", "custom"),
        name=table.get("name", where),
        bandwidth_bytes_per_s=table["bandwidth_bytes_per_s"],
        latency_s=table["latency_s"],
        source=table.get("source", ""),
    )


def _from_v1(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """A v1 file's tables as v2 lays them out: the host terms leave [framework] and the families leave [compute] for
    [host_overheads]. Keys and kinds are checked afterwards, as in a v2 file."""
    compute = dict(data.get("compute", {})) if isinstance(data.get("compute"), dict) else data.get("compute")
    framework = dict(data.get("framework", {})) if isinstance(data.get("framework"), dict) else data.get("framework")
    host: dict[str, Any] = {}
    if isinstance(framework, dict):
        host.update({name: framework.pop(name) for name in HOST_FIELDS if name in framework})
    if any(host.get(name) for name in ("hook_overhead_s", "bookkeeping_op_overhead_s")):
        raise HardwareError(
            f"{origin}: a {LEGACY_PROFILE_SCHEMA} profile prices the teaching strategies' hooks and ops without saying "
            f"how many they run; regenerate it with `shardscope calibrate --out FILE`"
        )
    if isinstance(compute, dict) and "families" in compute:
        host["families"] = compute.pop("families")
    upgraded = {**data, "schema": PROFILE_SCHEMA}
    for name, table in (("compute", compute), ("framework", framework), ("host_overheads", host or None)):
        if table is not None:
            upgraded[name] = table
    return upgraded


def _host_overheads(table: dict[str, Any], origin: str) -> HostOverheads | None:
    """The [host_overheads] table as a HostOverheads; None when the file has none."""
    if not table:
        return None
    families = {
        family: _table(value, FAMILY_KEYS, f"{origin}: [host_overheads.families.{family}]")
        for family, value in table.get("families", {}).items()
    }
    stages = {
        stage: _table(value, PYTHON_OPS_KEYS, f"{origin}: [host_overheads.python_ops.{stage}]")
        for stage, value in _table(
            table.get("python_ops", {}), STAGE_KEYS, f"{origin}: [host_overheads.python_ops]"
        ).items()
    }
    return HostOverheads(
        **{name: table.get(name, 0.0) for name in HOST_FIELDS},
        family_op_costs=tuple(
            FamilyOpCost(
                family=family,
                kernel_overhead_s=value.get("kernel_overhead_s", 0.0),
                backward_op_overhead_s=value.get("backward_op_overhead_s", 0.0),
            )
            for family, value in families.items()
        ),
        python_ops=tuple(
            PythonOps(stage=int(stage.removeprefix("stage_")), **value) for stage, value in stages.items()
        ),
    )


def parse_profile(text: str, origin: str = "profile") -> HardwareProfile:
    """A HardwareProfile from TOML text; an unknown key or a value of the wrong kind is an error naming it."""
    try:
        data = _table(tomllib.loads(text), TOP_KEYS, origin)
    except tomllib.TOMLDecodeError as error:
        raise HardwareError(f"{origin} is not valid TOML: {error}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise HardwareError(f"{origin} is nested too deeply to be a hardware profile") from None
    if data.get("schema") == LEGACY_PROFILE_SCHEMA:
        data = _from_v1(data, origin)
    if data.get("schema") != PROFILE_SCHEMA:
        raise HardwareError(
            f"{origin}: schema={data.get('schema')!r}, expected {PROFILE_SCHEMA!r} (or {LEGACY_PROFILE_SCHEMA!r})"
        )
    compute = _table(data.get("compute", {}), COMPUTE_KEYS, f"{origin}: [compute]")
    framework = _table(data.get("framework", {}), FRAMEWORK_KEYS, f"{origin}: [framework]")
    host = _table(data.get("host_overheads", {}), HOST_KEYS, f"{origin}: [host_overheads]")
    network = _table(data.get("network", {}), NETWORK_KEYS, f"{origin}: [network]")
    ops = {op: _table(value, OP_KEYS, f"{origin}: [network.ops.{op}]") for op, value in network.get("ops", {}).items()}
    return HardwareProfile(
        name=data.get("name", origin),
        source=data.get("source", origin),
        intra_node=_link(network.get("intra_node"), f"{origin}: network.intra_node"),
        inter_node=_link(network.get("inter_node", network.get("intra_node")), f"{origin}: network.inter_node"),
        host=_link(network.get("host", "pcie5-x16"), f"{origin}: network.host"),
        call_latency_s=network.get("call_latency_s", 0.0),
        algorithm=network.get("algorithm", "ring"),
        overlap=network.get("overlap", True),
        matmul_flops_per_s=compute.get("matmul_flops_per_s", 0.0),
        efficiency=compute.get("efficiency", DEFAULT_EFFICIENCY),
        per_op_kernels=compute.get("per_op_kernels", False),
        kernel_overhead_s=compute.get("kernel_overhead_s", 0.0),
        backward_op_overhead_s=compute.get("backward_op_overhead_s", 0.0),
        optimizer_tensor_overhead_s=compute.get("optimizer_tensor_overhead_s", 0.0),
        memory_bandwidth_bytes_per_s=compute.get("memory_bandwidth_bytes_per_s", 0.0),
        **{name: framework.get(name, 0.0) for name in FRAMEWORK_FIELDS},
        op_costs=tuple(
            OpCost(
                op=op,
                call_latency_s=value.get("call_latency_s", 0.0),
                bandwidth_bytes_per_s=value.get("bandwidth_bytes_per_s", 0.0),
            )
            for op, value in ops.items()
        ),
        host_overheads=_host_overheads(host, origin),
    )


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a hardware profile file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise HardwareError(f"cannot read hardware profile {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise HardwareError(f"hardware profile {str(path)!r} is not UTF-8 text: {error.reason}") from None
    return parse_profile(text, origin=str(path))


_CONTROL = re.compile("[\x00-\x1f\x7f]")  # U+0000-U+001F and U+007F: escaped in a TOML basic string


def _string(text: str) -> str:
    """A TOML basic string. Quotes, backslashes and the control characters TOML forbids in one are escaped; every
    other character is written as it is (the file is UTF-8), since JSON's escapes of characters beyond U+FFFF are
    surrogate pairs, which TOML rejects."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + _CONTROL.sub(lambda match: f"\\u{ord(match.group()):04x}", escaped) + '"'


def _link_toml(name: str, link: InterconnectSpec) -> str:
    rows = [
        f"[network.{name}]",
        f"id = {_string(link.id)}",
        f"name = {_string(link.name)}",
        f"bandwidth_bytes_per_s = {float(link.bandwidth_bytes_per_s)!r}",
        f"latency_s = {float(link.latency_s)!r}",
        f"source = {_string(link.source)}",
    ]
    return "\n".join(rows) + "\n"


def profile_to_toml(profile: HardwareProfile) -> str:
    """The profile as a TOML file that parse_profile reads back unchanged."""
    host = profile.host_overheads
    extension = (
        ["[host_overheads]", *(f"{name} = {float(getattr(host, name))!r}" for name in HOST_FIELDS), ""] if host else []
    )
    lines = [
        f"schema = {_string(PROFILE_SCHEMA)}",
        f"name = {_string(profile.name)}",
        f"source = {_string(profile.source)}",
        "",
        "[compute]",
        f"matmul_flops_per_s = {float(profile.matmul_flops_per_s)!r}",
        f"efficiency = {float(profile.efficiency)!r}",
        f"per_op_kernels = {'true' if profile.per_op_kernels else 'false'}",
        f"kernel_overhead_s = {float(profile.kernel_overhead_s)!r}",
        f"backward_op_overhead_s = {float(profile.backward_op_overhead_s)!r}",
        f"optimizer_tensor_overhead_s = {float(profile.optimizer_tensor_overhead_s)!r}",
        f"memory_bandwidth_bytes_per_s = {float(profile.memory_bandwidth_bytes_per_s)!r}",
        "",
        "[framework]",
        *(f"{name} = {float(getattr(profile, name))!r}" for name in FRAMEWORK_FIELDS),
        "",
        *extension,
        "[network]",
        f"algorithm = {_string(profile.algorithm)}",
        f"call_latency_s = {float(profile.call_latency_s)!r}",
        f"overlap = {'true' if profile.overlap else 'false'}",
        "",
    ]
    links = [_link_toml(name, getattr(profile, name)) for name in ("intra_node", "inter_node", "host")]
    families = [
        f"[host_overheads.families.{cost.family}]\nkernel_overhead_s = {float(cost.kernel_overhead_s)!r}\n"
        f"backward_op_overhead_s = {float(cost.backward_op_overhead_s)!r}\n"
        for cost in (host.family_op_costs if host else ())
    ]
    python_ops = [
        f"[host_overheads.python_ops.stage_{ops.stage}]\n"
        + "".join(f"{name} = {int(getattr(ops, name))}\n" for name in PYTHON_OP_COUNTS)
        for ops in (host.python_ops if host else ())
    ]
    ops = [
        f"[network.ops.{cost.op}]\ncall_latency_s = {float(cost.call_latency_s)!r}\n"
        f"bandwidth_bytes_per_s = {float(cost.bandwidth_bytes_per_s)!r}\n"
        for cost in profile.op_costs
    ]
    return "\n".join(lines) + "\n" + "\n".join(families + python_ops + links + ops)
