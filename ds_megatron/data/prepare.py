"""Prepare a run's data on every rank: rank 0 loads the corpus, builds or loads the tokenizer and packs the token
file (cached); the other ranks wait, then open what rank 0 made.  Train / validation split and samples."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ds_megatron.config import RunConfig, effective_tokenizer
from ds_megatron.data.corpus import (
    DataError,
    build_tokenizer,
    fingerprint_documents,
    load_documents,
    open_packed,
    pack,
    tokenizer_fingerprint,
)
from ds_megatron.data.stream import PackedSamples, split_train_valid


@dataclass
class RunData:
    tokenizer: object
    train: PackedSamples
    valid: PackedSamples
    num_tokens: int
    cache_file: Path


def _rank0_build(run: RunConfig) -> tuple[str, str]:
    data = run.section.data
    cache = Path(data.cache_dir)
    ds = load_documents(data.path, data.text_field, data.split)
    corpus_hash = fingerprint_documents(ds, data.path)
    spec = effective_tokenizer(run)
    tok, tok_dir = build_tokenizer(spec, ds, corpus_hash, cache)
    key = hashlib.sha256(f"{corpus_hash}|{tokenizer_fingerprint(tok)}|{data.text_field}".encode()).hexdigest()[:24]
    path = pack(ds, tok, key, cache, data.num_proc)
    return str(path), tok_dir


def prepare_data(run: RunConfig, rank: int, run_dir: Path | None = None) -> RunData:
    """Collective: every rank calls it.  Errors on rank 0 reach all ranks as a DataError."""
    payload: list = [None]
    if rank == 0:
        try:
            payload[0] = _rank0_build(run)
        except DataError as err:
            payload[0] = err
    if dist.is_initialized():
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], DataError):
        raise payload[0]
    cache_file, tok_path = payload[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_path)
    if len(tok) > run.model.vocab_size:
        raise DataError(
            f"error: ds_megatron.data.tokenizer: tokenizer vocabulary larger than the model's "
            f"({len(tok)} > vocab_size {run.model.vocab_size}); raise model.vocab_size to at least {len(tok)}"
        )
    if rank == 0 and run_dir is not None:
        tok.save_pretrained(run_dir / "tokenizer")
    packed = open_packed(Path(cache_file), verify_checksum=False)  # rank 0 verified it when building
    train_tokens, valid_tokens = split_train_valid(packed.tokens, run.section.data.valid_fraction)
    seed = run.section.train.seed
    s = run.model.seq_length
    return RunData(
        tok,
        PackedSamples(train_tokens, s, seed),
        PackedSamples(valid_tokens, s, seed + 1),
        len(packed.tokens),
        Path(cache_file),
    )
