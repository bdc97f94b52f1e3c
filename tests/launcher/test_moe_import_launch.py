"""A mixture of experts' transformers directory imported offline (``python -m ds_megatron.checkpoint import``) trains
from ``--load`` as transformers computes, at the imported layout and at another ep (``workers/moe_import.py``, one
4-process launch shared with other modules, 6 engines).

The test process writes a random ``Qwen3MoeForCausalLM`` (moe-tiny: 4 blocks, the first dense, 8 experts, top 2)
and ``MixtralForCausalLM`` (2 blocks, 4 experts, top 2) in both layouts transformers 5 saves (one linear per
expert, in shards as on the Hub, and its fused expert tensors) and imports each once: Qwen3-MoE published at tp 2 x
pp 2 with SP and ep 2 over the tp ranks, Qwen3-MoE fused at tp 1 x pp 2 x dp 2 at ep 1, Mixtral published at tp 1 x
dp 4 with ep 2, Mixtral fused at tp 2 with SP x dp 2 with ep 2.  The launch loads each at its imported layout, and
the two Qwen3-MoE imports also at the other ep (ep 2 -> 1 and 1 -> 2), and trains 2 fp32 steps of 8 sequences."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from launch import shared_launch
from test_checkpoint_import_moe import moe_run, random_moe_hf

from ds_megatron.checkpoint.__main__ import main as checkpoint_main

WORLD = 4
# name: (family, layout the directory is in, tp, pp, ep imported at)
IMPORTS = {
    "qwen3_published": ("qwen3_moe", "published", 2, 2, 2),
    "qwen3_fused": ("qwen3_moe", "fused", 1, 2, 1),
    "mixtral_published": ("mixtral", "published", 1, 1, 2),
    "mixtral_fused": ("mixtral", "fused", 2, 1, 2),
}
# case: (import, ep loaded at); the rest of the layout is the imported one
CASES = {
    "qwen3_published": ("qwen3_published", 2),
    "qwen3_published-at-ep1": ("qwen3_published", 1),
    "qwen3_fused": ("qwen3_fused", 1),
    "qwen3_fused-at-ep2": ("qwen3_fused", 2),
    "mixtral_published": ("mixtral_published", 2),
    "mixtral_fused": ("mixtral_fused", 2),
}
# fp32 against transformers' eager model: the same math in another order (the grouped GEMM, the vocabulary-parallel
# cross entropy, sums over the TP ranks and the data axis).  Measured at most: the loss and its LM part 1.1e-7
# relative (the load-balancing part equal), the logits 6.9e-7 apart; one routed block's experts rolled by one place
# move transformers' logits by 0.06 (Mixtral) and 0.14 (Qwen3-MoE).
RTOL = 1e-5
LOGITS_ATOL = 1e-5


def _run_config(family: str, tp: int, pp: int, ep: int) -> dict:
    cfg = moe_run(family, dp=WORLD // (tp * pp), sequence_parallel=tp > 1)
    cfg["ds_megatron"]["parallel"].update(tp=tp, pp=pp, ep=ep)
    cfg["ds_megatron"]["train"] = {"seed": 1234}
    return cfg


def _plan(out: pathlib.Path) -> list[str]:
    """The transformers directories, the four imports (the command, in this process), the launch's cases."""
    for family, seed in (("qwen3_moe", 1), ("mixtral", 2)):
        random_moe_hf(out / family, moe_run(family, dp=1), seed=seed)
    for name, (family, layout, tp, pp, ep) in IMPORTS.items():
        config = out / f"{name}.json"
        config.write_text(json.dumps(_run_config(family, tp, pp, ep)))
        argv = ["import", "--hf", str(out / family / layout), "--config", str(config), "--out", str(out / name)]
        assert checkpoint_main([*argv, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]) == 0, name
    plan = []
    for case, (name, ep) in CASES.items():
        family, _, tp, pp, _ = IMPORTS[name]
        cfg = _run_config(family, tp, pp, ep)
        cfg["ds_megatron"]["checkpoint"] = {"load": str(out / name)}
        plan.append({"name": case, "config": cfg})
    (out / "plan.json").write_text(json.dumps(plan))
    return [f"moe_import.py --out {out} --plan {out / 'plan.json'}"]


