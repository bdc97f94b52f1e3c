"""The resolved model shape of a run: a named size expanded, explicit fields applied, each family's rules checked
(gpt2's fixed fields; llama's KV heads, SwiGLU width, rotary base and scaling, tying).  Standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_megatron.config.errors import ConfigError, nearest
from ds_megatron.config.schema import ATTENTION_KERNELS, MODEL_FAMILIES, ROPE_SCALING_TYPES, ModelSection
from ds_megatron.config.sizes import NamedShape, all_size_names, named


@dataclass(frozen=True)
class ModelShape:
    """Fully resolved model shape (every field set; the llama-only fields hold the gpt2 family's fixed values:
    KV heads = heads, intermediate 4 h, tied embeddings, no rotary embedding)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_length: int
    max_position_embeddings: int
    dropout: float
    attention: str
    layer_norm_epsilon: float
    init_std: float
    family: str = "gpt2"
    num_kv_heads: int = 0  # 0: num_heads (set by resolve_shape)
    intermediate_size: int = 0  # 0: 4 h (set by resolve_shape)
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # sorted (key, value) pairs
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


LLAMA_ONLY = ("num_kv_heads", "intermediate_size", "rope_theta", "rope_scaling", "tie_word_embeddings")
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def gpt2_fixed_fields(hidden_size: int, num_heads: int) -> dict[str, Any]:
    """What the gpt2 family fixes that a llama chooses: every head its own K and V, an MLP of width 4 h, the output
    layer tied to the embedding (read by the config loader and the tuner's model spec)."""
    return {"num_kv_heads": num_heads, "intermediate_size": 4 * hidden_size, "tie_word_embeddings": True}


def _pick(explicit: Any, named_value: Any, default: Any) -> Any:
    return explicit if explicit is not None else named_value if named_value is not None else default


