"""The resolved model shape of a run or of a tuner question: a named size expanded, explicit fields applied, each
family's rules checked (the fixed fields of a family with ``fixed_kv_and_width``; the others' KV heads, MLP width,
rotary base and scaling, tying).  One resolver serves the config loader and the tuner; each reports errors in its
own vocabulary (:class:`Vocabulary`).  Standard library only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ds_megatron.config.errors import ConfigError, nearest
from ds_megatron.config.schema import ATTENTION_KERNELS, MODEL_FAMILIES, ROPE_SCALING_TYPES, ModelSection
from ds_megatron.config.sizes import LEARNING_RATES, NamedShape, all_size_names, named
from ds_megatron.model import DEFAULT_FAMILY, FAMILIES

DEFAULT_ROPE_THETA = 10000.0  # the rotary base of a Llama without a named size (transformers' default)
DEFAULT_LEARNING_RATE = 1.0e-4  # peak learning rate of a shape no published recipe gives one for


@dataclass(frozen=True)
class ModelShape:
    """Fully resolved model shape (every field set; a family with ``fixed_kv_and_width`` holds its fixed values in
    the CHOSEN fields: KV heads = heads, intermediate 4 h, tied embeddings, no rotary embedding)."""

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
    family: str = DEFAULT_FAMILY
    num_kv_heads: int = 0  # 0: num_heads (set by resolve_shape)
    intermediate_size: int = 0  # 0: 4 h (set by resolve_shape)
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # sorted (key, value) pairs
    tie_word_embeddings: bool = True
    size: str | None = None  # the named size, when one was given and no field changed its shape
    # Mixture of experts (EXPERT_FIELDS; a family with ``routed`` only: 0 experts is a dense model)
    head_width: int = 0  # a head's width d set by the family (Qwen3's head_dim); 0: h / a
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    moe_capacity_factor: float = 0.0  # 0: dropless
    shared_expert_intermediate_size: int = 0  # the shared expert's width (Qwen2-MoE); 0: none

    @property
    def head_dim(self) -> int:
        return self.head_width or self.hidden_size // self.num_heads

    @property
    def learning_rate(self) -> float:
        """The published peak learning rate of a named size (GPT-3's table, Llama 3's paper), else the default."""
        return LEARNING_RATES.get(self.size or "", DEFAULT_LEARNING_RATE)


CHOSEN = ("num_kv_heads", "intermediate_size", "rope_theta", "rope_scaling", "tie_word_embeddings")
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# The routed MLP's fields (``ModelSection`` names), read by a family with ``routed`` and refused by the others; the
# value when neither the config nor the named size gives one (None: required).
EXPERT_FIELDS: dict[str, Any] = {
    "head_dim": None,  # h / a
    "num_experts": None,
    "experts_per_token": None,
    "moe_intermediate_size": None,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "router_aux_loss_coef": 0.001,  # Qwen3-MoE's published value
    "router_z_loss_coef": 0.0,
    "moe_capacity_factor": 0.0,  # dropless
    "shared_expert_intermediate_size": 0,  # no shared expert (a family whose config has one needs it positive)
}
# The fields that make a family's architecture: a shape with these of a named size is that size (vocabulary and
# sequence length may differ: a run or a written config states them next to it).  Read by the resume check (with
# family, vocabulary and positions) and the tuner's written model.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "tie_word_embeddings")


@dataclass(frozen=True)
class Vocabulary:
    """How shape errors name things: ``ref`` is how a fix refers to a field (default ``model.<field>``), the setting
    of an error is ``prefix + ref``, and ``nouns`` say a field in a sentence (default: its name).  The config loader
    uses the defaults; the tuner names its command-line flags."""

    prefix: str = "ds_megatron."
    refs: dict[str, str] = field(default_factory=dict)
    nouns: dict[str, str] = field(default_factory=dict)

    def ref(self, name: str) -> str:
        return self.refs.get(name, f"model.{name}")

    def setting(self, name: str) -> str:
        return self.prefix + self.ref(name)

    def noun(self, name: str) -> str:
        return self.nouns.get(name, name)


CONFIG_FILE = Vocabulary()


def layers_per_stage(num_layers: int, pp: int) -> int:
    """Blocks on the largest pipeline stage, ceil(L / p): DeepSpeed's pipeline balances the blocks over the stages, so
    no stage holds more (read by the config loader's recompute check and the tuner's models)."""
    return -(-num_layers // pp)


def fixed_fields(hidden_size: int, num_heads: int) -> dict[str, Any]:
    """What a family with ``fixed_kv_and_width`` fixes that the others choose: every head its own K and V, an MLP of
    width 4 h, the output layer tied to the embedding."""
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


def resolve_shape(m: ModelSection, words: Vocabulary = CONFIG_FILE) -> ModelShape:
    """Fill the model shape from ``size`` and explicit fields; check what the shape alone can break."""
    shape = _named_shape(m, words)
    family = FAMILIES[_check_family(m, shape.family, words)]
    common = _common_fields(m, shape, words)
    if family.fixed_kv_and_width:
        resolved = _fixed(m, common, words)
    else:
        resolved = _chosen(m, shape, common, words)
    if family.routed:
        resolved = dataclasses.replace(resolved, **_experts(m, shape, resolved, words))
    return _with_size(resolved, m.size, shape)


def _named_shape(m: ModelSection, words: Vocabulary) -> NamedShape:
    """The named size ``m.size`` (checked against an explicit family), or an empty shape of the config's family."""
    if m.size is None:
        return NamedShape(family=m.family or DEFAULT_FAMILY, num_layers=0, hidden_size=0, num_heads=0)
    shape = named(m.size)
    if shape is None:
        near = nearest(m.size, all_size_names())
        raise ConfigError(
            words.setting("size"),
            "unknown size",
            f"{m.size!r}",
            f"use one of {', '.join(all_size_names())} ({near!r}?)",
        )
    if m.family is not None and m.family != shape.family:
        raise ConfigError(
            words.setting("family"),
            "differs from the named size's family",
            f"family={m.family!r}, size={m.size!r} is {shape.family!r}",
            f"remove {words.ref('family')} or set it to {shape.family!r}",
        )
    return shape


