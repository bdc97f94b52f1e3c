"""Load balance of context-parallel ring attention over packed documents: per CP rank, the score elements the ring
computes (chunk pairs that share a document, ``cp_comm.ring_scores_computed``) and the ones document masking really
needs (sum over the rank's tokens of restart position + 1), for a few document-length mixes.  No process group: the
counts follow from the document ids and the layout alone.

    python benchmarks/cp_document_balance.py [--seq-length 32768] [--cps 2 4 8] [--markdown OUT.md]

max/mean is the slowest rank's work over the mean (1.00: balanced); "of causal" is the mean work over what
unmasked causal attention computes per rank (the saving document masking brings).
"""

from __future__ import annotations

import argparse

import torch
from _results import write_markdown  # noqa: E402

from ds_megatron.context_parallel.attention import ring_scores_computed  # noqa: E402
from ds_megatron.context_parallel.layout import slice_for_rank  # noqa: E402
from ds_megatron.data.document_mask import document_positions  # noqa: E402


def ids_from_lengths(lengths: list[int], s: int) -> torch.Tensor:
    """[1, s] document ids of documents of ``lengths`` tokens (cut at s; the last one fills the rest)."""
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[:s]
    if len(ids) < s:
        ids = torch.cat([ids, torch.full((s - len(ids),), len(lengths))])
    return ids.unsqueeze(0)


def mixes(s: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    lognormal = (
        torch.exp(torch.randn(4 * s // 256, generator=gen) * 1.0 + 6.9).long().clamp_min(1).tolist()
    )  # median ~1k
    return {
        "one document": [s],
        "s/4 each": [s // 4] * 4,
        "2048 each": [2048] * (s // 2048),
        "256 each": [256] * (s // 256),
        "log-normal, median ~1k": lognormal,
        "one s/2 document first, then 256s": [s // 2] + [256] * (s // 512),
        "256s, then one s/2 document last": [256] * (s // 512) + [s // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=32768)
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--markdown")
    args = parser.parse_args()
    s = args.seq_length
    rows = [
        "| mix | cp | computed max/mean | computed of causal | needed max/mean | needed of causal |",
        "|---|---|---|---|---|---|",
    ]
    for name, lengths in mixes(s).items():
        ids = ids_from_lengths(lengths, s)
        needed_full = document_positions(ids) + 1  # keys a token may see: its restart position + 1
        for cp in args.cps:
            c = s // (2 * cp)
            causal = (2 * cp + 1) * c * c  # what every rank computes without document ids
            computed = ring_scores_computed(ids, cp)
            needed = [int(slice_for_rank(needed_full, 1, r, cp).sum()) for r in range(cp)]
            causal_needed = (s * (s + 1) // 2) / cp
            mean_c, mean_n = sum(computed) / cp, sum(needed) / cp
            rows.append(
                f"| {name} | {cp} | {max(computed) / mean_c:.2f} | {mean_c / causal:.2f} | "
                f"{max(needed) / mean_n:.2f} | {mean_n / causal_needed:.3f} |"
            )
    body = "\n".join(rows)
    print(body)
    if args.markdown:
        write_markdown(
            args.markdown,
            "Ring attention load balance with packed documents",
            "benchmarks/cp_document_balance.py",
            body,
        )


if __name__ == "__main__":
    main()
