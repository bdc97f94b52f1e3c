"""Prepare training data outside the training launch, and check prepared directories.

    python -m ds_megatron.data prepare --data 'corpus/*.jsonl' --tokenizer bpe:50257 --out corpus.prepared \\
        [--num-proc N] [--text-field text] [--valid-fraction 0.02]
    python -m ds_megatron.data verify corpus.prepared        # sizes and sha256 of every file against the manifest

Then train with ``--data corpus.prepared``.  Rerunning an interrupted ``prepare`` resumes it.  Exit status: 0 done,
2 bad input (one ``error: ...`` line; nothing is left unless shards were complete, and those are kept), 130
interrupted (complete shards are kept).
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds_megatron.data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenise local text files into a prepared directory")
    prep.add_argument(
        "--data", required=True, help="files, globs or directories, comma-separated (.txt .json .jsonl .parquet)"
    )
    prep.add_argument("--tokenizer", required=True, help="a tokenizer directory, or bpe:N to train a byte-level BPE")
    prep.add_argument("--out", required=True, help="the prepared directory (created; an interrupted one resumes)")
    prep.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="tokenising processes (default: cores)")
    prep.add_argument("--text-field", default="text", help="field holding the text in json/jsonl/parquet records")
    prep.add_argument("--valid-fraction", type=float, default=0.02, help="tail of the tokens training validates on")
    prep.add_argument(
        "--chunk-mb",
        type=float,
        default=None,
        help="input MiB per shard, the unit of work and resume (default: the corpus / 64, from 1 to 64)",
    )
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    ver = sub.add_parser("verify", help="check a prepared directory's files against its manifest (sha256)")
    ver.add_argument("directory")
    return p


def _check_args(args) -> None:
    from ds_megatron.config import ConfigError
    from ds_megatron.config.numbers import check_finite
    from ds_megatron.config.rules import check_tokenizer_spec, check_valid_fraction
    from ds_megatron.config.shape import Vocabulary

    if args.num_proc < 1:
        raise ConfigError("--num-proc", "must be at least 1", f"got {args.num_proc}", "pass e.g. --num-proc 4")
    check_valid_fraction(args.valid_fraction, Vocabulary(prefix="", refs={"valid_fraction": "--valid-fraction"}))
    check_finite("--chunk-mb", args.chunk_mb)  # nan passes the comparison below, and neither rounds to a size
    if args.chunk_mb is not None and args.chunk_mb <= 0:
        raise ConfigError("--chunk-mb", "must be positive", f"got {args.chunk_mb}", "pass e.g. 64")
    check_tokenizer_spec(args.tokenizer, Vocabulary(prefix="", refs={"tokenizer": "--tokenizer"}))


def _prepare(args) -> int:
    from ds_megatron.data.build import PrepareArgs, prepare

    _check_args(args)
    prepare(
        PrepareArgs(
            data=args.data,
            tokenizer=args.tokenizer,
            out=args.out,
            num_proc=args.num_proc,
            text_field=args.text_field,
            valid_fraction=args.valid_fraction,
            chunk_bytes=None if args.chunk_mb is None else max(1, round(args.chunk_mb * (1 << 20))),
            progress=not args.no_progress,
        ),
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return 0


def _verify(args) -> int:
    from ds_megatron.config import ConfigError
    from ds_megatron.data.prepared import check_prepared, read_manifest

    problem = check_prepared(args.directory, checksums=True)
    if problem is not None:
        raise ConfigError(args.directory, *problem)
    manifest = read_manifest(args.directory)
    print(
        f"{args.directory}: {manifest['num_tokens']:,} tokens, {manifest['num_docs']:,} documents, "
        f"{len(manifest['shards'])} shards ({manifest['dtype']}), tokenizer {manifest['tokenizer']['spec']} "
        f"({manifest['tokenizer']['fingerprint']}): every file matches its sha256"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from ds_megatron.config import ConfigError

    try:
        return _prepare(args) if args.command == "prepare" else _verify(args)
    except ConfigError as err:
        print(str(err), file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: complete shards are kept; rerun the same command to resume", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
