"""Expert parallelism through DeepSpeed's engine: the in-process parity (``tests/unit/test_moe_training.py``) runs
the pipeline layers and the engine's gradient rule by hand; this runs them in the recipe, with the EP and expert-DP
groups registered in DeepSpeed's tables, its start-up broadcast of the expert parameters, the replaced
``ReduceGrads`` instruction and the grad norm of the clipping optimizer (fp32); and on DeepSpeed's BF16 optimizer
(``workers/ep_training.py``: bf16 at ZeRO 0, bf16 + ZeRO-1 with fp32 accumulation) at (ep, tp, dp) = (2, 1, 2) and
(2, 2, 1) with SP, against the same model at ep 1 in the same launch."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from inprocess import BF16_TOLERANCE
from launch import ROOT, quiet_run_flags, read_records, shared_launch

CONFIG = str(ROOT / "ds_configs" / "moe_tiny.json")
# moe-tiny in fp32, short sequences, 8 sequences per step, gradient clipping on (moe_tiny.json's 1.0)
SMALL = ["--set", "ds_megatron.model.seq_length=64", "--set", 'ds_megatron.recompute.modules=["core_attn"]']
SMALL += ["--set", "train_batch_size=8", "--set", "train_micro_batch_size_per_gpu=2"]
SMALL += ["--set", "gradient_accumulation_steps=null", "--set", "ds_megatron.train.eval_interval=0"]
RUNS = [  # name, tp, flags: the same global batch, so the same losses
    ("dp2", 1, ["--set", "ds_megatron.parallel.sequence_parallel=false"]),
    ("dp2-ep2", 1, ["--set", "ds_megatron.parallel.sequence_parallel=false", "--ep", "2"]),  # expert-DP of one
]


def _plan(out: pathlib.Path) -> list[str]:
    items = []
    for name, tp, extra in RUNS:
        flags = quiet_run_flags(out, name, tp, 1, dropout=0.0)
        argv = ["--deepspeed_config", CONFIG, "--train-iters", "3", *flags, *SMALL, *extra]
        items.append({"name": name, "status_dir": str(out), "argv": argv, "output": True, "plot": False})
    (out / "plan.json").write_text(json.dumps(items))
    bf16 = ",".join(BF16_CASES)
    return [f"recipe_runs.py --plan {out / 'plan.json'} --exit-zero", f"ep_training.py --out {out} --cases {bf16}"]


# workers/ep_training.py's cases: each layout and precision at ep 1 and 2 (DeepSpeed's BF16 optimizer both ways)
BF16_LAYOUTS = {"dp2": 2, "tp2sp": 1}  # layout: dp x cp, the partition count of the non-expert parameter groups
BF16_CASES = [f"{layout}-{p}-ep{ep}" for layout in BF16_LAYOUTS for p in ("bf16", "bf16z1") for ep in (1, 2)]
# The experts' 2-step updates under TP + SP: the ep 1 reference splits every expert over TP (partial sums rounded to
# bf16, then summed), ep 2 holds whole experts, and the bf16 differences move a few tokens across near-tied routing
# decisions.  Measured (relative norm of the update difference, worst expert tensor): ep 2 against ep 1 at tp 2 + SP
# 1.24e-1 (1.25e-1 at dp 2); the two ep 1 layouts against each other (tp 2 + SP against dp 2) 9.7e-2, the same
# order.  A wrong partition or gradient scale moves it to ~1.  At dp 2 both runs compute the same dense math:
# BF16_TOLERANCE holds there for the largest element (measured 9.2e-3 of the largest update).
SP_EXPERT_UPDATE_TOLERANCE = 0.25
# at 4 processes: tp 2 + SP x dp 2, where at ep 2 (over the tp ranks) every expert-DP group has 2 ranks (bf16 at
# ZeRO 0, whose accumulation buffers are bf16, so the sum over expert-DP is where summing in fp32 matters); pp 2 x
# dp 2 (the experts' norm summed over the stages); and pp 2 with a stage holding only moe-tiny's dense first block
EXPERT_DP_CASES = ["tp2sp-bf16-ep1", "tp2sp-bf16-ep2"]
PP_CASES = ["pp2-bf16z1-ep1", "pp2-bf16z1-ep2"]
NO_EXPERT_STAGE = "pp2-bf16z1-ep2-L2"
FOUR = ",".join([*EXPERT_DP_CASES, *PP_CASES, NO_EXPERT_STAGE])
LAUNCH4 = shared_launch(__name__, 4, lambda out: [f"ep_training.py --out {out} --cases {FOUR}"])


# in the 2-process launch shared with other modules (launch.shared_launch)
LAUNCH = shared_launch(__name__, 2, _plan)


@pytest.mark.slow  # real processes with the deepspeed launcher: two recipe runs in the shared 2-process launch
def test_ep2_trains_as_ep1():
    """moe-tiny, 3 steps at dp 2: ep 2 logs ep 1's loss, aux loss and grad norm (measured by hand: bit for bit).  The
    experts' gradients take the engine's rule here (divided by dp x cp = 2, nothing to sum over an expert-DP group of
    one), the other parameters DeepSpeed's all-reduce; the in-process tier covers ep folded over tp + SP."""
    tmp_path = LAUNCH()
    for name, *_ in RUNS:
        result = json.loads((tmp_path / f"{name}.status.json").read_text())
        assert result["status"] == 0, (name, result["error"])
    out = "".join(f.read_text() for f in sorted(tmp_path.glob("dp2-ep2.rank*.out")))
    assert "experts split over ep 2" in out
    runs = {name: [r for r in read_records(tmp_path / name) if "loss" in r] for name, *_ in RUNS}
    assert [r["step"] for r in runs["dp2"]] == [1, 2, 3] == [r["step"] for r in runs["dp2-ep2"]]
    for want, got in zip(runs["dp2"], runs["dp2-ep2"], strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (key, want["step"], got[key], want[key])


def _expert_updates(result: dict) -> dict[str, torch.Tensor]:
    return {name: result["after"][name] - result["before"][name] for name in result["after"]}


def _check_against_ep1(case: str, got: dict, want: dict, dense_math_equal: bool) -> None:
    """``got`` (ep 2) logs ``want``'s (ep 1) losses and grad norms and takes its expert updates (the tests' docs)."""
    for key in ("losses", "norms"):
        for step, (g, w) in enumerate(zip(got[key], want[key], strict=True), 1):
            assert abs(g[0] - w[0]) <= BF16_TOLERANCE * abs(w[0]), (case, key, step, g[0], w[0])
    assert got["before"].keys() == want["before"].keys() and len(got["before"]) == 6, case  # 3 routed blocks
    for name, w0 in want["before"].items():
        assert torch.equal(got["before"][name], w0), (case, name)
    updates, ref = _expert_updates(got), _expert_updates(want)
    for name, delta in ref.items():
        diff = updates[name] - delta
        if dense_math_equal:
            worst = float(diff.abs().max() / delta.abs().max())
            assert worst <= BF16_TOLERANCE, (case, name, worst)
        else:
            relative = float(diff.norm() / delta.norm())
            assert relative <= SP_EXPERT_UPDATE_TOLERANCE, (case, name, relative)


def _check_every_rank_alike(case: str, result: dict) -> None:
    assert result["optimizer"] == "BF16_Optimizer", case
    for key in ("losses", "norms"):
        assert all(len(set(step)) == 1 for step in result[key]), (case, key, result[key])  # the same on every rank


@pytest.mark.slow  # in the shared 2-process launch: 8 engines of 2 steps each
def test_ep2_trains_as_ep1_on_the_bf16_optimizer():
    """bf16 at ZeRO 0 and bf16 + ZeRO-1 (DeepSpeed's BF16 optimizer both), (ep, tp, dp) = (2, 1, 2) and (2, 2, 1)
    with SP, 2 steps of moe-tiny with clipping at 1.0 (norms ~3: clipping acts): the expert parameters sit in
    parameter groups of their own, cut over the expert-DP group (one rank here) while the others are cut over dp x
    cp; every rank logs the same loss and grad norm; both equal ep 1's within BF16_TOLERANCE (measured 1.1e-4 and
    1.3e-3 relative at most); the experts start from ep 1's weights and take its 2-step update (fp32 masters, the
    EP ranks' experts joined) within BF16_TOLERANCE of the largest update at dp 2 and SP_EXPERT_UPDATE_TOLERANCE in
    relative norm under TP + SP (why: the constant).  Adam's eps is 1.0 in these runs, so that an update follows
    its gradient (m / (sqrt(v) + eps) ~ m): at 1e-8 the first update is lr x sign(g) for every element, which bf16
    rounding flips for near-zero gradients (measured: 0.2-2.5% of expert elements 2 lr apart) and clipping cannot
    change.  The updates catch what the norm alone would not: without the experts' division by dp x cp the dp 2
    grad norm moved by 0.55% (inside the tolerance) and every expert update by 99% of itself."""
    tmp_path = LAUNCH()
    results = {case: torch.load(tmp_path / f"{case}.pt") for case in BF16_CASES}
    for case, result in results.items():
        layout, _, ep = case.split("-")
        _check_every_rank_alike(case, result)
        want = [(False, BF16_LAYOUTS[layout])] * 2 + ([(True, 1)] if ep == "ep2" else [])
        assert result["groups"] == want, (case, result["groups"])
    for case in (c for c in BF16_CASES if c.endswith("ep2")):
        _check_against_ep1(case, results[case], results[case.replace("ep2", "ep1")], case.startswith("dp2"))


@pytest.mark.slow  # in the shared 4-process launch: 2 engines of 2 steps
def test_the_bf16_optimizer_cuts_and_sums_experts_over_expert_dp():
    """(ep, tp, dp) = (2, 2, 2) with SP, bf16 at ZeRO 0: the expert parameter group is cut over the expert-DP group
    (2 ranks: its partition count), its bf16 accumulation buffer is summed over that group in fp32 (one all-reduce
    per step, recorded), and the run equals ep 1 at the same layout as the 2-process runs do (measured: losses
    6.7e-5 and grad norms 2.4e-3 apart relative, the updates 1.25e-1 in relative norm)."""
    tmp_path = LAUNCH4()
    results = {case: torch.load(tmp_path / f"{case}.pt") for case in EXPERT_DP_CASES}
    for case, result in results.items():
        _check_every_rank_alike(case, result)
    assert results["tp2sp-bf16-ep1"]["groups"] == [(False, 2), (False, 2)]
    assert results["tp2sp-bf16-ep2"]["groups"] == [(False, 2), (False, 2), (True, 2)]
    assert results["tp2sp-bf16-ep2"]["expert_dp_sums"] == ["float32", "float32"]
    _check_against_ep1("tp2sp-bf16-ep2", results["tp2sp-bf16-ep2"], results["tp2sp-bf16-ep1"], False)


@pytest.mark.slow  # in the shared 4-process launch: 3 engines (one refused before DeepSpeed's)
def test_the_bf16_optimizer_at_ep2_over_pipeline_stages():
    """pp 2 x dp 2, bf16 + ZeRO-1, ep 2 over dp in each stage: DeepSpeed's norm sums each expert group's over the
    stages and then its EP group; the run equals ep 1 as the dp 2 runs do (BF16_TOLERANCE on losses and norms, on
    the largest update difference: the dense math is the same).  moe-tiny cut to 2 blocks puts only the dense first
    block on stage 0: refused on every rank in one line (the optimizer would assert there, and the other stage would
    wait in the norm's pipeline sum)."""
    tmp_path = LAUNCH4()
    results = {case: torch.load(tmp_path / f"{case}.pt") for case in PP_CASES}
    for case, result in results.items():
        _check_every_rank_alike(case, result)
    assert results["pp2-bf16z1-ep1"]["groups"] == [(False, 2), (False, 2)]
    assert results["pp2-bf16z1-ep2"]["groups"] == [(False, 2), (False, 2), (True, 1)]
    _check_against_ep1("pp2-bf16z1-ep2", results["pp2-bf16z1-ep2"], results["pp2-bf16z1-ep1"], True)
    refused = torch.load(tmp_path / f"{NO_EXPERT_STAGE}.pt")["refused"]
    assert refused.startswith("error: ds_megatron.parallel.ep: on DeepSpeed's BF16 optimizer every pipeline stage")
    assert "stage(s) [0] without one (num_layers=2, mlp_only_layers=[0]" in refused and "\n" not in refused
