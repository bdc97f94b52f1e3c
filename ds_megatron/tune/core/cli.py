"""What both command lines share (``python -m ds_megatron.tune`` and its ``inference`` subcommand): the flag table,
rows of (flag, argparse keywords, help) per argument group, with the model, cluster and empirical-mode rows both use;
a parser whose errors are one ``error:`` line; running a command and its empirical session."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ds_megatron.config import ConfigError
from ds_megatron.config.numbers import finite_float
from ds_megatron.config.sizes import all_size_names
from ds_megatron.model import FAMILIES
from ds_megatron.tune.core.gpus import DEFAULT_GPU, GPUS
from ds_megatron.tune.core.session import DEVICES
from ds_megatron.tune.core.spec import DEFAULT_EFFICIENCY, INTER_NODE_LATENCY_S, INTRA_NODE_LATENCY_S

Row = tuple[str, dict, str]  # (flag, add_argument's keywords, help)
EXIT_NO_FIT = 1
EXIT_CONFIG_ERROR = 2

INT, FLOAT = {"type": int}, {"type": finite_float}  # nan and inf are refused as they are parsed
SWITCH = {"action": argparse.BooleanOptionalAction, "default": None}  # --x, --no-x, or unset (None)
INTRA_US, INTER_US = INTRA_NODE_LATENCY_S * 1e6, INTER_NODE_LATENCY_S * 1e6
LLAMA_FLAGS = ("family", "kv_heads", "intermediate_size", "tie_word_embeddings")  # build_model_shape's keywords

MODEL_FLAGS: tuple[Row, ...] = (
    ("--model", {}, f"named size: {', '.join(all_size_names())}"),
    ("--family", {"choices": tuple(FAMILIES)}, "model family of an explicit shape (default gpt2)"),
    ("--layers", INT, "transformer blocks L (overrides --model)"),
    ("--hidden", INT, "hidden size h (overrides --model)"),
    ("--heads", INT, "attention heads a (overrides --model)"),
    ("--kv-heads", INT, "llama: grouped-query attention's KV heads (default: --heads)"),
    ("--intermediate-size", INT, "llama: SwiGLU width F (overrides --model)"),
    (
        "--tie-word-embeddings",
        SWITCH,
        "llama: output layer tied to the embedding (default: the named size's, else untied)",
    ),
    ("--vocab", INT, "vocabulary size V (default: the named size's, else 50257 or 128256)"),
    ("--seq-length", INT, "sequence length s (default: the named size's, else 2048 or 8192)"),
)
CLUSTER_FLAGS: tuple[Row, ...] = (
    ("--gpus", INT | {"required": True}, "total GPUs"),
    ("--gpus-per-node", INT | {"default": 8}, "GPUs per node (default 8)"),
    (
        "--gpu",
        {"choices": list(GPUS)},
        f"GPU preset: memory, peak, HBM, NVLink and network figures (default: {DEFAULT_GPU}'s figures); the flags "
        "below override it",
    ),
    ("--gpu-memory-gb", FLOAT, "memory per GPU in GiB (A100-80GB: 80)"),
    ("--gpu-peak-tflops", FLOAT, "dense bf16 peak per GPU (A100: 312)"),
    ("--memory-gbps", FLOAT, "HBM bandwidth per GPU in GB/s (A100-80GB: 2039)"),
    ("--intra-node-gbps", FLOAT, "NVLink GB/s per GPU, one way (A100: 300)"),
    ("--inter-node-gbps", FLOAT, "network GB/s per GPU, one way (200 Gb/s HDR: 25)"),
    (
        "--efficiency",
        FLOAT | {"default": DEFAULT_EFFICIENCY},
        f"ceiling of the matmul-efficiency curve, the fraction of peak a very large GEMM reaches (default "
        f"{DEFAULT_EFFICIENCY}, fitted on published A100 step times; fit yours with --empirical or tune.calibrate)",
    ),
    (
        "--intra-node-latency-us",
        FLOAT | {"default": INTRA_US},
        f"fixed cost of a collective or send inside a node (default {INTRA_US:g})",
    ),
    ("--inter-node-latency-us", FLOAT | {"default": INTER_US}, f"the same across nodes (default {INTER_US:g})"),
    (
        "--step-overhead-s",
        FLOAT | {"default": 0.0},
        "fixed seconds per step outside the model (default 0; --empirical on CPU fits it)",
    ),
)


def empirical_flags(
    measure: str, top: tuple[int, str], steps: tuple[int, str], warmup: tuple[int, str], dirs: str
) -> tuple[Row, ...]:
    """The ``--empirical*`` rows; ``measure`` says what the runs measure, ``top``, ``steps`` and ``warmup`` are each
    (default, help before the default), ``dirs`` says where the runs go."""
    counts = (("--empirical-top", top), ("--empirical-steps", steps), ("--empirical-warmup", warmup))
    return (
        ("--empirical", {"action": "store_true"}, measure),
        ("--max-minutes", FLOAT, "wall-clock budget of the whole command (required)"),
        *((flag, INT | {"default": d}, f"{text} (default {d})") for flag, (d, text) in counts),
        ("--device", {"choices": DEVICES, "default": "auto"}, "auto: gpu when torch sees CUDA, else cpu"),
        ("--empirical-dir", {"metavar": "DIR"}, dirs),
    )


def replaced(rows: tuple[Row, ...], changes: dict[str, tuple[dict, str]]) -> tuple[Row, ...]:
    """``rows`` with the keywords and help of the flags in ``changes`` replaced."""
    return tuple((flag, *changes[flag]) if flag in changes else (flag, options, text) for flag, options, text in rows)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one ConfigError line instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError("command line", message, "python -m ds_megatron.tune --help lists the flags", "fix the flag")


def build_parser(prog: str, description: str, groups: dict[str, tuple[Row, ...]]) -> argparse.ArgumentParser:
    """A parser with one argument group per entry of ``groups`` (title -> rows), in order."""
    p = Parser(prog=prog, description=description)
    for title, rows in groups.items():
        group = p.add_argument_group(title)
        for flag, options, text in rows:
            group.add_argument(flag, **options, help=text)
    return p


def empirical_settings(args: argparse.Namespace) -> dict:
    """The ``--empirical*`` flags both halves' options take, by field name (each names --empirical-steps its own)."""
    names = {"max_minutes": "max_minutes", "top": "empirical_top", "warmup": "empirical_warmup", "device": "device"}
    return {field: getattr(args, name) for field, name in names.items()} | {"work_dir": args.empirical_dir}


