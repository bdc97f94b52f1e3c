"""The tuner's selective-recompute modules (core_attn, mlp_act, layernorm): the sets it searches per kernel, their
memory (memory.py's formula) and time (memory-bound elementwise passes), the pins, the report and the written config.
Fast, in-process."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds_megatron.config import resolve
from ds_megatron.memory import activation_bytes_per_layer
from ds_megatron.tune import Candidate, Pins, build_cluster, build_model_shape, search, step_time
from ds_megatron.tune.__main__ import main
from ds_megatron.tune.core.memory_model import attention_dropout, layer_activation_bytes
from ds_megatron.tune.training.probe import run_slug
from ds_megatron.tune.training.search import evaluate
from ds_megatron.tune.training.space import SELECTIVE_MODULES
from ds_megatron.tune.training.time_model import stage_times

GPT_13B = build_model_shape("gpt3-13b", None, None, None, None, 2048)
LLAMA_8B = build_model_shape("llama3-8b", None, None, None, None, None)
H100_64 = build_cluster("h100-sxm", 64, 8)


def _cand(kernel: str, modules: tuple[str, ...], sp: bool = True, policy: str = "selective") -> Candidate:
    return Candidate(4, 4, 4, sp, 2, 64, policy, attention=kernel, recompute_modules=modules)


def test_labels_settings_and_run_directories():
    plain = _cand("eager", ())
    assert plain.recompute_modules == ("core_attn",) and plain.recompute_label() == "selective"
    assert plain == _cand("eager", ("core_attn",))  # the default spelled out is the same candidate
    both = _cand("sdpa", ("layernorm", "mlp_act"))  # any order: stored in RECOMPUTE_MODULES order
    assert both.recompute_modules == ("mlp_act", "layernorm")
    assert both.recompute_label() == "selective[mlp_act,layernorm]"
    assert both.settings()["recompute_modules"] == ["mlp_act", "layernorm"]
    full = dataclasses.replace(both, recompute="full")  # the modules belong to selective only
    assert full.recompute_modules == () and full.settings()["recompute_modules"] is None
    e = evaluate(GPT_13B, H100_64, both, 512)
    assert run_slug(3, e) == "03-tp4-pp4-dp4-sp-b2-selective-mlp_act-layernorm-sdpa"


@pytest.mark.parametrize("model", [GPT_13B, LLAMA_8B], ids=["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_each_module_set_stores_what_memory_py_counts(model, sp):
    s, b, h, t = model.seq_length, 2, model.hidden_size, 4
    ffn = model.intermediate_size
    for kernel, sets in SELECTIVE_MODULES.items():
        for modules in sets:
            cand = _cand(kernel, modules, sp)
            expected = activation_bytes_per_layer(
                s,
                b,
                h,
                model.num_heads,
                t,
                sp,
                "selective",
                attention=kernel,
                family=model.family,
                num_kv_heads=model.num_kv_heads,
                intermediate_size=ffn,
                attention_dropout=attention_dropout(model),
                modules=modules,
            )
            assert layer_activation_bytes(model, cand, "selective") == expected, (kernel, modules)
    # What each module drops, from the tensors themselves: the activation output (F per token, 2 bytes, TP-split)
    # and the two norm outputs (2 h per token, 2 bytes, SP-split).
    none = layer_activation_bytes(model, _cand("sdpa", (), sp, "none"), "none")
    mlp = layer_activation_bytes(model, _cand("sdpa", ("mlp_act",), sp), "selective")
    norms = layer_activation_bytes(model, _cand("sdpa", ("layernorm",), sp), "selective")
    both = layer_activation_bytes(model, _cand("sdpa", ("mlp_act", "layernorm"), sp), "selective")
    assert none - mlp == pytest.approx(s * b * ffn * 2 / t)
    assert none - norms == pytest.approx(s * b * 2 * h * 2 / (t if sp else 1))
    assert none - both == pytest.approx((none - mlp) + (none - norms))


@pytest.mark.parametrize("model,act_bytes", [(GPT_13B, 2 + 2), (LLAMA_8B, 2 * 2 + 2)], ids=["gelu", "swiglu"])
def test_elementwise_recompute_costs_its_bytes_at_the_memory_bandwidth(model, act_bytes):
    s, b, h, t, n = model.seq_length, 2, model.hidden_size, 4, -(-model.num_layers // 4)
    bandwidth = H100_64.memory_gbps * 1e9
    mlp = s * b * model.intermediate_size / t * act_bytes  # GELU: in + out; SwiGLU: gate + up in, out
    for sp in (False, True):
        norms = 2 * s * b / (t if sp else 1) * h * (2 + 2)  # two norms: input in, output out
        for modules, moved in ((("mlp_act",), mlp), (("layernorm",), norms), (("mlp_act", "layernorm"), mlp + norms)):
            first, _ = stage_times(model, H100_64, _cand("sdpa", modules, sp))
            assert first.recompute_passes_s == pytest.approx(n * moved / bandwidth)
    # Against no recompute: only those passes are added (no matmul runs again, so HFU = MFU); core_attn alone re-runs
    # the attention core's matmuls and no elementwise pass.
    none = step_time(model, H100_64, _cand("sdpa", (), True, "none"), 512)
    both = step_time(model, H100_64, _cand("sdpa", ("mlp_act", "layernorm")), 512)
    assert both.step_s == pytest.approx(none.step_s + both.recompute_passes_s) and both.hfu == pytest.approx(both.mfu)
    core = step_time(model, H100_64, _cand("eager", ("core_attn",)), 512)
    plain = step_time(model, H100_64, _cand("eager", (), True, "none"), 512)
    assert core.recompute_passes_s == 0.0 and core.compute_s > plain.compute_s and core.hfu > core.mfu


MEMORY_BOUND = ["--model", "gpt3-1.3b", "--global-batch-size", "512", "--gpus", "8", "--gpu-memory-gb", "28"]
MEMORY_BOUND += ["--tp", "1", "--pp", "1", "--micro-batch-size", "4"]


def test_short_of_memory_sdpa_recomputes_norms_and_activation_instead_of_whole_blocks(tmp_path, capsys):
    """GPT-3 1.3B, one GPU per replica, b 4, 28 GiB: sdpa without recompute needs 31.5 GiB, so the tuner must
    recompute something; the norm and activation outputs cost one elementwise pass each, full recompute whole
    forwards."""
    path = tmp_path / "winner.json"
    assert main([*MEMORY_BOUND, "--top", "3", "--write-config", str(path)]) == 0
    out = capsys.readouterr().out
    cfg = json.loads(path.read_text())
    run = resolve(cfg, 8)
    assert (run.model.attention, run.section.recompute.policy) == ("sdpa", "selective")
    assert run.section.recompute.modules == ("mlp_act", "layernorm")
    assert cfg["ds_megatron"]["recompute"]["modules"] == ["mlp_act", "layernorm"]
    assert "recompute selective[mlp_act,layernorm], attention sdpa" in out  # the winner
    assert "(which differs in: recompute selective[mlp_act,layernorm] instead of full/block/" in out
    assert "recomputed elementwise passes 0.0758 vs 0.0000" in out  # what it costs, against full's extra compute
    assert "no candidate without recompute fits: the closest, tp 1, pp 1, dp 8, b 4, sdpa attention, needs 31.5" in out
    header = next(line for line in out.splitlines() if line.startswith("rank"))
    row = next(line for line in out.splitlines() if "selective[mlp_act,layernorm]" in line and line.strip()[0] == "1")
    end = header.index("zero") + len("zero")  # right-aligned: the winner's ZeRO stage ends where the header does
    assert row[end - 3 : end + 1] == "  1 ", "the recompute column is widened to its longest label"


def test_pins_on_the_modules(capsys):
    cluster = build_cluster("a100-80gb", 64, 8)
    sdpa = search(GPT_13B, cluster, 1024, Pins(recompute="selective", attention="sdpa"))
    assert {e.candidate.recompute_modules for e in sdpa.evaluations} == set(SELECTIVE_MODULES["sdpa"])
    pinned = search(GPT_13B, cluster, 1024, Pins(recompute_modules=("layernorm", "mlp_act")))
    labels = {(e.candidate.attention, e.candidate.recompute_label()) for e in pinned.evaluations}
    assert labels == {(k, "selective[mlp_act,layernorm]") for k in ("eager", "sdpa")}
    args = ["--model", "gpt3-13b", "--global-batch-size", "1024", "--gpus", "64", "--top", "1"]
    assert main([*args, "--recompute-modules", "layernorm,mlp_act"]) == 0
    assert "recompute selective[mlp_act,layernorm]" in capsys.readouterr().out
    for extra, expected in (
        (["--recompute-modules", "mlp_ack"], "error: --recompute-modules: unknown module 'mlp_ack' ('mlp_act'?)"),
        (["--recompute-modules", "mlp_act,mlp_act"], "error: --recompute-modules: a module named twice"),
        (["--recompute-modules", ","], "error: --recompute-modules: no module"),
        (["--recompute", "full", "--recompute-modules", "mlp_act"], "error: --recompute-modules: applies to selective"),
        (["--recompute-modules", "mlp_act,moe"], "error: --recompute-modules: moe applies to routed experts only"),
    ):
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expected), err
