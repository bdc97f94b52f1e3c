"""The launcher tests of ``tests/unit/test_hf_interop.py``: that file's docstring states their subject."""

from __future__ import annotations

import json

import pytest
import torch
from launch import shared_launch
from safetensors.torch import load_file
from test_hf_interop import _random_hf
from transformers import GPT2LMHeadModel

from ds_megatron.checkpoint.__main__ import main as checkpoint_main


def _random_llama(path):
    """A random LlamaForCausalLM (GQA: 4 heads, 2 KV heads; untied) with non-trivial RMSNorm weights."""
    from transformers import LlamaForCausalLM

    from ds_megatron.model import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=1001,
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        max_position_embeddings=16,
        rope_theta=10000.0,
    ).to_hf()
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(path)
    return model


_ORIGINAL = {}


def _import_runs(out) -> list[str]:
    _ORIGINAL["gpt2"] = _random_hf(out / "hf")
    _random_llama(out / "hf_llama")
    return [f"hf_roundtrip.py --hf {out / 'hf'} --hf-llama {out / 'hf_llama'} --out {out}"]


# in the 4-process launch shared with other modules (launch.shared_launch)
LAUNCH = shared_launch(__name__, 4, _import_runs)


@pytest.fixture(scope="module")
def imported():
    """A random GPT-2 and a random Llama imported at tp 2 x pp 2 with SP (--init-from-hf) and saved as step-0
    DeepSpeed checkpoints (one run)."""
    out = LAUNCH()
    return _ORIGINAL["gpt2"], out


@pytest.mark.slow
def test_llama_import_at_tp2_pp2_sp_then_export_is_bitwise_identical(imported, tmp_path):
    from transformers import LlamaForCausalLM

    _, work = imported
    back = tmp_path / "back"  # the random Llama directory has no tokenizer files, so neither has its checkpoint
    assert (
        checkpoint_main(["export", "--checkpoint", str(work / "ck_llama"), "--out", str(back), "--no-tokenizer"]) == 0
    )
    back = load_file(tmp_path / "back" / "model.safetensors")
    original = load_file(work / "hf_llama" / "model.safetensors")
    assert set(back) == set(original) and "lm_head.weight" in back
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 1001, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = LlamaForCausalLM.from_pretrained(work / "hf_llama").eval()(ids).logits
        assert torch.equal(reloaded(ids).logits, ref)


@pytest.mark.slow
def test_load_of_an_offline_import_starts_training_from_its_weights(imported):
    """``python -m ds_megatron.checkpoint import`` of the same GPT-2, then --load in the launch: fp32 and bf16 at
    tp 2 x pp 2 and an import at tp 1 x pp 1 resharded on load all hold the --init-from-hf weights at step 0 (bf16:
    fp32 masters taken from them); the fp32 one trains a step."""
    _, work = imported
    for rank in range(4):
        loads = json.loads((work / f"import.rank{rank}.json").read_text())["loads"]
        assert set(loads) == {"fp32", "bf16", "resharded"}
        for name, rec in loads.items():
            assert rec["same_weights"] and rec["step"] == 0 and rec["global_steps"] == 0, (rank, name, rec)
        assert loads["bf16"]["masters_from_weights"], rank
        assert loads["fp32"]["loss_finite"] and loads["fp32"]["steps_after"] == 1, rank


@pytest.mark.slow
def test_import_at_tp2_pp2_then_export_is_bitwise_identical(imported, tmp_path):
    original, work = imported
    assert (
        checkpoint_main(["export", "--checkpoint", str(work / "ck"), "--out", str(tmp_path / "back"), "--no-tokenizer"])
        == 0
    )
    back = load_file(tmp_path / "back" / "model.safetensors")
    expected = {k: v for k, v in original.state_dict().items() if k != "lm_head.weight"}
    assert set(back) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 1001 and config["n_layer"] == 3
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "back").lm_head.weight.shape == (1001, 64)


@pytest.mark.slow
@pytest.mark.parametrize(("ck", "hf", "tp"), [("ck", "hf", 4), ("ck_llama", "hf_llama", 1)])
def test_offline_reshard_then_export_is_bitwise_identical(imported, tmp_path, monkeypatch, ck, hf, tp):
    """The step-0 checkpoints (tp 2 x pp 2) resharded offline to tp 4 (GPT-2: the vocabulary padded to another
    multiple) or tp 1 (Llama: GQA, untied lm_head) x pp 3, then exported: every tensor as imported.  A failure
    while writing leaves neither the output nor its temporary directory."""
    from ds_megatron.checkpoint import reshard_offline

    _, work = imported
    out = tmp_path / "resharded"
    argv = ["reshard", "--checkpoint", str(work / ck), "--tp", str(tp), "--pp", "3", "--dp", "1", "--out", str(out)]

    def crash(self):
        raise OSError("no space left on device")

    with monkeypatch.context() as m:
        m.setattr(reshard_offline._Writer, "_write_records", crash)
        with pytest.raises(OSError, match="no space left"):
            checkpoint_main(argv)
    assert list(tmp_path.iterdir()) == []
    assert checkpoint_main(argv) == 0
    saved = json.loads((out / "step00000000" / "config.json").read_text())["ds_megatron"]["parallel"]
    assert (saved["tp"], saved["pp"]) == (tp, 3)
    assert checkpoint_main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "back"), "--no-tokenizer"]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    original = load_file(work / hf / "model.safetensors")
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.slow
def test_export_shards_above_the_size_limit_and_runs_in_a_pipeline(imported, tmp_path):
    from transformers import pipeline

    original, work = imported
    out = tmp_path / "sharded"
    assert (
        checkpoint_main(
            [
                "export",
                "--checkpoint",
                str(work / "ck"),
                "--out",
                str(out),
                "--max-shard-size",
                "100KB",
                "--tokenizer",
                str(_byte_tokenizer(tmp_path)),
            ]
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = GPT2LMHeadModel.from_pretrained(out)
    for name, tensor in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    text = pipeline("text-generation", model=str(out))("hello", max_new_tokens=3, do_sample=False)
    assert text[0]["generated_text"].startswith("hello")


def _byte_tokenizer(tmp_path):
    """A real byte-level BPE tokenizer small enough for the 1001-token model."""
    from ds_megatron.data import build_tokenizer, load_documents

    ds = load_documents(None)
    tok, path = build_tokenizer("bpe:600", ds, "roundtrip", tmp_path / "tokcache")
    return path
