"""The overlapped data-parallel reduction (``parallel.overlap_grad_reduce``) trains bit for bit like DeepSpeed's own
reduction after the step, across real processes.

Why bit-equal and not merely close: at dp 2 each element of a sum is a + b, which is the same in either order, and
the scaling (x 1/2) is exact, so how the gradients are cut into buckets and when each all-reduce starts cannot change
a bit; the overlap reduces the same fp32 tensors (the BF16 optimizer's fp32 accumulators) with DeepSpeed's factors,
after the same tied and SP sums.  At dp > 2 the order in which a ring adds the ranks' terms depends on where an
element sits in its bucket, so there the two agree to fp32 rounding only.

Each case trains 3 steps with the overlap off and then on, from the same weights on the same data (worker
``tests/workers/grad_overlap.py``), with buckets cut small so that a tiny model has several: the losses, the gradient
norms and every final weight must be equal; step 1 learns the step's instruction stream (no bucket starts inside a
gradient pass), steps 2 and 3 start buckets inside the last gradient pass.  Covered: dp 2 (fp32 and bf16 with ZeRO-1,
gradient accumulation 2 and 4), dp 2 x pp 2 (tied embedding across the stages, reduced after its tied sum; 1F1B and
ZB-H1's deferred weight gradients; DualPipeV-ZB's and interleaved-ZB's two stages per rank), tp 2 + SP x dp 2 (the
SP-replicated gradients reduced after their once-per-step TP sum).
"""

from __future__ import annotations

import json

import pytest
from launch import shared_launch

CASES_2 = ["1,1,2,fp32,1f1b,2", "1,1,2,bf16,1f1b,4"]
CASES_4 = [
    "1,2,2,fp32,1f1b,2",
    "1,2,2,bf16,zb-h1,4",
    "1,2,2,fp32,dualpipev-zb,4",
    "1,2,2,bf16,interleaved-zb,4",
    "2,1,2,fp32,1f1b,4,sp",
    "2,1,2,bf16,1f1b,2,sp",
]
LAUNCH_2 = shared_launch(__name__, 2, lambda out: [f"grad_overlap.py --out {out} --cases {' '.join(CASES_2)}"])
LAUNCH_4 = shared_launch(__name__, 4, lambda out: [f"grad_overlap.py --out {out} --cases {' '.join(CASES_4)}"])


def check(out, cases: list[str], nprocs: int) -> None:
    for case in cases:
        ranks = [json.loads(f.read_text()) for f in sorted(out.glob(f"{case.replace(',', '-')}.rank*.json"))]
        assert len(ranks) == nprocs, case
        for r in ranks:
            assert r["losses_on"] == r["losses_off"], (case, r["losses_off"], r["losses_on"])
            assert r["norms_on"] == r["norms_off"], (case, r["norms_off"], r["norms_on"])
            assert r["weights_equal"], (case, r["weight_diff"])
            (_, first), *later = r["early"]
            assert len(r["early"]) == 3 and first == 0, (case, r["early"])
            assert all(in_pass > 0 for _, in_pass in later), (case, r["early"], r["buckets"])
            assert r["buckets"] > 1, case


@pytest.mark.slow  # one run in the shared 2-process launch
def test_overlap_at_dp2_trains_bit_equal():
    check(LAUNCH_2(), CASES_2, 2)


@pytest.mark.slow  # one run in the shared 4-process launch
def test_overlap_with_pp_tied_zero_bubble_and_sp_trains_bit_equal():
    check(LAUNCH_4(), CASES_4, 4)
