"""GPU presets for ``python -m ds_megatron.tune --gpu NAME``, from NVIDIA's datasheets: memory in GiB as the device
reports it, the dense bf16 Tensor Core peak (``ds_megatron.gpus``, the one table MFU reads too), bandwidths in GB/s
per GPU and per direction, one NIC per GPU as in NVIDIA's reference systems; the dense fp8 and int8 Tensor Core peaks
where the GPU has them (an A100 has no fp8).  The figures' sources are in docs/tuner.md, "GPU presets".  Standard
library only, so that anything in the package can import the table."""

from __future__ import annotations

from dataclasses import dataclass

from ds_megatron.gpus import DENSE_BF16_TFLOPS as PEAK


@dataclass(frozen=True)
class GpuPreset:
    """What the tuner needs to know about one GPU model (per GPU; bandwidths one direction)."""

    name: str
    memory_gb: float  # GiB as the device reports it
    peak_tflops: float  # dense bf16 Tensor Core peak
    memory_gbps: float  # HBM bandwidth, GB/s
    intra_node_gbps: float  # NVLink (or PCIe: an H100 PCIe's bridge joins only pairs of cards) per GPU, one way, GB/s
    inter_node_gbps: float  # network per GPU, one way, GB/s (200 Gb/s HDR: 25; 400 Gb/s NDR: 50)
    fp8_tflops: float | None = None  # dense fp8 Tensor Core peak (None: no fp8 Tensor Cores)
    int8_tops: float | None = None  # dense int8 Tensor Core peak, TOPS


GPUS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset("a100-40gb", 40, PEAK["a100"], 1555, 300, 25, None, 624),  # A100 SXM4 40GB, NVLink 3
        GpuPreset("a100-80gb", 80, PEAK["a100"], 2039, 300, 25, None, 624),  # A100 SXM4 80GB, NVLink 3
        GpuPreset("h100-sxm", 80, PEAK["h100-sxm"], 3350, 450, 50, 1979, 1979),  # H100 SXM5 80GB, NVLink 4
        GpuPreset("h100-pcie", 80, PEAK["h100-pcie"], 2000, 64, 25, 1513, 1513),  # H100 PCIe 80GB, PCIe Gen5 in node
        GpuPreset("h200", 140, PEAK["h200"], 4800, 450, 50, 1979, 1979),  # H200 SXM 141 GB (decimal) = 140 GiB
    )
}
DEFAULT_GPU = "a100-80gb"  # the tuner's defaults when neither --gpu nor the explicit flags are given
