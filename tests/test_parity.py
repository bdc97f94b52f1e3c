"""Every (tp, pp, dp) layout trains exactly like the single-device model, for both families.

Real processes (deepspeed launcher, gloo), fp32, dropout 0, vocabulary 1001 (padded to 1024, not divisible by 2 or
by 128).  Llama layouts (4 heads, 2 KV heads: grouped-query attention split over TP) run with SP on and off and with
tied and untied output layers, in the same launches as the GPT-2 ones.  Each worker compares its own shards with
the single-device reference: losses of 3 optimizer steps, step-1 gradients (every parameter, before clipping), the
global gradient norm, and the weights after 3 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import WORKERS, deepspeed_launch

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher

# The DualPipeV layouts (``dualpipev``, with a recompute policy each) train as exactly as 1F1B's: both families, tied
# and untied, with and without SP; gradient accumulation 4 = 2 x pp, the schedule's minimum.
DUALPIPEV = {
    2: ["1,2,1,dualpipev,full", "1,2,1,llama,dualpipev,selective"],
    4: ["2,2,1,sp,dualpipev,selective", "2,2,1,llama,sp,dualpipev,full"],
}
# With dropout on, every recompute policy's gradients equal no recompute's under DualPipeV, bit for bit.
REPLAY = {2: ["1,2,1,dualpipev,replay"]}
GROUPS = {
    1: ["1,1,1", "1,1,1,llama,tied"],
    2: ["2,1,1", "1,2,1", "1,1,2", "2,1,1,llama,sp", "2,1,1,llama,tied", "1,2,1,llama,tied", *DUALPIPEV[2]],
    4: ["2,2,1", "2,1,2", "2,2,1,llama,sp,tied", "2,2,1,llama", "2,1,2,llama,sp", *DUALPIPEV[4]],
}


def result_name(layout: str) -> str:
    """The worker's result-file stem of a layout argument (``2,1,1,llama,sp`` -> ``2-1-1-sp-llama-untied``)."""
    tp, pp, dp, *options = layout.split(",")
    family = [f"llama-{'tied' if 'tied' in options else 'untied'}"] if "llama" in options else []
    extra = [o for o in ("dualpipev", "selective", "full") if o in options]
    return "-".join([tp, pp, dp, *(["sp"] if "sp" in options else []), *family, *extra])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    for nprocs, layouts in GROUPS.items():
        layouts = [*layouts, *REPLAY.get(nprocs, [])]
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
    assert len(ranks) == tp * pp * dp
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
    # The layout table (every checkpoint name mapping reads it) names the layers each rank really built, in the
    # optimizer's order, under either schedule.
    for r in ranks:
        assert r["built_layers"] == r["table_layers"], (layout, r["pp_rank"], r["built_layers"], r["table_layers"])
    if "dualpipev" in layout:  # the V: rank 0 holds the embedding and the output layer, the loss stage
        first = next(r for r in ranks if r["pp_rank"] == 0)
        last = max(max(r["built_layers"]) for r in ranks)
        assert first["built_layers"][0] == 0 and max(first["built_layers"]) == last, first["built_layers"]


@pytest.mark.parametrize("layout", [lay for group in REPLAY.values() for lay in group])
def test_recompute_replays_dropout_under_dualpipev(results, layout):
    files = sorted(results.glob(f"{layout.replace(',', '-')}.rank*.json"))
    tp, pp, dp = (int(x) for x in layout.split(",")[:3])
    assert len(files) == tp * pp * dp
    for f in files:
        for policy, r in json.loads(f.read_text()).items():
            assert r["grad_diff"] == 0.0, (f.name, policy, r)
