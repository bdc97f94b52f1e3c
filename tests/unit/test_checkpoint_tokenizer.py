"""Fast tier: the tokenizer a checkpoint's weights were trained with travels with the tag (``checkpoint/tokenizer.py``).

Every writer of a tag puts it there, listed in the manifest (a training save, ``import`` from a transformers
directory that has one, ``reshard``); every reader checks it: ``export`` ships the tag's own whatever the working
directory and whatever other runs of the config wrote since, refuses a ``--tokenizer`` that is another tokenizer and
a tag without one (unless told); a run that ``--load``s a tag or starts ``--init-from-hf`` refuses another tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from test_checkpoint_import import gpt2_run, import_argv, random_hf, write_config

from ds_megatron.checkpoint.__main__ import main as checkpoint_main
from ds_megatron.checkpoint.manifest import manifest_records, tag_problem
from ds_megatron.checkpoint.tokenizer import check_run_tokenizer, difference, load_tokenizer
from ds_megatron.config import ConfigError
from ds_megatron.data.corpus import train_bpe_from_texts

TAG = "step00000000"
# Two corpora that train different byte-level BPEs of the same size (as two runs of one config on other data).
PROSE = ["the quick brown fox jumps over the lazy dog and then the dog sleeps"] * 40
CODE = ["def f(x): return x * 2 + 1  # a function that returns a number"] * 40


def bpe(path: Path, texts: list[str], size: int = 280):
    return train_bpe_from_texts(iter(texts), size, path)


@pytest.fixture
def imported(tmp_path):
    """A transformers directory with tokenizer A imported to a tp 2 x pp 2 checkpoint; tokenizer B trained apart."""
    hf = tmp_path / "hf"
    random_hf(hf, gpt2_run())
    bpe(tmp_path / "tok_a", PROSE).save_pretrained(hf)
    bpe(tmp_path / "tok_b", CODE)
    ck = tmp_path / "ck"
    assert checkpoint_main(import_argv(hf, write_config(tmp_path / "run.json", gpt2_run()), ck)) == 0
    return ck


def _same(a, b) -> bool:
    return difference(load_tokenizer(a, "test"), load_tokenizer(b, "test")) is None


def test_the_two_test_tokenizers_differ(tmp_path):
    a, b = bpe(tmp_path / "a", PROSE), bpe(tmp_path / "b", CODE)
    assert len(a) == len(b) == 280
    assert difference(a, b).endswith("vocabulary entries differ") and difference(a, a) is None


def test_import_carries_the_hf_tokenizer_listed_in_the_manifest(imported, tmp_path):
    listed = manifest_records(imported / TAG)
    assert "tokenizer/tokenizer.json" in listed and "tokenizer/tokenizer_config.json" in listed
    assert _same(imported / TAG / "tokenizer", tmp_path / "tok_a")
    assert tag_problem(imported / TAG) is None


def test_export_ships_the_tags_own_tokenizer_from_any_directory_after_other_runs(imported, tmp_path, monkeypatch):
    """Another run of the config then wrote its tokenizer where export used to look (beside the tags, in a shared
    run directory); export runs from another working directory: the tag's own tokenizer ships, with BOS/EOS."""
    for shared in (imported / "tokenizer", tmp_path / "runs" / "run" / "tokenizer"):
        load_tokenizer(tmp_path / "tok_b", "test").save_pretrained(shared)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "hf_out"
    assert checkpoint_main(["export", "--checkpoint", str(imported), "--out", str(out)]) == 0
    assert _same(out, tmp_path / "tok_a")
    eos = load_tokenizer(tmp_path / "tok_a", "test").eos_token_id
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == eos is not None


def test_reshard_keeps_the_tags_tokenizer(imported, tmp_path):
    re = tmp_path / "re"
    argv = ["reshard", "--checkpoint", str(imported), "--tp", "1", "--pp", "1", "--dp", "1", "--out", str(re)]
    assert checkpoint_main(argv) == 0
    assert "tokenizer/tokenizer.json" in manifest_records(re / TAG) and tag_problem(re / TAG) is None
    assert _same(re / TAG / "tokenizer", tmp_path / "tok_a")


