"""Which checkpoint tags are complete, and whether their files are still what was saved (standard library only, so
the command line can check before launching).

A tag is complete when ``manifest.json`` exists and every file it lists is present with its recorded size.  The
tag also carries ``config.json``, the resolved configuration it was trained with.  The manifest also records each
file's sha256: every reader of a tag (``--load``, ``export``, ``reshard``) hashes the files before it reads them
and refuses a tag whose bytes changed since the save (a flipped bit on disk, a copy cut short, a file edited or
replaced), and one that holds a loadable file the manifest does not list.
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_megatron.config import ConfigError
from ds_megatron.fileio import atomic_write_text, sha256_file

MANIFEST = "manifest.json"
TAG_CONFIG = "config.json"
# The tag's sub-directory holding the tokenizer its weights were trained with (``checkpoint/tokenizer.py``); its files
# are listed in the manifest as ``tokenizer/<name>``, hashed and checked like the others.
TOKENIZER_DIR = "tokenizer"
# What the readers of a tag open: DeepSpeed's and ds_megatron's torch files, ds_megatron's JSON records.
READ_SUFFIXES = (".pt", ".json")


def is_complete(tag_dir: Path, verify_checksums: bool = False) -> bool:
    return incompleteness(tag_dir, verify_checksums) is None


def manifest_records(tag_dir: Path) -> dict[str, dict] | None:
    """The manifest's ``{file name: {"bytes", "sha256"}}``, or None when there is no readable manifest."""
    try:
        files = json.loads((tag_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def incompleteness(tag_dir: Path, verify_checksums: bool = False) -> str | None:
    """Why ``tag_dir`` is not a complete tag (the first problem found), or None when it is.  With
    ``verify_checksums``, a file whose sha256 differs from the manifest's counts as a problem too."""
    if not (tag_dir / MANIFEST).is_file():
        return f"{tag_dir.name} has no {MANIFEST}"
    files = manifest_records(tag_dir)
    if files is None:
        return f"{tag_dir.name}/{MANIFEST} is not a manifest"
    for name, meta in files.items():
        f = tag_dir / name
        if not f.is_file():
            return f"{tag_dir.name}/{name} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{tag_dir.name}/{name} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}"
    return checksum_mismatch(tag_dir, sorted(files)) if verify_checksums else None


def shares(records: dict[str, dict], world: int) -> list[list[str]]:
    """``records``' file names split over ``world`` processes by bytes, so that hashing them takes about the same
    time everywhere: the largest file first, each to the process with the fewest bytes so far (the lowest rank on a
    tie).  Deterministic: every rank computes the same split without talking to the others."""
    loads, split = [0] * world, [[] for _ in range(world)]
    for name in sorted(records, key=lambda n: (-records[n]["bytes"], n)):
        rank = loads.index(min(loads))
        split[rank].append(name)
        loads[rank] += records[name]["bytes"]
    return [sorted(names) for names in split]


def checksum_mismatch(tag_dir: Path, names: list[str]) -> str | None:
    """The first of ``names`` (files the manifest lists) whose sha256 is not the recorded one, as ``tag/file: sha256
    ..., the manifest says ...``; None when all match.  Reads every byte of those files."""
    files = manifest_records(tag_dir) or {}
    for name in names:
        expected = files[name]["sha256"]
        actual = sha256_file(tag_dir / name)
        if actual != expected:
            return f"{tag_dir.name}/{name}: sha256 {actual[:16]}..., the manifest says {str(expected)[:16]}..."
    return None


def tag_files(tag_dir: Path) -> list[str]:
    """Every file of the tag the manifest lists, by its name in the manifest: the tag's own files and its
    tokenizer's (``tokenizer/<name>``)."""
    names = [p.name for p in tag_dir.iterdir() if p.is_file() and p.name != MANIFEST]
    tok = tag_dir / TOKENIZER_DIR
    if tok.is_dir():
        names += [f"{TOKENIZER_DIR}/{p.name}" for p in tok.iterdir() if p.is_file()]
    return sorted(names)


def unlisted(tag_dir: Path) -> str | None:
    """A file a reader would open (``READ_SUFFIXES`` in the tag, anything in its tokenizer directory) that the
    manifest does not list, or None.  Every file a save writes is listed (the manifest is written after all of them),
    so such a file was added afterwards."""
    listed = set(manifest_records(tag_dir) or {})
    read = [n for n in tag_files(tag_dir) if n.startswith(f"{TOKENIZER_DIR}/") or Path(n).suffix in READ_SUFFIXES]
    extra = [n for n in read if n not in listed]
    return f"{tag_dir.name}/{extra[0]} is not in {MANIFEST}" if extra else None


def tag_problem(tag_dir: Path, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with ``tag_dir`` as far as process ``rank`` of ``world`` checks it: missing files and sizes
    and unlisted files (cheap: every rank checks them all), then the sha256 of this rank's share of the files
    (``shares``).  One process (``world`` 1) hashes every file.  None when nothing is wrong."""
    problem = incompleteness(tag_dir) or unlisted(tag_dir)
    if problem is not None:
        return problem
    return checksum_mismatch(tag_dir, shares(manifest_records(tag_dir), world)[rank])


def corrupt_checkpoint(setting: str, problem: str, fix: str) -> ConfigError:
    """The one-line refusal of a tag that ``tag_problem`` found fault with."""
    return ConfigError(
        setting, "the checkpoint does not match its manifest (changed or damaged since the save)", problem, fix
    )


def verify_tag(tag_dir: Path, setting: str, fix: str) -> None:
    """Single process: refuse ``tag_dir`` unless every file it lists is there with its size and sha256 and nothing
    loadable was added (what the offline commands run before they read a tag)."""
    problem = tag_problem(tag_dir)
    if problem is not None:
        raise corrupt_checkpoint(setting, problem, fix)


def file_record(path: Path) -> dict:
    """What the manifest records of one file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_manifest(tag_dir: Path, step: int, files: dict[str, dict]) -> None:
    """The marker that makes a tag complete (written last, atomically): every file's record, and the step."""
    atomic_write_text(tag_dir / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


def complete_tags(save_dir: str | Path) -> list[str]:
    """Complete tags, oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.glob("step*") if p.is_dir() and is_complete(p))


def newest_complete_tag(save_dir: str | Path) -> str | None:
    tags = complete_tags(save_dir)
    return tags[-1] if tags else None


def resume_tag(load_dir: str | Path, setting: str = "ds_megatron.checkpoint.load") -> str:
    """The newest complete tag ``--load`` resumes from, or the one-line refusal when the directory holds none
    (pre-flight, the engine's verified tag, the loader)."""
    tag = newest_complete_tag(load_dir)
    if tag is None:
        raise ConfigError(
            setting,
            "no complete checkpoint there",
            f"{load_dir} has no tag with a manifest",
            "pass a directory written by --save (incomplete tags from a crash are skipped)",
        )
    return tag


def tag_config(save_dir: str | Path, tag: str) -> dict | None:
    f = Path(save_dir) / tag / TAG_CONFIG
    return json.loads(f.read_text()) if f.is_file() else None


def source_tag(src: Path, tag: str | None) -> str:
    """The complete ds_megatron tag of ``src`` to read (``tag``, or the newest complete one when None), or the
    one-line reason there is none: what every offline command reading a checkpoint (export, reshard) asks first."""
    if not src.is_dir():
        raise ConfigError("--checkpoint", "no such directory", str(src), "pass a directory written by --save")
    tags = sorted(p for p in src.iterdir() if p.is_dir() and p.name != "tokenizer")
    if tag is None:
        tag = newest_complete_tag(src)
        if not tags:
            raise ConfigError("--checkpoint", "no checkpoint in it", str(src), "pass a directory written by --save")
        if tag is None and not any((p / TAG_CONFIG).is_file() or (p / MANIFEST).is_file() for p in tags):
            raise ConfigError(
                "--checkpoint",
                "not a ds_megatron checkpoint (no tag has the config.json and manifest.json train_gpt.py writes)",
                str(src),
                "pass a directory written by recipes/train_gpt.py --save",
            )
        if tag is None:
            raise ConfigError(
                "--checkpoint", "no complete checkpoint", incompleteness(tags[-1]), "pass a directory written by --save"
            )
    elif not (src / tag).is_dir():
        raise ConfigError("--tag", "no such tag", f"{src}/{tag}", f"use one of {complete_tags(src)}")
    problem = incompleteness(src / tag)
    if problem is not None:
        raise ConfigError("--checkpoint", "incomplete checkpoint", problem, "use a complete tag")
    try:
        cfg = tag_config(src, tag)
    except ValueError:
        cfg = None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("ds_megatron"), dict):
        raise ConfigError(
            "--checkpoint",
            "not a ds_megatron checkpoint",
            f"{tag}/{TAG_CONFIG} is missing or has no ds_megatron section",
            "pass a directory written by recipes/train_gpt.py --save",
        )
    return tag
