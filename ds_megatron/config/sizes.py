"""Named model shapes.  The GPT-3 family follows Brown et al. 2020, Table 2.1 (s = 2048, V = 50257)."""

from __future__ import annotations

# name: (num_layers, hidden_size, num_heads)
GPT3_SHAPES: dict[str, tuple[int, int, int]] = {
    "gpt3-125m": (12, 768, 12),
    "gpt3-350m": (24, 1024, 16),
    "gpt3-760m": (24, 1536, 16),
    "gpt3-1.3b": (24, 2048, 16),  # the paper lists 24 heads of 128, which does not divide 2048; 16 x 128 does
    "gpt3-2.7b": (32, 2560, 32),
    "gpt3-6.7b": (32, 4096, 32),
    "gpt3-13b": (40, 5120, 40),  # the paper's 5140 is not divisible by 40 heads; 5120 is the usual choice
    "gpt3-175b": (96, 12288, 96),
}

# Small shapes for laptops and tests.
TINY_SHAPES: dict[str, tuple[int, int, int]] = {
    "gpt-tiny": (4, 128, 4),  # L, h, a of the CPU demo
}

# Peak learning rates of the GPT-3 family (Brown et al. 2020, Table 2.1), written into generated configs
# by the tuner.
GPT3_LEARNING_RATES: dict[str, float] = {
    "gpt3-125m": 6.0e-4,
    "gpt3-350m": 3.0e-4,
    "gpt3-760m": 2.5e-4,
    "gpt3-1.3b": 2.0e-4,
    "gpt3-2.7b": 1.6e-4,
    "gpt3-6.7b": 1.2e-4,
    "gpt3-13b": 1.0e-4,
    "gpt3-175b": 0.6e-4,
}


GPT3_VOCAB_SIZE = 50257
GPT3_SEQ_LENGTH = 2048


def named_shape(name: str) -> tuple[int, int, int] | None:
    """(num_layers, hidden_size, num_heads) for a named size, or None."""
    return GPT3_SHAPES.get(name) or TINY_SHAPES.get(name)


def all_size_names() -> list[str]:
    return sorted(GPT3_SHAPES) + sorted(TINY_SHAPES)
