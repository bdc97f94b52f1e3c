"""Megatron-LM / GPT-NeoX indexed datasets (PREFIX.bin + PREFIX.idx) read in place: the tokens read back as
written, every malformed pair is one line naming the file, the ids are checked against ``--tokenizer`` before
anything starts, and training cuts the stream, blends it and resumes it exactly as it does a prepared directory."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_prepare import make_tokenizer, run_prepare, write_corpus
from test_data_training import TINY, recipe

from ds_megatron.config import ConfigError, resolve
from ds_megatron.data import MicroBatchStream, PackedSamples, split_train_valid
from ds_megatron.data import megatron_indexed as mi
from ds_megatron.data.megatron_indexed import megatron_prefix, open_indexed, scan_ids
from ds_megatron.data.prepare import prepare_data
from ds_megatron.data.prepared import open_prepared
from ds_megatron.preflight import check_data, check_run

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}


def write_indexed(prefix: Path, docs: list[list[np.ndarray]], dtype: str = "uint16", code: int | None = None) -> Path:
    """The .bin/.idx pair of ``docs`` (each a list of sequences), written from the format's description alone."""
    sequences = [np.asarray(s, dtype=dtype) for doc in docs for s in doc]
    lengths = np.array([len(s) for s in sequences], dtype="<i4")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64) * itemsize))).astype("<i8")
    doc_index = np.concatenate(([0], np.cumsum([len(doc) for doc in docs]))).astype("<i8")
    Path(f"{prefix}.bin").write_bytes(
        b"".join(s.astype(np.dtype(dtype).newbyteorder("<")).tobytes() for s in sequences)
    )
    header = mi.MAGIC + struct.pack("<QBQQ", 1, CODES[dtype] if code is None else code, len(lengths), len(doc_index))
    Path(f"{prefix}.idx").write_bytes(header + lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())
    return prefix


def random_docs(seed: int, num_docs: int = 40, high: int = 300) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, high, rng.integers(1, 60)) for _ in range(rng.integers(1, 4))] for _ in range(num_docs)]


def flat(docs: list[list[np.ndarray]]) -> np.ndarray:
    return np.concatenate([s for doc in docs for s in doc]).astype(np.int64)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("megatron_tok") / "bpe300")


def run_config(tmp_path: Path, seq: int = 16, **data):
    cfg = json.loads(TINY.read_text())
    cfg["ds_megatron"]["parallel"] = {"tp": 1, "pp": 1}
    cfg["ds_megatron"]["model"]["seq_length"] = seq
    cfg["ds_megatron"]["data"] = {"cache_dir": str(tmp_path / "cache"), **data}
    return resolve(cfg, 1)


@pytest.mark.parametrize("dtype", ["uint16", "int32", "int64", "uint8"])
def test_tokens_read_back_as_written_without_a_copy(tmp_path, dtype):
    docs = random_docs(1, high=250 if dtype == "uint8" else 60_000)
    ds = open_indexed(str(write_indexed(tmp_path / "corpus", docs, dtype)))
    assert ds.dtype == np.dtype(dtype) and isinstance(ds.tokens, np.memmap) and str(ds.tokens.filename).endswith(".bin")
    assert np.array_equal(np.asarray(ds.tokens, dtype=np.int64), flat(docs))
    assert ds.num_docs == 40 and ds.num_sequences == sum(len(d) for d in docs)
    assert all(np.array_equal(ds.document(j), np.concatenate(doc)) for j, doc in enumerate(docs))
    sequences = [s for doc in docs for s in doc]
    assert all(np.array_equal(ds.sequence(i), s) for i, s in enumerate(sequences))
    assert scan_ids(ds.tokens) == (int(flat(docs).max()), None)


def test_the_id_scan_spans_chunks_and_finds_negative_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(mi, "SCAN_BYTES", 64)  # 16 int32 ids per chunk
    docs = random_docs(2)
    docs[-1][-1][-1] = 5000  # the largest id, in the last chunk
    ds = open_indexed(str(write_indexed(tmp_path / "a", docs, "int32")))
    assert scan_ids(ds.tokens, threads=3) == (5000, None)
    docs[7][0][0] = -3  # signed ids read as unsigned: one pass finds it
    ds = open_indexed(str(write_indexed(tmp_path / "b", docs, "int32")))
    assert scan_ids(ds.tokens, threads=2) == (5000, -3)


