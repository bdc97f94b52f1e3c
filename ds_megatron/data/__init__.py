"""L3: training data: corpora, tokenizers, packed memory-mapped token files, prepared directories, blends,
deterministic micro-batch streams.

Names are imported on first use (PEP 562), so that ``python -m ds_megatron.data``, its worker processes and the
pre-flight checks load only what they need (no torch for preparing data or reading a manifest)."""

from __future__ import annotations

import importlib

_WHERE = {
    "EOS_TOKEN": "corpus",
    "PackedTokens": "corpus",
    "build_tokenizer": "corpus",
    "fingerprint_documents": "corpus",
    "load_documents": "corpus",
    "open_packed": "corpus",
    "pack": "corpus",
    "tokenizer_fingerprint": "corpus",
    "builtin_documents": "demo",
    "IndexedDataset": "megatron_indexed",
    "open_indexed": "megatron_indexed",
    "MicroBatchStream": "stream",
    "PackedSamples": "stream",
    "split_train_valid": "stream",
    "BlendedSamples": "blend",
    "ShardedTokens": "prepared",
    "is_prepared": "prepared",
    "open_prepared": "prepared",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