def check_empirical_budget(args: argparse.Namespace) -> None:
    if args.empirical and args.max_minutes is None:
        raise ConfigError("--max-minutes", "required with --empirical", "not set", "pass e.g. --max-minutes 10")


def run_command(
    parser: Callable[[], argparse.ArgumentParser], run: Callable[[argparse.Namespace, float], int], argv: list[str]
) -> int:
    """``run(arguments, start)``'s exit status; bad input is one ``error:`` line on stderr and EXIT_CONFIG_ERROR.
    ``start`` (a time.monotonic() value) is when the --max-minutes budget began."""
    start = time.monotonic()
    try:
        return run(parser().parse_args(argv), start)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG_ERROR


def run_session(options, fits: bool, start: float, measure: Callable, report: Callable[..., str]):
    """The empirical session when one was asked for (``options``) and a candidate fits: ``measure(deadline, say)``
    with the deadline ``options.max_minutes`` after ``start``, its progress printed as it goes, then
    ``report(session)``; the session, or None."""
    if options is None:
        return None
    if not fits:
        print("empirical: skipped, no candidate fits")
        return None
    emp = measure(start + 60 * options.max_minutes, functools.partial(print, flush=True))
    print(report(emp))
    return emp


def check_output(flag: str, path: str | Path | None, force: bool = False) -> None:
    """An output file the tuner will write (``path`` given to ``flag``): its directory exists, and the file does not
    unless ``force`` (ConfigError otherwise).  Called before the search, so a refusal costs no work."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(flag, "is a directory", str(p), "pass the path of a file to write")
    if not p.parent.is_dir():
        parent = str(p.parent)
        raise ConfigError(
            flag,
            "the directory does not exist",
            f"{parent} for {p}",
            f"create it (mkdir -p {parent}) or pass another path",
        )
    if p.exists() and not force:
        raise ConfigError(flag, "the file exists", str(p), "pass --force to replace it, or another path")


def write_output(flag: str, path: str | Path, text: str, force: bool = False) -> None:
    """Write ``text`` to ``path``; without ``force`` only as a new file (one created since ``check_output`` is kept)."""
    try:
        with open(path, "w" if force else "x") as fh:
            fh.write(text)
    except FileExistsError:
        raise ConfigError(flag, "the file exists", str(path), "pass --force to replace it, or another path") from None
