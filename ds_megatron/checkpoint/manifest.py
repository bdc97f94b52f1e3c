"""Which checkpoint tags are complete (standard library only, so the command line can check before launching).

A tag is complete when ``manifest.json`` exists and every file it lists is present with its recorded size.  The
tag also carries ``config.json``, the resolved configuration it was trained with.
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_megatron.fileio import atomic_write_text, sha256_file

MANIFEST = "manifest.json"
TAG_CONFIG = "config.json"


def is_complete(tag_dir: Path, verify_checksums: bool = False) -> bool:
    return incompleteness(tag_dir, verify_checksums) is None


def incompleteness(tag_dir: Path, verify_checksums: bool = False) -> str | None:
    """Why ``tag_dir`` is not a complete tag (the first problem found), or None when it is."""
    manifest = tag_dir / MANIFEST
    if not manifest.is_file():
        return f"{tag_dir.name} has no {MANIFEST}"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return f"{tag_dir.name}/{MANIFEST} is not a manifest"
    for name, meta in files.items():
        f = tag_dir / name
        if not f.is_file():
            return f"{tag_dir.name}/{name} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{tag_dir.name}/{name} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if verify_checksums and sha256_file(f) != meta["sha256"]:
            return f"{tag_dir.name}/{name} does not match its sha256 in the manifest"
    return None


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


def tag_config(save_dir: str | Path, tag: str) -> dict | None:
    f = Path(save_dir) / tag / TAG_CONFIG
    return json.loads(f.read_text()) if f.is_file() else None
