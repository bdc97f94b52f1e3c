"""Training's side of the data: a prepared directory is read without tokenising (and checked against its manifest),
in-launch tokenisation waits on a file lock instead of a collective and refuses big corpora in pre-flight, and bad
data directories are one line and exit 2 before anything starts."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_prepare import make_tokenizer, run_prepare, write_corpus

from ds_megatron.config import ConfigError, resolve
from ds_megatron.data import MicroBatchStream, PackedSamples, corpus, split_train_valid
from ds_megatron.data import prepare as run_data
from ds_megatron.data.__main__ import main as data_main
from ds_megatron.data.prepared import ShardedTokens, open_prepared
from ds_megatron.preflight import check_data

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "ds_configs" / "gpt_tiny.json"


def run_config(tmp_path: Path, seq: int = 32, **data):
    cfg = json.loads(TINY.read_text())
    cfg["ds_megatron"]["parallel"] = {"tp": 1, "pp": 1}
    cfg["ds_megatron"]["model"]["seq_length"] = seq
    cfg["ds_megatron"]["data"] = {"cache_dir": str(tmp_path / "cache"), **data}
    return resolve(cfg, 1)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("prepared")
    tok = make_tokenizer(tmp / "tok")
    run_prepare(write_corpus(tmp / "corpus"), tok, tmp / "out", progress=False, valid_fraction=0.05)
    return tmp / "out"


def test_sharded_tokens_read_like_one_array():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 1000, n).astype(np.uint16) for n in (5, 1, 40, 17, 3)]
    flat, sharded = np.concatenate(arrays), ShardedTokens(arrays)
    assert len(sharded) == len(flat) and sharded[-1] == flat[-1] and sharded[6] == flat[6]
    for a, b in [(0, 66), (3, 9), (4, 47), (45, 46), (10, 10), (60, 200)]:
        assert np.array_equal(np.asarray(sharded[a:b]), flat[a:b])
    view = sharded[2:60][3:50]
    assert np.array_equal(np.asarray(view, dtype=np.int64), flat[2:60][3:50].astype(np.int64))
    train, valid = split_train_valid(sharded, 0.1)
    assert np.array_equal(np.asarray(valid), split_train_valid(flat, 0.1)[1])
    a, b = PackedSamples(train, 8, 1), PackedSamples(split_train_valid(flat, 0.1)[0], 8, 1)
    assert all(torch.equal(a[k], b[k]) for k in range(20))


def test_training_reads_a_prepared_directory_without_tokenizing(tmp_path, prepared, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenised in the launch")

    monkeypatch.setattr(run_data, "load_documents", refuse)
    monkeypatch.setattr(run_data, "pack", refuse)
    run = run_config(tmp_path, path=str(prepared), valid_fraction=0.3)
    check_data(run)
    data = run_data.prepare_data(run, 0, tmp_path / "run")
    out, err = capsys.readouterr()
    assert "data: prepared directory" in out
    assert err.splitlines() == [
        f"warning: ds_megatron.data.valid_fraction=0.3 is ignored: {prepared} was prepared with 0.05 (a prepared "
        "directory fixes its validation split; prepare again with --valid-fraction 0.3 to change it)"
    ]
    flat = np.asarray(open_prepared(prepared).tokens)
    cut = int(len(flat) * 0.95)  # the manifest's valid fraction, not the config's
    assert data.num_tokens == len(flat) and len(data.valid.tokens) == len(flat) - cut
    reference = PackedSamples(flat[:cut], 32, run.section.train.seed)
    assert all(torch.equal(data.train[k], reference[k]) for k in range(0, 400, 7))
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file() and len(data.tokenizer) == 300
    # Exact resume: the stream from step 3 is the uninterrupted stream's steps 3, 4, ...
    full = MicroBatchStream(data.train, 2, 2, 0, 1)
    seen = [next(full) for _ in range(10)]
    resumed = MicroBatchStream(data.train, 2, 2, 0, 1, start_step=3)
    assert all(torch.equal(next(resumed)[0], x) for x, _ in seen[6:])


def test_valid_fraction_warns_only_when_set_and_different(tmp_path, prepared, capsys):
    for fraction, rank in [(None, 0), (0.05, 0), (0.1, 1)]:  # the default; the prepared value; another rank
        data = {"valid_fraction": fraction} if fraction is not None else {}
        run_data.prepare_data(run_config(tmp_path, path=str(prepared), **data), rank)
        assert capsys.readouterr().err == "", fraction


def _copy(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "copy"))


def test_a_directory_that_does_not_match_its_manifest_is_refused(tmp_path, prepared):
    bad = _copy(prepared, tmp_path)
    with open(bad / "shard_00002.bin", "ab") as fh:
        fh.write(b"\0\0")
    with pytest.raises(ConfigError) as err:
        check_data(run_config(tmp_path, path=str(bad)))
    line = str(err.value)
    assert line.startswith("error: ds_megatron.data.path: the prepared directory does not match its manifest (")
    assert "shard_00002.bin has" in line and "rerun `python -m ds_megatron.data prepare" in line and "\n" not in line
    with pytest.raises(ConfigError, match="does not match its manifest"):
        run_data.prepare_data(run_config(tmp_path, path=str(bad)), 0)


def test_checksums_are_verified_on_request(tmp_path, prepared, monkeypatch):
    bad = _copy(prepared, tmp_path)
    with open(bad / "shard_00001.bin", "r+b") as fh:
        fh.write(b"\x07\x07")
    check_data(run_config(tmp_path, path=str(bad)))  # sizes match: cheap checks pass
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="shard_00001.bin fails its sha256"):
        check_data(run_config(tmp_path, path=str(bad), verify_checksums=True))


def test_incomplete_or_unusable_directories_are_refused(tmp_path, prepared):
    partial = _copy(prepared, tmp_path)
    manifest = json.loads((partial / "manifest.json").read_text())
    (partial / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    resumes = r"incomplete .*; rerun `python -m ds_megatron.data prepare .*` \(it resumes\)"
    with pytest.raises(ConfigError, match=resumes):
        check_data(run_config(tmp_path, path=str(partial)))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.md").write_text("nothing to train on")
    with pytest.raises(ConfigError, match="a directory with neither a prepared manifest nor text files"):
        check_data(run_config(tmp_path, path=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="tokenizer is larger than the model's vocabulary"):
        check_data(_small_vocab(prepared))
    with pytest.raises(ConfigError, match="too few tokens for one sample"):
        check_data(run_config(tmp_path, seq=8192, path=str(prepared)))


def _small_vocab(prepared: Path):
    cfg = json.loads(TINY.read_text())
    cfg["ds_megatron"]["parallel"] = {"tp": 1, "pp": 1}
    cfg["ds_megatron"]["model"].update(vocab_size=260, seq_length=32)
    cfg["ds_megatron"]["data"] = {"path": str(prepared), "tokenizer": "bpe:260"}
    return resolve(cfg, 1)


def test_big_text_is_refused_with_the_prepare_command_that_works(tmp_path, monkeypatch):
    data = write_corpus(tmp_path / "corpus", docs=12)
    tok = make_tokenizer(tmp_path / "tok")
    check_data(run_config(tmp_path, path=str(tmp_path / "corpus"), tokenizer=str(tok)))  # a directory of text: fine
    with pytest.raises(ConfigError) as err:
        check_data(run_config(tmp_path, path=data, tokenizer=str(tok), max_inlaunch_bytes=10_000))
    line = str(err.value)
    assert line.startswith("error: ds_megatron.data.path: too much text to tokenise inside the training launch (")
    assert "> data.max_inlaunch_bytes 0.00 GB" in line and "\n" not in line
    command = line.split("`")[1]
    out = line.rsplit("--data ", 1)[1]
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "ds_megatron.data", "prepare"]
    monkeypatch.chdir(tmp_path)
    assert data_main(argv[3:] + ["--no-progress"]) == 0
    check_data(run_config(tmp_path, path=out, max_inlaunch_bytes=10_000))


def test_in_launch_builders_wait_on_a_file_lock_not_a_collective(tmp_path, monkeypatch):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("some text " * 100)
    run = run_config(tmp_path, path=str(tmp_path / "c"))
    calls, results = [], []

    def slow_build(r):
        calls.append(threading.get_ident())
        time.sleep(0.3)
        cache = Path(r.section.data.cache_dir)
        tok = make_tokenizer(cache / "tok")
        ds = corpus.load_documents(r.section.data.path)
        from transformers import AutoTokenizer

        return str(corpus.pack(ds, AutoTokenizer.from_pretrained(tok), "k", cache)), str(tok)

    monkeypatch.setattr(run_data, "_build", slow_build)
    threads = [threading.Thread(target=lambda: results.append(run_data.build_in_launch(run))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 3 and len(set(results)) == 1
    assert (tmp_path / "cache" / ".lock").exists()


def test_pipeline_no_longer_uses_a_collective_for_data():
    source = Path(run_data.__file__).read_text()
    assert "broadcast" not in source and "torch.distributed" not in source and "dist." not in source


def recipe(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """The training recipe at world size 4, as pre-flight sees it (it exits before any process group)."""
    return subprocess.run(
        [sys.executable, "recipes/train_gpt.py", "--deepspeed_config", str(TINY), *args],
        cwd=ROOT,
        env={"WORLD_SIZE": "4", "PATH": "/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("case", ["neither", "mismatch", "weights"])
def test_recipe_refuses_bad_data_in_one_line(tmp_path, prepared, case):
    if case == "neither":
        (tmp_path / "nothing").mkdir()
        args, expected = ["--data", str(tmp_path / "nothing")], "a directory with neither a prepared manifest nor text"
    elif case == "mismatch":
        bad = _copy(prepared, tmp_path)
        (bad / "shard_00001.bin").write_bytes(b"short")
        args, expected = ["--data", str(bad)], "the prepared directory does not match its manifest"
    else:
        blend = json.dumps([[str(prepared), -0.5], [str(prepared), 1]])
        args, expected = ["--set", f"ds_megatron.data.blend={blend}"], "weights must be finite and >= 0"
    proc = recipe([*args, "--save", str(tmp_path / "save")])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    setting = "ds_megatron.data.blend" if case == "weights" else "ds_megatron.data.path"
    assert lines[0].startswith(f"error: {setting}: {expected}") and "Traceback" not in proc.stderr
    assert not (tmp_path / "save").exists()


def test_in_launch_path_builds_once_then_finds_the_cache(tmp_path, monkeypatch):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("a first document, " * 200)
    (tmp_path / "c" / "b.txt").write_text("and a second one. " * 200)
    tok = make_tokenizer(tmp_path / "tok")
    run = run_config(tmp_path, path=str(tmp_path / "c"), tokenizer=str(tok), valid_fraction=0.1)
    first = run_data.prepare_data(run, 0)
    monkeypatch.setattr(run_data, "_build", lambda r: (_ for _ in ()).throw(AssertionError("built twice")))
    second = run_data.prepare_data(run, 1)
    assert first.cache_file == second.cache_file and first.num_tokens == second.num_tokens > 1000
    assert torch.equal(first.train[5], second.train[5])


def test_a_data_problem_inside_the_launch_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    """``trainer.train`` turns a ConfigError of the data phase (found after pre-flight, e.g. a corpus without tokens)
    into EXIT_BAD_DATA and rank 0's one line; a ConfigError from building the engine is not a data problem and
    propagates."""
    from types import SimpleNamespace

    from ds_megatron import trainer

    run = run_config(tmp_path, path=str(tmp_path / "corpus.jsonl"))
    built = SimpleNamespace(topology=SimpleNamespace(rank=0))
    problem = ConfigError("ds_megatron.data.path", "the corpus has no tokens", "3 empty documents", "point it at text")

    def no_tokens(*args):
        raise problem

    monkeypatch.setattr(trainer, "init_distributed", lambda: None)  # no process group in this test
    monkeypatch.setattr(trainer, "stopped_in_start_up", lambda stop, phase: False)  # nor a stop to agree on
    monkeypatch.setattr(trainer, "build_engine", lambda run: built)
    monkeypatch.setattr(trainer, "prepare_data", no_tokens)
    monkeypatch.setattr(trainer, "run_dir_for", lambda run, name: tmp_path / "run")
    assert trainer.train(run) == trainer.EXIT_BAD_DATA == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: ds_megatron.data.path: the corpus has no tokens (3 empty documents); point it at text"
    ]

    def engine_fails(run):
        raise ConfigError("ds_megatron.checkpoint.load", "bad", "x", "y")

    monkeypatch.setattr(trainer, "build_engine", engine_fails)
    with pytest.raises(ConfigError, match="checkpoint.load"):
        trainer.train(run)
