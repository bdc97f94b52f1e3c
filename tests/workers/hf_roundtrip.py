"""Import worker: build the tp 2 x pp 2 SP pipeline from a transformers GPT-2 directory (--init-from-hf) and save a
step-0 checkpoint for the export round trip; with --hf-llama, the same for a LlamaForCausalLM directory (4 heads,
2 KV heads, untied) into ck_llama."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import tiny_ds_config, write_result  # noqa: E402

from ds_megatron.checkpoint.run_state import save_run  # noqa: E402
from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hf-llama")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    cfg = tiny_ds_config(2, 2, 1, vocab=1001, layers=3, sequence_parallel=True)
    cfg["ds_megatron"]["checkpoint"] = {"init_from_hf": args.hf}
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    save_run(built.engine, os.path.join(args.out, "ck"), 0, {"step": 0, "config": run.ds_config}, built.rng)
    if args.hf_llama:
        cfg = tiny_ds_config(2, 2, 1, vocab=1001, layers=3, sequence_parallel=True)
        cfg["ds_megatron"]["model"].update(
            family="llama", num_kv_heads=2, intermediate_size=96, rope_theta=10000.0, tie_word_embeddings=False
        )
        cfg["ds_megatron"]["checkpoint"] = {"init_from_hf": args.hf_llama}
        run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
        built = build_engine(run)
        save_run(built.engine, os.path.join(args.out, "ck_llama"), 0, {"step": 0, "config": run.ds_config}, built.rng)
    write_result(args.out, "import", {"ok": True})


if __name__ == "__main__":
    main()
