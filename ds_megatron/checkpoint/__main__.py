"""``python -m ds_megatron.checkpoint export --checkpoint DIR [--tag T] --out HF_DIR [--dtype fp32|bf16|fp16]
[--max-shard-size 5GB] [--tokenizer DIR]``: a DeepSpeed checkpoint of any tp/pp/dp -> a transformers GPT-2 directory.
(Import into training: ``recipes/train_gpt.py --init-from-hf HF_DIR``.)"""

from __future__ import annotations

import argparse
import sys

from ds_megatron.checkpoint.export import export
from ds_megatron.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_megatron.checkpoint", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="DeepSpeed checkpoint -> Hugging Face GPT2LMHeadModel directory")
    ex.add_argument("--checkpoint", required=True, help="directory written by train_gpt.py --save")
    ex.add_argument("--tag", help="checkpoint tag (default: the one 'latest' names)")
    ex.add_argument("--out", required=True, help="new output directory")
    ex.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ex.add_argument("--max-shard-size", default="5GB")
    ex.add_argument("--tokenizer", help="tokenizer directory (default: the one saved with the run)")
    ex.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.tag, args.dtype, args.max_shard_size, args.tokenizer)
    except ConfigError as err:
        if args.debug:
            raise
        print(str(err), file=sys.stderr)
        return 2
    print(f"wrote {out}: load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
