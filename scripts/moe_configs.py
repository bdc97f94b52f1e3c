"""Write ds_configs/<moe size>.json and recipes/<moe size>.sh for the mixture-of-experts sizes: the layout chosen
by the tuner (``python -m ds_megatron.tune``, expert parallelism searched with the rest) for nodes of 8 GPUs, plus
the training hyperparameters below.

    .venv/bin/python scripts/moe_configs.py   # rewrites the three configs and recipes

Shapes: the named sizes (the published config.json of each model: ds_megatron.model.qwen3_moe, .mixtral), their
sequence lengths (Qwen3's general pretraining stage, 4,096; Mixtral's context, 32,768) and vocabularies.
Hyperparameters: neither the Qwen3 report nor Mixtral's paper publishes its optimizer settings, so these are ours,
Llama 2's recipe (Touvron et al. 2023, sec. 2.2) at its two learning rates by size: AdamW betas (0.9, 0.95), eps
1e-5, weight decay 0.1, clipping 1.0, 2,000 linear warm-up steps, cosine decay to 10% of the peak; peak 3e-4 for
Qwen3-30B-A3B (3B active), 1.5e-4 for the larger two; 4M-token batches (1,024 sequences of 4,096; 128 of 32,768);
500B tokens (119,209 steps).  The router's auxiliary loss weight is the named size's.  bf16 with ZeRO-1 and fp32
gradient accumulation (DeepSpeed's BF16 optimizer, the one that trains at ep > 1), no dropout.

GPUs: H100 SXM where the model states fit; Qwen3-235B-A22B's 235B parameters need 20 bytes each (bf16 weights and
gradients, the fp32 accumulation buffer, fp32 masters and Adam moments partitioned by ZeRO-1 over dp and
expert-DP), 68 GiB per GPU on 64 GPUs before activations and the margin, so it gets 16 nodes (128 H100).
"""

from __future__ import annotations

from tuned_configs import recipe, run_sections, tune, warmup_cosine, write

TOKENS = 500e9
WARMUP_STEPS = 2000
SIZES = {  # file stem: (named size, GPUs, global batch in sequences, peak learning rate)
    "qwen3_30b_a3b": ("qwen3-30b-a3b", 32, 1024, 3e-4),
    "qwen3_235b_a22b": ("qwen3-235b-a22b", 128, 1024, 1.5e-4),
    "mixtral_8x7b": ("mixtral-8x7b", 64, 128, 1.5e-4),
}
TITLES = {"qwen3_moe": "Qwen3-MoE shapes", "mixtral": "Mixtral shapes"}
USAGE = '--data "my/corpus/*.jsonl" --tokenizer DIR [more flags]'
TOKENIZER_NOTE = "Pass the model's own tokenizer directory as --tokenizer."


def config(stem: str, size: str, cfg: dict, lr: float, seq_length: int) -> dict:
    """The tuner's config for ``size`` with the hyperparameters above and the shipped configs' run sections."""
    steps = int(TOKENS // (cfg["train_batch_size"] * seq_length))
    cfg["optimizer"]["params"].update(lr=lr, eps=1e-5)
    cfg["scheduler"] = warmup_cosine(steps, WARMUP_STEPS)
    cfg["steps_per_print"] = 1_000_000_000
    section = cfg["ds_megatron"]
    # as every shipped GPU config: the block's memory-bound pieces as compiled kernels
    section["model"] = {"compile": True, "size": size, "attention": section["model"]["attention"], "dropout": 0.0}
    section.update(run_sections(stem, steps))
    return cfg


def main() -> None:
    for stem, (size, gpus, batch, lr) in SIZES.items():
        tuned = tune(size, gpus, batch)
        cfg = config(stem, size, tuned.config, lr, tuned.model.seq_length)
        title = f"{size} ({TITLES[tuned.model.family]})"
        write(stem, cfg, recipe(stem, title, tuned, "h100-sxm", "scripts/moe_configs.py", TOKENIZER_NOTE, USAGE))


if __name__ == "__main__":
    main()
