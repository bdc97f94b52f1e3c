"""Fast tier: ``python -m ds_megatron.checkpoint import`` writes a step-0 DeepSpeed checkpoint that passes the
``--load`` checks and that ``export`` turns back into the input tensors bit for bit (GPT-2 tied and Llama untied,
fp32 and bf16, a padded vocabulary, tp 2 x pp 2); bad input is one line (exit 2) and leaves nothing.  That ``--load``
trains from it is checked in test_hf_interop.py's launch (tests/workers/hf_roundtrip.py)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_model

from ds_megatron.checkpoint.__main__ import main as checkpoint_main
from ds_megatron.checkpoint.manifest import newest_complete_tag, tag_problem
from ds_megatron.config import ConfigError, resolve

VOCAB = 1001  # padded to 1024 at tp 2: the padding rows must not reach the export
TAG = "step00000000"


def gpt2_run(bf16: bool = False) -> dict:
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "ds_megatron": {
            "model": tiny_model(num_layers=3, vocab_size=VOCAB),
            "parallel": {"tp": 1, "pp": 1},
        },
    }
    if bf16:
        cfg.update(bf16={"enabled": True}, zero_optimization={"stage": 1}, data_types={"grad_accum_dtype": "fp32"})
    return cfg


def llama_run(bf16: bool = True) -> dict:
    cfg = gpt2_run(bf16)
    cfg["ds_megatron"]["model"].update(
        family="llama", num_kv_heads=2, intermediate_size=96, rope_theta=10000.0, tie_word_embeddings=False
    )
    return cfg


def write_config(path: pathlib.Path, cfg: dict) -> pathlib.Path:
    path.write_text(json.dumps(cfg))
    return path


def random_hf(path: pathlib.Path, cfg: dict, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """A random transformers model of ``cfg``'s shape saved to ``path`` in ``dtype``; its tensors."""
    import transformers

    from ds_megatron.checkpoint.layout import run_model_config

    config = run_model_config(resolve(cfg, 1))
    hf_config = config.to_hf()
    cls = transformers.LlamaForCausalLM if config.family == "llama" else transformers.GPT2LMHeadModel
    torch.manual_seed(seed)
    model = cls(hf_config)
    with torch.no_grad():  # non-trivial norms and biases too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.to(dtype).save_pretrained(path)
    return load_file(path / "model.safetensors")


def import_argv(hf, config, out, tp=2, pp=2) -> list[str]:
    return ["import", "--hf", str(hf), "--config", str(config), "--tp", str(tp), "--pp", str(pp), "--out", str(out)]


