"""The algorithm models: wire bytes, alpha-beta time, bus bandwidth."""

from __future__ import annotations

import pytest

from shardscope.core.network import (
    Link,
    NetworkModel,
    Placement,
    bus_bandwidth_bytes_per_s,
    collective_cost,
)
from shardscope.core.result import CollectiveRow
from shardscope.specs import SpecError

GB = 1e9


def _net(
    algorithm: str = "ring", latency: float = 0.0, intra: float = 400 * GB, inter: float = 50 * GB
) -> NetworkModel:
    return NetworkModel(
        intra_node=Link(name="intra", bandwidth_bytes_per_s=intra, latency_s=latency),
        inter_node=Link(name="inter", bandwidth_bytes_per_s=inter, latency_s=latency),
        host=Link(name="host", bandwidth_bytes_per_s=32 * GB, latency_s=0.0),
        algorithm=algorithm,
    )


@pytest.mark.parametrize(
    ("op", "fraction"),
    [("all_reduce", 2 * 7 / 8), ("reduce_scatter", 7 / 8), ("all_gather", 7 / 8), ("broadcast", 1.0)],
)
def test_ring_wire_bytes(op: str, fraction: float) -> None:
    # "Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations": 2(n-1)/n S for all-reduce.
    cost = collective_cost(op, 1e9, Placement(size=8, per_node=8), _net())
    assert cost.wire_bytes == pytest.approx(fraction * 1e9)
    assert cost.inter_node_bytes == 0


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
def test_bus_bandwidth_of_a_bandwidth_optimal_ring_is_the_link_bandwidth(op: str) -> None:
    # NCCL Tests' PERFORMANCE.md: bus bandwidth is defined so that it equals the hardware's peak for an optimal ring.
    cost = collective_cost(op, 2**30, Placement(size=8, per_node=8), _net())
    row = CollectiveRow(phase="backward", op=op, group_size=8, payload_bytes=2**30, count=1)
    assert bus_bandwidth_bytes_per_s(row, cost.time_s) == pytest.approx(400 * GB)


def test_ring_across_nodes_runs_at_the_nics_times_gpus_per_node() -> None:
    cost = collective_cost("all_reduce", 1e9, Placement(size=16, per_node=8), _net())
    assert cost.time_s == pytest.approx(2 * 15 / 16 * 1e9 / min(400 * GB, 8 * 50 * GB))
    one_per_node = collective_cost("all_reduce", 1e9, Placement(size=16, per_node=1), _net())
    assert one_per_node.time_s == pytest.approx(2 * 15 / 16 * 1e9 / (50 * GB))


def test_a_group_that_does_not_fill_its_last_node_still_crosses_nodes() -> None:
    # 12 consecutive ranks on 8-GPU nodes: 8 on one node, 4 on the next, so the ring crosses the network
    assert Placement(size=12, per_node=8).nodes == 2
    cost = collective_cost("all_reduce", 1e9, Placement(size=12, per_node=8), _net())
    assert cost.inter_node_bytes > 0


def test_hierarchical_sends_one_gth_of_the_buffer_across_nodes() -> None:
    cost = collective_cost("all_reduce", 8e9, Placement(size=32, per_node=8), _net("hierarchical"))
    assert cost.inter_node_bytes == pytest.approx(2 * 3 / 4 * 8e9 / 8)
    assert cost.wire_bytes == pytest.approx(2 * 7 / 8 * 8e9 + 2 * 3 / 4 * 1e9)


def test_tree_latency_grows_with_log_nodes_and_auto_picks_it_for_small_messages() -> None:
    where = Placement(size=1024, per_node=8)
    ring = collective_cost("all_reduce", 1024, where, _net("ring", latency=5e-6))
    tree = collective_cost("all_reduce", 1024, where, _net("tree", latency=5e-6))
    auto = collective_cost("all_reduce", 1024, where, _net("auto", latency=5e-6))
    assert tree.time_s < ring.time_s / 10
    assert auto.time_s == tree.time_s
    # for a few ranks and a large buffer the ring's 2(n-1)/n beats the tree's 2: auto takes the ring
    few = Placement(size=4, per_node=4)
    big = collective_cost("all_reduce", 1e10, few, _net("auto", latency=5e-6))
    assert big.time_s == collective_cost("all_reduce", 1e10, few, _net("ring", latency=5e-6)).time_s


def test_alpha_beta_latency_term() -> None:
    cost = collective_cost("all_gather", 0, Placement(size=4, per_node=4), _net(latency=1e-5))
    assert cost.time_s == pytest.approx(3 * 1e-5)


def test_one_rank_costs_nothing() -> None:
    assert collective_cost("all_reduce", 1e9, Placement(size=1, per_node=1), _net()).time_s == 0


def test_a_link_without_bandwidth_is_refused() -> None:
    with pytest.raises(SpecError, match="bandwidth"):
        Link(name="dead", bandwidth_bytes_per_s=0.0, latency_s=0.0)
    with pytest.raises(SpecError, match="algorithm"):
        _net("butterfly")


def test_a_measured_per_op_cost_replaces_call_latency_and_bandwidth() -> None:
    from shardscope.core.network import Link, NetworkModel, Placement, collective_cost
    from shardscope.presets.hardware import OpCost

    link = Link(name="gloo", bandwidth_bytes_per_s=1e9, latency_s=1e-4)
    slow_scatter = OpCost(op="reduce_scatter", call_latency_s=5e-4, bandwidth_bytes_per_s=0.5e9)
    net = NetworkModel(intra_node=link, inter_node=link, host=link, call_latency_s=3e-4, op_costs=(slow_scatter,))
    pair = Placement(size=2, per_node=2)
    gather = collective_cost("all_gather", 2e6, pair, net)
    scatter = collective_cost("reduce_scatter", 2e6, pair, net)
    assert gather.time_s == pytest.approx(3e-4 + 1e-4 + 1e6 / 1e9)  # one ring step at the link's latency
    assert scatter.time_s == pytest.approx(5e-4 + 1e6 / 0.5e9)  # measured per call, steps included
    assert scatter.wire_bytes == gather.wire_bytes