def check_rope_scaling(scaling: Any, setting: str = "ds_megatron.model.rope_scaling") -> tuple | None:
    """A Llama ``rope_scaling`` block as sorted (key, value) pairs; only the ``llama3`` type is implemented."""
    if scaling is None:
        return None
    if isinstance(scaling, tuple):
        scaling = dict(scaling)
    if not isinstance(scaling, dict):
        raise ConfigError(
            setting, "must be an object or null", f"got {scaling!r}", 'write {"rope_type": "llama3", ...}'
        )
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALING_TYPES:
        raise ConfigError(
            setting,
            "unsupported rope scaling type",
            f"rope_type={kind!r}",
            f"use one of {ROPE_SCALING_TYPES} or null (no scaling)",
        )
    missing = [k for k in ROPE_SCALING_KEYS if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise ConfigError(setting, "llama3 scaling needs numbers for every key", f"missing {missing}", "set them")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"] or scaling["factor"] <= 0:
        raise ConfigError(
            setting,
            "needs factor > 0 and high_freq_factor > low_freq_factor",
            f"factor={scaling['factor']}, low={scaling['low_freq_factor']}, high={scaling['high_freq_factor']}",
            "use Llama 3's values (32, 1, 4)",
        )
    return tuple(sorted([("rope_type", "llama3"), *((k, scaling[k]) for k in ROPE_SCALING_KEYS)]))


def resolve_shape(m: ModelSection) -> ModelShape:
    """Fill the model shape from ``size`` and explicit fields; check what the shape alone can break."""
    layers, hidden, heads = m.num_layers, m.hidden_size, m.num_heads
    vocab, seq = m.vocab_size, m.seq_length
    shape = NamedShape(family=m.family or "gpt2", num_layers=0, hidden_size=0, num_heads=0)
    if m.size is not None:
        found = named(m.size)
        if found is None:
            near = nearest(m.size, all_size_names())
            raise ConfigError(
                "ds_megatron.model.size", "unknown size", f"{m.size!r}", f"use one of {all_size_names()} ('{near}'?)"
            )
        shape = found
        if m.family is not None and m.family != shape.family:
            raise ConfigError(
                "ds_megatron.model.family",
                "differs from the named size's family",
                f"family={m.family!r}, size={m.size!r} is {shape.family!r}",
                f"remove model.family or set it to {shape.family!r}",
            )
        layers = layers if layers is not None else shape.num_layers
        hidden = hidden if hidden is not None else shape.hidden_size
        heads = heads if heads is not None else shape.num_heads
        vocab = vocab if vocab is not None else shape.vocab_size
        seq = seq if seq is not None else shape.seq_length
    family = shape.family
    if family not in MODEL_FAMILIES:
        raise ConfigError("ds_megatron.model.family", "unknown family", f"{family!r}", f"use one of {MODEL_FAMILIES}")
    for name, value in (
        ("num_layers", layers),
        ("hidden_size", hidden),
        ("num_heads", heads),
        ("vocab_size", vocab),
        ("seq_length", seq),
    ):
        if value is None:
            raise ConfigError(
                f"ds_megatron.model.{name}",
                "not set",
                "no size and no explicit value",
                f"set model.size or model.{name}",
            )
        if value <= 0:
            raise ConfigError(f"ds_megatron.model.{name}", "must be positive", f"got {value}", "set a positive value")
    if hidden % heads != 0:
        raise ConfigError(
            "ds_megatron.model.hidden_size",
            "not divisible by num_heads",
            f"hidden_size={hidden}, num_heads={heads}",
            "choose hidden_size as a multiple of num_heads",
        )
    max_pos = _pick(m.max_position_embeddings, shape.max_position_embeddings, seq)
    if seq > max_pos:
        raise ConfigError(
            "ds_megatron.model.seq_length",
            "longer than the position table",
            f"seq_length={seq}, max_position_embeddings={max_pos}",
            "lower seq_length or raise max_position_embeddings",
        )
    if m.attention not in ATTENTION_KERNELS:
        raise ConfigError(
            "ds_megatron.model.attention",
            "unknown attention kernel",
            f"got {m.attention!r}",
            f"use one of {ATTENTION_KERNELS}",
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("ds_megatron.model.dropout", "must be in [0, 1)", f"got {m.dropout}", "set e.g. 0.1")
    common = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        vocab_size=vocab,
        seq_length=seq,
        max_position_embeddings=max_pos,
        dropout=m.dropout,
        attention=m.attention,
        layer_norm_epsilon=m.layer_norm_epsilon,
        init_std=m.init_std,
        family=family,
    )
    if family == "gpt2":
        given = [k for k in LLAMA_ONLY if getattr(m, k) is not None]
        if given:
            raise ConfigError(
                f"ds_megatron.model.{given[0]}",
                "applies to the llama family only",
                f"family=gpt2, {', '.join(given)} set",
                'remove it or set model.family to "llama"',
            )
        return ModelShape(**common, **gpt2_fixed_fields(hidden, heads))
    kv = _pick(m.num_kv_heads, shape.num_kv_heads, heads)
    if kv <= 0 or heads % kv != 0:
        raise ConfigError(
            "ds_megatron.model.num_kv_heads",
            "must divide num_heads",
            f"num_heads={heads}, num_kv_heads={kv}",
            f"use one of {[d for d in range(1, heads + 1) if heads % d == 0]}",
        )
    ffn = _pick(m.intermediate_size, shape.intermediate_size, None)
    if ffn is None or ffn <= 0:
        raise ConfigError(
            "ds_megatron.model.intermediate_size", "not set", f"got {ffn}", "set the SwiGLU width (e.g. 8/3 x h)"
        )
    theta = float(_pick(m.rope_theta, shape.rope_theta, 10000.0))
    if theta <= 0:
        raise ConfigError("ds_megatron.model.rope_theta", "must be positive", f"got {theta}", "set e.g. 500000")
    scaling = check_rope_scaling(m.rope_scaling if m.rope_scaling is not None else shape.rope_scaling)
    tied = _pick(m.tie_word_embeddings, shape.tie_word_embeddings, False)
    return ModelShape(
        **common,
        num_kv_heads=kv,
        intermediate_size=ffn,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(tied),
    )