@pytest.mark.parametrize(
    ("family", "bf16", "tp", "pp"),
    [("gpt2", False, 2, 2), ("llama", True, 2, 2), ("gpt2", True, 1, 3), ("llama", False, 2, 1)],
)
def test_import_then_export_gives_back_every_tensor_bit_for_bit(tmp_path, family, bf16, tp, pp):
    cfg = gpt2_run(bf16) if family == "gpt2" else llama_run(bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    original = random_hf(tmp_path / "hf", cfg, dtype)
    config = write_config(tmp_path / "run.json", cfg)
    ck = tmp_path / "ck"
    assert checkpoint_main(import_argv(tmp_path / "hf", config, ck, tp, pp)) == 0
    # What --load checks before and in the launch: the newest complete tag, every file against its sha256.
    assert newest_complete_tag(ck) == TAG and (ck / "latest").read_text() == TAG
    assert tag_problem(ck / TAG) is None
    saved = json.loads((ck / TAG / "config.json").read_text())
    assert (saved["ds_megatron"]["parallel"]["tp"], saved["ds_megatron"]["parallel"]["pp"]) == (tp, pp)
    assert json.loads((ck / TAG / "manifest.json").read_text())["step"] == 0
    emb = torch.load(ck / TAG / f"layer_00-model_{tp - 1:02d}-model_states.pt", weights_only=True)
    (weight,) = emb.values()
    assert weight.dtype == dtype and weight.shape[0] == 1024 // tp  # the run's precision, the padded vocabulary
    assert not list(ck.glob(f"{TAG}/*optim_states.pt")), "an import writes no optimizer state"

    back = tmp_path / "back"
    export = ["export", "--checkpoint", str(ck), "--out", str(back), "--dtype", "bf16" if bf16 else "fp32"]
    export.append("--no-tokenizer")  # the random model has none (test_checkpoint_tokenizer.py: one that has)
    assert checkpoint_main(export) == 0
    exported = load_file(back / "model.safetensors")
    expected = {k: v for k, v in original.items() if not (family == "gpt2" and k == "lm_head.weight")}
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_an_imported_checkpoint_reshards_offline_and_stays_an_import(tmp_path):
    """Offline reshard of an import (tp 2 x pp 2 -> tp 1 x pp 3) keeps it weights-only (a --load of it starts the
    optimizer afresh) and every tensor as imported."""
    cfg = llama_run()
    original = random_hf(tmp_path / "hf", cfg, torch.bfloat16)
    assert checkpoint_main(import_argv(tmp_path / "hf", write_config(tmp_path / "run.json", cfg), tmp_path / "ck")) == 0
    argv = ["reshard", "--checkpoint", str(tmp_path / "ck"), "--tp", "1", "--pp", "3", "--dp", "1"]
    assert checkpoint_main(argv + ["--out", str(tmp_path / "re")]) == 0
    assert (tmp_path / "re" / TAG / "imported.json").is_file() and tag_problem(tmp_path / "re" / TAG) is None
    export = ["export", "--checkpoint", str(tmp_path / "re"), "--out", str(tmp_path / "back"), "--dtype", "bf16"]
    export.append("--no-tokenizer")
    assert checkpoint_main(export) == 0
    exported = load_file(tmp_path / "back" / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_the_launch_checks_of_load_pass_on_an_imported_checkpoint(tmp_path):
    """Pre-flight's --load checks (model shape, unlisted or unsafe files) accept the tag at the run's layout."""
    from ds_megatron.preflight import check_resume

    cfg = llama_run()
    random_hf(tmp_path / "hf", cfg)
    assert checkpoint_main(import_argv(tmp_path / "hf", write_config(tmp_path / "run.json", cfg), tmp_path / "ck")) == 0
    cfg["ds_megatron"]["parallel"].update(tp=2, pp=2)
    check_resume(resolve(cfg, 4), tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / TAG / "imported.json").read_text())["optimizer"] == "fresh"


def _refused(tmp_path, capsys, argv: list[str], expected: str) -> None:
    out = tmp_path / "out"
    capsys.readouterr()  # what building the input printed
    assert checkpoint_main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*")), "an error left files behind"


@pytest.fixture
def gpt2_dir(tmp_path):
    random_hf(tmp_path / "hf", gpt2_run())
    return tmp_path / "hf", write_config(tmp_path / "run.json", gpt2_run())


def _argv(hf, config, tp=2, pp=2) -> list[str]:
    return import_argv(hf, config, "unused", tp, pp)[:-2]


def test_refuses_a_shape_the_config_disagrees_with(tmp_path, capsys, gpt2_dir):
    hf, _ = gpt2_dir
    cfg = gpt2_run()
    cfg["ds_megatron"]["model"]["hidden_size"] = 128
    other = write_config(tmp_path / "other.json", cfg)
    _refused(
        tmp_path,
        capsys,
        _argv(hf, other),
        "error: --hf: shape differs from the run's (n_embd: 64 in hf, 128 in the config)",
    )


def test_refuses_a_tensor_the_config_disagrees_with(tmp_path, capsys, gpt2_dir):
    """config.json agrees, a tensor does not: refused from the file headers, before anything is written."""
    hf, config = gpt2_dir
    tensors = load_file(hf / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"][:, :200].contiguous()
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    expected = "transformer.h.1.mlp.c_fc.weight: F32 (200, 64), the config's model has (256, 64)"
    _refused(tmp_path, capsys, _argv(hf, config), expected)


def test_refuses_missing_and_extra_tensors(tmp_path, capsys, gpt2_dir):
    hf, config = gpt2_dir
    tensors = load_file(hf / "model.safetensors")
    wpe = tensors.pop("transformer.wpe.weight")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path, capsys, _argv(hf, config), "1 tensor(s) of the model missing (first transformer.wpe.weight)")
    save_file({**tensors, "transformer.wpe.weight": wpe, "extra.weight": torch.ones(3)}, hf / "model.safetensors")
    _refused(tmp_path, capsys, _argv(hf, config), "a tensor the model has no parameter for (it would be lost)")


def test_refuses_an_unknown_architecture_and_missing_files(tmp_path, capsys, gpt2_dir):
    hf, config = gpt2_dir
    _refused(tmp_path, capsys, _argv(tmp_path / "nowhere", config), "error: --hf: no such directory")
    _refused(tmp_path, capsys, _argv(hf, tmp_path / "none.json"), "error: --config: file not found")
    hf_cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**hf_cfg, "model_type": "bert"}))
    _refused(tmp_path, capsys, _argv(hf, config), "error: --hf: unsupported architecture (model_type='bert')")
    (hf / "config.json").write_text(json.dumps({**hf_cfg, "model_type": "llama"}))
    _refused(tmp_path, capsys, _argv(hf, config), "model type 'llama' is not the config's family (gpt2)")
    (hf / "config.json").write_text(json.dumps(hf_cfg))
    (hf / "model.safetensors").unlink()
    _refused(tmp_path, capsys, _argv(hf, config), "error: --hf: no model.safetensors")
    (hf / "config.json").unlink()
    _refused(tmp_path, capsys, _argv(hf, config), "error: --hf: no readable config.json")