def _check_family(m: ModelSection, family: str, words: Vocabulary) -> str:
    """``family`` if it is known, trains, and is routed when ``m`` sets an expert field."""
    if family not in MODEL_FAMILIES:
        raise ConfigError(words.setting("family"), "unknown family", f"{family!r}", f"use one of {MODEL_FAMILIES}")
    if FAMILIES[family].no_training:
        trained = ", ".join(name for name, f in FAMILIES.items() if not f.no_training)
        raise ConfigError(words.setting("family"), FAMILIES[family].no_training, f"family={family!r}", f"use {trained}")
    if not FAMILIES[family].routed:
        routed = [name for name, f in FAMILIES.items() if f.routed]
        _refuse_set(m, EXPERT_FIELDS, family, routed, words, f"the mixture-of-experts families ({', '.join(routed)})")
    return family


def _refuse_set(m: ModelSection, fields, family: str, families: list[str], words: Vocabulary, which: str) -> None:
    """Refuse the first of ``fields`` set in ``m``: it applies to ``families`` (``which`` says them) only."""
    given = [k for k in fields if getattr(m, k) is not None]
    if given:
        raise ConfigError(
            words.setting(given[0]),
            f"applies to {which} only",
            f"family={family}, {', '.join(given)} set",
            f"remove it or set {words.ref('family')} to one of {', '.join(families)}",
        )


SIZE_FIELDS = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length")  # explicit, else the size's


