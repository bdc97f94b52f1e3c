"""The fp32 master weights of a mixed-precision checkpoint, read by pipeline layer and TP rank.

Under bf16 (DeepSpeed's BF16 optimizer) or with ZeRO-1 (DeepSpeed's ZeRO optimizer, fp32, bf16 or fp16), the
per-layer files hold the copies the forward pass used (16-bit, or fp32 equal to the masters); the weights the
optimizer really trains are fp32 and live in the optimizer files
``[bf16_]zero_pp_rank_<d>_mp_rank_<mp>_optim_states.pt``, one per (rank of DeepSpeed's data axis, model-parallel
rank), with ``mp = pp_rank * tp + tp_rank``; the data axis holds dp x cp ranks (context-parallel ranks are folded
into it, ``d = dp_rank * cp + cp_rank``), and the readers take the number of partitions from the files, so any cp
reads alike.  Each file holds, per parameter group, this data rank's contiguous slice of the group's flat fp32
buffer (``single_partition_of_fp32_groups``) and, per parameter name, the fragment of that slice that belongs to it
(``param_slice_mappings``: start, numel).  A parameter's full fp32 value is its fragments concatenated in data-axis
order.

Files are memory-mapped (``torch.load(mmap=True)``): only the fragments read are paged in, so the Adam moments in
the same files cost nothing, and host memory stays bounded by what the caller keeps.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ds_megatron.checkpoint import safe_load
from ds_megatron.pipeline_parallel.module import PipelineLayout

_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's state laid out like the flat fp32 partition, beside its step count
BF16_ALIGNMENT = 2  # DeepSpeed's BF16 optimizer pads each flat group to a multiple of this x dp elements
# One parameter's piece of one partition: (data rank, start in the parameter, start in the partition, numel).
Fragment = tuple[int, int, int, int]


def flat_partitions(
    numels: list[int], data: int, order: list[int] | None = None, param_alignment: int = 1
) -> tuple[int, int, list[list[Fragment]]]:
    """How DeepSpeed cuts one parameter group over ``data`` ranks: the parameters (``numels``, in group order)
    concatenated into one flat buffer, padded to a multiple of ``BF16_ALIGNMENT x data`` elements and cut into
    ``data`` equal partitions, data rank d holding the d-th.  The ZeRO optimizer may lay the buffer out in another
    ``order`` (group positions in buffer order: ``round_robin_order``) and pad each parameter but the buffer's last
    to a multiple of ``param_alignment`` elements (``param_paddings``); the BF16 optimizer does neither.  Returns
    the partition size, the tail padding (after the last parameter's end and its own padding) and, per parameter in
    group order, its fragments in data-rank order."""
    order = list(range(len(numels))) if order is None else order
    offsets, offset = [0] * len(numels), 0
    for i, pad in zip(order, param_paddings([numels[i] for i in order], param_alignment)):
        offsets[i] = offset
        offset += numels[i] + pad
    align = BF16_ALIGNMENT * data
    padded = -(-offset // align) * align
    size = padded // data
    fragments: list[list[Fragment]] = []
    for start, numel in zip(offsets, numels):
        end, pieces = start + numel, []
        for d in range(start // size, min(data, -(-end // size))) if size else ():
            lo, hi = max(start, d * size), min(end, (d + 1) * size)
            if lo < hi:
                pieces.append((d, lo - start, lo - d * size, hi - lo))
        fragments.append(pieces)
    return size, padded - offset, fragments


def zero_flat_layout(
    numels: list[int], data: int, round_robin: bool, parameter_alignment: bool, element_size: int
) -> tuple[list[int], int, int, list[list[Fragment]], list[int]]:
    """How DeepSpeed's ZeRO optimizer, with its options ``round_robin_gradients`` and ``parameter_alignment`` and
    model copies of ``element_size`` bytes, cuts one group of parameters (``numels``, in group order) over ``data``
    ranks: the group positions in buffer order, the partition size, the tail padding, each parameter's fragments
    (``flat_partitions``) and the zeros after each parameter in buffer order.  Both options off (their default, and
    the BF16 optimizer's only layout): the BF16 optimizer's cut."""
    order = round_robin_order(len(numels), data) if round_robin else list(range(len(numels)))
    # DeepSpeed's rule: each parameter of the flat buffer starts on a 16-byte boundary
    alignment = 16 // math.gcd(16, element_size) if parameter_alignment else 1
    size, padding, fragments = flat_partitions(numels, data, order, alignment)
    return order, size, padding, fragments, param_paddings([numels[i] for i in order], alignment)


def round_robin_order(count: int, data: int) -> list[int]:
    """The group positions of ``count`` parameters in the order DeepSpeed's ZeRO optimizer flattens them with
    ``round_robin_gradients`` over ``data`` ranks: every data-th from position 0, then from 1, and so on."""
    return [i for first in range(data) for i in range(first, count, data)]


def param_paddings(numels: list[int], param_alignment: int) -> list[int]:
    """The zeros DeepSpeed's ZeRO optimizer puts after each parameter of a flat buffer (``numels`` in buffer order)
    with ``parameter_alignment`` on, so that the next one starts at a multiple of ``param_alignment`` elements;
    none after the last (``round_robin_bit16_padding``)."""
    out, offset = [], 0
    for k, numel in enumerate(numels):
        offset += numel
        out.append(0 if k == len(numels) - 1 else -offset % param_alignment)
        offset += out[-1]
    return out


def rank_padding(size: int, padding: int, data: int, d: int) -> int:
    """How many of data rank ``d``'s ``size`` elements lie in the tail ``padding`` of a buffer of ``data``
    partitions (DeepSpeed's ZeRO optimizer records it per rank, ``groups_padding``; the BF16 optimizer only on the
    last rank, where all of it lies whenever a partition is at least as long)."""
    return max(0, min(size, (d + 1) * size - (size * data - padding)))


def optimizer_files(tag_dir: Path) -> dict[int, list[Path]]:
    """{model-parallel rank: optimizer files in data-parallel order}; empty when the checkpoint has none."""
    found: dict[int, dict[int, Path]] = {}
    for f in tag_dir.iterdir():
        m = _OPTIM_FILE.match(f.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    return {mp: [files[d] for d in sorted(files)] for mp, files in found.items()}


class MasterWeights:
    """fp32 masters of one checkpoint tag; ``None`` from :meth:`open` when the tag has no mixed-precision optimizer
    files (the fp32 path, where the per-layer files already hold the trained fp32 weights)."""

    def __init__(
        self, files: dict[int, list[Path]], tp: int, layout: PipelineLayout | None = None, trust: bool = False
    ):
        self.files, self.tp, self.trust = files, tp, trust
        # Only the naming of layer 0 (a tied embedding or not) depends on the layout; GPT-2's is always tied.
        self.layout = layout if layout is not None else PipelineLayout(0)
        self._loaded: dict[int, list[dict]] = {}

    @classmethod
    def open(
        cls, tag_dir: Path, tp: int, layout: PipelineLayout | None = None, trust: bool = False
    ) -> MasterWeights | None:
        """``trust`` reads files that need more than the weights-only unpickler allows (``safe_load``)."""
        files = optimizer_files(tag_dir)
        if not files:
            return None
        probe = safe_load.load(next(iter(files.values()))[0], trust=trust, mmap=True)
        if "single_partition_of_fp32_groups" not in probe.get("optimizer_state_dict", {}):
            return None
        return cls(files, tp, layout, trust)

    def _states(self, mp: int) -> list[dict]:
        if mp not in self._loaded:
            self._loaded[mp] = [
                safe_load.load(f, trust=self.trust, mmap=True)["optimizer_state_dict"] for f in self.files[mp]
            ]
        return self._loaded[mp]

    def release(self, keep_from_pp: int) -> None:
        """Forget the files of pipeline stages before ``keep_from_pp`` (callers walk the layers in order)."""
        for mp in [m for m in self._loaded if m // self.tp < keep_from_pp]:
            del self._loaded[mp]

    def holds(self, layer_idx: int, key: str, tp_rank: int, pp_rank: int) -> bool:
        mp = pp_rank * self.tp + tp_rank
        name = self.layout.local_name(layer_idx, key)
        return mp in self.files and any(name in m for s in self._states(mp) for m in s["param_slice_mappings"])

    def find(
        self, layer_idx: int, key: str, tp_rank: int, pp_rank: int, state_key: str | None = None
    ) -> torch.Tensor | None:
        """The flat fp32 master of ``key`` in pipeline layer ``layer_idx`` on (pp_rank, tp_rank), or with
        ``state_key`` its optimizer state (``exp_avg``, ``exp_avg_sq``: the wrapped optimizer holds one flat tensor
        per group, laid out like the master partition); None when that stage does not hold it."""
        mp = pp_rank * self.tp + tp_rank
        if mp not in self.files:
            return None
        name = self.layout.local_name(layer_idx, key)
        pieces = []
        for state in self._states(mp):
            for g, (group, mapping) in enumerate(
                zip(state["single_partition_of_fp32_groups"], state["param_slice_mappings"])
            ):
                if name in mapping:
                    flat = group if state_key is None else state["base_optimizer_state"]["state"][g][state_key]
                    address = mapping[name]
                    pieces.append(flat.narrow(0, address.start, address.numel))
        return torch.cat(pieces) if pieces else None  # a copy: nothing stays mapped

    def optimizer_step(self) -> torch.Tensor | None:
        """Adam's step count (the same for every group and rank), None before the first step."""
        state = self._states(min(self.files))[0]["base_optimizer_state"]["state"]
        return state[0]["step"].clone() if 0 in state else None

    def stage_of(self, layer_idx: int, key: str, start: int = 0) -> int | None:
        """The pipeline stage (from ``start`` on) whose optimizer files hold layer ``layer_idx``."""
        for stage in range(start, self.num_stages):
            if self.holds(layer_idx, key, 0, stage):
                return stage
        return None

    @property
    def num_stages(self) -> int:
        return max(self.files) // self.tp + 1
