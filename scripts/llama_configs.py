"""Write ds_configs/llama3_<size>.json and recipes/llama3_<size>.sh: the layout chosen by the tuner
(``python -m ds_megatron.tune``) for nodes of 8 H100 SXM GPUs, plus the training hyperparameters below.

    .venv/bin/python scripts/llama_configs.py   # rewrites the four configs and recipes

Hyperparameters (Touvron et al. 2023, Llama 2, sec. 2.2, which Llama 3 keeps for these sizes): AdamW betas (0.9,
0.95), eps 1e-5, weight decay 0.1, clipping 1.0, 2,000 linear warm-up steps, cosine decay to 10% of the peak; peak
learning rates from ds_megatron.config.sizes (3e-4; 1.5e-4 for 70B); 4M-token batches (512 sequences of 8,192).
The token budget is ours: 500B tokens (119,209 steps), a recipe-sized run rather than Llama 3's 15T.
bf16 with ZeRO-1 and fp32 gradient accumulation, no dropout (Llama pretraining uses none).
"""

from __future__ import annotations

from tuned_configs import recipe, run_sections, tune, warmup_cosine, write

from ds_megatron.config.sizes import LEARNING_RATES

GLOBAL_BATCH = 512
SEQ = 8192
TOKENS = 500e9
WARMUP_STEPS = 2000
SIZES = {  # file stem: (named size, GPUs)
    "llama3_1b": ("llama3.2-1b", 8),
    "llama3_3b": ("llama3.2-3b", 8),
    "llama3_8b": ("llama3-8b", 8),
    "llama3_70b": ("llama3-70b", 64),
}
USAGE = '--data "my/corpus/*.jsonl" --tokenizer DIR [more flags]'
TOKENIZER_NOTE = "Pass a Llama 3 tokenizer directory (vocabulary 128,256) as --tokenizer."


def config(stem: str, size: str, cfg: dict) -> dict:
    """The tuner's config for ``size`` with Llama's hyperparameters and the shipped configs' run sections."""
    steps = int(TOKENS // (GLOBAL_BATCH * SEQ))
    cfg["optimizer"]["params"].update(lr=LEARNING_RATES[size], eps=1e-5)
    cfg["scheduler"] = warmup_cosine(steps, WARMUP_STEPS)
    cfg["steps_per_print"] = 1_000_000_000
    section = cfg["ds_megatron"]
    section["model"] = {"size": size, "attention": section["model"]["attention"], "dropout": 0.0}
    section.update(run_sections(stem, steps))
    return cfg


def main() -> None:
    for stem, (size, gpus) in SIZES.items():
        tuned = tune(size, gpus, GLOBAL_BATCH)
        cfg = config(stem, size, tuned.config)
        title = f"{size} (Llama 3 shapes)"
        write(stem, cfg, recipe(stem, title, tuned, "h100-sxm", "scripts/llama_configs.py", TOKENIZER_NOTE, USAGE))


if __name__ == "__main__":
    main()
