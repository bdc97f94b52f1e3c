"""A shipped config in miniature: the same code paths on 2-4 CPU processes in seconds.

``miniature(path)`` keeps everything that selects code (precision, ZeRO stage, gradient accumulation dtype,
optimizer, scheduler type and ratios, clipping, SP, recompute policy, attention kernel, dropout, pipeline on or off)
and shrinks what only sets sizes: a few layers (two per pipeline stage; an uneven ``pipeline_layout`` stays uneven),
width 64, 4 heads, sequence 64, a 1,024-token BPE vocabulary, micro-batch 2 with 2 accumulation steps, schedule
steps scaled to a 3-step run;
``model.compile`` turned off (compile time, not a code path the miniature would check); a mixture of experts keeps
its family and top 2 of 4 experts of width 32 (the first layer dense in the Qwen3-MoE layout).
tp/pp/dp are adapted to 4 processes: pp = min(pp, 2), cp = min(cp, 2) (a context-parallel config keeps cp > 1),
tp = min(tp, 4 // (pp cp)), and dp fills the 4 (at least 2 where that fits, so ZeRO-1 really partitions the
optimizer state): every miniature runs at 4 processes, so all of them share one launch.  An expert-parallel config
(ep > 1) keeps ep > 1: the largest ep up to its own that the miniature's layout and 4 experts admit
(``config.ep_rules.valid_ep_values``).

Configs whose miniatures differ only in numbers that select no code (learning rate, betas, schedule lengths, seed)
share one run: ``code_path_key`` says which.  A config added to ds_configs/ is covered without writing a test.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ds_megatron.config import sizes
from ds_megatron.config.ep_rules import valid_ep_values

MAX_PROCS = 4
VOCAB = 1024
MINI_STEPS = 3  # train 2, save, resume for 1
MINI_EXPERTS = 4  # a mixture of experts' experts in miniature


def adapted_layout(tp: int, pp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(tp, pp, cp, dp) of the miniature."""
    pp2 = min(pp, 2)
    cp2 = min(cp, 2)
    tp2 = min(tp, MAX_PROCS // (pp2 * cp2))
    dp2 = MAX_PROCS // (tp2 * pp2 * cp2)
    return tp2, pp2, cp2, dp2


def miniature_layout(layout: list[int], pp: int, mini_pp: int) -> list[int]:
    """An uneven ``pipeline_layout`` for the miniature's 2 blocks per pipeline rank: as many stages per rank as the
    config's, balanced, then one block moved off the lighter end stage onto the other end, as the config's end
    stages differ (the uneven path stays the code path; the counts are the miniature's)."""
    stages = len(layout) // pp * mini_pp
    blocks = 2 * mini_pp
    mini = [blocks // stages + (1 if i < blocks % stages else 0) for i in range(stages)]
    if layout[-1] < layout[0] and mini[-1] > 1:
        mini[-1], mini[0] = mini[-1] - 1, mini[0] + 1
    elif layout[0] < layout[-1] and mini[0] > 1:
        mini[0], mini[-1] = mini[0] - 1, mini[-1] + 1
    return mini


def miniature(path: Path) -> tuple[dict, int]:
    """(the miniature DeepSpeed config, its number of processes)."""
    cfg = copy.deepcopy(json.loads(Path(path).read_text()))
    sec = cfg.setdefault("ds_megatron", {})
    par = sec.setdefault("parallel", {})
    tp, pp, cp, dp = adapted_layout(par.get("tp", 1), par.get("pp", 1), par.get("cp", 1))
    if par.get("pipeline_layout"):
        par["pipeline_layout"] = miniature_layout(par["pipeline_layout"], par.get("pp", 1), pp)
    par.update(tp=tp, pp=pp, **({"cp": cp} if cp > 1 else {}))
    if par.get("ep", 1) > 1:
        sp = par.get("sequence_parallel", False)
        par["ep"] = max(e for e in valid_ep_values(tp, cp, dp, sp, MINI_EXPERTS) if e <= par["ep"])
    model = sec.setdefault("model", {})
    named = sizes.named(model.pop("size", None) or "")
    model.pop("max_position_embeddings", None)
    model.update(num_layers=2 * pp, hidden_size=64, num_heads=4, seq_length=64, vocab_size=VOCAB)
    family = model.get("family") or (named.family if named else "gpt2")
    if family == "llama":  # the family and its code-selecting choices (tying, rope scaling) stay; widths shrink
        model.update(family="llama", num_kv_heads=max(2, tp), intermediate_size=176)
        for key in ("tie_word_embeddings", "rope_theta", "rope_scaling"):
            value = getattr(named, key, None) if named else None
            if key not in model and value is not None:
                model[key] = dict(value) if key == "rope_scaling" else value
        if "rope_scaling" in model:  # scaling over an original context longer than the miniature's sequence
            model["rope_scaling"]["original_max_position_embeddings"] = 32
    if family in ("qwen3_moe", "mixtral"):  # a mixture of experts: its family and routing, fewer and narrower experts
        model.update(family=family, num_kv_heads=max(2, tp), intermediate_size=176, rope_theta=10000.0)
        model.update(num_experts=MINI_EXPERTS, experts_per_token=2, moe_intermediate_size=32)
        if family == "qwen3_moe":  # the first layer dense, as moe-tiny's
            model.update(mlp_only_layers=[0])
    # compiling costs each process tens of seconds on a shared CPU, more than a 3-step miniature runs; what compile
    # changes (the block's elementwise kernels) is checked against eager by tests/unit/test_compile.py
    model["compile"] = False
    rc = sec.setdefault("recompute", {})
    if rc.get("policy") == "full":
        rc["num_layers"] = min(rc.get("num_layers", 1), 2)
    micro, gas = 2, 2
    cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas, train_batch_size=micro * gas * dp)
    sched = (cfg.get("scheduler") or {}).get("params")
    if sched is not None:  # warm up over 2 steps, decay over the next 2: the 3 steps see both
        sched.update(warmup_num_steps=2, total_num_steps=4)
    sec["train"] = {**sec.get("train", {}), "train_iters": MINI_STEPS, "eval_interval": 0, "eval_iters": 1}
    sec["train"].update(log_interval=1, generate_tokens=0)
    sec["data"] = {**sec.get("data", {}), "path": None, "tokenizer": f"bpe:{VOCAB}", "num_proc": 1}
    sec["logging"] = {"wandb_project": None}
    sec["checkpoint"] = {"save_interval": 2}
    return cfg, tp * pp * cp * dp


# Keys that hold numbers only (no code path depends on them): two miniatures equal but for these run once.
_NUMBERS_ONLY = (("optimizer", "params"), ("scheduler", "params"), ("ds_megatron", "train", "seed"))


def code_path_key(cfg: dict) -> str:
    key = copy.deepcopy(cfg)
    for path in _NUMBERS_ONLY:
        node = key
        for part in path[:-1]:
            node = node.get(part, {})
        node.pop(path[-1], None)
    return json.dumps(key, sort_keys=True)
