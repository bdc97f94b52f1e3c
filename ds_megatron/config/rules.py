"""L0.2: the rules that more than one command checks, each in one function here.  A rule names settings through the
caller's :class:`~ds_megatron.config.shape.Vocabulary` (``CONFIG_FILE_RULES`` for the config file's keys, or a
command's flags), so the user reads it in the words they typed.  Standard library only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ds_megatron.config.errors import ConfigError
from ds_megatron.config.shape import Vocabulary

# The config file's keys for the settings the rules speak of (prefix-free: DeepSpeed's own keys have none).
CONFIG_FILE_RULES = Vocabulary(
    prefix="",
    refs={
        "zero": "zero_optimization.stage",
        "tokenizer": "ds_megatron.data.tokenizer",
        "vocab_size": "ds_megatron.model.vocab_size",
        "recompute_modules": "ds_megatron.recompute.modules",
        "valid_fraction": "ds_megatron.data.valid_fraction",
        "batch_split": "train_batch_size",
        "tp": "ds_megatron.parallel.tp",
        "attention": "ds_megatron.model.attention",
    },
)

# What TP splits, and why a tp must divide it.
TP_SPLITS = {
    "num_heads": "TP splits the query heads",
    "num_kv_heads": "TP splits the KV heads like the query heads",
    "intermediate_size": "TP splits the MLP width",
    "moe_intermediate_size": "TP splits each expert's MLP width",
}


def tp_misfit(shape: Any, tp: int) -> str | None:
    """The first field of TP_SPLITS that ``tp`` does not divide (None: tp fits the shape)."""
    return next((name for name in TP_SPLITS if getattr(shape, name) % tp != 0), None)


def check_tp_fits(shape: Any, tp: int, words: Vocabulary, choices: list[int] | None = None) -> None:
    """Refuse a tp that does not divide what TP splits (:func:`tp_misfit`), naming the tps that fit: ``choices``
    when the caller narrows them further (a TP group inside a node), else every tp up to the number of heads."""
    name = tp_misfit(shape, tp)
    if name is not None:
        if choices is None:
            choices = [t for t in range(1, shape.num_heads + 1) if tp_misfit(shape, t) is None]
        reason = "" if name == "num_heads" else f" ({TP_SPLITS[name]})"
        raise ConfigError(
            words.setting("tp"),
            f"{name} not divisible by tp",
            f"{name}={getattr(shape, name)}, tp={tp}",
            f"choose tp from {choices}{reason}",
        )


# The overlapped data-parallel reduction's bucket (parallel.overlap_grad_reduce, pipeline_parallel.grad_reduce), which
# the tuner's time model times too: 4M elements (16 MiB of fp32) per all-reduce, large enough for bandwidth, small
# enough to start while the backward of earlier layers still runs (torch DDP's default bucket is 25 MiB, Megatron-LM's
# 40M elements).
GRAD_REDUCE_BUCKET_ELEMENTS = 2**22

# Every ds_megatron run is a DeepSpeed PipelineModule, at pp 1 too, and DeepSpeed's PipelineEngine asserts a ZeRO
# stage below 2 in its constructor ("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism", deepspeed
# 0.19.8), on every rank inside deepspeed.initialize.
PIPELINE_ZERO_STAGES = (0, 1)


def check_zero_stage(stage: int, pp: int | None, words: Vocabulary) -> None:
    if stage not in PIPELINE_ZERO_STAGES:
        raise ConfigError(
            words.setting("zero"),
            "DeepSpeed's pipeline engine (every ds_megatron run, pp 1 included) supports ZeRO stage 0 or 1 only",
            f"stage={stage}" + ("" if pp is None else f", pp={pp}"),
            f"set {words.ref('zero')} to 1",
        )


def core_attn_saves_nothing(attention: str, modules: tuple[str, ...]) -> bool:
    """Selective recompute of ``core_attn`` checkpoints the s x s attention core, which the sdpa kernel never
    stores: it would save nothing and cost a recompute.  Refused by the config and the tuner's pins, never searched,
    an error of the memory formula."""
    return attention == "sdpa" and "core_attn" in modules


def check_core_attn(attention: str, modules: tuple[str, ...], words: Vocabulary, defaulted: bool = False) -> None:
    """Refuse :func:`core_attn_saves_nothing`; ``defaulted``: the modules are the default list, not the user's."""
    if core_attn_saves_nothing(attention, modules):
        raise ConfigError(
            words.setting("recompute_modules"),
            "core_attn recomputes the s x s attention core, which the sdpa kernel never stores, so it would save "
            "nothing and cost a recompute",
            f"policy=selective, modules={list(modules)}{' (the default)' if defaulted else ''}, attention=sdpa",
            f"with sdpa list other modules in {words.ref('recompute_modules')} (e.g. mlp_act, layernorm), or set "
            f"{words.ref('attention')} to eager",
        )