def _damage(prefix: Path, case: str) -> str:
    """Spoil a good pair one way; returns the file the refusal must name."""
    idx, binf = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    raw = bytearray(idx.read_bytes())
    n = struct.unpack_from("<Q", raw, 18)[0]
    if case == "magic":
        raw[:9] = b"TNTIDX\x00\x00\x00"
    elif case == "version":
        struct.pack_into("<Q", raw, 9, 2)
    elif case == "float":
        raw[17] = 7
    elif case == "unknown dtype":
        raw[17] = 9
    elif case == "truncated idx":
        raw = raw[:-8]
    elif case == "short header":
        raw = raw[:20]
    elif case == "pointer":
        struct.pack_into("<q", raw, mi.HEADER.size + 4 * n + 8 * 5, 10**9)
    elif case == "negative length":
        struct.pack_into("<i", raw, mi.HEADER.size + 4 * 3, -1)
    elif case == "doc index":
        struct.pack_into("<q", raw, mi.HEADER.size + 12 * n + 8 * 4, n + 5)
    elif case == "truncated bin":
        binf.write_bytes(binf.read_bytes()[:-2])
        return str(binf)
    elif case == "longer bin":
        binf.write_bytes(binf.read_bytes() + b"\0\0")
        return str(binf)
    elif case == "missing bin":
        binf.unlink()
        return str(binf)
    idx.write_bytes(bytes(raw))
    return str(idx)


@pytest.mark.parametrize(
    "case,problem",
    [
        ("magic", "not a Megatron indexed dataset index (wrong magic) (starts with b'TNTIDX"),
        ("version", "unsupported index version (version 2, this reader knows 1)"),
        ("float", "token ids stored as floating point (dtype code 7 (float32))"),
        ("unknown dtype", "unknown token dtype code (code 9, known 1-8)"),
        ("truncated idx", "truncated index ("),
        ("short header", "truncated index header (20 bytes"),
        (
            "pointer",
            "sequence byte offsets out of range (not the running sum of lengths x itemsize from 0) "
            "(sequence 5: offset 1000000000, expected",
        ),
        ("negative length", "a negative sequence length (sequence 3: -1)"),
        ("doc index", "the document index goes back (document 4 starts at sequence"),
        ("truncated bin", "truncated token file ("),
        ("longer bin", "token file longer than its index describes ("),
        ("missing bin", "missing half of a Megatron indexed dataset (corpus.idx exists, corpus.bin does not)"),
    ],
)
def test_a_malformed_pair_is_one_line_naming_the_file(tmp_path, monkeypatch, case, problem):
    monkeypatch.setattr(mi, "CHECK_ENTRIES", 4)  # the index is checked in chunks: a fault past the first is found
    prefix = write_indexed(tmp_path / "corpus", random_docs(3), "uint16")
    open_indexed(str(prefix))  # whole, it passes in chunks too
    where = _damage(prefix, case)
    with pytest.raises(ConfigError) as err:
        open_indexed(str(prefix))
    line = str(err.value)
    assert line.startswith(f"error: {where}: {problem}") and "; " in line and "\n" not in line, line


def test_a_file_of_the_pair_is_not_its_prefix(tmp_path):
    prefix = write_indexed(tmp_path / "corpus", random_docs(3))
    assert megatron_prefix(str(prefix)) == str(prefix) and megatron_prefix(str(tmp_path / "other")) is None
    with pytest.raises(ConfigError, match=rf"named by its prefix.*; pass {prefix} \(it reads"):
        megatron_prefix(f"{prefix}.bin")


