"""Sequence parallelism inside the pipeline equals the single-device GPT.

(tp, pp) = (2, 1) and (2, 2) with SP, 5 optimizer steps, fp32, dropout 0: losses, every gradient, the gradient norm
and the weights match the single-device reference (which the parity suite also matches with SP off, so SP on
equals SP off).  LayerNorm weights stay bit-identical across TP ranks (their gradients are summed over the TP group,
DeepSpeed does not know they need it), and the tensors that cross the pipeline stage boundary are sequence shards of
s/t rows.
"""

from __future__ import annotations

import json
import shutil

import pytest
from launch import shared_launch

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher

SEQ, TP = 16, 2
LAYOUTS = {2: "2,1,1", 4: "2,2,1"}


def _runs(nprocs: int):
    """At 2 processes the SP parity run at tp 2 and the bf16 runs (SP at tp 2, then the gradient reduction at dp 2),
    at 4 the SP parity run at tp 2 x pp 2 and the collective count."""

    def runs(out) -> list[str]:
        sub = out / ("bf16" if nprocs == 2 else "collectives")
        sub.mkdir()
        other = (
            f"bf16_sp.py --out {sub} --sp-grad-sync step,micro_batch --dp-reduction"
            if nprocs == 2
            else f"collectives.py --out {sub}"
        )
        return [f"parity.py --out {out} --layouts {LAYOUTS[nprocs]} --sequence-parallel --steps 5", other]

    return runs


# in the launches of 2 and 4 processes shared with other modules (launch.shared_launch)
LAUNCHES = [shared_launch(__name__, nprocs, _runs(nprocs)) for nprocs in LAYOUTS]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Both launches' results in one folder."""
    out = tmp_path_factory.mktemp("sp")
    for launched in LAUNCHES:
        shutil.copytree(launched(), out, dirs_exist_ok=True)
    return out


@pytest.fixture(scope="module")
def results(launches):
    return {
        layout: [
            json.loads(f.read_text()) for f in sorted(launches.glob(f"{layout.replace(',', '-')}-sp-eager.rank*.json"))
        ]
        for layout in LAYOUTS.values()
    }


@pytest.mark.parametrize("layout", list(LAYOUTS.values()))
def test_sp_matches_single_device(results, layout):
    ranks = results[layout]
    assert len(ranks) == 2 * int(layout.split(",")[1])
    for r in ranks:
        assert len(r["losses"]) == 5
        for got, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(got - ref) <= 1e-5 * abs(ref), (layout, r["losses"], r["ref_losses"])
        for got, ref in zip(r["norms"], r["ref_norms"]):
            assert abs(got - ref) <= 1e-5 * abs(ref), (layout, r["norms"], r["ref_norms"])
        assert r["grad_diff"] <= 1e-5, r["grad_diff"]
        assert r["param_diff"] <= 1e-4, r["param_diff"]


@pytest.mark.parametrize("layout", list(LAYOUTS.values()))
def test_layernorm_weights_identical_across_tp_and_equal_to_tp1(results, layout):
    ranks = results[layout]
    by_stage: dict[int, list[dict]] = {}
    for r in ranks:
        by_stage.setdefault(r["pp_rank"], []).append(r)
    for stage_ranks in by_stage.values():
        first = stage_ranks[0]["norm_weights"]
        assert first, "no LayerNorm parameters found"
        for other in stage_ranks[1:]:
            assert other["norm_weights"].keys() == first.keys()
            for name in first:
                assert other["norm_weights"][name]["got"] == first[name]["got"], f"{name} differs across TP ranks"
        for name, w in first.items():
            assert max(abs(a - b) for a, b in zip(w["got"], w["ref"])) <= 1e-5, name


def test_stage_boundary_tensors_are_sequence_shards(results):
    later = [r for r in results["2,2,1"] if r["pp_rank"] == 1]
    assert later
    for r in later:
        assert r["boundary_shapes"], "stage 1 received nothing"
        for shape in r["boundary_shapes"]:
            assert shape[0] == SEQ // TP, shape


