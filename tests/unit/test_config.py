"""The config contract: bad input gives one line naming the setting, the values and the fix,
raised by pure validation (no process group, nothing written)."""

from __future__ import annotations

import copy
import json

import pytest
from tiny import tiny_model

from ds_megatron.config import ConfigError, resolve

BASE = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "ds_megatron": {
        "model": tiny_model(),
        "parallel": {"tp": 2, "pp": 2},
    },
}


def with_changes(world: int = 8, **changes) -> tuple[dict, int]:
    cfg = copy.deepcopy(BASE)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg, world


BAD = [
    (
        "hidden not divisible by heads",
        with_changes(ds_megatron__model__hidden_size=65),
        "ds_megatron.model.hidden_size",
        ["65", "4"],
    ),
    (
        "heads not divisible by tp",
        with_changes(ds_megatron__parallel__tp=3, world=12),
        "ds_megatron.parallel.tp",
        ["num_heads=4", "tp=3"],
    ),
    (
        "fewer layers than stages",
        with_changes(ds_megatron__parallel__pp=8, world=16),
        "ds_megatron.parallel.pp",
        ["num_layers=4", "pp=8"],
    ),
    ("tp*pp does not divide world", with_changes(world=6), "ds_megatron.parallel", ["tp(2) x pp(2)", "world size 6"]),
    ("batch arithmetic", with_changes(train_batch_size=10), "train_batch_size", ["10 != 2 x 2 x 2 = 8"]),
    (
        "batch split over dp",
        with_changes(train_batch_size=10, gradient_accumulation_steps=None),
        "train_batch_size",
        ["does not split into micro batches over dp", "train_batch_size=10", "dp=2", "multiple of 4"],
    ),
    (
        "unknown key",
        with_changes(ds_megatron__parallel__tensor_parallel=2),
        "ds_megatron.parallel.tensor_parallel",
        ["did you mean"],
    ),
    ("wrong type", with_changes(ds_megatron__parallel__tp="2"), "ds_megatron.parallel.tp", ["'2'"]),
    (
        "zero 3 with pipeline",
        with_changes(zero_optimization={"stage": 3}),
        "zero_optimization.stage",
        ["stage=3", "pp=2"],
    ),
    (
        # every run is a DeepSpeed PipelineModule, whose engine asserts ZeRO < 2 at pp 1 too (in deepspeed.initialize)
        "zero 2 without pipeline stages",
        with_changes(zero_optimization={"stage": 2}, ds_megatron__parallel__pp=1, world=4),
        "zero_optimization.stage",
        ["stage=2", "pp=1"],
    ),
    ("bf16 and fp16", with_changes(bf16={"enabled": True}, fp16={"enabled": True}), "bf16.enabled", ["bf16=true"]),
    (
        "fp32 gradient accumulation of bf16 at ZeRO 0",  # DeepSpeed: NotImplementedError inside initialize
        with_changes(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}),
        "data_types.grad_accum_dtype",
        ["grad_accum_dtype=fp32, model bf16, zero_optimization.stage=0", "set zero_optimization.stage to 1"],
    ),
    (
        "unknown gradient accumulation dtype",
        with_changes(data_types={"grad_accum_dtype": "fp8"}, zero_optimization={"stage": 1}),
        "data_types.grad_accum_dtype",
        ["'fp8'"],
    ),
    (
        "sp with indivisible sequence",
        with_changes(ds_megatron__model__seq_length=15, ds_megatron__parallel__sequence_parallel=True),
        "ds_megatron.parallel.sequence_parallel",
        ["seq_length=15", "tp=2"],
    ),
    (
        "unknown attention",
        with_changes(ds_megatron__model__attention="flash"),
        "ds_megatron.model.attention",
        ["'flash'"],
    ),
    ("unknown size", with_changes(ds_megatron__model__size="gpt3-125"), "ds_megatron.model.size", ["gpt3-125m"]),
    (
        "sequence above position table",
        with_changes(ds_megatron__model__max_position_embeddings=8),
        "ds_megatron.model.seq_length",
        ["seq_length=16", "max_position_embeddings=8"],
    ),
    ("non-positive batch", with_changes(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu", ["0"]),
    (
        "negative norm epsilon",
        with_changes(ds_megatron__model__layer_norm_epsilon=-1e-5),
        "ds_megatron.model.layer_norm_epsilon",
        ["-1e-05"],
    ),
    ("zero init std", with_changes(ds_megatron__model__init_std=0.0), "ds_megatron.model.init_std", ["0.0"]),
    ("negative seed", with_changes(ds_megatron__train__seed=-5), "ds_megatron.train.seed", ["-5"]),
    (
        "negative keep_last",
        with_changes(ds_megatron__checkpoint__keep_last=-1),
        "ds_megatron.checkpoint.keep_last",
        ["-1"],
    ),
    ("zero num_proc", with_changes(ds_megatron__data__num_proc=0), "ds_megatron.data.num_proc", ["0"]),
    (
        "unknown wandb mode",
        with_changes(ds_megatron__logging__wandb_mode="of"),
        "ds_megatron.logging.wandb_mode",
        ["'of'"],
    ),
    (
        "peak below zero",
        with_changes(ds_megatron__logging__peak_tflops=-1.0),
        "ds_megatron.logging.peak_tflops",
        ["-1.0"],
    ),
    ("non-positive steps", with_changes(ds_megatron__train__train_iters=0), "ds_megatron.train.train_iters", ["0"]),
    (
        "odd llama head dimension",  # the rotary embedding turns a head's dimensions in pairs
        with_changes(
            ds_megatron__model__family="llama",
            ds_megatron__model__hidden_size=60,
            ds_megatron__model__intermediate_size=160,
        ),
        "ds_megatron.model.hidden_size",
        ["head dimension must be even for the rotary embedding", "hidden_size=60 / num_heads=4 = 15", "hidden_size 64"],
    ),
]


@pytest.mark.parametrize("name,case,setting,values", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_setting_values_and_fix(name, case, setting, values):
    cfg, world = case
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"error: {setting}: "), msg
    for v in values:
        assert v in msg, (v, msg)
    assert ";" in msg  # the fix follows the values


def test_good_config_resolves():
    run = resolve(copy.deepcopy(BASE), 8)
    assert (run.tp, run.pp, run.dp) == (2, 2, 2)
    assert (run.micro_batch_size, run.grad_accum_steps, run.global_batch_size) == (2, 2, 8)


def test_attention_kernel_defaults_to_sdpa():
    """A config that names no kernel runs sdpa (on a GPU flash or memory-efficient attention: no s x s scores held
    per head and micro-batch, as eager holds them); eager stays one setting away.  Selective recompute with its
    default module, core_attn, then needs eager and says so."""
    assert resolve(copy.deepcopy(BASE), 8).model.attention == "sdpa"
    cfg, world = with_changes(ds_megatron__model__attention="eager")
    assert resolve(cfg, world).model.attention == "eager"
    cfg, world = with_changes(ds_megatron__recompute={"policy": "selective"})
    with pytest.raises(ConfigError, match=r"modules=\['core_attn'\] \(the default\), attention=sdpa"):
        resolve(cfg, world)
    cfg, world = with_changes(ds_megatron__recompute={"policy": "selective", "modules": ["mlp_act"]})
    assert resolve(cfg, world).section.recompute.selective_modules == ("mlp_act",)


def test_batch_arithmetic_fills_the_missing_key():
    cfg = copy.deepcopy(BASE)
    del cfg["gradient_accumulation_steps"]
    assert resolve(cfg, 8).grad_accum_steps == 2
    cfg = copy.deepcopy(BASE)
    del cfg["train_batch_size"]
    assert resolve(cfg, 8).global_batch_size == 8


def test_named_size_fills_the_shape():
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "ds_megatron": {"model": {"size": "gpt3-175b"}, "parallel": {"tp": 8, "pp": 8}},
    }
    run = resolve(cfg, 1024)
    assert (run.model.num_layers, run.model.hidden_size, run.model.num_heads) == (96, 12288, 96)
    assert (run.model.vocab_size, run.model.seq_length, run.dp) == (50257, 2048, 16)


