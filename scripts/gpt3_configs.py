"""Write ds_configs/gpt3_<size>.json and recipes/gpt3_<size>.sh: the layout chosen by the tuner
(``python -m ds_megatron.tune``) for nodes of 8 H100 SXM GPUs, plus GPT-3's published training hyperparameters; and
the paper variant ds_configs/paper/gpt3_175b_a100.json with recipes/paper/gpt3_175b_a100.sh.

    .venv/bin/python scripts/gpt3_configs.py   # rewrites the nine configs and recipes, prints the README table

Hyperparameters (Brown et al. 2020, Table 2.1 and appendix B): s 2048, the batch size in tokens and the peak
learning rate of each size (ds_megatron.config.sizes), AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1,
clipping 1.0, linear warm-up over the first 375M tokens, cosine decay to 10% of the peak at 260B tokens, 300B tokens
in all (constant after the decay); dropout 0.1 (GPT-2's, which the paper does not change).  bf16 with ZeRO-1 and fp32
gradient accumulation.

Nodes: the smallest cluster each size was first sized for (1 node up to 1.3B, then 2, 4, 8 and 128), unchanged: at
every size the tuner's winner on that many H100s predicts an MFU of at least 49%.

Paper variant: GPT-3 175B as Korthikanti et al. 2022 train it (Table 3: tp 8, pp 8, eager attention with SP and
selective recompute, micro-batch 1) on the 1,024 A100 80GB GPUs of the NeMo Megatron announcement, with GPT-3's own
batch of 1,536 sequences (3.2M tokens): the same hyperparameters, the layout pinned instead of searched.
"""

from __future__ import annotations

from tuned_configs import Tuned, recipe, run_sections, tune, warmup_cosine, write

from ds_megatron.config.sizes import LEARNING_RATES
from ds_megatron.tune import Pins
from ds_megatron.tune.core.memory_model import GIB

SEQ = 2048
WARMUP_TOKENS = 375e6
DECAY_TOKENS = 260e9
TOKENS = 300e9
DROPOUT = 0.1
SIZES = {  # file stem: (named size, GPUs, global batch in sequences of 2048: 0.5M, 1M, 2M and 3.2M tokens)
    "gpt3_125m": ("gpt3-125m", 8, 256),
    "gpt3_350m": ("gpt3-350m", 8, 256),
    "gpt3_760m": ("gpt3-760m", 8, 256),
    "gpt3_1.3b": ("gpt3-1.3b", 8, 512),
    "gpt3_2.7b": ("gpt3-2.7b", 16, 512),
    "gpt3_6.7b": ("gpt3-6.7b", 32, 1024),
    "gpt3_13b": ("gpt3-13b", 64, 1024),
    "gpt3_175b": ("gpt3-175b", 1024, 1536),
}
GPU = "h100-sxm"
PAPER = ("paper/gpt3_175b_a100", "gpt3-175b", 1024, 1536, "a100-80gb")
PAPER_PINS = Pins(tp=8, pp=8, micro_batch_size=1, sequence_parallel=True, recompute="selective", attention="eager")
USAGE = '--data "my/corpus/*.jsonl" [more train_gpt.py flags]'
GENERATOR = "scripts/gpt3_configs.py"


def config(stem: str, size: str, tuned: Tuned) -> dict:
    """GPT-3's hyperparameters around the tuner's layout, in the order the shipped GPT-3 configs keep."""
    layout = tuned.config
    tokens = layout["train_batch_size"] * SEQ
    recompute = dict(layout["ds_megatron"]["recompute"])
    if recompute["policy"] != "full":  # chunk size and method only mean something for full recompute
        recompute = {k: v for k, v in recompute.items() if k in ("policy", "modules")}
    section = {
        "model": {"size": size, "dropout": DROPOUT, "attention": layout["ds_megatron"]["model"]["attention"]},
        "parallel": layout["ds_megatron"]["parallel"],
        "recompute": recompute,
        **run_sections(stem, round(TOKENS / tokens)),
    }
    return {
        "train_batch_size": layout["train_batch_size"],
        "train_micro_batch_size_per_gpu": layout["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": layout["gradient_accumulation_steps"],
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LEARNING_RATES[size], "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "scheduler": warmup_cosine(round(DECAY_TOKENS / tokens), round(WARMUP_TOKENS / tokens)),
        "steps_per_print": 1_000_000_000,
        "ds_megatron": section,
    }


def title(size: str) -> str:
    return f"GPT-3 {size.removeprefix('gpt3-').upper()} (Brown et al. 2020)"


def table_row(size: str, tuned: Tuned) -> str:
    """One row of the README's table: layout, predicted memory of the fuller stage and MFU."""
    c, w = tuned.winner.candidate, tuned.winner
    nodes = max(1, c.tp * c.pp * c.dp // 8)
    return (
        f"| {size.removeprefix('gpt3-').upper()} | {nodes} | {c.tp} x {c.pp} x {c.dp} | "
        f"{'on' if c.sequence_parallel else '-'} | {c.recompute_label()} | {c.attention} | "
        f"{c.micro_batch_size} x {c.num_micro_batches} | {w.required_bytes / GIB:.1f} GiB | {w.time.mfu:.1%} |"
    )


def main() -> None:
    rows = []
    for stem, (size, gpus, batch) in SIZES.items():
        tuned = tune(size, gpus, batch, GPU)
        write(stem, config(stem, size, tuned), recipe(stem, title(size), tuned, GPU, GENERATOR, "", USAGE))
        rows.append(table_row(size, tuned))
    stem, size, gpus, batch, gpu = PAPER
    tuned = tune(size, gpus, batch, gpu, PAPER_PINS)
    note = "The paper's layout (Korthikanti et al. 2022), pinned."
    write(stem, config(stem, size, tuned), recipe(stem, title(size), tuned, gpu, GENERATOR, note, USAGE))
    print("\n| size | nodes | tp x pp x dp | SP | recompute | attention | micro x accumulation | memory | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"paper variant (1,024 x A100 80GB): {table_row(size, tuned)}")


if __name__ == "__main__":
    main()
