"""The built-in demo corpus: real English prose that ships with every CPython (the reference documentation text in
``pydoc_data.topics``, about 0.47 MB), tokenised as bytes so the demo needs no network and no tokenizer files."""

from __future__ import annotations

import torch

BYTE_VOCAB_SIZE = 257  # 256 byte values + one end-of-document token
EOS_BYTE_ID = 256


def builtin_documents() -> list[str]:
    """CPython's reference documentation, one document per topic (about 0.47 MB of English prose and code)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def builtin_corpus_bytes() -> torch.Tensor:
    """All documentation topics, each followed by EOS, as a 1-D int64 tensor of token ids."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids.extend(topics[key].encode("utf-8"))
        ids.append(EOS_BYTE_ID)
    return torch.tensor(ids, dtype=torch.int64)


def byte_encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def byte_decode(ids: list[int] | torch.Tensor) -> str:
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return bytes(v for v in values if v < 256).decode("utf-8", errors="replace")