def test_preflight_checks_the_tokenizer_against_the_ids(tmp_path, tok, monkeypatch):
    prefix = str(write_indexed(tmp_path / "corpus", random_docs(4, num_docs=80, high=300)))
    with pytest.raises(ConfigError, match="^error: ds_megatron.data.tokenizer: Megatron indexed data carries no "):
        check_data(run_config(tmp_path, path=prefix))
    with pytest.raises(ConfigError, match="carries no tokenizer.*data.tokenizer='bpe:512'.*pass --tokenizer DIR"):
        check_data(run_config(tmp_path, path=prefix, tokenizer="bpe:512"))
    readonly = tmp_path / "readonly"
    readonly.write_text("")  # a file where the cache directory should be: the record cannot be written
    check_run(run_config(tmp_path, path=prefix, tokenizer=str(tok), cache_dir=str(readonly)))
    scans = []
    monkeypatch.setattr(mi, "scan_ids", lambda tokens: scans.append(1) or scan_ids(tokens))
    check_run(run_config(tmp_path, path=prefix, tokenizer=str(tok)))  # 300 tokens, ids below 300
    check_run(run_config(tmp_path, path=prefix, tokenizer=str(tok)))  # recorded for the unchanged pair
    assert scans == [1]

    docs = random_docs(4, num_docs=80, high=300)
    docs[10][0][0] = 300  # one id past the tokenizer
    write_indexed(tmp_path / "corpus", docs)  # rewritten: a new size/time, scanned again
    with pytest.raises(ConfigError) as err:
        check_data(run_config(tmp_path, path=prefix, tokenizer=str(tok)))
    assert str(err.value) == (
        "error: ds_megatron.data.tokenizer: the tokenizer is smaller than the largest token id in the data "
        f"(300 tokens in {tok}, id 300 in {prefix}.bin); pass the tokenizer the data was tokenised with"
    )
    assert scans == [1, 1]
    monkeypatch.setenv("LOCAL_RANK", "1")  # one process per node scans
    check_data(run_config(tmp_path, path=prefix, tokenizer=str(tok)))
    with pytest.raises(ConfigError, match="too few tokens for one sample of seq_length"):
        check_data(run_config(tmp_path, seq=1024, path=prefix, tokenizer=str(tok)))
    with pytest.raises(ConfigError, match="^error: ds_megatron.data.hf_config: a configuration name needs a Hug"):
        check_data(run_config(tmp_path, path=prefix, tokenizer=str(tok), hf_config="wikitext-2-raw-v1"))
    with pytest.raises(ConfigError, match="valid_fraction: must be in"):
        check_data(run_config(tmp_path, path=prefix, tokenizer=str(tok), valid_fraction=0.6))


