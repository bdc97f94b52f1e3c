"""transformers -> ds_megatron (tp 2 x pp 2, --init-from-hf) -> DeepSpeed checkpoint -> export gives back
bitwise-identical tensors; bad input to export is one error line and writes nothing."""

from __future__ import annotations

import torch
from tiny import tiny_gpt
from transformers import GPT2LMHeadModel

from ds_megatron.checkpoint.__main__ import main as checkpoint_main


def _random_hf(path):
    cfg = tiny_gpt(vocab_size=1001, n_embd=64, n_layer=3).to_hf()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():  # non-trivial LayerNorms and biases too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(path)
    return model


def test_export_refuses_bad_input_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert checkpoint_main(["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --checkpoint: no such directory")
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    partial = tmp_path / "partial"
    (partial / "step00000001").mkdir(parents=True)
    (partial / "step00000001" / "config.json").write_text("{}")  # a save cut short before its manifest
    (partial / "latest").write_text("step00000001")
    assert checkpoint_main(["export", "--checkpoint", str(partial), "--out", str(out)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert checkpoint_main(["export", "--checkpoint", str(partial), "--tag", "step00000001", "--out", str(out)]) == 2
    assert "incomplete checkpoint" in capsys.readouterr().err
    # A tag that is not there is the --tag's fault, named with the complete tags there are (export and reshard alike)
    assert checkpoint_main(["export", "--checkpoint", str(partial), "--tag", "step00000099", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: --tag: no such tag (")
    assert not out.exists()


def test_init_from_hf_of_another_shape_or_architecture_is_refused_before_launch(tmp_path):
    import subprocess
    import sys

    from launch import ROOT

    _random_hf(tmp_path / "hf")  # vocab 1001, 3 layers: the tiny demo config has other shapes
    proc = subprocess.run(
        [
            sys.executable,
            "recipes/train_gpt.py",
            "--deepspeed_config",
            "ds_configs/gpt_tiny.json",
            "--init-from-hf",
            str(tmp_path / "hf"),
        ],
        cwd=ROOT,
        env={"WORLD_SIZE": "4", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ds_megatron.checkpoint.init_from_hf: shape differs"), lines
    for key in ("vocab_size: 1001", "n_layer: 3"):  # every differing key is named
        assert key in lines[0], lines


def test_init_from_hf_of_another_architecture_is_refused(tmp_path):
    from transformers import BertConfig

    from ds_megatron.checkpoint.hf_import import check_hf_config

    BertConfig(vocab_size=1001, hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    gpt = tiny_gpt(vocab_size=1001, n_embd=64, n_layer=3)
    try:
        check_hf_config(tmp_path, gpt)
    except ValueError as err:
        assert str(err).startswith("error: --init-from-hf: model type 'bert' is not the run's family (gpt2)")
    else:
        raise AssertionError("a BERT config was accepted")
