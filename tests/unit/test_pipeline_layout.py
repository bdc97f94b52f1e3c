"""Uneven pipeline stages (``ds_megatron.parallel.pipeline_layout``, ``--pipeline-layout``): the refusals before
launch, the stage boundaries a layout gives (``pipeline_parallel.module.stage_parts``, the one table the module, the
engines and the checkpoint readers read), and the resharding decision.  No process group: training at an uneven
layout (bit for bit the even one's, 1F1B and interleaved) and resuming an even checkpoint at an uneven layout run in
the parity launch (tests/launcher/test_parity.py)."""

from __future__ import annotations

import copy

import pytest

from ds_megatron.checkpoint.layout import shard_context, stage_param_layers
from ds_megatron.cli.train import apply_overrides, build_parser
from ds_megatron.config import ConfigError, resolve
from ds_megatron.config.facts import needs_resharding
from ds_megatron.model import model_config
from ds_megatron.pipeline_parallel.module import PipelineLayout, layer_specs, stage_parts

BASE = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "ds_megatron": {
        "model": {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "vocab_size": 1001, "seq_length": 16},
        "parallel": {"pp": 2},
    },
}


def cfg(layout=None, layers: int = 4, **parallel) -> dict:
    out = copy.deepcopy(BASE)
    out["ds_megatron"]["model"]["num_layers"] = layers
    out["ds_megatron"]["parallel"].update(parallel)
    if layout is not None:
        out["ds_megatron"]["parallel"]["pipeline_layout"] = layout
    return out


INTERLEAVED = {"pipeline_schedule": "interleaved-1f1b", "virtual_stages": 2}
SETTING = "ds_megatron.parallel.pipeline_layout: "


@pytest.mark.parametrize(
    "config, message",
    [
        (cfg([1, 3]), None),
        (cfg([0, 4]), None),  # the first stage holds the embedding alone
        (cfg([4, 0]), None),  # the last stage the final norm, output layer and loss alone
        (cfg([0, 1, 3, 0], **INTERLEAVED), None),
        (cfg([0, 2, 2, 0], pipeline_schedule="dualpipev"), None),
        (cfg([0, 1, 1, 0], layers=2, **INTERLEAVED), None),  # fewer blocks than stages: the ends hold none
        (
            cfg([1, 1, 2]),
            SETTING + "one block count per pipeline stage, in model order (pipeline_layout=[1, 1, 2] has 3 entries; "
            "pp 2 = 2 stages); give 2 counts summing to 4, e.g. [2, 2]",
        ),
        (
            cfg([2, 2], **INTERLEAVED),
            SETTING + "one block count per pipeline stage, in model order (pipeline_layout=[2, 2] has 2 entries; pp 2 "
            "x 2 stages per rank of interleaved-1f1b = 4 stages); give 4 counts summing to 4, e.g. [1, 1, 1, 1]",
        ),
        (
            cfg([1, 1, 1], pipeline_schedule="dualpipev"),
            SETTING + "one block count per pipeline stage, in model order (pipeline_layout=[1, 1, 1] has 3 entries; pp "
            "2 x 2 stages per rank of dualpipev = 4 stages)",
        ),
        (
            cfg([2, 3]),
            SETTING + "the block counts do not sum to the model's layers (pipeline_layout=[2, 3] sums to 5, "
            "num_layers=4); give 2 counts summing to 4, e.g. [2, 2]",
        ),
        (cfg([-1, 5]), SETTING + "a block count is negative (pipeline_layout=[-1, 5]); use counts >= 0, e.g. [2, 2]"),
        (
            cfg([1, 0, 2, 1], **INTERLEAVED),
            SETTING + "a stage other than the first (the embedding) and the last (the output layer and loss) holds no "
            "block (pipeline_layout=[1, 0, 2, 1]: stage 1 of 4 is empty); give every middle stage at least 1 block, "
            "e.g. [1, 1, 1, 1]",
        ),
        (
            cfg([1, 3], partition_method="uniform"),
            SETTING + "pipeline_layout sets the stages' blocks itself, so a partition_method would be ignored "
            "(pipeline_layout=[1, 3], partition_method='uniform'); remove one of the two",
        ),
        (cfg([1.5, 2.5]), SETTING + "block counts must be integers (pipeline_layout=[1.5, 2.5])"),
        (cfg("1,3"), SETTING + "must be tuple"),
    ],
)
def test_the_layout_is_checked_before_launch(config, message):
    if message is None:
        run = resolve(config, 2)
        assert run.section.parallel.pipeline_layout == tuple(config["ds_megatron"]["parallel"]["pipeline_layout"])
        return
    with pytest.raises(ConfigError) as err:
        resolve(config, 2)
    text = str(err.value).removeprefix("error: ")
    assert text.startswith(message) and "\n" not in text, text


def test_full_recompute_counts_the_largest_stage_of_the_layout():
    """Balanced, 4 blocks over pp 2 hold at most 2 per stage; the layout [1, 3] holds 3 on its last stage."""
    full = {"policy": "full", "num_layers": 3, "method": "block"}
    with pytest.raises(ConfigError, match=r"4 layers / pp 2 = at most 2 per stage"):
        resolve({**cfg(), "ds_megatron": {**cfg()["ds_megatron"], "recompute": full}}, 2)
    uneven = cfg([1, 3])
    uneven["ds_megatron"]["recompute"] = full
    assert resolve(uneven, 2).section.recompute.num_layers == 3
    uneven["ds_megatron"]["recompute"] = {**full, "num_layers": 4}
    with pytest.raises(ConfigError, match=r"num_layers=4, pipeline_layout=\[1, 3\]: at most 3 per stage"):
        resolve(uneven, 2)


