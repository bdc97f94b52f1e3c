"""``python -m ds_megatron.checkpoint``: offline work on the checkpoints of ``recipes/train_gpt.py --save``.

``export --checkpoint DIR [--tag T] --out HF_DIR [--dtype fp32|bf16|fp16] [--max-shard-size 5GB] [--tokenizer DIR |
--no-tokenizer]``:
a DeepSpeed checkpoint of any tp/pp/dp -> a transformers directory, with the tokenizer saved in the tag (import into
training: ``recipes/train_gpt.py --init-from-hf HF_DIR``).

``reshard --checkpoint DIR [--tag T] --tp N --pp M --dp D [--cp C] [--ep E] [--expert-tp X] [--pipeline-layout 3,5,5,3]
--out DIR2``: the same checkpoint at another layout (cp, ep and expert_tp: the saved ones unless given; blocks per
stage: the saved ones at
the saved pp, else balanced), ready for ``--load DIR2`` on N x C x M x D processes (resharding on load does the same
inside the launch).

Both read files weights-only and refuse one that needs more, unless ``--trust-checkpoint``.

``import --hf HF_DIR --config CONFIG.json --tp N --pp M [--ep E] --out DIR``: a transformers directory of a
ds_megatron family -> a step-0 DeepSpeed checkpoint of that run at tp N x pp M (weights in the run's precision, no
optimizer state: ``--load DIR`` starts training from it with a fresh optimizer), with HF_DIR's tokenizer when it has
one.  A mixture of experts' directory is read one linear per expert (as published) or with transformers 5's fused
expert tensors; ``--ep`` (default: the config's) is recorded in the run's configuration, the files being those of ep 1
whatever it is."""

from __future__ import annotations

import argparse
import sys

from ds_megatron.config import ConfigError

TRUST_HELP = "read files that need arbitrary unpickling (it can run code from them): only for checkpoints you trust"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_megatron.checkpoint", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="DeepSpeed checkpoint -> Hugging Face directory")
    ex.add_argument("--checkpoint", required=True, help="directory written by train_gpt.py --save")
    ex.add_argument("--tag", help="checkpoint tag (default: the newest complete one)")
    ex.add_argument("--out", required=True, help="new output directory")
    ex.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ex.add_argument("--max-shard-size", default="5GB")
    ex.add_argument(
        "--tokenizer",
        help="tokenizer directory (default: the one saved in the tag; needed for a tag without one, and must be the "
        "same tokenizer as a tag's own)",
    )
    ex.add_argument("--no-tokenizer", action="store_true", help="write the weights alone, without a tokenizer")
    rs = sub.add_parser("reshard", help="checkpoint -> the same checkpoint at another tp x cp x pp x dp")
    rs.add_argument("--checkpoint", required=True, help="directory written by train_gpt.py --save")
    rs.add_argument("--tag", help="checkpoint tag (default: the newest complete one)")
    rs.add_argument("--tp", type=int, required=True, help="tensor-parallel size of the new layout")
    rs.add_argument("--pp", type=int, required=True, help="pipeline stages of the new layout")
    rs.add_argument("--dp", type=int, required=True, help="data-parallel size of the new layout")
    rs.add_argument("--cp", type=int, help="context-parallel size of the new layout (default: the saved one)")
    rs.add_argument("--ep", type=int, help="expert-parallel size of the new layout (default: the saved one)")
    rs.add_argument("--expert-tp", type=int, help="expert_tp of the new layout, 1 or --tp (default: the saved one)")
    rs.add_argument("--out", required=True, help="new output directory (must not exist)")
    rs.add_argument(
        "--pipeline-layout",
        help="blocks per pipeline stage of the new layout, e.g. 3,5,5,3 (default: the saved one at the saved pp, "
        "else balanced)",
    )
    im = sub.add_parser("import", help="Hugging Face directory -> step-0 checkpoint at tp x pp")
    im.add_argument("--hf", required=True, help="transformers model directory (config.json, safetensors)")
    im.add_argument("--config", required=True, help="the run's DeepSpeed config (model shape, precision, batch)")
    im.add_argument("--tp", type=int, required=True, help="tensor-parallel size of the run")
    im.add_argument("--pp", type=int, required=True, help="pipeline stages of the run")
    im.add_argument(
        "--ep", type=int, help="expert-parallel size of the run (default: the config's; checked against its dp and SP)"
    )
    im.add_argument("--out", required=True, help="new output directory (must not exist)")
    im.add_argument("--debug", action="store_true", help="show the traceback of an error")
    for p in (ex, rs):
        p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
        p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = ap.parse_args(argv)
    try:
        if args.command == "export":
            from ds_megatron.checkpoint.export import export

            out = export(
                args.checkpoint,
                args.out,
                args.tag,
                args.dtype,
                args.max_shard_size,
                args.tokenizer,
                trust_checkpoint=args.trust_checkpoint,
                weights_only=args.no_tokenizer,
            )
            done = f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"
        elif args.command == "import":
            from ds_megatron.checkpoint.import_cmd import import_checkpoint
            from ds_megatron.checkpoint.manifest import tag_config
            from ds_megatron.config.facts import saved_ep, saved_world

            out = import_checkpoint(args.hf, args.out, args.config, args.tp, args.pp, ep=args.ep)
            saved = tag_config(out, (out / "latest").read_text().strip())
            with_ep = f" --ep {saved_ep(saved)}" if saved_ep(saved) > 1 else ""
            done = (
                f"train from it with --load {out} --tp {args.tp} --pp {args.pp}{with_ep} on {saved_world(saved)} "
                "processes (the optimizer starts afresh)"
            )
        else:
            from ds_megatron.checkpoint.manifest import tag_config
            from ds_megatron.checkpoint.reshard_offline import reshard_checkpoint
            from ds_megatron.config.facts import saved_cp, saved_ep
            from ds_megatron.config.pipeline_checks import block_counts

            layout = (
                None if args.pipeline_layout is None else tuple(block_counts(args.pipeline_layout, "--pipeline-layout"))
            )
            out = reshard_checkpoint(
                args.checkpoint,
                args.out,
                args.tp,
                args.pp,
                args.dp,
                args.tag,
                args.trust_checkpoint,
                cp=args.cp,
                pipeline_layout=layout,
                ep=args.ep,
                expert_tp=args.expert_tp,
            )
            saved = tag_config(out, (out / "latest").read_text().strip())
            cp, ep = saved_cp(saved), saved_ep(saved)
            written = saved["ds_megatron"]["parallel"].get("pipeline_layout")
            world = args.tp * cp * args.pp * args.dp
            layout_flag = "" if written is None else f" --pipeline-layout {','.join(map(str, written))}"
            with_ep = f" --ep {ep}" if ep > 1 else ""
            expert_tp = saved["ds_megatron"]["parallel"].get("expert_tp")
            with_ep += "" if expert_tp is None else f" --expert-tp {expert_tp}"
            done = (
                f"resume with --load {out} --tp {args.tp} --cp {cp} --pp {args.pp}{with_ep}{layout_flag} "
                f"on {world} processes"
            )
    except ConfigError as err:
        if args.debug:
            raise
        print(str(err), file=sys.stderr)
        return 2
    print(f"wrote {out}: {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