def test_bf16_zero1_path_keeps_sp_replicated_weights_identical(launches):
    """On the GPU path (DeepSpeed's BF16 optimizer, fp32 gradient accumulation over 4 micro-batches) the
    SP-replicated gradients are summed over TP once per step on the fp32 buffers: LayerNorm weights and row-parallel
    biases stay identical across TP ranks, and the run equals the per-micro-batch sync within bf16 rounding."""
    runs = {
        mode: [json.loads((launches / "bf16" / f"bf16-sp-{mode}.rank{i}.json").read_text()) for i in (0, 1)]
        for mode in ("step", "micro_batch")
    }
    for r0, r1 in runs.values():
        assert len(r0["replicated"]) == 4 * 6 + 3  # per block: 2 LayerNorms x 2 + 2 row biases; wpe + ln_f
        for name, values in r0["replicated"].items():
            assert values == r1["replicated"][name], name
        assert r0["norms"] == r1["norms"]
        assert all(1.0 < x < 10.0 for x in r0["losses"])
    step, micro = runs["step"][0], runs["micro_batch"][0]
    for a, b in zip(step["losses"], micro["losses"]):
        assert abs(a - b) <= 2e-3 * abs(b), (step["losses"], micro["losses"])
    for name, values in step["replicated"].items():
        diff = max(abs(x - y) for x, y in zip(values, micro["replicated"][name]))
        assert diff <= 0.02, (name, diff)  # a few bf16 ulps of weights near 1 after 5 updates


def test_bf16_data_parallel_gradients_are_summed_in_fp32():
    """bf16 + ZeRO-1 with fp32 gradient accumulation at dp 2: the gradient all-reduces over the data-parallel group
    (the overlapped reduction's buckets, ``parallel.overlap_grad_reduce``, on by default; DeepSpeed's one all-reduce
    without it) carry every parameter's gradient once, in fp32 (left to DeepSpeed's default it copies them to bf16
    and sums those); the only other all-reduce there is the step's fp32 loss."""
    out = LAUNCHES[0]()  # the 2-process launch alone
    for rank in (0, 1):
        r = json.loads((out / "bf16" / f"bf16-dp-reduce.rank{rank}.json").read_text())
        assert r["dp"] == 2
        grads = [(dtype, n) for dtype, n in r["all_reduces"] if n > 1]
        assert {dtype for dtype, _ in grads} == {"float32"}, r["all_reduces"]
        assert sum(n for _, n in grads) == r["params"], r["all_reduces"]


def test_tp_collectives_per_step_are_the_stated_count(launches):
    """tp 2 x pp 2 with SP, 4 micro-batches, 2 blocks per stage: per block and micro-batch 6 all-gathers (2 forward,
    4 backward: the saved sequence shards are gathered again, and the row-parallel gradients) and 4 reduce-scatters
    (gloo: all-reduces); the first stage adds the vocabulary embedding's reduce-scatter and its backward all-gather,
    the last stage the fused output layer + loss's, all in forward: 1 all-gather of the hidden states, 1 all-gather
    of the [max, sum, target] statistics per chunk of tokens (one chunk at this size) and 1 reduce-scatter of the
    hidden states' gradient per micro-batch (unfused it was 2 all-gathers, 1 reduce-scatter and the cross entropy's
    2 all-reduces); and each stage sums its SP-replicated gradients with one all-reduce per step."""
    for rank in range(4):
        r = json.loads((launches / "collectives" / f"collectives.rank{rank}.json").read_text())
        m, blocks, first = r["micro_batches"], r["blocks"], r["pp_rank"] == 0
        assert (m, blocks) == (4, 2)
        all_gathers = m * (6 * blocks + (1 if first else 2))
        all_reduces = m * (4 * blocks + 1) + 1
        assert r["counts"] == {"all_gather": all_gathers, "all_reduce": all_reduces}, (rank, r)