def check_valid_fraction(fraction: float, words: Vocabulary) -> None:
    """The tail of the token stream held out for validation (text tokenised in the launch, prepared directories,
    Megatron indexed data): a fraction in (0, 0.5)."""
    if not 0.0 < fraction < 0.5:
        raise ConfigError(words.setting("valid_fraction"), "must be in (0, 0.5)", f"got {fraction}", "use e.g. 0.02")


def check_batch_split(global_batch: int, micro: int, dp: int, words: Vocabulary) -> None:
    """A step's global batch is whole micro-batches on each of the dp replicas: train_batch_size divisible by
    micro batch x dp.  The error names ``words.setting("batch_split")``: train_batch_size in a config, the offline
    reshard's ``--dp``, the tuner's ``--global-batch-size``; ``words.noun`` says the two batch keys."""
    if global_batch % (micro * dp) != 0:
        other_dp = f"use a dp dividing {global_batch // micro}, or " if global_batch % micro == 0 else ""
        glob, mb = words.noun("train_batch_size"), words.noun("train_micro_batch_size_per_gpu")
        raise ConfigError(
            words.setting("batch_split"),
            "the global batch does not split into micro batches over dp",
            f"{glob}={global_batch}, {mb}={micro}, dp={dp}",
            f"{other_dp}set {glob} to a multiple of {micro * dp}",
        )


MIN_BPE_SIZE = 260  # the byte-level BPE starts from 256 byte tokens and EOS; below a few merges it is no BPE


def check_tokenizer_spec(spec: str, words: Vocabulary) -> None:
    """``bpe:N`` with N >= MIN_BPE_SIZE, or an existing tokenizer directory."""
    if spec.startswith("bpe:"):
        size = spec.removeprefix("bpe:")
        if not size.isdigit() or int(size) < MIN_BPE_SIZE:
            raise ConfigError(
                words.setting("tokenizer"),
                f"bpe size must be an integer >= {MIN_BPE_SIZE}",
                f"got {spec!r}",
                "write e.g. bpe:8192",
            )
    elif not Path(spec).is_dir():
        raise ConfigError(
            words.setting("tokenizer"),
            "not a directory nor bpe:N",
            f"got {spec!r}",
            "pass a tokenizer directory or bpe:N",
        )


def check_tokenizer_fits(
    size: int,
    source: str,
    vocab_size: int,
    words: Vocabulary,
    setting: str | None = None,
    problem: str = "tokenizer vocabulary larger than the model's",
) -> None:
    """A tokenizer of ``size`` tokens (``source``: its spec, directory or count as the values show it) must fit the
    model's vocabulary: a larger id would index past the embedding.  ``setting``: where the tokenizer came from
    (default: the tokenizer setting)."""
    if size > vocab_size:
        raise ConfigError(
            setting or words.setting("tokenizer"),
            problem,
            f"{source} > vocab_size {vocab_size}",
            f"set {words.ref('vocab_size')} to at least {size}",
        )
