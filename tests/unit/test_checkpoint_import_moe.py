"""Fast tier: ``python -m ds_megatron.checkpoint import`` of a mixture of experts' transformers directory
(``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``), in both layouts transformers 5.24's ``save_pretrained`` writes:
the published one (its default: one linear per expert, ``mlp.experts.<e>.gate_proj.weight`` or Mixtral's
``block_sparse_moe.experts.<e>.w1.weight``) and its fused tensors (``save_original_format=False``:
``mlp.experts.gate_up_proj`` [E, 2F, h], ``mlp.experts.down_proj`` [E, h, F]).  Each import at tp 1 and 2 (SP with
ep 2 at tp 2), pp 1 and 2, ep 1 and 2 writes a checkpoint that passes the ``--load`` checks, records its ep, and
exports back to the published layout bit for bit; the two layouts of one model import to the same files.  An ep the
folding cannot form is one line naming the valid values, before anything is written.  That ``--load`` trains from
these checkpoints as transformers computes: ``tests/launcher/test_moe_import_launch.py``."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint_import import TAG, _refused, import_argv, write_config

from ds_megatron.checkpoint.__main__ import main as checkpoint_main
from ds_megatron.checkpoint.layout import run_model_config
from ds_megatron.checkpoint.manifest import newest_complete_tag, tag_problem
from ds_megatron.config import resolve
from ds_megatron.config.facts import saved_world

MODELS = {
    # moe-tiny: 4 blocks of width 128, the first dense, 8 experts of width 64, top 2 renormalised
    "qwen3_moe": {"size": "moe-tiny"},
    # every block routed: 4 experts of width 32, top 2; GQA 4 heads / 2 KV heads of width 16
    "mixtral": {
        "family": "mixtral",
        "num_layers": 2,
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "intermediate_size": 32,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "experts_per_token": 2,
        "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    },
}
LAYOUTS = ("published", "fused")


def moe_run(family: str, dp: int, sequence_parallel: bool = True, bf16: bool = False) -> dict:
    """A run config of ``family``'s tiny model, 8 sequences a step in micro-batches of 2 over ``dp`` replicas."""
    model = {**MODELS[family], "vocab_size": 64, "seq_length": 16, "dropout": 0.0, "attention": "eager"}
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 8 // (2 * dp),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "ds_megatron": {"model": model, "parallel": {"tp": 1, "pp": 1, "sequence_parallel": sequence_parallel}},
    }
    if bf16:
        cfg.update(bf16={"enabled": True}, zero_optimization={"stage": 1}, data_types={"grad_accum_dtype": "fp32"})
    return cfg


