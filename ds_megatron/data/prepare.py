"""A run's data, on every rank, without any process-group collective (a collective would time out while a long
tokenisation runs):

- ``data.path`` a prepared directory (``python -m ds_megatron.data prepare``), or ``data.blend`` a weighted list of
  them: nothing is tokenised.  The shards are memory-mapped and checked against the manifest (sizes here; sha256 in
  pre-flight with ``data.verify_checksums``), the tokenizer is the directory's, and validation is the tail
  ``valid_fraction`` of the token stream (the value recorded by ``prepare``, default 0.02; a different
  ``data.valid_fraction`` set for the run is ignored, with a warning).
- anything else (the built-in corpus, local files up to ``data.max_inlaunch_bytes``, a Hugging Face dataset): tokenised
  here into the packed cache under ``data.cache_dir``.  The first process of a node to take the file lock in that
  directory builds the cache (or checks the one there); the others wait on the lock, then find it through a small
  record keyed by the inputs and open it.  The last ``data.valid_fraction`` of the tokens is the validation split.

- ``data.path`` the prefix of a Megatron-LM / GPT-NeoX indexed dataset (PREFIX.bin + PREFIX.idx, also allowed in a
  blend): nothing is tokenised.  The pair is checked (``megatron_indexed.open_indexed``) and the .bin memory-mapped as
  one token stream, cut exactly like a packed file; the tokenizer is ``data.tokenizer`` (required: the files carry
  none) or, in a blend, the prepared directories'; validation is the tail ``data.valid_fraction`` of its tokens.

Samples follow from the seed and the step (``stream.py``), so a resumed run continues at the exact sample.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ds_megatron.config import ConfigError, RunConfig, effective_tokenizer
from ds_megatron.config.rules import CONFIG_FILE_RULES, check_tokenizer_fits
from ds_megatron.config.schema import DataSection
from ds_megatron.data.blend import BlendedSamples
from ds_megatron.data.corpus import (
    build_tokenizer,
    eos_id,
    fingerprint_documents,
    launch_record,
    load_documents,
    open_packed,
    pack,
    tokenizer_fingerprint,
)
from ds_megatron.data.lock import file_lock
from ds_megatron.data.megatron_indexed import IndexedDataset, megatron_prefix, open_indexed, tokenizer_spec
from ds_megatron.data.prepared import Prepared, check_one_tokenizer, is_prepared, open_prepared
from ds_megatron.data.stream import DocumentMasking, PackedSamples, split_train_valid
from ds_megatron.fileio import atomic_write_text


@dataclass
class RunData:
    tokenizer: object
    train: PackedSamples | BlendedSamples
    valid: PackedSamples | BlendedSamples
    num_tokens: int
    cache_file: Path  # the packed token file, or the (first) prepared directory
    documents: DocumentMasking | None = None  # data.document_mask: how the micro-batches mark packed documents


def _say(rank: int, line: str) -> None:
    if rank == 0:
        print(line, flush=True)


def _warn_ignored_valid_fraction(run: RunConfig, rank: int, fractions: dict[str, float]) -> None:
    """A prepared directory fixes its validation split (``prepare --valid-fraction``, recorded in its manifest), so a
    ``data.valid_fraction`` the user set does nothing there: say so once, naming both values.  Left at its default
    (``DataSection.valid_fraction``), the setting was never asked for and says nothing."""
    asked = run.section.data.valid_fraction
    differ = {d: f for d, f in fractions.items() if f != asked}
    if asked == DataSection.valid_fraction or not differ:
        return
    where = ", ".join(f"{d} was prepared with {f:g}" for d, f in differ.items())
    if rank == 0:
        print(
            f"warning: ds_megatron.data.valid_fraction={asked:g} is ignored: {where} (a prepared directory fixes its "
            f"validation split; prepare again with --valid-fraction {asked:g} to change it)",
            file=sys.stderr,
            flush=True,
        )


def _load_tokenizer(path: str | Path, run: RunConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    check_tokenizer_fits(len(tok), f"{len(tok)} tokens in {path}", run.model.vocab_size, CONFIG_FILE_RULES)
    return tok


# ---- raw text, tokenised in the launch -----------------------------------------------------------------------------
def _build(run: RunConfig) -> tuple[str, str]:
    data = run.section.data
    cache = Path(data.cache_dir)
    ds = load_documents(data.path, data.text_field, data.split, data.hf_config)
    corpus_hash = fingerprint_documents(ds, data.path)
    spec = effective_tokenizer(run)
    tok, tok_dir = build_tokenizer(spec, ds, corpus_hash, cache)
    key = hashlib.sha256(f"{corpus_hash}|{tokenizer_fingerprint(tok)}|{data.text_field}".encode()).hexdigest()[:24]
    path = pack(ds, tok, key, cache, data.num_proc)
    return str(path), tok_dir


def build_in_launch(run: RunConfig, rank: int = 0) -> tuple[str, str]:
    """(packed token file, tokenizer directory): built by the first process to take the cache directory's lock,
    found by the others once they take it in turn."""
    cache = Path(run.section.data.cache_dir)
    record = launch_record(run)
    waiting = f"waiting for another process building the token cache in {cache} (lock {cache / '.lock'})"
    with file_lock(cache / ".lock", on_wait=lambda: _say(rank, waiting)):
        if record.is_file():
            found = json.loads(record.read_text())
            try:
                open_packed(Path(found["cache_file"]), verify_checksum=False)
                if Path(found["tokenizer"]).is_dir():
                    return found["cache_file"], found["tokenizer"]
            except ConfigError:
                pass  # gone or damaged since: build again (pack verifies and rebuilds)
        cache_file, tok_dir = _build(run)
        atomic_write_text(record, json.dumps({"cache_file": cache_file, "tokenizer": tok_dir}))
        return cache_file, tok_dir


def _in_launch_data(run: RunConfig, rank: int) -> RunData:
    cache_file, tok_path = build_in_launch(run, rank)
    tok = _load_tokenizer(tok_path, run)
    packed = open_packed(Path(cache_file), verify_checksum=False)  # the builder verified it
    train_tokens, valid_tokens = split_train_valid(packed.tokens, run.section.data.valid_fraction)
    seed, s = run.section.train.seed, run.model.seq_length
    return RunData(
        tok,
        PackedSamples(train_tokens, s, seed),
        PackedSamples(valid_tokens, s, seed + 1),
        len(packed.tokens),
        packed.path,
    )


# ---- prepared directories ------------------------------------------------------------------------------------------
def _open_checked(directory: str) -> Prepared:
    prepared = open_prepared(directory)
    if len(prepared.tokens) < 2:
        raise ConfigError("ds_megatron.data.path", "the prepared directory has no tokens", directory, "prepare text")
    return prepared


def _prepared_tokenizer(prepared: Prepared, run: RunConfig):
    tok = _load_tokenizer(prepared.tokenizer_dir, run)
    expected = prepared.manifest["tokenizer"]["fingerprint"]
    if tokenizer_fingerprint(tok) != expected:
        raise ConfigError(
            "ds_megatron.data.path",
            f"the tokenizer in {prepared.tokenizer_dir} is not the one its shards were made with",
            f"{tokenizer_fingerprint(tok)} != {expected}",
            "prepare the directory again",
        )
    return tok


def _splits(tokens, fraction: float, run: RunConfig) -> tuple[PackedSamples, PackedSamples]:
    """Train and validation samples of a token stream whose last ``fraction`` is held out."""
    train_tokens, valid_tokens = split_train_valid(tokens, fraction)
    seed, s = run.section.train.seed, run.model.seq_length
    return PackedSamples(train_tokens, s, seed), PackedSamples(valid_tokens, s, seed + 1)


def _prepared_splits(prepared: Prepared, run: RunConfig) -> tuple[PackedSamples, PackedSamples]:
    return _splits(prepared.tokens, prepared.manifest["valid_fraction"], run)


def _megatron_splits(ds: IndexedDataset, run: RunConfig) -> tuple[PackedSamples, PackedSamples]:
    """These files fix no split: the run's ``data.valid_fraction`` cuts the stream, as it cuts text."""
    return _splits(ds.tokens, run.section.data.valid_fraction, run)


