"""GPU presets for ``python -m ds_megatron.tune --gpu NAME``: one row per GPU, from the vendors' published figures.
Standard library only, so that anything in the package can import the table.

Units: memory in GiB as the device reports it (an "80 GB" A100 or H100 shows 80 GiB); dense bf16 Tensor Core peak
in TFLOP/s (the datasheets print the 2:4-sparse figure first: dense is half of it); bandwidths in GB/s
(10^9 bytes/s), per GPU and per direction.

Sources (NVIDIA datasheets):
- A100 SXM4 (A100 datasheet): bf16 312 TFLOP/s dense (624 sparse); 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at
  2,039 GB/s; NVLink 3 600 GB/s per GPU (both directions together: 300 each way).
- H100 SXM5 80 GB (H100 datasheet): bf16 1,979 TFLOP/s sparse = 989 dense; HBM3 3.35 TB/s; NVLink 4 900 GB/s
  (450 each way).
- H100 PCIe 80 GB (same datasheet): bf16 1,513 TFLOP/s sparse = 756 dense; HBM2e 2 TB/s; PCIe Gen5 x16 128 GB/s
  (64 each way).  Its NVLink bridge joins only pairs of cards, so a TP group of 4 or 8 talks over PCIe: 64.
- H200 SXM 141 GB (H200 datasheet): bf16 989 TFLOP/s dense, as H100 SXM; HBM3e 4.8 TB/s; NVLink 4 900 GB/s.  The
  141 GB (decimal) is 140 GiB as the device reports it (143,771 MiB).

Inter-node: one NIC per GPU, the reference systems' layout.  DGX A100: one 200 Gb/s HDR InfiniBand port per GPU =
25 GB/s; DGX H100 and DGX H200: one 400 Gb/s NDR port per GPU = 50 GB/s.  H100 PCIe servers are not a reference
system: the table assumes the low end of that range, 200 Gb/s per GPU = 25 GB/s.  Pass --inter-node-gbps for yours.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPreset:
    """What the tuner needs to know about one GPU model (per GPU; bandwidths one direction)."""

    name: str
    memory_gb: float  # GiB as the device reports it
    peak_tflops: float  # dense bf16 Tensor Core peak
    memory_gbps: float  # HBM bandwidth, GB/s
    intra_node_gbps: float  # NVLink (or PCIe) per GPU, one way, GB/s
    inter_node_gbps: float  # network per GPU, one way, GB/s
    description: str


GPUS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset("a100-40gb", 40, 312, 1555, 300, 25, "A100 SXM4 40GB, NVLink 3, one 200 Gb/s HDR NIC per GPU"),
        GpuPreset("a100-80gb", 80, 312, 2039, 300, 25, "A100 SXM4 80GB, NVLink 3, one 200 Gb/s HDR NIC per GPU"),
        GpuPreset("h100-sxm", 80, 989, 3350, 450, 50, "H100 SXM5 80GB, NVLink 4, one 400 Gb/s NDR NIC per GPU"),
        GpuPreset("h100-pcie", 80, 756, 2000, 64, 25, "H100 PCIe 80GB, PCIe Gen5 in the node, 200 Gb/s per GPU"),
        GpuPreset("h200", 140, 989, 4800, 450, 50, "H200 SXM 141GB, NVLink 4, one 400 Gb/s NDR NIC per GPU"),
    )
}
DEFAULT_GPU = "a100-80gb"  # the tuner's defaults when neither --gpu nor the explicit flags are given