@pytest.mark.parametrize(
    ("tp", "pp", "expected"),
    [
        (3, 1, "num_heads not divisible by tp (num_heads=4, tp=3)"),
        (1, 4, "fewer layers than pipeline stages (num_layers=3, pp=4)"),
        (0, 1, "--tp: must be a positive integer"),
    ],
)
def test_refuses_a_layout_the_model_cannot_take(tmp_path, capsys, gpt2_dir, tp, pp, expected):
    hf, config = gpt2_dir
    _refused(tmp_path, capsys, _argv(hf, config, tp, pp), expected)


def test_refuses_an_existing_output_and_an_fp16_run(tmp_path, capsys, gpt2_dir):
    hf, config = gpt2_dir
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    assert checkpoint_main(_argv(hf, config) + ["--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: --out: already exists")
    assert list((tmp_path / "out").iterdir()) == []
    (tmp_path / "out").rmdir()
    fp16 = write_config(tmp_path / "fp16.json", {**gpt2_run(), "fp16": {"enabled": True}})
    _refused(tmp_path, capsys, _argv(hf, fp16), "error: --config: import writes bf16 and fp32 runs")


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch, gpt2_dir):
    """Not the output, not its temporary directory, not the parents created for it (fileio.staged_directory,
    shared with export and reshard)."""
    from ds_megatron.checkpoint import reshard_offline

    hf, config = gpt2_dir

    def crash(self):
        raise OSError("no space left on device")

    monkeypatch.setattr(reshard_offline._Writer, "_write_records", crash)
    out = tmp_path / "new" / "deeper" / "ck"
    with pytest.raises(OSError, match="no space left"):
        checkpoint_main(_argv(hf, config) + ["--out", str(out)])
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_directories_follow_the_umask(tmp_path, gpt2_dir, umask):
    """import (and export and reshard, which share fileio.staged_directory) leave files and directories with the
    modes the umask gives, as training does: mkdtemp's 0700 and safetensors' 0600 would lock out a teammate or a
    serving account."""
    import os
    import stat

    from ds_megatron.fileio import staged_directory

    hf, config = gpt2_dir
    old = os.umask(umask)
    try:
        out = tmp_path / "ck"
        assert checkpoint_main(_argv(hf, config) + ["--out", str(out)]) == 0
        with staged_directory(tmp_path / "export", ".tmp-") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
    finally:
        os.umask(old)
    written = [out, *out.rglob("*"), tmp_path / "export", tmp_path / "export" / "model.safetensors"]
    modes = {str(p): stat.S_IMODE(p.stat().st_mode) for p in written}
    want = {str(p): (0o777 if p.is_dir() else 0o666) & ~umask for p in written}
    assert modes == want


