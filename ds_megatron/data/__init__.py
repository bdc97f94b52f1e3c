"""L3: training data: corpora, tokenizers, packed memory-mapped token files, deterministic micro-batch streams."""

from ds_megatron.data.corpus import (
    EOS_TOKEN,
    DataError,
    PackedTokens,
    build_tokenizer,
    fingerprint_documents,
    load_documents,
    open_packed,
    pack,
    tokenizer_fingerprint,
)
from ds_megatron.data.demo import BYTE_VOCAB_SIZE, EOS_BYTE_ID, builtin_corpus_bytes, builtin_documents
from ds_megatron.data.stream import MicroBatchStream, PackedSamples, split_train_valid

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOS_BYTE_ID",
    "EOS_TOKEN",
    "DataError",
    "MicroBatchStream",
    "PackedSamples",
    "PackedTokens",
    "build_tokenizer",
    "builtin_corpus_bytes",
    "builtin_documents",
    "fingerprint_documents",
    "load_documents",
    "open_packed",
    "pack",
    "split_train_valid",
    "tokenizer_fingerprint",
]