def test_the_command_line_flag_sets_the_layout():
    args = build_parser().parse_args(["--deepspeed_config", "x.json", "--pipeline-layout", "0,1,3,0"])
    out = apply_overrides(cfg(**INTERLEAVED), args)
    assert resolve(out, 2).section.parallel.pipeline_layout == (0, 1, 3, 0)
    bad = build_parser().parse_args(["--deepspeed_config", "x.json", "--pipeline-layout", "1;3"])
    with pytest.raises(ConfigError) as err:
        apply_overrides(cfg(), bad)
    assert str(err.value) == (
        "error: --pipeline-layout: not a comma-separated list of block counts (got '1;3'); write one integer per "
        "pipeline stage, e.g. --pipeline-layout 3,5,5,3"
    )


def test_block_counts_map_to_layer_boundaries():
    """GPT-2's layers are wte, wpe, 4 blocks, ln_f and the tied output layer; Llama's embed_tokens, 4 blocks, norm
    and the output layer: the embedding (and positions) go with the first stage, the norm and output with the last."""
    gpt, llama = PipelineLayout(4), PipelineLayout(4, "llama", tied=False)
    assert gpt.parts_of([2, 2]) == [0, 4, 8]
    assert gpt.parts_of([1, 3]) == [0, 3, 8]
    assert gpt.parts_of([0, 4]) == [0, 2, 8]  # wte and wpe alone on stage 0
    assert gpt.parts_of([4, 0]) == [0, 6, 8]  # ln_f and the output layer alone on stage 1
    assert gpt.parts_of([0, 1, 3, 0]) == [0, 2, 3, 6, 8]
    assert gpt.parts_of([4]) == [0, 8]
    assert gpt.blocks_of([0, 2, 3, 6, 8]) == [0, 1, 3, 0] and llama.blocks_of([0, 2, 4, 7]) == [1, 2, 1]
    assert llama.parts_of([1, 2, 1]) == [0, 2, 4, 7]
    with pytest.raises(ValueError):
        gpt.parts_of([2, 3])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_balanced_split_is_a_layout_too(family):
    """Without a layout, DeepSpeed's ``type:BlockPipe`` split keeps the embedding on the first stage and the output
    layer on the last, so it is the table of its own block counts: a run can write its split out and get the same
    stages (up to 12 blocks over up to 8 stages)."""
    for layers in range(1, 13):
        run = resolve(cfg(layers=layers, pp=1), 1)
        config = model_config(run.model)
        layout = PipelineLayout.of(config)
        specs = layer_specs(config, shard_context(config, run, 1), 0)
        for stages in range(1, min(layers, 8) + 1):
            parts = stage_parts(layout, specs, stages, "type:BlockPipe", None)
            blocks = layout.blocks_of(parts)
            assert layout.parts_of(blocks) == parts, (layers, stages, parts)
            assert blocks == [layers // stages + (s < layers % stages) for s in range(stages)]  # the first get more
            assert stage_parts(layout, specs, stages, "type:BlockPipe", blocks) == parts


def test_the_checkpoint_table_reads_the_layout():
    """The layers each rank holds, in the optimizer's order (what resharding and the fp32-master reader map by):
    GPT-2, 4 blocks, tied output layer registered under layer 0."""
    run = resolve(cfg([1, 3]), 2)
    assert stage_param_layers(model_config(run.model), run, 2) == [[0, 1, 2], [0, 3, 4, 5, 6]]
    even = resolve(cfg(), 2)
    assert stage_param_layers(model_config(even.model), even, 2) == [[0, 1, 2, 3], [0, 4, 5, 6]]
    # interleaved, stages 0 and 2 on rank 0: wte + wpe, then blocks 1-3; rank 1 block 0, then ln_f + the output
    run = resolve(cfg([0, 1, 3, 0], **INTERLEAVED), 2)
    assert stage_param_layers(model_config(run.model), run, 2) == [[0, 1, 3, 4, 5], [0, 2, 6]]
    # DualPipeV: stages 0 and 3 on rank 0 (the embedding, blocks 3 and the output), 1 and 2 on rank 1
    run = resolve(cfg([1, 1, 1, 1], pipeline_schedule="dualpipev"), 2)
    assert stage_param_layers(model_config(run.model), run, 2) == [[0, 1, 2, 5, 6], [3, 4]]


def test_another_split_reshards_on_load():
    """A rank's optimizer files hold other layers under another split: resuming across it reshards (a layout
    written out equal to the balanced split too: the same result, by the slower load)."""
    even, uneven = resolve(cfg(), 2).ds_config, resolve(cfg([1, 3]), 2).ds_config
    assert needs_resharding(even, uneven) and needs_resharding(uneven, even)
    assert not needs_resharding(uneven, resolve(cfg([1, 3]), 2).ds_config)
    assert needs_resharding(uneven, resolve(cfg([3, 1]), 2).ds_config)
    assert needs_resharding(even, resolve(cfg([2, 2]), 2).ds_config)