def _common_fields(m: ModelSection, shape: NamedShape, words: Vocabulary) -> dict[str, Any]:
    """The fields every family has: the sizes (explicit, else the named size's), the position table, the kernel,
    dropout and the norm's and initialiser's constants; each checked on its own."""
    ref, setting = words.ref, words.setting
    values = {name: getattr(m, name) for name in SIZE_FIELDS}
    if m.size is not None:
        values = {name: _pick(value, getattr(shape, name), None) for name, value in values.items()}
    for name, value in values.items():
        if value is None:
            raise ConfigError(
                setting(name), "not set", "no size and no explicit value", f"set {ref('size')} or {ref(name)}"
            )
        if value <= 0:
            raise ConfigError(setting(name), "must be positive", f"got {value}", "set a positive value")
    hidden, heads, seq = values["hidden_size"], values["num_heads"], values["seq_length"]
    if hidden % heads != 0:
        raise ConfigError(
            setting("hidden_size"),
            f"not divisible by {words.noun('num_heads')}",
            f"hidden_size={hidden}, num_heads={heads}",
            f"choose {ref('hidden_size')} as a multiple of {ref('num_heads')}",
        )
    max_pos = _pick(m.max_position_embeddings, shape.max_position_embeddings, seq)
    if seq > max_pos:
        raise ConfigError(
            setting("seq_length"),
            "longer than the position table",
            f"seq_length={seq}, max_position_embeddings={max_pos}",
            "lower seq_length or raise max_position_embeddings",
        )
    if m.attention not in ATTENTION_KERNELS:
        raise ConfigError(
            setting("attention"), "unknown attention kernel", f"got {m.attention!r}", f"use one of {ATTENTION_KERNELS}"
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(setting("dropout"), "must be in [0, 1)", f"got {m.dropout}", "set e.g. 0.1")
    # A norm divides by sqrt(variance + epsilon): a negative epsilon gives NaN on a constant row.  A zero init_std
    # starts every weight at 0, and no gradient ever tells a block's heads or units apart.
    for name, example in (("layer_norm_epsilon", "1e-5"), ("init_std", "0.02")):
        if not getattr(m, name) > 0:
            raise ConfigError(setting(name), "must be positive", f"got {getattr(m, name)}", f"set e.g. {example}")
    return dict(
        **values,
        max_position_embeddings=max_pos,
        dropout=m.dropout,
        attention=m.attention,
        layer_norm_epsilon=m.layer_norm_epsilon,
        init_std=m.init_std,
        family=shape.family,
    )


def _fixed(m: ModelSection, common: dict, words: Vocabulary) -> ModelShape:
    """The shape of a family with ``fixed_kv_and_width``: the CHOSEN fields are its fixed values, and setting one
    is refused."""
    choices = [f.name for f in FAMILIES.values() if not f.fixed_kv_and_width]
    _refuse_set(m, CHOSEN, common["family"], choices, words, f"the {', '.join(choices)} families")
    return ModelShape(**common, **fixed_fields(common["hidden_size"], common["num_heads"]))


def _experts(m: ModelSection, shape: NamedShape, resolved: ModelShape, words: Vocabulary) -> dict[str, Any]:
    """The routed MLP's fields of a family with ``routed``: the config's, else the named size's, else
    EXPERT_FIELDS' defaults; checked against each other and the family's fixed values."""
    family = FAMILIES[resolved.family]
    named = {family.shape_renamed.get(k, k): v for k, v in shape.family_fields}
    values: dict[str, Any] = {}
    for name, default in EXPERT_FIELDS.items():
        value = _pick(getattr(m, name), named.get(name), default)
        if value is None and name != "head_dim":
            raise ConfigError(
                words.setting(name), "not set", f"family={family.name}, no size gives it", f"set {words.ref(name)}"
            )
        values[name] = value
    for name, fixed in family.fixed_expert_fields:
        if values[name] != fixed:
            others = [f.name for f in FAMILIES.values() if f.routed and name not in dict(f.fixed_expert_fields)]
            raise ConfigError(
                words.setting(name),
                f"the {family.name} family fixes it",
                f"{name}={values[name]!r}, {family.name} has {fixed!r}",
                f"remove it (or use a family that sets it: {', '.join(others)})",
            )
    shared = values["shared_expert_intermediate_size"]
    has_shared = "shared_expert_intermediate_size" in {f.name for f in dataclasses.fields(family.config)}
    if not (isinstance(shared, int) and (shared > 0 if has_shared else shared >= 0)):
        raise ConfigError(
            words.setting("shared_expert_intermediate_size"), "must be a positive integer",
            f"got {shared!r}, family={family.name} (every routed layer has a shared expert)", "set its width",
        )  # fmt: skip
    e, k, layers = values["num_experts"], values["experts_per_token"], resolved.num_layers
    for name in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
        if not (isinstance(values[name], int) and values[name] > 0):
            raise ConfigError(words.setting(name), "must be a positive integer", f"got {values[name]!r}", "set one")
    if not 1 <= k <= e:
        raise ConfigError(
            words.setting("experts_per_token"),
            f"must be 1..{words.noun('num_experts')}",
            f"experts_per_token={k}, num_experts={e}",
            f"use 1..{e} (2 or 8 in the published models)",
        )
    bad = [i for i in values["mlp_only_layers"] if not (isinstance(i, int) and 0 <= i < layers)]
    if bad:
        raise ConfigError(
            words.setting("mlp_only_layers"),
            "layer indices out of range",
            f"got {list(values['mlp_only_layers'])}, num_layers={layers}",
            f"list indices in 0..{layers - 1}",
        )
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
        if not values[name] >= 0:
            raise ConfigError(words.setting(name), "must be >= 0", f"got {values[name]}", "set e.g. 0.001 (0: off)")
    if not (isinstance(values["moe_capacity_factor"], (int, float)) and values["moe_capacity_factor"] >= 0):
        raise ConfigError(
            words.setting("moe_capacity_factor"), "must be a number >= 0", f"got {values['moe_capacity_factor']!r}",
            "set e.g. 1.25 (0: dropless)",
        )  # fmt: skip
    values["moe_capacity_factor"] = float(values["moe_capacity_factor"])
    head = values.pop("head_dim") or resolved.hidden_size // resolved.num_heads
    if head <= 0 or head % 2:
        raise ConfigError(
            words.setting("head_dim"),
            "must be positive and even (the rotary embedding turns its dimensions in pairs)",
            f"got {head}",
            "set e.g. 128",
        )
    if head * resolved.num_heads != resolved.hidden_size and not getattr(family.config, "own_head_dim", True):
        raise ConfigError(
            words.setting("head_dim"), f"the {family.name} family's heads are hidden_size / num_heads wide",
            f"head_dim={head}, hidden_size={resolved.hidden_size}, num_heads={resolved.num_heads}", "remove it",
        )  # fmt: skip
    values["mlp_only_layers"] = tuple(sorted(set(values["mlp_only_layers"])))
    return {"head_width": head, **values}


def check_rotary_head_dim(hidden: int, heads: int, words: Vocabulary = CONFIG_FILE) -> None:
    """A rotary family's rule on its head dimension: the rotary embedding turns each head's dimensions in pairs
    (i, i + d/2), so d = hidden / heads must be even (an odd d passes every shape check and fails in the first
    forward, where the two halves cannot be paired)."""
    head_dim = hidden // heads
    if head_dim % 2:
        ref = words.ref
        raise ConfigError(
            words.setting("hidden_size"),
            "the head dimension must be even for the rotary embedding, which turns its dimensions in pairs",
            f"hidden_size={hidden} / num_heads={heads} = {head_dim}",
            f"choose {ref('hidden_size')} and {ref('num_heads')} with an even quotient (e.g. {ref('hidden_size')} "
            f"{heads * (head_dim + 1)})",
        )


def _chosen(m: ModelSection, shape: NamedShape, common: dict, words: Vocabulary) -> ModelShape:
    """The CHOSEN fields of a family without ``fixed_kv_and_width``: KV heads, MLP width, rotary base and scaling,
    tying."""
    heads = common["num_heads"]
    check_rotary_head_dim(common["hidden_size"], heads, words)
    kv = _pick(m.num_kv_heads, shape.num_kv_heads, heads)
    if kv <= 0 or heads % kv != 0:
        raise ConfigError(
            words.setting("num_kv_heads"),
            f"must divide {words.noun('num_heads')}",
            f"num_heads={heads}, num_kv_heads={kv}",
            f"use one of {[d for d in range(1, heads + 1) if heads % d == 0]}",
        )
    ffn = _pick(m.intermediate_size, shape.intermediate_size, None)
    if ffn is None:
        raise ConfigError(
            words.setting("intermediate_size"),
            "not set",
            "no size gives it",
            f"set {words.ref('intermediate_size')}, the SwiGLU width (e.g. 8/3 x h)",
        )
    if ffn <= 0:
        raise ConfigError(words.setting("intermediate_size"), "must be positive", f"got {ffn}", "set e.g. 8/3 x h")
    theta = float(_pick(m.rope_theta, shape.rope_theta, DEFAULT_ROPE_THETA))
    if theta <= 0:
        raise ConfigError(words.setting("rope_theta"), "must be positive", f"got {theta}", "set e.g. 500000")
    scaling = m.rope_scaling if m.rope_scaling is not None else shape.rope_scaling
    return ModelShape(
        **common,
        num_kv_heads=kv,
        intermediate_size=ffn,
        rope_theta=theta,
        rope_scaling=check_rope_scaling(scaling, words.setting("rope_scaling")),
        tie_word_embeddings=bool(_pick(m.tie_word_embeddings, shape.tie_word_embeddings, False)),
    )


def _with_size(resolved: ModelShape, size: str | None, shape: NamedShape) -> ModelShape:
    """``resolved`` with ``size`` kept when its SHAPE_FIELDS are the named size's (fields the size leaves unset
    compared with the family's defaults)."""
    if size is None:
        return resolved
    if FAMILIES[shape.family].fixed_kv_and_width:
        defaults = fixed_fields(shape.hidden_size, shape.num_heads)
    else:
        defaults = {"num_kv_heads": shape.num_heads, "tie_word_embeddings": False}
    named_value = {f: _pick(None, getattr(shape, f), defaults.get(f)) for f in SHAPE_FIELDS}
    same = all(getattr(resolved, f) == named_value[f] for f in SHAPE_FIELDS)
    if FAMILIES[shape.family].routed:  # and the experts' layout, the head width included
        renamed = FAMILIES[shape.family].shape_renamed
        fields = {renamed.get(k, k): v for k, v in shape.family_fields}
        fields["head_width"] = fields.pop("head_dim", None) or shape.hidden_size // shape.num_heads
        fields["mlp_only_layers"] = tuple(sorted(set(fields.get("mlp_only_layers", ()))))
        # the loss's weights and the training-time token dropping, not the architecture's
        loss_weights = ("router_aux_loss_coef", "router_z_loss_coef", "moe_capacity_factor")
        same = same and all(getattr(resolved, f) == v for f, v in fields.items() if f not in loss_weights)
    if same:
        return dataclasses.replace(resolved, size=size)
    return resolved