def random_moe_hf(root: pathlib.Path, cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random transformers model of ``cfg``'s shape (every expert distinct, norms away from 1) saved twice under
    ``root``: ``published`` (``save_pretrained``'s default, in shards of at most 40 KB with their index, as the
    Hub's files are: one layer's experts spread over several files) and ``fused``; the model."""
    import transformers

    from ds_megatron.model import family_of

    config = run_model_config(resolve(cfg, saved_world(cfg)))
    torch.manual_seed(seed)
    model = getattr(transformers, family_of(config).hf_architecture)(config.to_hf())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = model.to(dtype).eval()
    model.save_pretrained(root / "published", max_shard_size="40KB")
    model.save_pretrained(root / "fused", save_original_format=False)
    return model


def stored_tensors(hf_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers directory, from its one file or from the shards its index names."""
    index = hf_dir / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(hf_dir / "model.safetensors")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return {k: v for f in files for k, v in load_file(hf_dir / f).items()}


def _expert_keys(stored: dict) -> tuple[list[str], list[str]]:
    """(one expert's linears, stacked expert tensors) among a file's names."""
    per_expert = [k for k in stored if ".experts." in k and k.split(".experts.")[1].split(".")[0].isdigit()]
    stacked = [k for k in stored if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    return per_expert, stacked


# (family, layout, tp, pp, ep, dp, bf16): each family and layout once, tp 1 and 2, pp 1 and 2, ep 1 and 2 among them
CASES = [
    ("qwen3_moe", "published", 2, 2, 2, 1, False),  # ep 2 folded over the tp ranks (SP)
    ("qwen3_moe", "fused", 1, 1, 2, 2, False),  # ep 2 over dp
    ("mixtral", "published", 1, 2, 2, 2, False),
    ("mixtral", "fused", 2, 1, 1, 2, True),  # bf16 on DeepSpeed's BF16 optimizer
]


@pytest.mark.parametrize(("family", "layout", "tp", "pp", "ep", "dp", "bf16"), CASES)
def test_moe_import_then_export_gives_back_the_published_tensors(
    tmp_path, capsys, family, layout, tp, pp, ep, dp, bf16
):
    cfg = moe_run(family, dp, bf16=bf16)
    random_moe_hf(tmp_path, cfg, dtype=torch.bfloat16 if bf16 else torch.float32)
    published = stored_tensors(tmp_path / "published")
    weight_map = json.loads((tmp_path / "published" / "model.safetensors.index.json").read_text())["weight_map"]
    files_per_layer: dict[str, set[str]] = {}
    for key, file in weight_map.items():
        if ".experts." in key:
            files_per_layer.setdefault(key.split(".experts.")[0], set()).add(file)
    assert max(len(files) for files in files_per_layer.values()) > 1  # a layer's experts in several shards
    per_expert, stacked = _expert_keys(stored_tensors(tmp_path / layout))
    # the layouts are what transformers 5 writes: one linear per expert by default, stacked tensors when asked
    assert (bool(per_expert), bool(stacked)) == ((True, False) if layout == "published" else (False, True))
    ck = tmp_path / "ck"
    argv = import_argv(tmp_path / layout, write_config(tmp_path / "run.json", cfg), ck, tp, pp)
    capsys.readouterr()  # what writing the model printed
    assert checkpoint_main([*argv, "--ep", str(ep)]) == 0
    with_ep = f" --ep {ep}" if ep > 1 else ""
    want = f"train from it with --load {ck} --tp {tp} --pp {pp}{with_ep} on {tp * pp * dp} processes"
    assert want in capsys.readouterr().out.strip().splitlines()[-1]
    assert newest_complete_tag(ck) == TAG and tag_problem(ck / TAG) is None
    saved = json.loads((ck / TAG / "config.json").read_text())
    parallel = saved["ds_megatron"]["parallel"]
    assert (parallel["tp"], parallel["pp"], parallel.get("ep", 1), saved_world(saved)) == (tp, pp, ep, tp * pp * dp)
    assert json.loads((ck / TAG / "imported.json").read_text())["model_type"] == family
    back = tmp_path / "back"
    dtype = ["--dtype", "bf16" if bf16 else "fp32"]
    assert checkpoint_main(["export", "--checkpoint", str(ck), "--out", str(back), "--no-tokenizer", *dtype]) == 0
    exported = stored_tensors(back)
    assert set(exported) == set(published)
    for name, tensor in published.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert json.loads((back / "config.json").read_text())["model_type"] == family


@pytest.mark.parametrize("family", list(MODELS))
def test_both_layouts_import_to_the_same_files_and_pass_the_load_checks(tmp_path, family):
    """tp 2 x pp 2 with ep 2 over the tp ranks: the published and the fused directory of one model give the same
    layer files, every expert's TP shard (gate rows then up rows of each), and ``--load``'s pre-flight checks accept
    the tag at that layout."""
    from ds_megatron.preflight import check_resume

    cfg = moe_run(family, dp=1)
    random_moe_hf(tmp_path, cfg)
    config = write_config(tmp_path / "run.json", cfg)
    for layout in LAYOUTS:
        argv = import_argv(tmp_path / layout, config, tmp_path / f"ck_{layout}", 2, 2)
        assert checkpoint_main([*argv, "--ep", "2"]) == 0, layout
    files = sorted(p.relative_to(tmp_path / "ck_published") for p in (tmp_path / "ck_published").rglob("layer_*.pt"))
    assert files == sorted(p.relative_to(tmp_path / "ck_fused") for p in (tmp_path / "ck_fused").rglob("layer_*.pt"))
    experts = 0
    for rel in files:
        a = torch.load(tmp_path / "ck_published" / rel, weights_only=True)
        b = torch.load(tmp_path / "ck_fused" / rel, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
        experts += sum(k.endswith("experts.gate_up_proj") for k in a)
    assert experts > 0
    cfg["ds_megatron"]["parallel"].update(tp=2, pp=2, ep=2)
    check_resume(resolve(cfg, 4), tmp_path / "ck_published")


EP = "error: ds_megatron.parallel.ep: "
FOLDING = EP + "ep must divide the ranks of a stage holding distinct tokens (tp x cp x dp under SP, cp x dp without)"


# (family, tp, ep, sequence_parallel, dp, the one line)
REFUSED = [
    # the folding: ep divides the ranks of a stage holding distinct tokens and the experts (mixtral has 4)
    ("mixtral", 1, 3, True, 4, FOLDING + " and num_experts (ep=3, tp=1, cp=1, dp=4, sequence_parallel=true, "
     "num_experts=4); use ep in [1, 2, 4]"),
    ("qwen3_moe", 1, 4, True, 2, FOLDING + " and num_experts (ep=4, tp=1, cp=1, dp=2, sequence_parallel=true, "
     "num_experts=8); use ep in [1, 2]"),
    ("mixtral", 2, 2, False, 1, EP + "an EP group spans ranks holding distinct tokens; without sequence "
     "parallelism tp ranks share theirs (ep=2, tp=2, cp=1, dp=1, sequence_parallel=false, num_experts=4); turn on "
     "sequence_parallel, or use ep in [1]"),
    ("dense", 1, 2, False, 2, EP + "expert parallelism splits routed experts, and this model has none"),
    ("qwen3_moe", 1, 0, True, 1, "error: --ep: must be a positive integer (got 0)"),
]  # fmt: skip


def test_an_ep_the_layout_cannot_form_is_one_line_before_anything(tmp_path, capsys):
    """Each of REFUSED, against one directory per family: exit 2, the one line, no output and no temporary
    directory left."""
    from test_checkpoint_import import gpt2_run, random_hf

    random_hf(tmp_path / "dense" / "published", gpt2_run())
    for family in MODELS:
        random_moe_hf(tmp_path / family, moe_run(family, dp=1))
    for family, tp, ep, sp, dp, expected in REFUSED:
        if family == "dense":
            cfg = gpt2_run()
        else:
            cfg = moe_run("qwen3_moe" if family == "bf16" else family, dp, sequence_parallel=sp, bf16=family == "bf16")
        cfg["gradient_accumulation_steps"] = 8 // (2 * dp)
        config = write_config(tmp_path / "run.json", cfg)
        hf = tmp_path / ("qwen3_moe" if family == "bf16" else family) / "published"
        argv = import_argv(hf, config, "unused", tp, 1)[:-2]
        _refused(tmp_path, capsys, [*argv, "--ep", str(ep)], expected)