@pytest.mark.parametrize("damage", ["header length 10^12", "header JSON overwritten", "cut short"])
def test_a_damaged_safetensors_file_is_one_line_naming_it_before_anything(tmp_path, capsys, gpt2_dir, damage):
    """import and --init-from-hf (its pre-flight, before any process group) read every safetensors header first:
    a damaged file is one line naming it, not a SafetensorError traceback from inside the run."""
    import struct

    from ds_megatron.config.facts import saved_world
    from ds_megatron.preflight import check_init_from_hf

    hf, config = gpt2_dir
    file = hf / "model.safetensors"
    raw = file.read_bytes()
    header = struct.unpack("<Q", raw[:8])[0]
    file.write_bytes(
        {
            "header length 10^12": struct.pack("<Q", 10**12) + raw[8:],
            "header JSON overwritten": raw[:8] + b"#" * header + raw[8 + header :],
            "cut short": raw[: len(raw) - 100],
        }[damage]
    )
    want = "not a readable safetensors file (damaged, cut short or another format) (" + str(file)
    _refused(tmp_path, capsys, _argv(hf, config), want)
    with pytest.raises(ConfigError) as err:
        cfg = json.loads(pathlib.Path(config).read_text())
        check_init_from_hf(resolve(cfg, saved_world(cfg)), hf)
    assert str(err.value).startswith(f"error: ds_megatron.checkpoint.init_from_hf: {want}: ")


def _hub_layouts(hf: pathlib.Path, tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    """The two other layouts GPT-2 files come in on the Hub, written from ``hf``'s tensors: the published GPT-2
    files (``GPT2Model`` names without ``transformer.``, no ``lm_head``, a causal-mask buffer per block) and the
    DialoGPT style (prefixed names, ``lm_head`` dropped, ``attn.bias`` and ``attn.masked_bias`` buffers)."""
    import shutil

    tensors = load_file(hf / "model.safetensors")
    blocks = sorted({k.split(".")[2] for k in tensors if k.startswith("transformer.h.")}, key=int)
    mask = torch.tril(torch.ones(16, 16, dtype=torch.uint8)).view(1, 1, 16, 16)
    hub = {k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"}
    hub |= {f"h.{i}.attn.bias": mask.clone() for i in blocks}
    dialo = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    dialo |= {
        f"transformer.h.{i}.attn.{b}": t
        for i in blocks
        for b, t in (("bias", mask.clone()), ("masked_bias", mask[0].clone()))
    }
    out = {}
    for name, stored in (("hub", hub), ("dialogpt", dialo)):
        out[name] = tmp_path / name
        shutil.copytree(hf, out[name])
        save_file(stored, str(out[name] / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_gpt2_files_in_the_hubs_own_layouts_import_as_transformers_loads_them(tmp_path, gpt2_dir):
    """Names mapped as transformers maps them on load (base-model prefix added, mask buffers ignored, the tied
    output layer taken from the embedding): both layouts import to the very files the canonical layout gives, and
    --init-from-hf's pre-flight accepts them (and still refuses a file missing a parameter, before launch)."""
    import transformers

    from ds_megatron.config.facts import saved_world
    from ds_megatron.preflight import check_init_from_hf

    hf, config = gpt2_dir
    layouts = _hub_layouts(hf, tmp_path)
    reference = transformers.GPT2LMHeadModel.from_pretrained(hf).eval()
    ids = torch.arange(12).view(2, 6)
    assert checkpoint_main(_argv(hf, config) + ["--out", str(tmp_path / "ck_ref")]) == 0
    cfg = json.loads(pathlib.Path(config).read_text())
    run = resolve(cfg, saved_world(cfg))
    for name, directory in layouts.items():
        loaded = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()  # the layouts are real ones
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=0)
        assert checkpoint_main(_argv(directory, config) + ["--out", str(tmp_path / f"ck_{name}")]) == 0, name
        ref_files = sorted((tmp_path / "ck_ref").rglob("layer_*.pt"))
        assert ref_files, "the import wrote no layer files"
        for ref in ref_files:
            ours = tmp_path / f"ck_{name}" / ref.relative_to(tmp_path / "ck_ref")
            a, b = torch.load(ref, weights_only=True), torch.load(ours, weights_only=True)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, ref.name)
        check_init_from_hf(run, directory)
    stored = load_file(layouts["hub"] / "model.safetensors")
    save_file({k: v for k, v in stored.items() if k != "ln_f.weight"}, str(layouts["hub"] / "model.safetensors"))
    with pytest.raises(ConfigError, match="init_from_hf: 1 tensor.s. of the model missing .first transformer.ln_f"):
        check_init_from_hf(run, layouts["hub"])