def _prepared_data(run: RunConfig, rank: int) -> RunData:
    data = run.section.data
    prepared = _open_checked(data.path)
    tok = _prepared_tokenizer(prepared, run)
    m = prepared.manifest
    spec = data.tokenizer
    if spec is not None and spec != m["tokenizer"]["spec"]:
        _say(rank, f"note: data.tokenizer={spec} is ignored: {data.path} was tokenised with {m['tokenizer']['spec']}")
    _say(
        rank,
        f"data: prepared directory {data.path}: {m['num_tokens']:,} tokens, {m['num_docs']:,} documents, "
        f"{len(m['shards'])} shards, tokenizer {m['tokenizer']['spec']}; validation: the last "
        f"{m['valid_fraction']:g} of the tokens",
    )
    _warn_ignored_valid_fraction(run, rank, {data.path: m["valid_fraction"]})
    train, valid = _prepared_splits(prepared, run)
    return RunData(tok, train, valid, len(prepared.tokens), prepared.directory)


def _megatron_data(run: RunConfig, rank: int, prefix: str) -> RunData:
    data = run.section.data
    spec = tokenizer_spec(data.tokenizer, None, "ds_megatron.data.tokenizer")
    ds = open_indexed(prefix)
    tok = _load_tokenizer(spec, run)
    _say(
        rank,
        f"data: Megatron indexed dataset {prefix}: {len(ds.tokens):,} {ds.dtype.name} tokens, {ds.num_docs:,} "
        f"documents, {ds.num_sequences:,} sequences, tokenizer {spec}; validation: the last "
        f"{data.valid_fraction:g} of the tokens",
    )
    train, valid = _megatron_splits(ds, run)
    return RunData(tok, train, valid, len(ds.tokens), Path(os.path.expanduser(prefix) + ".bin"))


