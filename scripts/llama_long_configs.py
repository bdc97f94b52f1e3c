"""Write ds_configs/llama3_8b_128k.json and recipes/llama3_8b_128k.sh: Llama 3 8B continued at 131,072
tokens, the layout chosen by the tuner (``python -m ds_megatron.tune``, which searches context parallelism from
16,384 tokens on) for 4 nodes of 8 H100 SXM GPUs, plus the hyperparameters below.

    .venv/bin/python scripts/llama_long_configs.py   # rewrites the config and its recipe

Like every shipped config, it runs in miniature in the tests (tests/miniature.py keeps cp 2 there).

Shape: the 8B with Llama 3.1's long-context rotary scaling (Grattafiori et al. 2024; the transformers config of
Llama 3.1 8B: rope_type llama3, factor 8, low/high frequency factors 1 and 4, original context 8,192) and a position
table of 131,072, so ``--init-from-hf`` takes a Llama 3.1 8B directory as it is (or a Llama 3 8B / an exported 8k
run whose config.json is given the same two fields).  Continued training, so a tenth of the pretraining peak,
2e-5, the rate Xiong et al. 2023 continue Llama 2 7B/13B at for long context; 4M-token batches as in the 8k recipe
(32 sequences of 131,072); 20B tokens (4,768 steps) with 200 warm-up steps: a recipe-sized budget of ours.
bf16 with ZeRO-1 and fp32 gradient accumulation, no dropout (CP refuses attention dropout anyway).
"""

from __future__ import annotations

from tuned_configs import GPUS_PER_NODE, Tuned, recipe, run_sections, warmup_cosine, write

from ds_megatron.tune import Pins, build_cluster, build_model_shape, search
from ds_megatron.tune.training.search import SearchResult
from ds_megatron.tune.training.written import ds_config

STEM = "llama3_8b_128k"
SIZE = "llama3-8b"
SEQ = 131072
GPUS = 32
GLOBAL_BATCH = 32
TOKENS = 20e9
WARMUP_STEPS = 200
PEAK_LR = 2e-5
ROPE_SCALING = {  # Llama 3.1's
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
USAGE = '--init-from-hf LLAMA31_8B_DIR --data "my/corpus/*.jsonl" --tokenizer DIR [more flags]'
NOTE = "Pass a Llama 3 tokenizer directory (vocabulary 128,256) as --tokenizer."


# sdpa pinned: at 131,072 tokens the eager kernel's memory-bound passes over its score blocks make every eager
# candidate slower (the unpinned search picks the same layout, in 4x the time).
PINS = Pins(attention="sdpa")


def search_long(gpu: str = "h100-sxm", gpus: int = GPUS) -> SearchResult:
    """The tuner's search for the 8B at 131,072 tokens on ``gpus`` GPUs of ``gpu`` (nodes of 8)."""
    model = build_model_shape(SIZE, None, None, None, None, SEQ)
    return search(model, build_cluster(gpu, gpus, GPUS_PER_NODE), GLOBAL_BATCH, PINS)


def tune(result: SearchResult) -> Tuned:
    """The winner of ``search_long`` as a config, with the command that reproduces it."""
    if result.winner is None:
        raise SystemExit(f"{SIZE} at {SEQ} on {result.cluster.num_gpus} GPUs: no configuration fits")
    command = (
        f"python -m ds_megatron.tune --model {SIZE} --seq-length {SEQ} --gpu {result.cluster.gpu} "
        f"--gpus {result.cluster.num_gpus} --global-batch-size {GLOBAL_BATCH} --attention {PINS.attention}"
    )
    return Tuned(ds_config(result, result.winner), result.winner, result.model, command)


def config(cfg: dict) -> dict:
    """The tuner's config with the long-context shape and the continued-training hyperparameters."""
    steps = int(TOKENS // (GLOBAL_BATCH * SEQ))
    cfg["optimizer"]["params"].update(lr=PEAK_LR, eps=1e-5)
    cfg["scheduler"] = warmup_cosine(steps, WARMUP_STEPS)
    cfg["steps_per_print"] = 1_000_000_000
    section = cfg["ds_megatron"]
    section["model"] = {
        "size": SIZE,
        "seq_length": SEQ,
        "max_position_embeddings": SEQ,
        "rope_scaling": ROPE_SCALING,
        "attention": section["model"]["attention"],
        "dropout": 0.0,
        "compile": True,  # as every shipped GPU config: the block's memory-bound pieces as compiled kernels
    }
    section.update(run_sections(STEM.rsplit("/", 1)[-1], steps))
    return cfg


def main() -> None:
    tuned = tune(search_long())
    h200 = search_long("h200").winner
    c = h200.candidate
    note = (
        f"{NOTE}\n# On nodes of 8 H200 (140 GiB) the tuner picks tp {c.tp} x cp {c.cp} ({c.cp_comm}) x pp {c.pp} "
        f"x dp {c.dp}, recompute {c.recompute_label()}\n# ({h200.time.step_s:.1f} s/step against "
        f'{tuned.winner.time.step_s:.1f} here): regenerate with search_long("h200") for those.'
    )
    title = f"{SIZE} continued at {SEQ:,} tokens (Llama 3 shapes)"
    script = recipe(STEM, title, tuned, "h100-sxm", "scripts/llama_long_configs.py", note, USAGE)
    write(STEM, config(tuned.config), script)


if __name__ == "__main__":
    main()