def test_document_masking_refuses_a_pair_whose_documents_do_not_end_in_eos(tmp_path, tok):
    """Packed documents are told apart by their EOS: masking a pair written without EOS would mask nothing, so it
    is refused before launch (alone and in a blend); with EOS after every document, or without masking, it trains."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tok).eos_token_id
    docs = [[np.asarray(s) % eos if eos else s for s in doc] for doc in random_docs(5, num_docs=60, high=300)]
    no_eos = str(write_indexed(tmp_path / "no_eos", docs))
    with_eos = str(write_indexed(tmp_path / "with_eos", [[*doc[:-1], np.append(doc[-1], eos)] for doc in docs]))
    mask = {"tokenizer": str(tok), "document_mask": True}
    with pytest.raises(ConfigError) as err:
        check_data(run_config(tmp_path, path=no_eos, **mask))
    assert str(err.value).startswith(
        "error: ds_megatron.data.document_mask: the Megatron data's documents do not end in EOS, which is how packed "
        f"documents are told apart (0 of 60 documents sampled from {no_eos}.idx end in EOS id {eos}); rewrite the "
    )
    with pytest.raises(ConfigError, match="documents do not end in EOS"):
        check_data(run_config(tmp_path, blend=[[with_eos, 0.5], [no_eos, 0.5]], **mask))
    check_data(run_config(tmp_path, path=with_eos, **mask))
    check_data(run_config(tmp_path, path=no_eos, tokenizer=str(tok)))
    assert mi.documents_ending_in(open_indexed(with_eos), eos, sample=7) == (7, 7)


def test_the_recipe_refuses_megatron_data_without_a_tokenizer_in_one_line(tmp_path):
    prefix = write_indexed(tmp_path / "corpus", random_docs(5, num_docs=200))
    proc = recipe(["--data", str(prefix), "--save", str(tmp_path / "save")])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ds_megatron.data.tokenizer: Megatron indexed data carries no tokenizer")
    assert not (tmp_path / "save").exists()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok) -> Path:
    tmp = tmp_path_factory.mktemp("megatron_prepared")
    run_prepare(write_corpus(tmp / "corpus", docs=10), tok, tmp / "out", progress=False, valid_fraction=0.05)
    return tmp / "out"


def test_training_windows_are_the_prepared_formats_and_resume_exactly(tmp_path, tok, prepared, capsys):
    """The prepared directory's token stream written as a Megatron pair (one document per prepared document) gives
    the very samples the prepared directory gives, with the same seed and validation fraction."""
    source = open_prepared(prepared)
    stream = np.asarray(source.tokens)
    starts = source.tokens._offsets[:-1]
    ends = [0] + [int(e) + int(start) for i, start in enumerate(starts) for e in source.document_ends(i)]
    docs = [[stream[a:b]] for a, b in zip(ends[:-1], ends[1:])]
    prefix = str(write_indexed(tmp_path / "same", docs, "uint16"))
    run = run_config(tmp_path, path=prefix, tokenizer=str(tok), valid_fraction=0.05)
    check_run(run)
    data = prepare_data(run, 0, tmp_path / "run")
    out = capsys.readouterr().out
    assert f"data: Megatron indexed dataset {prefix}: {len(stream):,} uint16 tokens, 10 documents" in out
    assert "validation: the last 0.05 of the tokens" in out and (tmp_path / "run" / "tokenizer").is_dir()
    reference = prepare_data(run_config(tmp_path, path=str(prepared)), 0)
    for k in range(0, 3 * data.train.num_samples, 7):  # three epochs, each its own permutation
        assert torch.equal(data.train[k], reference.train[k])
    assert all(torch.equal(data.valid[k], reference.valid[k]) for k in range(data.valid.num_samples))
    # the samples follow from the seed alone, and the stream resumes at the exact micro-batch
    train, _ = split_train_valid(stream, 0.05)
    assert torch.equal(data.train[5], PackedSamples(train, 16, run.section.train.seed)[5])
    other = prepare_data(run_config(tmp_path, path=prefix, tokenizer=str(tok), valid_fraction=0.05), 0)
    assert all(torch.equal(data.train[k], other.train[k]) for k in range(50))
    full = MicroBatchStream(data.train, 2, 3, dp_rank=1, dp_size=2)
    seen = [next(full) for _ in range(3 * 5)]
    resumed = MicroBatchStream(other.train, 2, 3, 1, 2, start_step=2)
    assert all(torch.equal(next(resumed)[0], x) for x, _ in seen[6:])


def test_a_different_seed_draws_other_samples(tmp_path, tok):
    prefix = str(write_indexed(tmp_path / "corpus", random_docs(6, num_docs=200)))
    cfg = json.loads(TINY.read_text())
    cfg["ds_megatron"].update(parallel={"tp": 1, "pp": 1}, data={"path": prefix, "tokenizer": str(tok)})
    cfg["ds_megatron"]["model"]["seq_length"] = 16
    one = prepare_data(resolve(cfg, 1), 0)
    cfg["ds_megatron"].setdefault("train", {})["seed"] = 77
    two = prepare_data(resolve(cfg, 1), 0)
    firsts = [(one.train[k].tolist(), two.train[k].tolist()) for k in range(20)]
    assert sum(a != b for a, b in firsts) > 10


def test_a_blend_mixes_megatron_data_with_a_prepared_directory(tmp_path, tok, prepared, capsys):
    prefix = str(write_indexed(tmp_path / "meg", random_docs(7, num_docs=300)))
    blend = [[str(prepared), 1], [prefix, 3]]
    run = run_config(tmp_path, blend=blend)  # no --tokenizer: the prepared directory's reads the Megatron ids too
    check_run(run)
    check_run(run_config(tmp_path, blend=blend, tokenizer="bpe:512"))  # ignored, as beside prepared data alone
    data = prepare_data(run, 0)
    assert "data: blend of 1 prepared directories and 1 Megatron indexed datasets" in capsys.readouterr().out
    sources = [data.train.locate(k) for k in range(4096)]
    assert [d for d, _ in sources].count(1) == 3072
    train, _ = split_train_valid(np.asarray(open_indexed(prefix).tokens), 0.02)
    own = PackedSamples(train, 16, run.section.train.seed)
    k, j = next((k, j) for k, (d, j) in enumerate(sources) if d == 1)
    assert torch.equal(data.train[k], own[j])

    other = make_tokenizer(tmp_path / "words", words=300)
    with pytest.raises(ConfigError, match="not the tokenizer the blended prepared directories were made with"):
        check_run(run_config(tmp_path, blend=blend, tokenizer=str(other)))
    with pytest.raises(ConfigError, match="^error: ds_megatron.data.tokenizer: Megatron indexed data carries no"):
        check_run(run_config(tmp_path, blend=[[prefix, 1], [prefix, 1]]))
    check_run(run_config(tmp_path, blend=[[prefix, 1], [prefix, 1]], tokenizer=str(other)))  # 300 words: ids fit
    small = make_tokenizer(tmp_path / "small", words=200)
    with pytest.raises(ConfigError, match=r"smaller than the largest token id in the data \(200 tokens in"):
        check_run(run_config(tmp_path, blend=[[prefix, 1]], tokenizer=str(small)))
    with pytest.raises(
        ConfigError, match=r"not a prepared directory \(.*nothing.bin/.idx\); run .*or pass a Megatron prefix"
    ):
        check_run(run_config(tmp_path, blend=[[prefix, 1], [str(tmp_path / "nothing"), 1]]))
    os.remove(f"{prefix}.bin")
    with pytest.raises(ConfigError, match=rf"^error: {prefix}.bin: missing half of a Megatron indexed dataset"):
        check_run(run_config(tmp_path, blend=blend))
