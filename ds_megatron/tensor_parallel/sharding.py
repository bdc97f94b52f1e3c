"""How one full parameter maps to its tensor-parallel shards (and back).

A rule is written once per parameter by the plan in ``parallelize.py`` and used for building sharded layers,
comparing against references, and checkpoint export/import.

Fused QKV (``c_attn``): the output dim holds [q | k | v], each head-major.  Splitting by heads means rank r takes
heads [r a/t, (r+1) a/t) from each of q, k and v: view the dim as [3, t, h/t] and keep [:, r].
Vocabulary: the full [V, h] table is padded with zero rows to [V_pad, h] first, then split in contiguous blocks;
merging strips the padding back to V.  V_pad depends on tp (a multiple of ``vocab_multiple`` x tp), so a table
merged at one tp and cut at another must go through V: the rule carries both sizes, and every merge (resharding,
offline resharding, export) strips to the rule's V rather than guessing which parameters are padded by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardRule:
    """``dim`` None: replicated.  ``fused``: number of equal fused blocks along dim (3 for QKV).
    ``padded_size``: the full size along ``dim`` after zero padding (vocabulary), else None; ``unpadded_size``: the
    real size along ``dim`` before that padding (the vocabulary V), which :func:`unshard` strips back to."""

    dim: int | None = None
    fused: int = 1
    padded_size: int | None = None
    unpadded_size: int | None = None

    @property
    def replicated(self) -> bool:
        return self.dim is None


REPLICATED = ShardRule()


def shard(full: torch.Tensor, rule: ShardRule, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of ``full`` (a new contiguous tensor)."""
    if rule.replicated or size == 1 and rule.padded_size is None:
        return full.clone()
    dim = rule.dim
    if rule.padded_size is not None and full.shape[dim] > rule.padded_size:
        raise ValueError(
            f"size {full.shape[dim]} along dim {dim} exceeds the padded size {rule.padded_size} (merge the shards "
            "with unshard, which strips the padding, before cutting them at another tp)"
        )
    if rule.padded_size is not None and rule.padded_size != full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = rule.padded_size - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    n = full.shape[dim]
    if n % (rule.fused * size) != 0:
        raise ValueError(f"size {n} along dim {dim} is not divisible by fused({rule.fused}) x tp({size})")
    blocks = full.chunk(rule.fused, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], rule: ShardRule, full_size: int | None = None) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from all ranks' shards, padding stripped to the rule's
    ``unpadded_size`` (``full_size``, when given, overrides it)."""
    if rule.replicated:
        return shards[0].clone()
    dim = rule.dim
    per_rank = [s.chunk(rule.fused, dim=dim) for s in shards]
    blocks = [torch.cat([p[i] for p in per_rank], dim=dim) for i in range(rule.fused)]
    full = torch.cat(blocks, dim=dim)
    full_size = full_size if full_size is not None else rule.unpadded_size
    if full_size is not None and full.shape[dim] != full_size:
        full = full.narrow(dim, 0, full_size)
    return full.contiguous()
