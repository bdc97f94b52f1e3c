"""Every shipped config as a user runs it, in miniature (``miniature.py``: same precision, ZeRO stage, optimizer,
scheduler, SP, recompute, attention kernel and dropout; tiny shapes, 2-4 processes).  Per miniature, two launches of
the recipe: 3 straight steps saving at steps 2 and 3, then a resume from step 2 for one step.  Checked: the resumed
step equals the straight run's bit for bit (loss, gradient norm, learning rate, validation loss), each step's
logged learning rate is the published schedule's, and the checkpoint exports (from the fp32 masters when it has
them) to a model transformers loads."""

from __future__ import annotations

import json
import math

from launch import ROOT
from miniature import code_path_key, miniature

from ds_megatron.config.schedule import WarmupCosine, warmup_cosine_from

CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))
GROUPS: dict[str, list] = {}
for _path in CONFIGS:
    GROUPS.setdefault(code_path_key(miniature(_path)[0]), []).append(_path)


def test_every_shipped_config_is_covered_by_a_miniature():
    covered = {p for paths in GROUPS.values() for p in paths}
    assert covered == set(CONFIGS) and len(CONFIGS) >= 9
    # the miniatures keep what selects code paths
    for path in CONFIGS:
        shipped, (mini, nprocs) = json.loads(path.read_text()), miniature(path)
        assert 2 <= nprocs <= 4
        for key in ("bf16", "fp16", "zero_optimization", "data_types", "optimizer", "gradient_clipping"):
            assert mini.get(key) == shipped.get(key), (path.name, key)
        s, m = shipped["ds_megatron"], mini["ds_megatron"]
        assert m["recompute"].get("policy") == s.get("recompute", {}).get("policy")
        for key in ("dropout", "attention"):
            assert m["model"].get(key) == s["model"].get(key)
        sp = s.get("parallel", {}).get("sequence_parallel", False)
        assert m["parallel"].get("sequence_parallel", False) == sp and (not sp or m["parallel"]["tp"] > 1)
        assert (m["parallel"]["pp"] > 1) == (s.get("parallel", {}).get("pp", 1) > 1)
        assert (m["parallel"].get("ep", 1) > 1) == (s.get("parallel", {}).get("ep", 1) > 1)  # expert parallelism kept
        assert mini["scheduler"]["type"] == shipped["scheduler"]["type"]


def test_a_miniature_keeps_expert_parallelism(tmp_path):
    """A config at ep > 1 keeps EP in miniature, at the largest ep its layout forms: moe_tiny on bf16 + ZeRO-1 at
    ep 8 (tp 2 x pp 2 with SP: the miniature's EP group can span its 2 tp ranks) runs at ep 2 and resolves; by hand
    (2026-12-02, CPU, 4 processes) that miniature's straight run and its resume from step 2 logged the same step-3
    loss, grad norm, learning rate and validation loss, bit for bit, and its step-3 export loaded in transformers."""
    from ds_megatron.config import resolve

    cfg = json.loads((ROOT / "ds_configs" / "moe_tiny.json").read_text())
    cfg.update(bf16={"enabled": True}, zero_optimization={"stage": 1}, data_types={"grad_accum_dtype": "fp32"})
    cfg["ds_megatron"]["parallel"]["ep"] = 8
    (tmp_path / "moe_tiny_ep.json").write_text(json.dumps(cfg))
    mini, nprocs = miniature(tmp_path / "moe_tiny_ep.json")
    assert mini["ds_megatron"]["parallel"]["ep"] == 2 and nprocs == 4
    assert resolve(mini, nprocs).section.parallel.ep == 2


def test_published_schedule_of_a_shipped_config():
    """gpt3_125m: linear warm-up over 715 steps from a non-zero first step, cosine to 10% at 260B tokens."""
    cfg = json.loads((ROOT / "ds_configs" / "gpt3_125m.json").read_text())
    s = warmup_cosine_from(cfg)
    assert s == WarmupCosine(715, 495911, 0.0, 0.1)
    assert s.ratio(1) == 1 / 715 and s.ratio(2) == 2 / 715 and s.ratio(715) == 1.0
    assert math.isclose(s.ratio(716), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / (495911 - 715))))
    mid = 715 + (495911 - 715) // 2
    assert math.isclose(s.ratio(mid), 0.55, abs_tol=1e-5)
    assert math.isclose(s.ratio(495911), 0.1) and math.isclose(s.ratio(572205), 0.1)  # floor to the end of training
    tokens = cfg["train_batch_size"] * 2048
    assert abs(cfg["scheduler"]["params"]["total_num_steps"] * tokens - 260e9) / 260e9 < 1e-3
