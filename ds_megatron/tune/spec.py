"""What the tuner is asked about: the model, the cluster, the pinned dimensions, and one candidate configuration.

The model and the cluster are checked here as they are built, the request as a whole (pins against model and
cluster) in :mod:`ds_megatron.tune.validate`, before any search; a bad input raises
:class:`ds_megatron.config.ConfigError` (one line: ``error: <setting>: <problem> (<values>); <fix>``).  Standard
library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ds_megatron.config import ConfigError
from ds_megatron.config.errors import nearest
from ds_megatron.config.schema import RECOMPUTE_MODULES
from ds_megatron.config.shape import gpt2_fixed_fields
from ds_megatron.config.sizes import (
    FAMILIES,
    GPT3_SEQ_LENGTH,
    GPT3_VOCAB_SIZE,
    LEARNING_RATES,
    LLAMA3_SEQ_LENGTH,
    LLAMA3_VOCAB_SIZE,
    all_size_names,
    named,
)
from ds_megatron.tune.gpus import DEFAULT_GPU, GPUS

DEFAULT_SELECTIVE_MODULES = ("core_attn",)  # what "selective" recomputes when no modules are named (the loader's)
SDPA_CORE_ATTN_REASON = (
    "recomputing core_attn with sdpa is not offered: it checkpoints the s x s attention core, which the sdpa kernel "
    "never stores, so it would save nothing and cost a recompute (the config loader refuses it); sdpa is searched "
    "with selective recompute of mlp_act and layernorm instead"
)

# The ceiling of the matmul-efficiency curve (ds_megatron.tune.matmuls: a matmul of intensity I runs at
# ceiling x I / (I + peak / bandwidth) of the peak), the time model's one free parameter.  Fitted by
# calibration.fit_time_model to two published step times (ds_megatron.tune.paper_runs, Korthikanti et al. 2022,
# Table 5, SP + selective recompute on A100 80GB): the 22B model at tp 8 on 8 GPUs, 1.10 s, and the 1T model at
# tp 8 x pp 64 on 512 GPUs, 71.49 s; the fit gives 0.8687 (relative RMS error 0.3%).  With it the six other rows of
# the table (175B, 530B and both modes of every model) are predicted within 6.2% (22B full recompute 1.33 s
# against 1.42; 530B full 51.1 against 49.05; the others within 3.1%) and the paper's MFU within 2.3 points
# (tests/test_tune_paper.py).  Its matmuls then run at 71-78% of the A100's peak.  The same ceiling serves every
# preset: each GPU's curve differs through its ridge point (H100 SXM's is 1.9x the A100's, so the same GEMM runs
# further below its peak); fit yours with ``--empirical`` or calibration.calibrate and pass it as --efficiency.
DEFAULT_EFFICIENCY = 0.869
INTRA_NODE_LATENCY_S = 20e-6  # per collective or transfer inside a node (NCCL launch + ring set-up)
INTER_NODE_LATENCY_S = 50e-6  # per collective or transfer across nodes
# What TP splits, and why a tp must divide it (the query heads need no reason: they define TP's head split).
TP_SPLITS = {
    "num_heads": "TP splits the query heads",
    "num_kv_heads": "TP splits the KV heads like the query heads",
    "intermediate_size": "TP splits the MLP width",
}

# Dropout of a generated Llama config: Llama's published recipes train without dropout (its only one is on the
# attention probabilities), so the tuner models and writes 0.  A GPT config keeps the loader's default (0.1), every
# dropout on, as the paper's memory table counts it.
LLAMA_DROPOUT = 0.0
# Vocabulary and sequence length when neither a named size nor a flag gives them.
DEFAULT_VOCAB = {"gpt2": GPT3_VOCAB_SIZE, "llama": LLAMA3_VOCAB_SIZE}
DEFAULT_SEQ_LENGTH = {"gpt2": GPT3_SEQ_LENGTH, "llama": LLAMA3_SEQ_LENGTH}


@dataclass(frozen=True)
class ModelSpec:
    """The decoder to train.  ``family`` "gpt2": pre-LayerNorm, learned positions, MLP width 4h, tied embeddings
    (the llama fields then hold those fixed values); "llama": RMSNorm, rotary positions, grouped-query attention
    with ``num_kv_heads``, SwiGLU of width ``intermediate_size``, tied or untied output layer."""

    num_layers: int  # L
    hidden_size: int  # h
    num_heads: int  # a
    vocab_size: int  # V, before TP padding
    seq_length: int  # s (also the size of a GPT's position table)
    size: str | None = None  # named size from ds_megatron.config.sizes, when one was given and kept unchanged
    family: str = "gpt2"  # "gpt2" or "llama"
    num_kv_heads: int | None = None  # k (None: num_heads)
    intermediate_size: int | None = None  # F, the MLP width (None: 4h, GPT's; a llama needs it)
    tie_word_embeddings: bool | None = None  # output layer shares the embedding (None: gpt2 tied, llama untied)
    rope_theta: float | None = None  # llama: carried into the written config (no effect on memory or time)
    rope_scaling: tuple | None = None  # llama: the same, Llama 3.2's (key, value) pairs or None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError("--family", "unknown family", repr(self.family), f"use one of {', '.join(FAMILIES)}")
        gpt = self.family == "gpt2"
        fixed = gpt2_fixed_fields(self.hidden_size, self.num_heads)
        llama = {"num_kv_heads": self.num_heads, "intermediate_size": None, "tie_word_embeddings": False}
        fill = fixed if gpt else llama
        for name, default in fill.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if gpt and (self.num_kv_heads, self.intermediate_size, self.tie_word_embeddings) != tuple(fill.values()):
            raise ConfigError(
                "--family",
                "a GPT has num_kv_heads = num_heads, intermediate_size = 4 h and tied embeddings",
                f"num_kv_heads={self.num_kv_heads}, intermediate_size={self.intermediate_size}, "
                f"tie_word_embeddings={self.tie_word_embeddings}",
                "pass --family llama for another shape",
            )
        if self.intermediate_size is None:
            raise ConfigError(
                "--intermediate-size", "not set", "a llama without a named size", "pass e.g. --intermediate-size 14336"
            )

    @property
    def learning_rate(self) -> float:
        """The published peak learning rate of a named size (GPT-3's table, Llama 3's paper); 1e-4 otherwise."""
        return LEARNING_RATES.get(self.size or "", 1.0e-4)


@dataclass(frozen=True)
class Cluster:
    """The machines.  Bandwidths are per GPU, in GB/s (10^9 bytes per second, one direction)."""

    num_gpus: int
    gpus_per_node: int
    gpu_memory_gb: float  # usable device memory in GiB (an "80 GB" A100 or H100 has 80 GiB)
    peak_tflops: float  # dense bf16 peak per GPU (A100: 312)
    intra_node_gbps: float = 300.0  # NVLink (A100: 600 GB/s both directions = 300 each way)
    inter_node_gbps: float = 25.0  # InfiniBand share per GPU (one 200 Gb/s HDR NIC per GPU = 25 GB/s)
    memory_gbps: float = 2039.0  # HBM bandwidth (A100 80GB: 2,039 GB/s); the eager kernel's s x s passes run at it
    gpu: str | None = None  # the preset the figures came from (ds_megatron.tune.gpus), with any flags that changed it
    efficiency: float = DEFAULT_EFFICIENCY  # ceiling of the matmul-efficiency curve (tune.matmuls; calibrate fits it)
    intra_node_latency_s: float = INTRA_NODE_LATENCY_S  # fixed cost of each collective or send inside a node
    inter_node_latency_s: float = INTER_NODE_LATENCY_S  # the same across nodes
    # Fixed time per optimizer step outside the model (optimizer update, Python and launch overheads); 0 unless
    # fitted by calibration.fit_time_model from short runs (tune --empirical) or passed as --step-overhead-s.
    step_overhead_s: float = 0.0

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12


@dataclass(frozen=True)
class Pins:
    """Dimensions fixed by the user (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    sequence_parallel: bool | None = None
    recompute: str | None = None  # "none" | "selective" | "full"
    zero: int | None = None  # 0 | 1
    attention: str | None = None  # "eager" | "sdpa"
    recompute_modules: tuple[str, ...] | None = None  # selective's modules, in any order (implies "selective")


def ordered_modules(modules: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``modules`` in RECOMPUTE_MODULES order: one spelling per set, so that equal sets compare equal."""
    return tuple(m for m in RECOMPUTE_MODULES if m in modules)


@dataclass(frozen=True)
class Candidate:
    """One training configuration: layout, micro-batching, recompute policy and ZeRO stage."""

    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    micro_batch_size: int  # b
    num_micro_batches: int  # m = global batch / (dp * b), the gradient accumulation steps
    recompute: str  # "none" | "selective" | "full"
    recompute_layers: int = 1  # full only: chunk size (uniform) or recomputed blocks per stage (block)
    recompute_method: str = "uniform"  # full only: "uniform" | "block"
    zero: int = 1
    attention: str = "eager"  # "eager" | "sdpa" (sdpa never with core_attn recomputed)
    # What selective recompute recomputes (empty: DEFAULT_SELECTIVE_MODULES); stored in RECOMPUTE_MODULES order,
    # and emptied for the other policies (so that dataclasses.replace(c, recompute="full") stays valid).
    recompute_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        modules = tuple(self.recompute_modules)
        if set(modules) - set(RECOMPUTE_MODULES):
            raise ValueError(f"recompute_modules must be among {RECOMPUTE_MODULES}, got {modules}")
        if self.recompute != "selective":
            modules = ()
        else:
            modules = ordered_modules(modules or DEFAULT_SELECTIVE_MODULES)
        object.__setattr__(self, "recompute_modules", modules)

    def recompute_label(self) -> str:
        """``none``, ``selective`` (core attention, the default), ``selective[mlp_act,layernorm]``, ``full/block/1``."""
        if self.recompute == "full":
            return f"full/{self.recompute_method}/{self.recompute_layers}"
        if self.recompute == "selective" and self.recompute_modules != DEFAULT_SELECTIVE_MODULES:
            return f"selective[{','.join(self.recompute_modules)}]"
        return self.recompute

    def settings(self) -> dict:
        """The JSON record: the full-recompute fields None under the other policies, the modules under selective."""
        full = self.recompute == "full"
        layout = ("tp", "pp", "dp", "sequence_parallel", "micro_batch_size", "num_micro_batches", "recompute")
        return {
            **{key: getattr(self, key) for key in layout},
            "recompute_layers": self.recompute_layers if full else None,
            "recompute_method": self.recompute_method if full else None,
            "recompute_modules": list(self.recompute_modules) if self.recompute == "selective" else None,
            "zero_stage": self.zero,
            "attention": self.attention,
        }


def check_positive(setting: str, value: int | float | None, example: str) -> None:
    """Refuse a count or rate that is not positive, naming the flag."""
    if value is None or value <= 0:
        raise ConfigError(setting, "must be positive", f"got {value}", f"pass e.g. {setting} {example}")


# The fields that make a shape that of a named size (vocabulary and sequence length may differ: the written config
# states them next to the size).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "tie_word_embeddings")


def build_model_spec(
    model: str | None,
    layers: int | None,
    hidden: int | None,
    heads: int | None,
    vocab: int | None,
    seq_length: int | None,
    *,
    family: str | None = None,
    kv_heads: int | None = None,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool | None = None,
) -> ModelSpec:
    """A named size (``--model gpt3-175b``, ``--model llama3-70b``), optionally overridden, or an explicit shape
    (``family="llama"`` for a Llama one).  ``size`` is kept only when the named shape is unchanged."""
    shape = named(model) if model is not None else None
    if model is not None and shape is None:
        near = nearest(model, all_size_names())
        raise ConfigError(
            "--model", "unknown size", repr(model), f"use one of {', '.join(all_size_names())} ({near!r}?)"
        )
    if shape is not None and family is not None and family != shape.family:
        raise ConfigError(
            "--family",
            "differs from the named size's family",
            f"family={family!r}, {model!r} is {shape.family!r}",
            "drop --family",
        )
    family = shape.family if shape is not None else family or "gpt2"
    if family not in FAMILIES:
        raise ConfigError("--family", "unknown family", repr(family), f"use one of {', '.join(FAMILIES)}")
    llama_flags = {"--kv-heads": kv_heads, "--intermediate-size": intermediate_size}
    given = [f for f, v in {**llama_flags, "--tie-word-embeddings": tie_word_embeddings}.items() if v is not None]
    if family == "gpt2" and given:
        raise ConfigError(given[0], "applies to the llama family only", f"{given[0]} with a GPT", "pass --family llama")

    def pick(value: Any, named_value: Any, default: Any = None) -> Any:
        """The flag's value, else the named size's, else the default."""
        return value if value is not None else named_value if named_value is not None else default

    layers = pick(layers, shape and shape.num_layers)
    hidden = pick(hidden, shape and shape.hidden_size)
    heads = pick(heads, shape and shape.num_heads)
    for flag, value in (("--layers", layers), ("--hidden", hidden), ("--heads", heads)):
        if value is None:
            raise ConfigError(flag, "not set", "no --model and no explicit shape", f"pass --model or {flag}")
    vocab = pick(vocab, shape and shape.vocab_size, DEFAULT_VOCAB[family])
    seq_length = pick(seq_length, shape and shape.seq_length, DEFAULT_SEQ_LENGTH[family])
    for flag, value in (
        ("--layers", layers),
        ("--hidden", hidden),
        ("--heads", heads),
        ("--vocab", vocab),
        ("--seq-length", seq_length),
    ):
        check_positive(flag, value, "2048" if flag == "--seq-length" else "a positive integer")
    for flag, value in llama_flags.items():
        if value is not None:
            check_positive(flag, value, "a positive integer")
    if hidden % heads != 0:
        raise ConfigError(
            "--hidden", "not divisible by the number of heads", f"hidden={hidden}, heads={heads}", "choose h = a x d"
        )
    kv = pick(kv_heads, shape and shape.num_kv_heads, heads)
    if heads % kv != 0:
        raise ConfigError(
            "--kv-heads",
            "must divide the number of heads",
            f"heads={heads}, kv_heads={kv}",
            f"use one of {[d for d in range(1, heads + 1) if heads % d == 0]}",
        )
    llama = family == "llama"
    spec = ModelSpec(
        layers,
        hidden,
        heads,
        vocab,
        seq_length,
        family=family,
        num_kv_heads=kv,
        intermediate_size=pick(intermediate_size, shape and shape.intermediate_size),
        tie_word_embeddings=pick(tie_word_embeddings, shape and shape.tie_word_embeddings),
        rope_theta=shape.rope_theta if llama and shape is not None else None,
        rope_scaling=shape.rope_scaling if llama and shape is not None else None,
    )
    if shape is None:
        return spec
    base = dataclasses.replace(spec, **{f: getattr(shape, f) for f in SHAPE_FIELDS})  # gpt2's None fields refilled
    unchanged = all(getattr(spec, f) == getattr(base, f) for f in SHAPE_FIELDS)
    return dataclasses.replace(spec, size=model) if unchanged else spec


# Cluster field <- (GpuPreset field, command-line flag): what --gpu sets and which explicit flag overrides it.
PRESET_FIELDS = {
    "gpu_memory_gb": ("memory_gb", "--gpu-memory-gb"),
    "peak_tflops": ("peak_tflops", "--gpu-peak-tflops"),
    "memory_gbps": ("memory_gbps", "--memory-gbps"),
    "intra_node_gbps": ("intra_node_gbps", "--intra-node-gbps"),
    "inter_node_gbps": ("inter_node_gbps", "--inter-node-gbps"),
}


def build_cluster(gpu: str | None, num_gpus: int, gpus_per_node: int, **values: float | None) -> Cluster:
    """A cluster of ``gpu`` (a :data:`ds_megatron.tune.gpus.GPUS` name; None: the a100-80gb defaults) whose figures
    are replaced by every explicit value that is not None (``gpu_memory_gb=40``); other keywords (``efficiency``,
    latencies, ``step_overhead_s``) pass through to :class:`Cluster`."""
    if gpu is not None and gpu not in GPUS:
        near = nearest(gpu, list(GPUS))
        raise ConfigError("--gpu", "unknown GPU", repr(gpu), f"use one of {', '.join(GPUS)} ({near!r}?)")
    preset = GPUS[gpu or DEFAULT_GPU]
    fields, changed = {}, []
    for name, (column, flag) in PRESET_FIELDS.items():
        value = values.pop(name, None)
        fields[name] = getattr(preset, column) if value is None else value
        if value is not None and value != getattr(preset, column):
            changed.append(f"{flag} {value:g}")
    rest = {k: v for k, v in values.items() if v is not None}
    label = None if gpu is None else gpu + (f" with {', '.join(changed)}" if changed else "")
    return Cluster(num_gpus=num_gpus, gpus_per_node=gpus_per_node, gpu=label, **fields, **rest)
