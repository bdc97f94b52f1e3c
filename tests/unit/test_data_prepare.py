"""``python -m ds_megatron.data prepare``: the prepared format, its equality with the in-launch cache, resume, parallel
workers and bad inputs (one line, exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from ds_megatron.config import ConfigError
from ds_megatron.data import build, sources
from ds_megatron.data.__main__ import main
from ds_megatron.data.build import PrepareArgs, prepare
from ds_megatron.data.corpus import EOS_TOKEN, load_documents, pack
from ds_megatron.data.prepared import check_prepared, open_prepared, read_manifest
from ds_megatron.fileio import sha256_file


def write_corpus(root: Path, kind: str = "jsonl", docs: int = 40) -> str:
    """About 200 KB of CPython's documentation as .jsonl, .txt (one file per document) or .parquet; returns --data."""
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)[:docs]]
    root.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        for part in range(2):
            with open(root / f"part{part}.jsonl", "w") as fh:
                fh.writelines(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts[part::2]))
        return str(root / "*.jsonl")
    if kind == "txt":
        for i, text in enumerate(texts):
            (root / f"doc{i:03d}.txt").write_text(text)
        return str(root)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": texts}), root / "c.parquet", row_group_size=7)
    return str(root / "c.parquet")


def make_tokenizer(out: Path, words: int | None = None) -> Path:
    """A byte-level BPE of 300 tokens trained on a little text, or (``words``) a word-level tokenizer that large."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ds_megatron.data.corpus import train_bpe_from_texts

    if words is None:
        from pydoc_data.topics import topics

        train_bpe_from_texts((topics[k] for k in sorted(topics)[:10]), 300, out)
        return out
    vocab = {EOS_TOKEN: 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(words - 2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, unk_token="[UNK]").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "bpe300")


def run_prepare(data: str, tok: Path | str, out: Path, **kw) -> dict:
    return prepare(PrepareArgs(data, str(tok), str(out), chunk_bytes=kw.pop("chunk_bytes", 30_000), **kw), log=print)


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
def test_prepared_stream_equals_the_in_launch_cache(tmp_path, tok_dir, kind):
    from transformers import AutoTokenizer

    data = write_corpus(tmp_path / "corpus", kind)
    field = "body" if kind == "parquet" else "text"
    manifest = run_prepare(data, tok_dir, tmp_path / "out", text_field=field, progress=False)
    assert manifest["complete"] and manifest["dtype"] == "uint16" and len(manifest["shards"]) >= 3
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cache = pack(load_documents(data, field), tok, "k", tmp_path / "cache")
    prepared = open_prepared(tmp_path / "out", checksums=True)
    assert np.array_equal(np.asarray(prepared.tokens), np.fromfile(cache, dtype=np.uint16))
    # Every document ends in EOS, where the index says it ends; the manifest's sums and checksums hold.
    ends = prepared.document_ends(1)
    shard1 = np.fromfile(tmp_path / "out" / "shard_00001.bin", dtype=np.uint16)
    assert len(ends) == manifest["shards"][1]["num_docs"]
    assert (shard1[ends.astype(np.int64) - 1] == tok.eos_token_id).all()
    assert manifest["num_docs"] == 40 and manifest["num_tokens"] == sum(s["num_tokens"] for s in manifest["shards"])
    assert manifest["shards"][0]["bin"]["sha256"] == sha256_file(tmp_path / "out" / "shard_00000.bin")
    ident = manifest["tokenizer"]
    assert ident["vocab_size"] == len(tok) and set(ident["files"]) >= {"tokenizer.json"}
    saved = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    assert saved(["a b"])["input_ids"] == tok(["a b"])["input_ids"]


def test_uint32_tokens_when_the_vocabulary_does_not_fit_uint16(tmp_path):
    tok = make_tokenizer(tmp_path / "words", words=70_000)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_text("".join(json.dumps({"text": f"w{i} w69990 w5"}) + "\n" for i in range(50)))
    manifest = run_prepare(str(tmp_path / "c"), tok, tmp_path / "out", progress=False)
    tokens = np.asarray(open_prepared(tmp_path / "out").tokens)
    assert manifest["dtype"] == "uint32" and tokens.dtype == np.uint32
    assert tokens[:4].tolist() == [2, 69992, 7, 0]  # w0 w69990 w5 EOS


def test_bpe_spec_trains_the_same_tokenizer_as_the_launch(tmp_path):
    from ds_megatron.data.corpus import build_tokenizer, fingerprint_documents, tokenizer_fingerprint

    data = write_corpus(tmp_path / "corpus", "jsonl", docs=12)
    manifest = run_prepare(data, "bpe:300", tmp_path / "out", progress=False)
    ds = load_documents(data)
    tok, _ = build_tokenizer("bpe:300", ds, fingerprint_documents(ds, data), tmp_path / "cache")
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()


def test_jsonl_chunks_partition_the_lines_and_batches_stay_small(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": "x" * (i % 37) + str(i)}) + "\n" for i in range(300)]
    path.write_text("".join(lines[:100]) + "\n" + "".join(lines[100:]))  # a blank line is skipped
    monkeypatch.setattr(sources, "BATCH_DOCS", 16)
    for chunk_bytes in (1, 97, 1000, 10**6):
        chunks = sources.plan_chunks([str(path)], chunk_bytes)
        batches = [b for c in chunks for b in sources.read_batches(c, "text")]
        assert [t for texts, _ in batches for t in texts] == [json.loads(line)["text"] for line in lines]
        assert max(len(texts) for texts, _ in batches) <= 16
        assert sum(n for _, n in batches) == path.stat().st_size - 1


def test_interrupted_prepare_resumes_keeping_complete_shards(tmp_path, tok_dir, monkeypatch):
    data = write_corpus(tmp_path / "corpus")
    reference = run_prepare(data, tok_dir, tmp_path / "ref", progress=False)
    real, calls = build.tokenize_chunk, []

    def crash_on_third(job, report=None):
        calls.append(job.chunk.index)
        if len(calls) == 3:
            (Path(job.out) / "shard_00002.bin.tmp99").write_bytes(b"half")  # what a killed worker leaves
            raise KeyboardInterrupt
        return real(job, report)

    monkeypatch.setattr(build, "tokenize_chunk", crash_on_third)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_prepare(data, tok_dir, out, progress=False)
    partial = read_manifest(out)
    assert not partial["complete"] and [s["name"] for s in partial["shards"]] == ["shard_00000", "shard_00001"]
    problem = check_prepared(out)
    assert problem[0] == "the prepared directory is incomplete" and "2 of" in problem[1]
    (out / "shard_00005.bin").write_bytes(b"x" * 10)  # renamed, but its manifest entry was never written
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_0000[01].*")}
    monkeypatch.setattr(build, "tokenize_chunk", real)
    final = run_prepare(data, tok_dir, out, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard_0000[01].*")} == kept
    assert final["complete"] and [s["bin"]["sha256"] for s in final["shards"]] == [
        s["bin"]["sha256"] for s in reference["shards"]
    ]
    assert not list(out.glob("*.tmp*")) and check_prepared(out, checksums=True) is None


def test_worker_processes_make_the_same_shards_with_a_progress_bar(tmp_path, tok_dir, capsys):
    data = write_corpus(tmp_path / "corpus")
    one = run_prepare(data, tok_dir, tmp_path / "one", progress=False)
    two = run_prepare(data, tok_dir, tmp_path / "two", num_proc=2, progress=True)
    assert [s["bin"]["sha256"] for s in one["shards"]] == [s["bin"]["sha256"] for s in two["shards"]]
    err = capsys.readouterr().err
    assert "prepare: 100%" in err and "tok/s" in err


def test_cli_prepare_then_verify(tmp_path, tok_dir, capsys):
    data = write_corpus(tmp_path / "corpus", docs=8)
    out = tmp_path / "out"
    assert main(["prepare", "--data", data, "--tokenizer", str(tok_dir), "--out", str(out), "--num-proc", "1"]) == 0
    assert main(["verify", str(out)]) == 0
    manifest = read_manifest(out)
    assert manifest["command"].startswith("python -m ds_megatron.data prepare --data ")
    with open(out / "shard_00000.bin", "r+b") as fh:  # same size, other bytes: only the checksum sees it
        fh.write(b"\x01\x02")
    capsys.readouterr()
    assert main(["verify", str(out)]) == 2
    assert "shard_00000.bin fails its sha256" in capsys.readouterr().err
    # A damaged copy is remade where it lies, never by a command writing into the sound original.
    import shutil

    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(out, copy)
    assert main(["verify", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"--out {copy} " in err and f"--out {out} " not in err, err


def _bad_inputs(tmp: Path, tok_dir: Path) -> list[tuple[list[str], str]]:
    good = write_corpus(tmp / "corpus", docs=4)
    (tmp / "broken.jsonl").write_text('{"text": broken\n{"text": "fine"}\n')  # found before any work starts
    (tmp / "other.jsonl").write_text('{"body": "no text field"}\n')
    (tmp / "binary.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")  # a file passed by mistake
    (tmp / "taken").mkdir()
    (tmp / "taken" / "notes.txt").write_text("someone's files")
    common = ["--tokenizer", str(tok_dir), "--out", str(tmp / "o")]
    return [
        (["--data", str(tmp / "nothing*.jsonl"), *common], "error: --data: no file matches"),
        (["--data", str(tmp / "other.jsonl"), *common], "error: --text-field: no field 'text' in"),
        (["--data", str(tmp / "broken.jsonl"), *common], "error: --data: invalid JSON in"),
        (["--data", str(tmp / "binary.jsonl"), *common], "error: --data: not UTF-8 text (" + str(tmp / "binary.jsonl")),
        (["--data", good, "--tokenizer", "bpe:12", "--out", str(tmp / "o")], "error: --tokenizer: bpe size"),
        (["--data", good, "--tokenizer", str(tmp / "none"), "--out", str(tmp / "o")], "error: --tokenizer: not a dir"),
        (["--data", good, *common, "--num-proc", "0"], "error: --num-proc: must be at least 1"),
        (["--data", good, *common, "--valid-fraction", "0.7"], "error: --valid-fraction: must be in (0, 0.5)"),
        (["--data", good, *common, "--chunk-mb", "nan"], "error: --chunk-mb: must be a finite number (got nan)"),
        (["--data", good, "--tokenizer", str(tok_dir), "--out", str(tmp / "taken")], "error: --out: "),
    ]


def test_bad_inputs_one_line_exit_2(tmp_path, tok_dir, capsys):
    for args, expected in _bad_inputs(tmp_path, tok_dir):
        capsys.readouterr()
        assert main(["prepare", *args, "--no-progress"]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expected) and ";" in err[0], (args, err)
    assert not (tmp_path / "o").exists()
    assert (tmp_path / "taken" / "notes.txt").read_text() == "someone's files"  # never overwritten


# Bad input that only reading the whole corpus finds (so after the output directory exists): (file name, its bytes,
# the line's start).  Each is found by the main process (a .txt or .json file, or training a BPE) or by a worker.
LATE_BAD_INPUTS = [
    ("late.jsonl", b'{"text": "fine"}\n{"text": broken\n', "error: --data: invalid JSON in {f} at byte 17 ("),
    ("null.jsonl", b'{"text": "fine"}\n{"text": null}\n', "error: --text-field: 'text' is not text in {f} at byte 17"),
    ("number.jsonl", b'{"text": "fine"}\n{"text": 5}\n', "error: --text-field: 'text' is not text in {f} at byte 17"),
    ("blank.jsonl", b'{"text": ""}\n{"text": ""}\n', "error: --data: the corpus has no tokens ({f}); point it"),
    ("latin1.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "error: --data: not UTF-8 text ({f} at byte 30: "),
    ("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"), "error: --data: not UTF-8 text ({f} at byte 3: invalid"),
    ("array.json", b'[{"text": "ok"}, {"text": "\xff"}]', "error: --data: not UTF-8 text ({f} at byte 27: invalid"),
    ("broken.json", b'[{"text": "ok"},\n {"text": }]', "error: --data: invalid JSON in {f} (Expecting value at line 2"),
]


@pytest.mark.parametrize("tokenizer", ["dir", "bpe:300"])
def test_bad_input_found_while_tokenising_leaves_nothing(tmp_path, tok_dir, capsys, tokenizer):
    """No complete shard: no directory is left (or an existing empty one is left empty), so that the rerun with the
    fixed input is not refused as a directory "holding another preparation"."""
    spec = str(tok_dir) if tokenizer == "dir" else tokenizer
    for i, (name, content, expected) in enumerate(LATE_BAD_INPUTS):
        path = tmp_path / name
        path.write_bytes(content)
        out = tmp_path / f"o{i}" / "nested"
        if i % 2:  # a directory that exists, empty, before prepare runs
            out.mkdir(parents=True)
        capsys.readouterr()
        assert main(["prepare", "--data", str(path), "--tokenizer", spec, "--out", str(out), "--no-progress"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()  # with bpe:N, "training a byte-level BPE ..." first
        err = [line for line in lines if line.startswith("error")]
        assert len(err) == 1 and lines[-1] == err[0] and err[0].startswith(expected.format(f=path)), (name, lines)
        if i % 2:
            assert err[0].endswith(f"then rerun (nothing is left in {out})") and list(out.iterdir()) == [], err
        else:
            assert err[0].endswith(f"then rerun ({out} is removed)") and not (tmp_path / f"o{i}").exists(), err
    path = tmp_path / "late.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(20)))  # fixed
    assert main(["prepare", "--data", str(path), "--tokenizer", spec, "--out", str(tmp_path / "o0" / "nested")]) == 0


def test_bad_input_after_complete_shards_keeps_them_resumable(tmp_path, tok_dir, capsys):
    """Shards already complete stay (as after an interrupt), in two worker processes too; the line says so."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": f"good text {i} " * 40}) + "\n" for i in range(30)))
    (corpus / "b.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    out = tmp_path / "out"
    args = ["prepare", "--data", str(corpus), "--tokenizer", str(tok_dir), "--out", str(out), "--no-progress"]
    assert main([*args, "--chunk-mb", "0.004", "--num-proc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    kept = read_manifest(out)["shards"]
    assert len(err) == 1 and err[0].startswith(f"error: --data: not UTF-8 text ({corpus / 'b.jsonl'} at byte 30"), err
    assert err[0].endswith(
        f"({out} keeps its {len(kept)} complete shard(s), and the same command resumes from them; after changing the "
        f"input, delete {out} or pass a new --out)"
    )
    assert kept and check_prepared(out)[0] == "the prepared directory is incomplete"


def test_a_changed_corpus_is_refused_not_mixed(tmp_path, tok_dir):
    data = write_corpus(tmp_path / "corpus", docs=6)
    run_prepare(data, tok_dir, tmp_path / "out", progress=False)
    with open(tmp_path / "corpus" / "part0.jsonl", "a") as fh:
        fh.write(json.dumps({"text": "one more"}) + "\n")
    os.utime(tmp_path / "corpus" / "part0.jsonl", ns=(1, 1))
    with pytest.raises(ConfigError, match="holds another preparation"):
        run_prepare(data, tok_dir, tmp_path / "out", progress=False)


# Settings a prepared directory ignores (it brings its own tokenizer and validation split): (flags, the line the same
# settings give for raw text, where they apply).
IGNORED_WITH_PREPARED = [
    ([], "error: ds_megatron.data.tokenizer: tokenizer vocabulary larger than the model's (bpe:1024 > vocab_size 512)"),
    (["--tokenizer", "bpe:12"], "error: ds_megatron.data.tokenizer: bpe size must be an integer >= 260"),
    (["--tokenizer", "/no/such/tokenizer"], "error: ds_megatron.data.tokenizer: not a directory nor bpe:N"),
    (
        ["--tokenizer", "bpe:512", "--set", "ds_megatron.data.valid_fraction=0.7"],
        "error: ds_megatron.data.valid_fraction: must be in (0, 0.5)",
    ),
]


def test_settings_a_prepared_directory_ignores_are_not_refused(tmp_path, tok_dir, monkeypatch):
    """gpt_tiny.json sets data.tokenizer bpe:1024; with model.vocab_size 512 and a prepared directory of a 300-token
    tokenizer, the directory's tokenizer is what must fit: pre-flight passes, for a directory and for a blend, while
    raw text with the same settings is still refused."""
    from ds_megatron.cli.train import validate

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = write_corpus(tmp_path / "corpus", docs=12)
    run_prepare(data, tok_dir, tmp_path / "out", progress=False)
    base = ["--deepspeed_config", str(Path(__file__).parents[2] / "ds_configs" / "gpt_tiny.json"), "--tp", "1"]
    base += ["--pp", "1", "--set", "ds_megatron.model.vocab_size=512"]
    blend = f'ds_megatron.data.blend=[["{tmp_path / "out"}", 1.0]]'
    for flags, raw_text_error in IGNORED_WITH_PREPARED:
        _, run = validate([*base, *flags, "--data", str(tmp_path / "out")])
        assert run.model.vocab_size == 512
        validate([*base, *flags, "--set", blend])
        with pytest.raises(ConfigError) as err:
            validate([*base, *flags, "--data", data])
        assert str(err.value).startswith(raw_text_error), err.value
