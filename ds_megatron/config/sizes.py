"""Named model shapes of both families.  Standard library only.

GPT-3 (family ``gpt2``): Brown et al. 2020, Table 2.1 (s = 2048, V = 50257).
Llama 3 / 3.2 (family ``llama``): the published ``config.json`` of each model as transformers reads it
(``LlamaConfig``): layers, hidden, heads, KV heads, intermediate size, vocabulary 128,256, rope theta 500,000, tied
embeddings for the 3.2 models only, Llama 3.2's ``llama3`` rope scaling (factor 32 over an original 8,192 positions).
The training sequence length of a named Llama size is 8,192 (Llama 3's pretraining context).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NamedShape:
    """Everything a named size fixes.  ``None`` fields are left to the config (vocabulary and sequence length of
    the small CPU shapes, which follow the tokenizer and the run)."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int | None = None  # llama: grouped-query attention's KV heads
    intermediate_size: int | None = None  # llama: SwiGLU width
    vocab_size: int | None = None
    seq_length: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # llama3 scaling, as sorted (key, value) pairs
    tie_word_embeddings: bool | None = None


GPT3_VOCAB_SIZE = 50257  # GPT-2's byte-level BPE vocabulary, which GPT-3 kept
GPT3_SEQ_LENGTH = 2048
LLAMA3_VOCAB_SIZE = 128256
LLAMA3_SEQ_LENGTH = 8192
LLAMA3_ROPE_THETA = 500000.0
# Llama 3.2's rope_scaling block: positions beyond the original 8,192 reached by stretching the low frequencies.
LLAMA32_ROPE_SCALING = (
    ("factor", 32.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
    ("rope_type", "llama3"),
)


def _gpt3(layers: int, hidden: int, heads: int) -> NamedShape:
    return NamedShape("gpt2", layers, hidden, heads, vocab_size=GPT3_VOCAB_SIZE, seq_length=GPT3_SEQ_LENGTH)


def _llama3(
    layers: int, hidden: int, heads: int, kv: int, ffn: int, tied: bool, max_pos: int, scaling: tuple | None
) -> NamedShape:
    return NamedShape(
        "llama",
        layers,
        hidden,
        heads,
        num_kv_heads=kv,
        intermediate_size=ffn,
        vocab_size=LLAMA3_VOCAB_SIZE,
        seq_length=LLAMA3_SEQ_LENGTH,
        max_position_embeddings=max_pos,
        rope_theta=LLAMA3_ROPE_THETA,
        rope_scaling=scaling,
        tie_word_embeddings=tied,
    )


SHAPES: dict[str, NamedShape] = {
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),  # the paper lists 24 heads of 128, which does not divide 2048; 16 x 128 does
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),  # the paper's 5140 is not divisible by 40 heads; 5120 is the usual choice
    "gpt3-175b": _gpt3(96, 12288, 96),
    "llama3.2-1b": _llama3(16, 2048, 32, 8, 8192, True, 131072, LLAMA32_ROPE_SCALING),
    "llama3.2-3b": _llama3(28, 3072, 24, 8, 8192, True, 131072, LLAMA32_ROPE_SCALING),
    "llama3-8b": _llama3(32, 4096, 32, 8, 14336, False, 8192, None),
    "llama3-70b": _llama3(80, 8192, 64, 8, 28672, False, 8192, None),
    # Small shapes for laptops and tests (vocabulary from the tokenizer, sequence from the config).
    "gpt-tiny": NamedShape("gpt2", 4, 128, 4),
    "llama-tiny": NamedShape(
        "llama", 4, 128, 4, num_kv_heads=2, intermediate_size=352, rope_theta=10000.0, tie_word_embeddings=False
    ),
}

# Peak learning rates: GPT-3 from Brown et al. 2020, Table 2.1; Llama 3 from its paper (8B and 70B: 3e-4 and 1.5e-4;
# the 3.2 models, distilled rather than pretrained from scratch in the paper, take the 8B's).  Written into
# generated configs by the tuner.
LEARNING_RATES: dict[str, float] = {
    "gpt3-125m": 6.0e-4,
    "gpt3-350m": 3.0e-4,
    "gpt3-760m": 2.5e-4,
    "gpt3-1.3b": 2.0e-4,
    "gpt3-2.7b": 1.6e-4,
    "gpt3-6.7b": 1.2e-4,
    "gpt3-13b": 1.0e-4,
    "gpt3-175b": 0.6e-4,
    "llama3.2-1b": 3.0e-4,
    "llama3.2-3b": 3.0e-4,
    "llama3-8b": 3.0e-4,
    "llama3-70b": 1.5e-4,
}
GPT3_LEARNING_RATES = {k: v for k, v in LEARNING_RATES.items() if k.startswith("gpt3-")}


def named(name: str) -> NamedShape | None:
    """The named shape, or None."""
    return SHAPES.get(name)


def all_size_names() -> list[str]:
    return sorted(SHAPES)