def _blend_data(run: RunConfig, rank: int) -> RunData:
    """Prepared directories and Megatron prefixes, mixed: the prepared directories bring their tokenizer (the one
    ``data.tokenizer`` must name for the Megatron data, pre-flight checks), else ``data.tokenizer`` is it."""
    data = run.section.data
    paths = [str(entry[0]) for entry in data.blend]
    weights = [float(entry[1]) for entry in data.blend]
    members = [
        open_indexed(p) if not is_prepared(p) and megatron_prefix(p, "ds_megatron.data.blend") else _open_checked(p)
        for p in paths
    ]
    prepared = [m for m in members if isinstance(m, Prepared)]
    prints = {p: m.manifest["tokenizer"]["fingerprint"] for p, m in zip(paths, members) if isinstance(m, Prepared)}
    check_one_tokenizer(prints, "ds_megatron.data.blend")
    if prepared:
        tok = _prepared_tokenizer(prepared[0], run)
    else:
        tok = _load_tokenizer(tokenizer_spec(data.tokenizer, None, "ds_megatron.data.tokenizer"), run)
    fractions = {p: m.manifest["valid_fraction"] for p, m in zip(paths, members) if isinstance(m, Prepared)}
    _warn_ignored_valid_fraction(run, rank, fractions)
    splits = [_prepared_splits(m, run) if isinstance(m, Prepared) else _megatron_splits(m, run) for m in members]
    seed = run.section.train.seed
    train = BlendedSamples([t for t, _ in splits], weights, seed)
    valid = BlendedSamples([v for _, v in splits], weights, seed + 1)
    planned = run.section.train.train_iters * run.global_batch_size
    realised = train.realised(planned) / max(1, planned)
    shares = ", ".join(f"{p} {r:.4f} (weight {w / sum(weights):.4f})" for p, r, w in zip(paths, realised, weights))
    kinds = f"{len(prepared)} prepared directories"
    if len(prepared) < len(paths):
        kinds += f" and {len(paths) - len(prepared)} Megatron indexed datasets"
    _say(rank, f"data: blend of {kinds}; realised shares of the run's {planned:,} samples: {shares}")
    first = members[0]
    where = first.directory if isinstance(first, Prepared) else Path(os.path.expanduser(paths[0]) + ".bin")
    return RunData(tok, train, valid, sum(len(m.tokens) for m in members), where)


def prepare_data(run: RunConfig, rank: int, run_dir: Path | None = None) -> RunData:
    """Every rank calls it, each on its own (no collective).  Raises ConfigError for unusable data (the trainer's
    EXIT_BAD_DATA)."""
    data = run.section.data
    if data.blend:
        result = _blend_data(run, rank)
    elif is_prepared(data.path):
        result = _prepared_data(run, rank)
    elif (prefix := megatron_prefix(data.path)) is not None:
        result = _megatron_data(run, rank, prefix)
    else:
        result = _in_launch_data(run, rank)
    if data.document_mask:
        # Every packed file and prepared shard puts the tokenizer's EOS after each document (``corpus.pack``,
        # ``prepare``; a prepared directory's tokenizer is checked against its shards), so that id ends one.
        setting = "ds_megatron.data.document_mask"
        result.documents = DocumentMasking(eos_id(result.tokenizer, setting), data.document_positions)
    if rank == 0 and run_dir is not None:
        result.tokenizer.save_pretrained(run_dir / "tokenizer")
    return result