def test_config_error_keeps_its_parts_across_processes():
    """prepare's worker processes raise it: unpickled in the parent, it is the same line with the same parts."""
    import pickle

    err = ConfigError("--data", "invalid JSON in a.jsonl at byte 7", "Expecting value", "fix or remove that line")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "error: --data: invalid JSON in a.jsonl at byte 7 (Expecting value); fix or remove that line"
    assert (back.setting, back.problem, back.values, back.fix) == (err.setting, err.problem, err.values, err.fix)


# Every kind of place a number sits in a config: DeepSpeed's own keys (optimizer params, a list inside them, clipping,
# scheduler params, a section ds_megatron never reads), and ours (model, train, data, logging, a blend's weight).
# (the path an error names, the key set, how the number sits under that key)
NUMBERS = [
    ("optimizer.params.lr", "optimizer", lambda x: {"type": "AdamW", "params": {"lr": x}}),
    ("optimizer.params.betas[1]", "optimizer", lambda x: {"type": "AdamW", "params": {"betas": [0.9, x]}}),
    ("gradient_clipping", "gradient_clipping", lambda x: x),
    (
        "scheduler.params.warmup_max_lr",
        "scheduler",
        lambda x: {"type": "WarmupCosineLR", "params": {"warmup_max_lr": x}},
    ),
    ("fp16.loss_scale", "fp16", lambda x: {"enabled": False, "loss_scale": x}),
    ("ds_megatron.model.dropout", "ds_megatron.model.dropout", lambda x: x),
    ("ds_megatron.model.layer_norm_epsilon", "ds_megatron.model.layer_norm_epsilon", lambda x: x),
    ("ds_megatron.train.sample_temperature", "ds_megatron.train.sample_temperature", lambda x: x),
    ("ds_megatron.data.valid_fraction", "ds_megatron.data.valid_fraction", lambda x: x),
    ("ds_megatron.logging.peak_tflops", "ds_megatron.logging.peak_tflops", lambda x: x),
    ("ds_megatron.data.blend[0][1]", "ds_megatron.data.blend", lambda x: [["a.prepared", x]]),
]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("path,key,wrap", NUMBERS, ids=[n[0] for n in NUMBERS])
def test_every_number_must_be_finite(path, key, wrap, literal):
    """Python's json reads NaN and Infinity; a NaN passes every check written as a comparison (``lr <= 0`` is false)
    and fails inside torch once the engine is built.  Any non-finite number, wherever it sits, is one line."""
    value = json.loads(literal)
    cfg = copy.deepcopy(BASE)
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = wrap(value)
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 8)
    assert str(err.value) == (
        f"error: {path}: must be a finite number (got {value}); write a finite number (NaN and Infinity are not "
        "values a run can use)"
    )


