"""What a collective costs: bytes on the wire per rank and time, from an algorithm model applied to a ledger row.

Time is the alpha-beta (latency-bandwidth) model of "The communication challenge for MPP: Intel Paragon and Meiko
CS-2" (Hockney): t = steps x alpha + bytes / beta, with a fixed cost per call added as NCCL's own tuning model does
(src/graph/tuning.cc: latency = baseLat + steps x hwLat, time = latency + bytes / algorithm bandwidth).
- ring: "Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations" (Patarasuk and Yuan): all-reduce sends
  2(n-1)/n x S per rank in 2(n-1) steps; reduce-scatter and all-gather (n-1)/n x S in n-1 steps (S = the unsharded
  buffer). Broadcast is a pipelined chain: S per rank.
- tree: NCCL's double binary tree ("Massively Scale Your Deep Learning Training with NCCL 2.4"): all-reduce in
  2 x (intra-node hops + log2(nodes) inter-node hops) steps, at half the bus bandwidth (tuning.cc: ratio .5), i.e.
  2 x S per rank. Only all-reduce has a tree; other ops use the ring, as in NCCL.
- hierarchical: "Highly Scalable Deep Learning Training System with Mixed-Precision: Training ImageNet in Four
  Minutes" (Jia et al.): reduce-scatter inside the node, all-reduce of 1/g of the buffer across nodes, all-gather
  inside the node.
A ring that crosses nodes runs one channel per GPU's NIC, so its bus bandwidth is min(intra, g x inter) for g ranks of
the group per node (NCCL: busBw = nChannels x speedInter).
Ring attention's send is one hop: the payload over the intra-node link, or the inter-node one once the ring spans
nodes; its recv costs nothing of its own. Groups lie on the mesh pp x dp_replicate x dp_shard x cp x tp, tp innermost
(`placement`): a tp group of at most a node's GPUs stays on the intra-node link.
Bus bandwidth is as "NCCL Tests: PERFORMANCE.md" defines it: algbw x 2(n-1)/n for all-reduce, x (n-1)/n for
reduce-scatter and all-gather, x 1 for broadcast.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardscope.core.comm import CommEvent, comm_events, repeated_totals
from shardscope.core.result import CollectiveRow, LedgerKey
from shardscope.presets.hardware import HardwareProfile, InterconnectSpec, OpCost
from shardscope.specs import Scenario, SpecError

ALGORITHMS = ("ring", "tree", "hierarchical", "auto")


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One kind of link a rank sends over."""

    name: str
    """What it is, e.g. 'NVLink 4 (H100 SXM)' or 'measured gloo loopback'."""
    bandwidth_bytes_per_s: float
    """Bytes per second in one direction, per GPU."""
    latency_s: float
    """Latency of one algorithm step over this link."""

    def __post_init__(self) -> None:
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise SpecError(
                f"Link.bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} for {self.name!r} must be a "
                f"positive number of bytes per second"
            )
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise SpecError(f"Link.latency_s={self.latency_s} for {self.name!r} must be zero or more seconds")


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkModel:
    """The links of a cluster and the collective algorithm assumed."""

    intra_node: Link
    """Between GPUs of one node (NVLink, PCIe, or shared memory on one host)."""
    inter_node: Link
    """Between nodes, per GPU (its share of the node's NICs)."""
    host: Link
    """Between a GPU and its host (PCIe), for offload copies."""
    call_latency_s: float = 0.0
    """Fixed cost of one collective call (NCCL's baseLat; gloo's per-call overhead when calibrated)."""
    algorithm: str = "ring"
    """'ring', 'tree', 'hierarchical', or 'auto' (the fastest of ring and tree, as NCCL's tuner picks)."""
    op_costs: tuple[OpCost, ...] = ()
    """Measured per-op call latency and bandwidth (inside a node), replacing call_latency_s, the intra-node step
    latency and bandwidth for that op: gloo's reduce_scatter is 1.5-3x slower than its all_gather at the same
    payload. Measured at the calibration's group size, whose ring steps the call latency then includes."""

    def for_op(self, op: str) -> NetworkModel:
        """This model with the op's own measured cost, if it has one."""
        cost = next((cost for cost in self.op_costs if cost.op == op), None)
        if cost is None:
            return self
        link = dataclasses.replace(self.intra_node, bandwidth_bytes_per_s=cost.bandwidth_bytes_per_s, latency_s=0.0)
        return dataclasses.replace(self, intra_node=link, call_latency_s=cost.call_latency_s, op_costs=())

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise SpecError(f"NetworkModel.algorithm={self.algorithm!r} is not known; allowed: {', '.join(ALGORITHMS)}")
        if not (self.call_latency_s >= 0 and math.isfinite(self.call_latency_s)):
            raise SpecError(f"NetworkModel.call_latency_s={self.call_latency_s} must be zero or more seconds")


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """How a communication group sits on the nodes."""

    size: int
    """Ranks in the group."""
    per_node: int
    """Ranks of the group on one node."""

    @property
    def nodes(self) -> int:
        """Nodes the group spans: a group that does not fill its last node still reaches it."""
        return max(1, -(-self.size // self.per_node))


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCost:
    """What one call costs one rank."""

    wire_bytes: float
    """Bytes the rank sends (intra- and inter-node together)."""
    inter_node_bytes: float
    """The part of wire_bytes that crosses nodes."""
    time_s: float
    """Duration of the call."""


def placement(event: CommEvent, scenario: Scenario) -> Placement:
    """Where the event's group lies on the mesh pp x dp_replicate x dp_shard x cp x tp (tp innermost, as torchtitan's
    ParallelDims orders it): a tp group is consecutive ranks, a cp group strided by tp, the data-parallel groups
    (every rank with the same tp slice, or an hsdp shard group of dp_shard x cp) by tp, hsdp's replica groups by
    the shard group x tp, and the ranks holding the same experts by ep x tp. A group strided by k has at most ranks
    per node / k of its ranks on one node."""
    per_node = scenario.cluster.ranks_per_node
    size = event.row.group_size
    group = event.group
    if group == "tp":
        stride = 1
    elif group == "replica":
        stride = scenario.shard_degree * scenario.strategy.tp
    elif group == "experts":  # one rank per expert group (core.expert_parallel)
        stride = scenario.strategy.ep * scenario.strategy.tp
    else:
        stride = scenario.strategy.tp
    return Placement(size=size, per_node=max(1, min(size, per_node // stride)))


def _step_factor(op: str, ranks: int) -> tuple[float, int]:
    """(bytes sent per rank as a fraction of S, algorithm steps) of a flat ring."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks, 2 * (ranks - 1)
    if op in ("reduce_scatter", "all_gather"):
        return (ranks - 1) / ranks, ranks - 1
    if op == "broadcast":
        return 1.0, ranks - 1
    if op == "all_to_all":  # pairwise exchange: each rank keeps 1/n of its buffer and sends the rest in n - 1 steps
        return (ranks - 1) / ranks, ranks - 1
    raise SpecError(f"op {op!r} is not a collective")


def _ring(op: str, payload: float, where: Placement, net: NetworkModel) -> CollectiveCost:
    fraction, steps = _step_factor(op, where.size)
    _, inter_steps = _step_factor(op, where.nodes) if where.nodes > 1 else (0.0, 0)
    bandwidth = net.intra_node.bandwidth_bytes_per_s
    if where.nodes > 1:
        bandwidth = min(bandwidth, where.per_node * net.inter_node.bandwidth_bytes_per_s)
    latency = (steps - inter_steps) * net.intra_node.latency_s + inter_steps * net.inter_node.latency_s
    wire = fraction * payload
    inter = wire / where.per_node if where.nodes > 1 else 0.0
    return CollectiveCost(wire_bytes=wire, inter_node_bytes=inter, time_s=latency + wire / bandwidth)


def _tree(payload: float, where: Placement, net: NetworkModel) -> CollectiveCost:
    latency = 2 * (
        (where.per_node - 1) * net.intra_node.latency_s + math.ceil(math.log2(where.nodes)) * net.inter_node.latency_s
    )
    bandwidth = net.intra_node.bandwidth_bytes_per_s
    if where.nodes > 1:
        bandwidth = min(bandwidth, where.per_node * net.inter_node.bandwidth_bytes_per_s)
    wire = 2 * payload
    inter = wire / where.per_node if where.nodes > 1 else 0.0
    return CollectiveCost(wire_bytes=wire, inter_node_bytes=inter, time_s=latency + wire / bandwidth)


def _hierarchical(op: str, payload: float, where: Placement, net: NetworkModel) -> CollectiveCost:
    if where.nodes == 1 or where.per_node == 1:
        return _ring(op, payload, where, net)
    inside = Placement(size=where.per_node, per_node=where.per_node)
    across_payload = payload if op == "broadcast" else payload / where.per_node
    intra = _ring(op, payload, inside, net)
    inter_fraction, inter_steps = _step_factor(op, where.nodes)
    inter_wire = inter_fraction * across_payload
    inter_time = inter_steps * net.inter_node.latency_s + inter_wire / net.inter_node.bandwidth_bytes_per_s
    return CollectiveCost(
        wire_bytes=intra.wire_bytes + inter_wire, inter_node_bytes=inter_wire, time_s=intra.time_s + inter_time
    )


def _send(payload: float, where: Placement, net: NetworkModel) -> CollectiveCost:
    """One step of a ring of point-to-point sends (ring attention): the payload to the next rank, over the
    inter-node link once the ring spans nodes (its slowest hop; one GPU's NIC), else within the node."""
    link = net.inter_node if where.nodes > 1 else net.intra_node
    inter = payload / where.per_node if where.nodes > 1 else 0.0
    return CollectiveCost(
        wire_bytes=payload, inter_node_bytes=inter, time_s=link.latency_s + payload / link.bandwidth_bytes_per_s
    )


def collective_cost(op: str, payload_bytes: float, where: Placement, net: NetworkModel) -> CollectiveCost:
    """Wire bytes and time of one call of a collective on a group placed as given. A recv costs nothing of its own:
    it completes with the send it is paired with (each rank sends and receives at once, over both directions of
    its link), which carries the time."""
    if where.size <= 1 or op == "recv":
        return CollectiveCost(wire_bytes=0.0, inter_node_bytes=0.0, time_s=0.0)
    net = net.for_op(op)
    algorithm = net.algorithm
    if op == "send":
        cost = _send(payload_bytes, where, net)
    elif algorithm == "auto":
        candidates = [_ring(op, payload_bytes, where, net)]
        if op == "all_reduce":
            candidates.append(_tree(payload_bytes, where, net))
        cost = min(candidates, key=lambda candidate: candidate.time_s)
    elif algorithm == "tree" and op == "all_reduce":
        cost = _tree(payload_bytes, where, net)
    elif algorithm == "hierarchical":
        cost = _hierarchical(op, payload_bytes, where, net)
    else:
        cost = _ring(op, payload_bytes, where, net)
    return CollectiveCost(
        wire_bytes=cost.wire_bytes, inter_node_bytes=cost.inter_node_bytes, time_s=cost.time_s + net.call_latency_s
    )


def host_copy_time_s(payload_bytes: float, net: NetworkModel) -> float:
    """A copy between GPU and host over PCIe: latency plus bytes over the host link's bandwidth."""
    return net.host.latency_s + payload_bytes / net.host.bandwidth_bytes_per_s


def event_cost(event: CommEvent, scenario: Scenario, net: NetworkModel) -> CollectiveCost:
    """Wire bytes and time of one event of the ledger (host copies cost time, never wire bytes)."""
    if event.group == "host":
        return CollectiveCost(
            wire_bytes=0.0, inter_node_bytes=0.0, time_s=host_copy_time_s(event.row.payload_bytes, net)
        )
    return collective_cost(event.row.op, event.row.payload_bytes, placement(event, scenario), net)


def bus_bandwidth_bytes_per_s(row: CollectiveRow, time_s: float) -> float:
    """nccl-tests' bus bandwidth of one call of the row that took time_s (NCCL Tests: PERFORMANCE.md)."""
    if time_s <= 0:
        raise SpecError(f"time_s={time_s} must be positive to compute a bandwidth")
    algorithm_bandwidth = row.payload_bytes / time_s
    ranks = row.group_size
    factor = {
        "all_reduce": 2 * (ranks - 1) / ranks,
        "reduce_scatter": (ranks - 1) / ranks,
        "all_gather": (ranks - 1) / ranks,
        "broadcast": 1.0,
        "send": 1.0,
    }.get(row.op)
    if factor is None:
        raise SpecError(f"op {row.op!r} has no bus bandwidth; it is not a collective")
    return algorithm_bandwidth * factor


def _link(spec: InterconnectSpec) -> Link:
    return Link(name=spec.name, bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s, latency_s=spec.latency_s)


def network_model(profile: HardwareProfile) -> NetworkModel:
    """The network half of a hardware profile."""
    return NetworkModel(
        intra_node=_link(profile.intra_node),
        inter_node=_link(profile.inter_node),
        host=_link(profile.host),
        call_latency_s=profile.call_latency_s,
        algorithm=profile.algorithm,
        op_costs=profile.op_costs,
    )


def ledger_costs(scenario: Scenario, net: NetworkModel) -> dict[LedgerKey, tuple[float, ...]]:
    """Calls, wire bytes and seconds of each ledger row (phase, op, group, group size, payload) of one step; O(1) in
    the number of micro-batches."""

    def tally(case: Scenario) -> dict[LedgerKey, tuple[float, ...]]:
        totals: dict[LedgerKey, tuple[float, ...]] = {}
        for event in comm_events(case):
            key, cost = event.row.key, event_cost(event, case, net)
            count, wire, seconds = totals.get(key, (0, 0.0, 0.0))
            totals[key] = (count + 1, wire + cost.wire_bytes, seconds + cost.time_s)
        return totals

    return repeated_totals(scenario, tally)
