"""The time of a collective on the cluster's links: the link a group uses, and a ring collective or an all-to-all
over it (shared by the training and the inference models)."""

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


def all_to_all_s(num_bytes: float, ranks: int, cluster: Cluster, stride: int = 1) -> float:
    """An all-to-all over ``ranks`` ranks ``stride`` apart (consecutive at 1), each sending ``num_bytes`` spread
    evenly over the group: (n-1)/n of it leaves the GPU.  Ranks fill nodes of ``gpus_per_node`` in order, so a node
    holds gpus_per_node / stride of the group's members.  Inside a node (the group spanning ``ranks`` x ``stride``
    <= GPUs per node) it runs at NVLink's bandwidth; a group spanning nodes sends the share bound for its own node's
    members over NVLink and the rest over the network at once, the slower of the two setting the time (with the
    network's latency)."""
    if ranks <= 1:
        return 0.0
    node = cluster.gpus_per_node
    if ranks * stride <= node:
        gbps, latency = link(cluster, False)
        return latency + (ranks - 1) / ranks * num_bytes / (gbps * 1e9)
    members = max(1, node // stride)  # of the group in one node
    local = (members - 1) / ranks * num_bytes / (cluster.intra_node_gbps * 1e9)
    remote = (ranks - members) / ranks * num_bytes / (cluster.inter_node_gbps * 1e9)
    return cluster.inter_node_latency_s + max(local, remote)
