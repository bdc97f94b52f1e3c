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
import shutil
from pathlib import Path

import pytest
import torch
from launch import shared_launch

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher

# The DualPipeV layouts (``dualpipev``, with a recompute policy each) train as exactly as 1F1B's: both families, tied
# and untied, with and without SP; gradient accumulation 4 = 2 x pp, the schedule's minimum.
# The Llama one at tp 2 runs ``dualpipev-zb`` (``zb``: weight gradients deferred into DualPipeV's drain), which
# costs the 4-process launch no extra layout.
DUALPIPEV = {
    2: ["1,2,1,dualpipev,full", "1,2,1,llama,dualpipev,selective"],
    4: ["2,2,1,sp,dualpipev,selective", "2,2,1,llama,sp,dualpipev,zb,full"],
}
# ``dualpipev-zb`` beside a DualPipeV layout of the same launch: the single-device comparison, and DualPipeV's
# losses and gradient norms bit for bit (at tp 2 with SP, selective recompute, too: measured by hand).
DUALPIPEV_ZB = {2: {"1,2,1,dualpipev,zb,full": "1,2,1,dualpipev,full"}}
# Interleaved 1F1B (``interleaved``: 2 virtual stages per rank), three layouts (the launches' time is a budget):
# GPT-2 tied at pp 2 and Llama tied at tp 2 + SP beside the 1F1B layout of the same launch (the single-device
# comparison, and 1F1B's step-1 gradients bit for bit, every parameter on every rank: the gradient norm sums each
# rank's squares over other layers, so it is 1F1B's within fp32 rounding; see the test), and Llama untied at pp 4
# (``l8``: 8 layers for its 8 stages) against the single-device model only.  ``interleaved-zb`` runs in the
# checkpoint worker (resumed from an interleaved-1f1b checkpoint: its losses bit for bit).
INTERLEAVED = {
    2: {"1,2,1,interleaved": "1,2,1"},
    4: {"2,2,1,llama,sp,tied,interleaved": "2,2,1,llama,sp,tied"},
}
# Uneven pipeline stages (``blocks<counts>``: ``pipeline_layout``) beside the even layout of the same schedule: 1F1B
# at [1, 3], interleaved 1F1B at [0, 1, 3, 0] (the embedding alone on the first stage, the output layer and loss
# alone on the last) and DualPipeV at [0, 2, 2, 0] (rank 0 holds no block: its module's own partitioning override);
# against the single-device model, and the even run's gradients and losses bit for bit.
UNEVEN = {
    2: {
        "1,2,1,blocks1-3": "1,2,1",
        "1,2,1,interleaved,blocks0-1-3-0": "1,2,1,interleaved",
        "1,2,1,dualpipev,full,blocks0-2-2-0": "1,2,1,dualpipev,full",
    }
}
# With dropout on, every recompute policy's gradients equal no recompute's under DualPipeV, bit for bit.
REPLAY = {2: ["1,2,1,dualpipev,replay"]}
# DualPipeV checkpoints, export, sampling and bf16, in the 2-process launch (tests/workers/schedule_checkpoint.py).
# Interleaved 1F1B's checkpoints, resharding (to 1F1B and back, from v 2 to v 4), interleaved-zb, sampling and
# export, in the same launch (tests/workers/interleaved_checkpoint.py).
CHECKPOINT = {2: ["checkpoint", "interleaved-checkpoint"]}
GROUPS = {
    1: ["1,1,1", "1,1,1,llama,tied"],
    2: [
        "2,1,1",
        "1,2,1",
        "1,1,2",
        "2,1,1,llama,sp",
        "2,1,1,llama,tied",
        "1,2,1,llama,tied",
        "1,1,1,llama,cp2",
        *DUALPIPEV[2],
        *DUALPIPEV_ZB[2],
        *INTERLEAVED[2],
        *UNEVEN[2],
    ],
    4: [
        "2,2,1,docs",
        "2,1,2",
        "2,2,1,llama,sp,tied",
        "2,2,1,llama",
        "2,1,2,llama,sp",
        "1,2,1,cp2",
        "1,1,2,llama,cp2,a2a",
        *DUALPIPEV[4],
        "1,2,1,llama,cp2,docs",
        *INTERLEAVED[4],
        "1,4,1,llama,l8,interleaved",  # 8 layers for interleaving's 8 stages
    ],
}


