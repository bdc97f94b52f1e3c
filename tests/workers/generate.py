"""Generation worker: greedy continuation through the pipeline engine (tp 2 with SP, pp 1, or tp 1 pp 2) equals
greedy decoding with the single-device GPT holding the same (initial) weights.  ``--layout`` may be given more than
once: one engine per layout, one after the other in this launch."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from common import tiny_ds_config, write_result  # noqa: E402

from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402
from ds_megatron.generate import Decoder  # noqa: E402
from ds_megatron.model.gpt2.model import GPT, GPTConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", action="append", help="tp,pp,dp (default 2,1,1); repeat for several")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    for layout in args.layout or ["2,1,1"]:
        compare(args.out, *(int(x) for x in layout.split(",")))


def compare(out: str, tp: int, pp: int, dp: int) -> None:
    run = resolve(tiny_ds_config(tp, pp, dp, sequence_parallel=tp > 1), int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    prompt = [5, 17, 99, 3, 250]
    decoder = Decoder(
        built.engine,
        built.topology,
        run.model.seq_length,
        run.micro_batch_size,
        pad_id=0,
        vocab_size=run.model.vocab_size,
    )
    got = decoder.greedy(prompt, 8)
    model = GPT(GPTConfig.from_shape(run.model), seed=run.section.train.seed).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    write_result(out, f"generate-{tp}{pp}{dp}", {"pipeline": got, "reference": ids[len(prompt) :]})


if __name__ == "__main__":
    main()
