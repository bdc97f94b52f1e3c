"""The time of a collective on the cluster's links: the link a group uses, and a ring collective over it (shared by
the training and the inference models)."""

from __future__ import annotations

from ds_megatron.tune.core.spec import Cluster


def link(cluster: Cluster, inter_node: bool) -> tuple[float, float]:
    """(GB/s per GPU, latency in s) of the network (``inter_node``) or of NVLink."""
    if inter_node:
        return cluster.inter_node_gbps, cluster.inter_node_latency_s
    return cluster.intra_node_gbps, cluster.intra_node_latency_s


def ring_s(num_bytes: float, ranks: int, gbps: float, latency_s: float, passes: float = 2.0) -> float:
    """A ring collective over ``ranks``: latency + passes x (n-1)/n x bytes / bandwidth, with 2 passes for an
    all-reduce and 1 for an all-gather or reduce-scatter (of a ``num_bytes`` result)."""
    if ranks <= 1:
        return 0.0
    return latency_s + passes * (ranks - 1) / ranks * num_bytes / (gbps * 1e9)