def result_name(layout: str) -> str:
    """The worker's result-file stem of a layout argument (``2,1,1,llama,sp`` -> ``2-1-1-sp-llama-untied``)."""
    tp, pp, dp, *options = layout.split(",")
    family = [f"llama-{'tied' if 'tied' in options else 'untied'}"] if "llama" in options else []
    cp = [o for o in options if o.startswith("cp")]
    cp_part = [*cp, *(["a2a"] if cp and "a2a" in options else [])]
    extra = [o for o in ("dualpipev", "zb", "interleaved", "l8", "selective", "full") if o in options]
    extra += [o for o in options if o.startswith("blocks")]
    docs = ["docs"] if "docs" in options else []
    return "-".join([tp, pp, dp, *(["sp"] if "sp" in options else []), *family, *cp_part, *extra, *docs])


def _parity_run(layouts: list[str]):
    return lambda out: [f"parity.py --out {out} --layouts {' '.join(layouts)}"]


# one run per process count, in the launch of that count shared with other modules (launch.shared_launch)
LAUNCHES = [
    shared_launch(__name__, nprocs, _parity_run([*layouts, *REPLAY.get(nprocs, []), *CHECKPOINT.get(nprocs, [])]))
    for nprocs, layouts in GROUPS.items()
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every process count's results in one folder."""
    out = tmp_path_factory.mktemp("parity")
    for launched in LAUNCHES:
        shutil.copytree(launched(), out, dirs_exist_ok=True)
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
    # The layout table (every checkpoint name mapping reads it) names the layers each rank really built, in the
    # optimizer's order, under either schedule.
    for r in ranks:
        assert r["built_layers"] == r["table_layers"], (layout, r["pp_rank"], r["built_layers"], r["table_layers"])
    if "dualpipev" in layout:  # the V: rank 0 holds the embedding and the output layer, the loss stage
        first = next(r for r in ranks if r["pp_rank"] == 0)
        last = max(max(r["built_layers"]) for r in ranks)
        assert first["built_layers"][0] == 0 and max(first["built_layers"]) == last, first["built_layers"]


@pytest.mark.parametrize("layout,plain", [pair for group in DUALPIPEV_ZB.values() for pair in group.items()])
def test_deferred_weight_grads_train_as_dualpipev(results, layout, plain):
    """Deferring the weight gradients changes when they are computed, not what: the same sums in the same order."""
    for zb, dv in zip(_load(results, layout), _load(results, plain), strict=True):
        assert (zb["pp_rank"], zb["tp_rank"]) == (dv["pp_rank"], dv["tp_rank"])
        assert zb["losses"] == dv["losses"] and zb["norms"] == dv["norms"], (layout, zb, dv)
        assert zb["engine"] == "DualPipeVZeroBubbleEngine" and dv["engine"] == "AsyncSendDualPipeVEngine", (
            zb["engine"],
            dv["engine"],
        )


@pytest.mark.parametrize("layout,plain", [pair for group in INTERLEAVED.values() for pair in group.items()])
def test_interleaved_gives_1f1b_gradients(results, layout, plain):
    """Interleaving changes the order of the passes and which rank holds which blocks, not a sum: each parameter's
    micro-batch gradients accumulate in the same order, so step 1's loss and every gradient are 1F1B's bit for bit,
    and an evaluation before it (the forward-only order) gives that loss.
    The global norm adds each rank's sum of squares, over other parameters per rank than under 1F1B (rank 0 holds
    blocks 0 and 2 of 4, not 0 and 1): measured within 2e-7 of 1F1B's; the later losses follow the clipped step."""
    ranks = {(r["pp_rank"], r["tp_rank"]): r for r in _load(results, layout)}
    plains = {(r["pp_rank"], r["tp_rank"]): r for r in _load(results, plain)}
    assert ranks.keys() == plains.keys()
    interleaved = {k: v for r in ranks.values() for k, v in r["grad_hashes"].items()}
    one_f_one_b = {k: v for r in plains.values() for k, v in r["grad_hashes"].items()}
    assert interleaved == one_f_one_b, sorted(k for k in one_f_one_b if interleaved.get(k) != one_f_one_b[k])
    for key, r in ranks.items():
        assert r["engine"] == "InterleavedEngine", r["engine"]
        # evaluation (the forward-only order) before the first step: the first step's loss, bit for bit
        assert r["eval_loss"] == r["losses"][0], (layout, r["eval_loss"], r["losses"])
        assert r["losses"][0] == plains[key]["losses"][0], (layout, r["losses"], plains[key]["losses"])
        for got, ref in zip(r["norms"] + r["losses"], plains[key]["norms"] + plains[key]["losses"], strict=True):
            assert abs(got - ref) <= 1e-6 * abs(ref), (layout, r["norms"], plains[key]["norms"])
    # rank r holds stages r and r + p of 2p: rank 0 the embedding and a block of the second half
    first = ranks[(0, 0)]["built_layers"]
    assert first[0] == 0 and first != plains[(0, 0)]["built_layers"], first


@pytest.mark.parametrize("layout,even", [pair for group in UNEVEN.values() for pair in group.items()])
def test_uneven_stages_train_as_the_even_ones(results, layout, even):
    """Moving blocks between stages changes which rank computes them, not a sum: every step-1 gradient (each
    parameter's micro-batch gradients accumulate in the same order) and every loss equal the even layout's bit for
    bit; the gradient norm adds each rank's sum of squares over other parameters, so it is the even one's within
    fp32 rounding.  Each rank built the layers the layout gives it (the checkpoint table's, checked in
    test_layout_matches_single_device)."""
    ranks = {(r["pp_rank"], r["tp_rank"]): r for r in _load(results, layout)}
    evens = {(r["pp_rank"], r["tp_rank"]): r for r in _load(results, even)}
    assert ranks.keys() == evens.keys()
    uneven_grads = {k: v for r in ranks.values() for k, v in r["grad_hashes"].items()}
    even_grads = {k: v for r in evens.values() for k, v in r["grad_hashes"].items()}
    assert uneven_grads == even_grads, sorted(k for k in even_grads if uneven_grads.get(k) != even_grads[k])
    for key, r in ranks.items():
        assert r["losses"] == evens[key]["losses"], (layout, r["losses"], evens[key]["losses"])
        for got, ref in zip(r["norms"], evens[key]["norms"], strict=True):
            assert abs(got - ref) <= 1e-6 * abs(ref), (layout, r["norms"], evens[key]["norms"])
        assert r["built_layers"] != evens[key]["built_layers"], (layout, r["built_layers"])
    # GPT-2: wte 0, wpe 1, blocks 2-5, ln_f 6, the tied output layer 7 (its parameters registered under layer 0)
    expected = {
        "1,2,1,blocks1-3": [0, 1, 2],
        "1,2,1,interleaved,blocks0-1-3-0": [0, 1, 3, 4, 5],
        "1,2,1,dualpipev,full,blocks0-2-2-0": [0, 1, 6],
    }[layout]
    assert ranks[(0, 0)]["built_layers"] == expected, ranks[(0, 0)]["built_layers"]


@pytest.mark.parametrize("layout", [lay for group in REPLAY.values() for lay in group])
def test_recompute_replays_dropout_under_dualpipev(results, layout):
    files = sorted(results.glob(f"{layout.replace(',', '-')}.rank*.json"))
    tp, pp, dp = (int(x) for x in layout.split(",")[:3])
    assert len(files) == tp * pp * dp
    for f in files:
        for policy, r in json.loads(f.read_text()).items():
            assert r["grad_diff"] == 0.0, (f.name, policy, r)


def test_interleaved_checkpoints_resume_across_schedules_and_v_sample_and_export(results):
    """An interleaved-1f1b checkpoint resumes exactly at its own placement (DeepSpeed's per-layer files, written and
    read chunk by chunk), resharded under 1F1B and back (stages r, r + p <-> stage r) and at v 4 (stages r, r + 2
    -> r, r + 2, r + 4, r + 6) with the straight run's losses, and under interleaved-zb without resharding; greedy
    decoding through the interleaved engine (its forward-only order, logits on rank p - 1) equals the single-device
    model's; ``python -m ds_megatron.checkpoint export`` of the pp 2 v 2 checkpoint gives a transformers model whose
    logits are the single-device model's with the weights the ranks held.  An even checkpoint resumes at uneven
    stages (``pipeline_layout``, interleaved and 1F1B) continuing the straight run, and the uneven run's checkpoint
    exports the weights its ranks held."""
    import transformers

    from ds_megatron.checkpoint.__main__ import main as checkpoint_main
    from ds_megatron.model.gpt2.model import GPT, GPTConfig

    tmp_path = results / "interleaved-checkpoint"
    for rank in (0, 1):
        r = json.loads((tmp_path / f"losses.rank{rank}.json").read_text())
        a = r["A"]
        assert r["B"] == {k: a[k] for k in ("3", "4")}, r  # same schedule and placement: bit for bit
        assert not r["B_resharded"] and r["C_resharded"] and r["D_resharded"] and not r["E_resharded"], r
        # 1F1B computes interleaving's step-1 gradients bit for bit (test_interleaved_gives_1f1b_gradients); after
        # resharding both ways the losses continue A's within fp32 rounding of the norm (measured: bit for bit)
        assert abs(r["C"]["3"] - a["3"]) <= 1e-6 * abs(a["3"]) and abs(r["D"]["4"] - a["4"]) <= 1e-6 * abs(a["4"])
        assert r["E"]["3"] == r["B"]["3"], (r["E"], r["B"])  # deferred W passes: the same sums
        assert r["generate"]["pipeline"] == r["generate"]["reference"], r["generate"]
        # Even -> uneven stages (another split: resharded on load) continues the straight run: interleaved at
        # [0, 3, 5, 0] from A's step 2, 1F1B at [3, 5] from C's step 3.
        assert r["F_resharded"] and r["G_resharded"], r
        for step in ("3", "4"):
            assert abs(r["F"][step] - a[step]) <= 1e-6 * abs(a[step]), (step, r["F"], a)
        assert abs(r["G"]["4"] - a["4"]) <= 1e-6 * abs(a["4"]), (r["G"], a)
        # rank 0 builds stages 0 (wte, wpe) and 2 (blocks 3-7), rank 1 stages 1 (blocks 0-2) and 3 (ln_f, output)
        assert r["F_layers"] == ([[0, 2], [5, 10]] if rank == 0 else [[2, 5], [10, 12]]), r["F_layers"]
        # v 4: rank r builds stages r, r + 2, r + 4, r + 6 of 8, a block each.  Step 3's loss is the loaded weights'
        # forward, the same operations in the same order: bit for bit.  Step 4 follows an update with the same
        # gradient sums as v 2's but a global norm whose per-rank sums of squares are grouped otherwise (fp32
        # rounding; measured: bit for bit).
        assert r["H_resharded"] and len(r["H_layers"]) == 4, r
        assert r["H"]["3"] == a["3"] and abs(r["H"]["4"] - a["4"]) <= 1e-6 * abs(a["4"]), (r["H"], a)
    # Export from the uneven run's checkpoint: the weights the ranks held (per-layer files, whatever the split).
    from safetensors.torch import load_file

    from ds_megatron.checkpoint.export import export
    from ds_megatron.checkpoint.reshard import OldCheckpoint

    out = export(tmp_path / "uneven", tmp_path / "hf-uneven", tag="step00000003", progress=False, weights_only=True)
    exported = load_file(str(out / "model.safetensors"))
    held = {**torch.load(tmp_path / "params-uneven.rank0.pt"), **torch.load(tmp_path / "params-uneven.rank1.pt")}
    adapter = OldCheckpoint(tmp_path / "uneven", "step00000003").adapter
    assert set(exported) == set(held)
    for name, tensor in held.items():
        got = adapter.from_hf(name, {name: exported[name]})
        assert torch.equal(got, tensor[: got.shape[0]]), name
    hf_dir = tmp_path / "hf"
    argv = ["export", "--checkpoint", str(tmp_path / "il"), "--tag", "step00000002", "--out", str(hf_dir)]
    assert checkpoint_main([*argv, "--no-tokenizer"]) == 0  # the worker saves no tokenizer
    exported = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    held = {**torch.load(tmp_path / "params.rank0.pt"), **torch.load(tmp_path / "params.rank1.pt")}
    reference = GPT(GPTConfig.from_hf(exported.config)).eval()
    state = reference.state_dict()
    assert {k for k in held if k in state} == set(state), set(state) ^ set(held)
    reference.load_state_dict({k: held[k][: state[k].shape[0]] for k in state})  # the vocabulary padding stripped
    ids = torch.randint(0, exported.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (exported(ids).logits - reference(ids)).abs().max().item()
    assert diff <= 1e-5, diff  # transformers' GPT-2 and ours: fp32 rounding (tests/unit/test_hf_parity.py)


def test_dualpipev_checkpoints_resume_at_either_schedule_and_export(results):
    """A DualPipeV checkpoint resumes exactly at its own layout, resharded under 1F1B (and back) with the loss curve
    continuing within 1e-5, without resharding under dualpipev-zb (bit for bit), as a 1F1B one does under ZB-H1,
    and exports to transformers with the weights the ranks held; greedy decoding (the recipe's end-of-training
    sample) reads the logits on rank 0 and equals the single-device model's; bf16 + ZeRO-1
    (fp32 masters in DeepSpeed's BF16 optimizer) trains as under 1F1B, and with deferred weight gradients
    (``dualpipev-zb``) as DualPipeV, bit for bit."""
    from safetensors.torch import load_file

    from ds_megatron.checkpoint.export import export

    tmp_path = results / "checkpoint"  # the parity launch's "checkpoint" layout (tests/workers/schedule_checkpoint.py)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"losses.rank{rank}.json").read_text())
        a = r["A"]
        assert r["B"] == {k: a[k] for k in ("3", "4")}, r  # same schedule and layout: bit for bit
        assert not r["B_resharded"] and r["C_resharded"] and r["D_resharded"]
        # Another schedule that places the stages alike loads without resharding and continues as the saved one:
        # ZB-H1 from 1F1B's step 3 (C), dualpipev-zb from DualPipeV's step 2 (A, continued in B), bit for bit.
        assert not r["E_resharded"] and not r["F_resharded"], r
        assert r["E"]["4"] == r["C"]["4"], (r["E"], r["C"])  # ZB-H1 computes 1F1B's gradients bit for bit
        assert r["F"]["3"] == r["B"]["3"], (r["F"], r["B"])
        assert r["generate"]["pipeline"] == r["generate"]["reference"], r["generate"]
        bf16, bf16_dv, bf16_zb = r["bf16-1f1b"], r["bf16-dualpipev"], r["bf16-dualpipev-zb"]
        for step, loss in bf16["losses"].items():
            assert abs(bf16_dv["losses"][step] - loss) <= 1e-6 * abs(loss), (bf16, bf16_dv)
        assert abs(bf16_dv["norm"] - bf16["norm"]) <= 1e-5 * bf16["norm"], (bf16, bf16_dv)
        assert bf16_zb == bf16_dv, (bf16_zb, bf16_dv)  # W passes framed like backward passes: bit for bit
        for run, steps in (("C", ("3", "4")), ("D", ("4",))):
            for step in steps:
                assert abs(r[run][step] - a[step]) <= 1e-5 * abs(a[step]), (run, step, r[run], a)
    # Offline resharding writes each rank's optimizer state where the layout table puts its layers: the DualPipeV
    # checkpoint at tp 2 x pp 2 (still DualPipeV) and at pp 1 (1F1B) holds the same fp32 weights and Adam state.
    from ds_megatron.checkpoint.reshard import OldCheckpoint
    from ds_megatron.checkpoint.reshard_offline import reshard_checkpoint
    from ds_megatron.config.facts import saved_schedule

    src = OldCheckpoint(tmp_path / "dv", "step00000002")
    for tp, pp, schedule in ((2, 2, "dualpipev"), (1, 1, "1f1b")):
        new = tmp_path / f"dv-{tp}x{pp}"
        reshard_checkpoint(tmp_path / "dv", new, tp, pp, 1, progress=False)
        moved = OldCheckpoint(new, "step00000002")
        assert saved_schedule(moved.run.ds_config) == schedule
        for i, _ in src.layout.saved_layers():
            for key in src.layer_file(i, 0):
                name = src.layout.full_name(src.layout.local_name(i, key))
                assert torch.equal(src.full_weight(name), moved.full_weight(name)), name
                a, b = src.full_optimizer_state(name), moved.full_optimizer_state(name)
                assert all(torch.equal(a[k], b[k]) for k in a), name
    # the worker saves without a tokenizer (a run's saves hold one: test_checkpoint_tokenizer.py)
    out = export(tmp_path / "dv", tmp_path / "hf", tag="step00000002", progress=False, weights_only=True)
    exported = load_file(str(out / "model.safetensors"))
    held = {**torch.load(tmp_path / "params.rank0.pt"), **torch.load(tmp_path / "params.rank1.pt")}
    assert set(exported) == set(held)
    for name, tensor in held.items():
        got = src.adapter.from_hf(name, {name: exported[name]})  # our orientation (GPT-2's Conv1D transposed)
        assert torch.equal(got, tensor[: got.shape[0]]), name  # the export strips the vocabulary padding rows
        assert torch.count_nonzero(tensor[got.shape[0] :]) == 0, name
