"""The token cache is reused, the resume position is exact, both token dtypes work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ds_megatron.config import ConfigError
from ds_megatron.data import (
    MicroBatchStream,
    PackedSamples,
    build_tokenizer,
    builtin_documents,
    fingerprint_documents,
    load_documents,
    open_packed,
    pack,
)


class StubTokenizer:
    """Whitespace 'tokenizer' with a configurable vocabulary size (to exercise uint32 files)."""

    def __init__(self, size: int):
        self.size, self.eos_token_id = size, size - 1

    def __len__(self):
        return self.size

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[(len(w) * 7919 + i) % (self.size - 1) for i, w in enumerate(t.split())] for t in texts]}


def test_builtin_corpus_is_real_text():
    docs = builtin_documents()
    assert len(docs) > 50 and sum(map(len, docs)) > 400_000
    assert "statement" in " ".join(docs[:20])


@pytest.mark.parametrize("vocab,dtype", [(1000, "uint16"), (70000, "uint32")])
def test_pack_dtype_eos_and_cache_reuse(tmp_path, vocab, dtype):
    ds = load_documents(None)
    tok = StubTokenizer(vocab)
    path = pack(ds, tok, "k", tmp_path)
    packed = open_packed(path)
    assert packed.manifest["dtype"] == dtype and packed.tokens.dtype == np.dtype(dtype)
    assert int((np.asarray(packed.tokens) == tok.eos_token_id).sum()) >= len(ds)  # an EOS after every document
    mtime = path.stat().st_mtime_ns
    assert pack(ds, tok, "k", tmp_path) == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_corrupt_cache_is_detected_and_rebuilt(tmp_path):
    ds = load_documents(None)
    tok = StubTokenizer(1000)
    path = pack(ds, tok, "k", tmp_path)
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xff")
    with pytest.raises(ConfigError) as err:
        open_packed(path)
    assert str(err.value) == (
        f"error: ds_megatron.data.cache_dir: the token cache fails its checksum ({path}: sha256 differs from the "
        f"manifest); delete {path} and its manifest to build it again"
    )
    pack(ds, tok, "k", tmp_path)
    open_packed(path)


def test_local_files_and_bpe_tokenizer(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i}. " + "the quick brown fox jumps. " * 50)
    ds = load_documents(str(tmp_path / "*.txt"))
    assert len(ds) == 3
    tok, tok_dir = build_tokenizer("bpe:300", ds, fingerprint_documents(ds, str(tmp_path / "*.txt")), tmp_path / "c")
    assert len(tok) <= 300 and tok.eos_token == "<|endoftext|>"
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"body": "hello there"}\n{"body": "general kenobi"}\n')
    assert load_documents(str(jsonl), text_field="body")["text"] == ["hello there", "general kenobi"]
    with pytest.raises(ConfigError) as err:
        load_documents(str(jsonl), text_field="text")
    assert str(err.value) == "error: ds_megatron.data.text_field: no column 'text' (['body']); set data.text_field"
    with pytest.raises(ConfigError) as err:
        load_documents(str(tmp_path / "missing*.txt"))
    missing = tmp_path / "missing*.txt"
    assert str(err.value) == f"error: ds_megatron.data.path: no file matches ({missing}); check the path or glob"


def test_resume_position_is_exact():
    tokens = torch.arange(10_000)
    samples = PackedSamples(tokens, 16, seed=3)
    full = MicroBatchStream(samples, 2, 3, dp_rank=1, dp_size=2)
    seen = [next(full) for _ in range(3 * 5)]  # 5 steps of 3 micro-batches
    resumed = MicroBatchStream(samples, 2, 3, dp_rank=1, dp_size=2, start_step=3)
    for expected in seen[9:]:
        got = next(resumed)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_samples_cover_each_epoch_once_and_dp_ranks_are_disjoint():
    tokens = torch.arange(1 + 16 * 50)
    samples = PackedSamples(tokens, 16, seed=0)
    starts = sorted(int(samples[k][0]) for k in range(50))
    assert starts == list(range(0, 800, 16))
    a = MicroBatchStream(samples, 2, 1, 0, 2)
    b = MicroBatchStream(samples, 2, 1, 1, 2)
    ids_a = {int(x) for _ in range(5) for x in next(a)[0][:, 0]}
    ids_b = {int(x) for _ in range(5) for x in next(b)[0][:, 0]}
    assert not ids_a & ids_b


def test_a_directory_stands_for_the_text_files_under_it(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "notes.md").write_text("not a corpus file")
    assert load_documents(str(tmp_path))["text"] == ["first", "second", "third"]


def test_utf8_check_names_the_first_bad_byte_across_read_blocks(tmp_path, monkeypatch):
    """Read a block at a time: a character cut by a block's end is carried over, and the offset is the file's."""
    from ds_megatron.data import sources

    text = "na\u00efve caf\u00e9 \u20ac \U0001f600 " * 40  # 2-, 3- and 4-byte characters at every block offset
    good = tmp_path / "good.txt"
    good.write_bytes(text.encode())
    for block in (1, 2, 3, 5, 7, 1 << 24):
        monkeypatch.setattr(sources, "UTF8_BLOCK", block)
        sources.check_utf8_file(str(good), "ds_megatron.data.path")
        for bad, offset in ((text.encode() + b"\xff tail", len(text.encode())), (b"abc\xe2\x82", 3)):
            (tmp_path / "bad.txt").write_bytes(bad)
            with pytest.raises(ConfigError) as err:
                sources.check_utf8_file(str(tmp_path / "bad.txt"), "ds_megatron.data.path")
            assert str(err.value).startswith(
                f"error: ds_megatron.data.path: not UTF-8 text ({tmp_path / 'bad.txt'} at byte {offset}: "
            ), (block, err.value)


def test_launch_text_is_checked_once_per_node_and_not_when_its_cache_is_built(tmp_path, monkeypatch):
    """Pre-flight reads text for its encoding on a node's first process only, and not at all when the launch will
    not read it (a packed cache built from these very files); that is what bounds the second read."""
    import json

    from ds_megatron.config import resolve
    from ds_megatron.data.corpus import launch_record
    from ds_megatron.preflight import check_data

    (tmp_path / "a.txt").write_bytes(b"fine text \xe9")
    cfg = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / "gpt_tiny.json").read_text())
    cfg["ds_megatron"]["parallel"] = {"tp": 1, "pp": 1}
    cfg["ds_megatron"]["data"] = {"path": str(tmp_path / "a.txt"), "cache_dir": str(tmp_path / "cache")}
    run = resolve(cfg, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="not UTF-8 text .*a.txt at byte 10: "):
        check_data(run)
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_data(run)
    monkeypatch.setenv("LOCAL_RANK", "0")
    launch_record(run).parent.mkdir(parents=True)
    launch_record(run).write_text("{}")
    check_data(run)