def test_which_optimizer_wrapper_deepspeed_builds():
    """The one owner of DeepSpeed's choice (its engine's ``_do_optimizer_sanity_check``), read by the offline
    resharder and by whether a dp change needs resharding."""
    from ds_megatron.config.facts import deepspeed_wraps_optimizer, optimizer_wrapper

    def cfg(prec: str | None, stage: int, accum: str | None = None, offload: str | None = None) -> dict:
        out = {"zero_optimization": {"stage": stage}}
        if prec:
            out[prec] = {"enabled": True}
        if accum:
            out["data_types"] = {"grad_accum_dtype": accum}
        if offload:
            out["zero_optimization"]["offload_optimizer"] = {"device": offload}
        return out

    assert optimizer_wrapper(cfg(None, 0)) is None and not deepspeed_wraps_optimizer(cfg(None, 0))
    assert optimizer_wrapper(cfg(None, 1)) == "ZeRO" and deepspeed_wraps_optimizer(cfg(None, 1))
    assert optimizer_wrapper(cfg("bf16", 1, "fp32")) == "BF16"
    assert optimizer_wrapper(cfg("bf16", 1, "float32")) == "BF16"
    assert optimizer_wrapper(cfg("bf16", 1)) == "ZeRO" and optimizer_wrapper(cfg("bf16", 1, "bf16")) == "ZeRO"
    assert optimizer_wrapper(cfg("bf16", 1, "fp32", offload="cpu")) == "ZeRO"
    assert optimizer_wrapper(cfg("bf16", 0)) == "BF16"
    assert optimizer_wrapper(cfg("fp16", 0)) == "FP16" and optimizer_wrapper(cfg("fp16", 1)) == "ZeRO"