LAUNCH = shared_launch(__name__, WORLD, _plan)


@pytest.fixture(scope="module")
def launched():
    out = LAUNCH()
    return out, {case: torch.load(out / f"{case}.pt") for case in CASES}


def _transformers_step(hf_dir: pathlib.Path, tokens: torch.Tensor, micro: int = 2) -> dict:
    """transformers' forward on one step's tokens [B, s + 1], micro-batch by micro-batch as the pipeline takes them
    (each with its own routing statistics): the mean of the LM loss, of the load-balancing loss and of the training
    loss (LM + router_aux_loss_coef x load balancing), and the first micro-batch's logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    lm, aux, first = [], [], None
    with torch.no_grad():
        for mb in tokens.split(micro):
            out = model(input_ids=mb[:, :-1], output_router_logits=True)
            first = out.logits if first is None else first
            lm.append(F.cross_entropy(out.logits.flatten(0, 1), mb[:, 1:].flatten()))
            aux.append(out.aux_loss)
    lm_loss, aux_loss = torch.stack(lm).mean(), torch.stack(aux).mean()
    loss = lm_loss + model.config.router_aux_loss_coef * aux_loss
    return {"loss": float(loss), "lm_loss": float(lm_loss), "aux_loss": float(aux_loss), "logits": first}


def _close(got: float, want: float, what) -> None:
    assert abs(got - want) <= RTOL * abs(want), (what, got, want)


@pytest.mark.slow  # in the shared 4-process launch
def test_an_imported_moe_checkpoint_starts_from_transformers_forward(launched):
    """At every imported layout (tp 1/2, pp 1/2, ep 1/2, both families, both expert layouts), the first step's
    loss, its LM and load-balancing parts and the first micro-batch's logits equal transformers' forward on the
    same tokens; every rank logs the same loss, and the second step trains on (another loss, finite)."""
    out, results = launched
    for case, (name, _) in CASES.items():
        family, *_ = IMPORTS[name]
        got = results[case]
        assert got["client_step"] == 0 and got["layout"][:2] == IMPORTS[name][2:4], case
        want = _transformers_step(out / family / "published", got["tokens"][0])
        first, second = got["steps"]
        assert len({r["loss"] for r in first}) == 1 and len({r["loss"] for r in second}) == 1, (case, got["steps"])
        for key in ("loss", "lm_loss", "aux_loss"):
            _close(first[0][key], want[key], (case, key))
        (logits,) = got["logits"]
        torch.testing.assert_close(logits, want["logits"], rtol=0, atol=LOGITS_ATOL, msg=lambda m, c=case: f"{c}: {m}")
        assert torch.isfinite(torch.tensor(second[0]["loss"])) and second[0]["loss"] != first[0]["loss"], case


@pytest.mark.slow  # the same launch
def test_an_imported_checkpoint_trains_alike_at_ep_1_and_2(launched):
    """The ep 2 import loaded at ep 1 (DeepSpeed's own load of the files) and the ep 1 import loaded at ep 2 (each
    rank cutting its experts out of them) log the losses of the same import at its own ep, step for step (measured:
    1.1e-7 relative at most, equal in 11 of the 12 values)."""
    _, results = launched
    for case, other in (("qwen3_published-at-ep1", "qwen3_published"), ("qwen3_fused-at-ep2", "qwen3_fused")):
        assert (results[case]["ep"], results[other]["ep"]) == (CASES[case][1], CASES[other][1])
        for step, (got, want) in enumerate(zip(results[case]["steps"], results[other]["steps"], strict=True), 1):
            for key in ("loss", "lm_loss", "aux_loss"):
                _close(got[0][key], want[0][key], (case, step, key))
