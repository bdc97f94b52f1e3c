"""Every (tp, pp, dp) layout trains exactly like the single-device model, for both families.

Real processes (deepspeed launcher, gloo), fp32, dropout 0, vocabulary 1001 (padded to 1024, not divisible by 2 or
by 128).  Llama layouts (4 heads, 2 KV heads: grouped-query attention split over TP) run with SP on and off and with
tied and untied output layers, in the same launches as the GPT-2 ones.  Context-parallel layouts (``cp2``: each
sequence split over 2 ranks, ring; ``a2a``: all-to-all) ride in the same launches: DeepSpeed's own gradient
average over its data axis (dp x cp), its loss average, the pipeline with CP chunks at the boundary, dp 2 x cp 2.
Packed documents (``docs``: ``data.document_mask``, restart positions) ride there too, at tp 2 x pp 2 (DeepSpeed
partitions the boundary's first tensor over TP) and pp 2 x cp 2 Llama: the boundary is (hidden, doc_ids,
positions), the two int64 ids [b, s / cp] arriving without gradient.
Each worker compares its own shards with the single-device reference: losses of 3 optimizer steps, step-1
gradients (every parameter, before clipping), the global gradient norm, and the weights after 3 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import WORKERS, deepspeed_launch

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher

GROUPS = {
    1: ["1,1,1", "1,1,1,llama,tied"],
    2: ["2,1,1", "1,2,1", "1,1,2", "2,1,1,llama,sp", "2,1,1,llama,tied", "1,2,1,llama,tied", "1,1,1,llama,cp2"],
    4: [
        "2,2,1,docs",
        "2,1,2",
        "2,2,1,llama,sp,tied",
        "2,2,1,llama",
        "2,1,2,llama,sp",
        "1,2,1,cp2",
        "1,1,2,llama,cp2,a2a",
        "1,2,1,llama,cp2,docs",
    ],
}


def result_name(layout: str) -> str:
    """The worker's result-file stem of a layout argument (``2,1,1,llama,sp`` -> ``2-1-1-sp-llama-untied``)."""
    tp, pp, dp, *options = layout.split(",")
    family = [f"llama-{'tied' if 'tied' in options else 'untied'}"] if "llama" in options else []
    cp = [o for o in options if o.startswith("cp")]
    cp_part = [*cp, *(["a2a"] if cp and "a2a" in options else [])]
    docs = ["docs"] if "docs" in options else []
    return "-".join([tp, pp, dp, *(["sp"] if "sp" in options else []), *family, *cp_part, *docs])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    for nprocs, layouts in GROUPS.items():
        deepspeed_launch(WORKERS / "parity.py", nprocs, ["--out", str(out), "--layouts", *layouts])
    return out


def _load(out: Path, layout: str) -> list[dict]:
    files = sorted(out.glob(f"{result_name(layout)}-eager.rank*.json"))
    assert files, f"no results for {layout}"
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("layout", [lay for group in GROUPS.values() for lay in group], ids=result_name)
def test_layout_matches_single_device(results, layout):
    ranks = _load(results, layout)
    tp, pp, dp = (int(x) for x in layout.split(",")[:3])
    cp = next((int(o[2:]) for o in layout.split(",")[3:] if o.startswith("cp")), 1)
    assert len(ranks) == tp * cp * pp * dp
    if cp > 1 and pp > 1:  # stage-boundary activations hold this CP rank's s / cp tokens (seq 16 in the workers)
        later = [r for r in ranks if r["pp_rank"] > 0]
        assert later and all(shape[0] == 16 // cp for r in later for shape in r["boundary_shapes"]), later
    if "docs" in layout and pp > 1:  # doc_ids and positions cross the boundary: int64 [b, s / cp], no gradient
        later = [r for r in ranks if r["pp_rank"] > 0]
        ids = ["torch.int64", [2, 16 // cp], False]
        assert later and all(extras == [ids, ids] for r in later for extras in r["boundary_extras"]), later
    for r in ranks:
        for got, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(got - ref) <= 1e-5 * abs(ref), (layout, r["losses"], r["ref_losses"])
        for got, ref in zip(r["norms"], r["ref_norms"]):
            assert abs(got - ref) <= 1e-5 * abs(ref), (layout, r["norms"], r["ref_norms"])
        assert r["grad_diff"] <= 1e-5, (layout, r["grad_diff"])
        # Adam divides by sqrt(v): on elements whose gradient is ~1e-7, float rounding differences of ~1e-8 move the
        # update by a visible fraction of lr (1e-3), so the weights get a looser bound than the gradients.
        assert r["param_diff"] <= 1e-4, (layout, r["param_diff"])
    covered = set().union(*(r["checked"] for r in ranks))
    assert covered == set(ranks[0]["all_names"]), sorted(set(ranks[0]["all_names"]) - covered)
