"""L0.5: the dense bf16 Tensor Core peak of each GPU model, one table for MFU (``metrics.py``) and the tuner's presets
(``tune/core/gpus.py``).  Standard library only.

A device is recognised by its full name as ``torch.cuda.get_device_name()`` reports it, never by a substring: the
H100 comes as SXM ("NVIDIA H100 80GB HBM3", 989), PCIe (756) and NVL (835), and "H100" alone would give all three
the SXM figure.  A name the table does not know gets no peak (and so no MFU) rather than a guess.

Peaks are dense (without 2:4 structured sparsity; NVIDIA's datasheets print the sparse figure, twice the dense one),
from NVIDIA's datasheets:
- A100 (SXM4 and PCIe, 40 and 80 GB): 312 TFLOP/s BF16 Tensor Core (A100 datasheet, "624*" with sparsity).
- H100 SXM 1,979* -> 989; H100 PCIe 1,513* -> 756; H100 NVL 1,671* -> 835 (H100 datasheet).
- H200 SXM 1,979* -> 989; H200 NVL 1,671* -> 835 (H200 datasheet).
- GH200: the Hopper GPU of the Grace Hopper superchip, 1,979* -> 989 (GH200 datasheet).
- B200: 4.5 PFLOP/s* FP16/BF16 per GPU -> 2,250 (HGX B200: 72 PFLOP/s* for 8 GPUs).
- B300: 36 PFLOP/s* FP16/BF16 for the 8 GPUs of an HGX B300 -> 2,250 per GPU.
- L40S: 362 TFLOP/s BF16 dense (733* with sparsity; L40S datasheet).
GB200 and GB300 (rack-scale figures only) are left out: pass ``--peak-tflops`` for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPeak:
    """One GPU model: its key, the device names it reports (a full-match regular expression) and its peak."""

    key: str
    device_names: str  # re.fullmatch against torch.cuda.get_device_name()
    dense_bf16_tflops: float


PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak("a100", r"NVIDIA A100[- ](SXM4-(40|80)GB|PCIE-40GB|80GB PCIe)", 312),
    GpuPeak("h100-sxm", r"NVIDIA H100 80GB HBM3", 989),
    GpuPeak("h100-pcie", r"NVIDIA H100 PCIe", 756),
    GpuPeak("h100-nvl", r"NVIDIA H100 NVL", 835),
    GpuPeak("h200", r"NVIDIA H200", 989),
    GpuPeak("h200-nvl", r"NVIDIA H200 NVL", 835),
    GpuPeak("gh200", r"NVIDIA GH200 .*", 989),
    GpuPeak("b200", r"NVIDIA B200", 2250),
    GpuPeak("b300", r"NVIDIA B300( .*)?", 2250),
    GpuPeak("l40s", r"NVIDIA L40S", 362),
)
DENSE_BF16_TFLOPS: dict[str, float] = {p.key: p.dense_bf16_tflops for p in PEAKS}


def gpu_peak(device_name: str | None) -> GpuPeak | None:
    """The table's row for ``device_name`` (the whole name must match), or None for a name it does not know."""
    if not device_name:
        return None
    return next((p for p in PEAKS if re.fullmatch(p.device_names, device_name.strip())), None)


def peak_tflops(device_name: str | None) -> float | None:
    """Dense bf16 TFLOP/s of ``device_name``, or None when the table does not know it."""
    row = gpu_peak(device_name)
    return None if row is None else row.dense_bf16_tflops