@pytest.mark.parametrize(
    "changes,warned",
    [
        (
            {"ds_megatron__parallel__cp_comm": "a2a"},
            ["ds_megatron.parallel.cp_comm does nothing here: 'a2a' with cp 1"],
        ),
        (
            {"ds_megatron__data__document_positions": "global"},
            ["ds_megatron.data.document_positions does nothing here: 'global' applies with data.document_mask"],
        ),
        (
            {"ds_megatron__parallel__tp": 1, "ds_megatron__parallel__sequence_parallel": True, "train_batch_size": 16},
            ["ds_megatron.parallel.sequence_parallel does nothing here: with tp 1"],
        ),
        # read in these layouts, or left at their defaults: nothing to say
        (
            {
                "ds_megatron__parallel__cp": 2,
                "ds_megatron__parallel__cp_comm": "a2a",
                "ds_megatron__model__dropout": 0,
                "train_batch_size": 4,
            },
            [],
        ),
        ({"ds_megatron__data__document_mask": True, "ds_megatron__data__document_positions": "global"}, []),
        ({}, []),
    ],
)
def test_settings_nothing_reads_are_named(changes, warned):
    """A setting the user gave that this layout never reads is accepted (a config may be shared between layouts) but
    named in one warning line; the engine prints these lines at start."""
    from ds_megatron.config import unused_settings
    from ds_megatron.engine import deepspeed_config_for

    run = resolve(*with_changes(**changes))
    lines = unused_settings(run)
    assert len(lines) == len(warned) and all(
        line.startswith(f"warning: {w}") for line, w in zip(lines, warned, strict=True)
    ), lines
    notes: list[str] = []
    deepspeed_config_for(run, notes)
    assert [n for n in notes if n.startswith("warning:")] == lines


def test_eval_only_needs_weights_to_evaluate_and_lifts_train_iters():
    """``--eval-only`` evaluates what --load or --init-from-hf loads: without either it is refused; with it
    train_iters 0 is accepted; and train_iters 0 alone names --eval-only in its fix."""
    cfg, world = with_changes(ds_megatron__train__eval_only=True)
    with pytest.raises(ConfigError, match="^error: ds_megatron.train.eval_only: nothing to evaluate"):
        resolve(cfg, world)
    resolve(*with_changes(ds_megatron__train__eval_only=True, ds_megatron__checkpoint__load="ck"))
    resolve(
        *with_changes(
            ds_megatron__train__eval_only=True, ds_megatron__train__train_iters=0, ds_megatron__checkpoint__load="ck"
        )
    )
    with pytest.raises(ConfigError, match="train_iters: must be a positive integer .got 0.; .* pass --eval-only"):
        resolve(*with_changes(ds_megatron__train__train_iters=0))


def test_the_batch_split_names_the_callers_setting():
    """One rule, one message: the config blames train_batch_size, the offline reshard its --dp flag."""
    from ds_megatron.config.rules import CONFIG_FILE_RULES, check_batch_split
    from ds_megatron.config.shape import Vocabulary

    check_batch_split(12, 2, 3, CONFIG_FILE_RULES)  # 12 = 2 x 2 x 3: splits
    values = "(train_batch_size=12, train_micro_batch_size_per_gpu=2, dp=4)"
    with pytest.raises(ConfigError) as err:
        check_batch_split(12, 2, 4, CONFIG_FILE_RULES)
    assert str(err.value) == (
        f"error: train_batch_size: the global batch does not split into micro batches over dp {values}; "
        "use a dp dividing 6, or set train_batch_size to a multiple of 8"
    )
    with pytest.raises(ConfigError) as err:
        check_batch_split(12, 2, 4, Vocabulary(prefix="", refs={"batch_split": "--dp"}))
    assert str(err.value).startswith("error: --dp: the global batch does not split into micro batches over dp (")