def _one_error(capsys, argv: list[str], expected: str, out: Path) -> str:
    capsys.readouterr()
    assert checkpoint_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not out.exists()
    return err[0]


def test_export_refuses_another_tokenizer_and_a_tag_without_one(imported, tmp_path, capsys):
    out = tmp_path / "hf_out"
    export = ["export", "--checkpoint", str(imported), "--out", str(out)]
    _one_error(capsys, [*export, "--tokenizer", str(tmp_path / "tok_b")], "vocabulary entries differ", out)
    assert checkpoint_main([*export, "--tokenizer", str(tmp_path / "tok_a")]) == 0  # the same one is accepted

    bare = tmp_path / "bare"  # an import of weights alone: no tokenizer in the tag
    random_hf(tmp_path / "hf_bare", gpt2_run())
    assert checkpoint_main(import_argv(tmp_path / "hf_bare", tmp_path / "run.json", bare)) == 0
    out2 = tmp_path / "hf_out2"
    export = ["export", "--checkpoint", str(bare), "--out", str(out2)]
    line = _one_error(capsys, export, "--tokenizer: the checkpoint holds no tokenizer", out2)
    assert "pass --tokenizer DIR" in line
    assert checkpoint_main([*export, "--no-tokenizer"]) == 0
    assert not (out2 / "tokenizer.json").exists()


def test_a_changed_or_added_tokenizer_file_is_refused_like_a_weight(imported, tmp_path, capsys):
    tok = imported / TAG / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"the"', '"teh"', 1))
    out = tmp_path / "hf_out"
    _one_error(capsys, ["export", "--checkpoint", str(imported), "--out", str(out)], "tokenizer/tokenizer.json", out)


def test_import_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path, capsys):
    hf = tmp_path / "hf"
    random_hf(hf, gpt2_run())
    bpe(tmp_path / "big", PROSE + CODE + [" ".join(str(i) for i in range(3000))] * 3, size=1200).save_pretrained(hf)
    out = tmp_path / "ck"
    _one_error(capsys, import_argv(hf, write_config(tmp_path / "run.json", gpt2_run()), out), "--hf: tokenizer", out)


def _run(load=None, init=None):
    return SimpleNamespace(section=SimpleNamespace(checkpoint=SimpleNamespace(load=load, init_from_hf=init)))


def test_a_run_refuses_another_tokenizer_than_its_weights(imported, tmp_path):
    """--load of a tag (and --init-from-hf of a directory) with a tokenizer: the run's must be that one."""
    a, b = load_tokenizer(tmp_path / "tok_a", "test"), load_tokenizer(tmp_path / "tok_b", "test")
    check_run_tokenizer(_run(load=str(imported)), a, TAG)
    with pytest.raises(ConfigError, match=r"data.tokenizer: not the tokenizer .* was trained with \(\d+ of 280"):
        check_run_tokenizer(_run(load=str(imported)), b, TAG)
    check_run_tokenizer(_run(init=str(tmp_path / "hf")), a, None)
    with pytest.raises(ConfigError, match="--tokenizer .*hf"):
        check_run_tokenizer(_run(init=str(tmp_path / "hf")), b, None)
    check_run_tokenizer(_run(init=str(tmp_path / "hf_none")), b, None)  # a directory without one: nothing to check


class _Engine:
    """What ``save_run`` asks of DeepSpeed's engine: its files in the tag."""

    def save_checkpoint(self, root, tag, client_state, save_latest):
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"module": None, **client_state}, Path(root) / tag / "mp_rank_00_model_states.pt")


def test_every_training_save_puts_the_runs_tokenizer_in_the_tag(tmp_path):
    from ds_megatron.checkpoint.run_state import save_run
    from ds_megatron.random import RNGTracker

    a = bpe(tmp_path / "tok_a", PROSE)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for step in (1, 2):  # a second save rewrites the tokenizer of a tag of that name from the run's own
            tag = save_run(_Engine(), tmp_path / "ck", step, {"step": step}, RNGTracker(), tokenizer=a)
    finally:
        dist.destroy_process_group()
    listed = manifest_records(tmp_path / "ck" / tag)
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= set(listed)
    assert tag_problem(tmp_path / "ck" / tag) is None
    assert _same(tmp_path / "ck" / tag / "tokenizer", tmp_path / "tok_a")
