"""Which checkpoint tags are complete (standard library only, so the command line can check before launching).

A tag is complete when ``manifest.json`` exists and every file it lists is present with its recorded size.  The
tag also carries ``config.json``, the resolved configuration it was trained with.
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_megatron.fileio import sha256_file

MANIFEST = "manifest.json"
TAG_CONFIG = "config.json"


def is_complete(tag_dir: Path, verify_checksums: bool = False) -> bool:
    manifest = tag_dir / MANIFEST
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    for name, meta in files.items():
        f = tag_dir / name
        if not f.is_file() or f.stat().st_size != meta["bytes"]:
            return False
        if verify_checksums and sha256_file(f) != meta["sha256"]:
            return False
    return True


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
