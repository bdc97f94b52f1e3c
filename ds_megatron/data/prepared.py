"""A prepared data directory: what ``python -m ds_megatron.data prepare`` writes and training reads (its files,
``manifest.json``, ``shard_NNNNN.bin`` / ``.idx`` and ``tokenizer/``: docs/data.md, "Real corpora: prepare them once").

The token stream is the shards concatenated in order, the same stream the in-launch path packs for the same corpus
and tokenizer.  A shard counts only once the manifest names it: its files are written under temporary names, synced
and renamed, then the manifest is rewritten atomically with its entry.  ``complete`` becomes true with the last one.

Standard library and numpy only, so the pre-flight checks can read a manifest cheaply.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_megatron.config import ConfigError
from ds_megatron.fileio import sha256_file

FORMAT = "ds_megatron.prepared"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
INDEX_DTYPE = np.dtype("<u8")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def read_manifest(directory: str | Path) -> dict | None:
    """The manifest of a prepared directory, or None when ``directory`` is not one."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def is_prepared(path: str | Path | None) -> bool:
    return path is not None and os.path.isdir(os.path.expanduser(str(path))) and read_manifest(path) is not None


def reads_prepared(data) -> bool:
    """Whether a run's data section (``DataSection``) reads prepared directories (``blend``, or ``path`` naming one):
    their tokenizer and validation split are the directories', so ``data.tokenizer`` and ``data.valid_fraction`` are
    ignored there (the launch says so) and must not be refused."""
    return bool(data.blend) or is_prepared(data.path)


def file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _file_problem(path: Path, entry: dict, checksums: bool) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{path.name} has {size} bytes, the manifest says {entry['bytes']}"
    if checksums and sha256_file(path) != entry["sha256"]:
        return f"{path.name} fails its sha256"
    return None


def shard_problem(directory: Path, shard: dict, itemsize: int, checksums: bool) -> str | None:
    """Why a shard's files do not match its manifest entry (None: they do)."""
    name = shard["name"]
    if shard["bin"]["bytes"] != shard["num_tokens"] * itemsize or shard["idx"]["bytes"] != shard["num_docs"] * 8:
        return f"{name}: sizes disagree with its token and document counts"
    for suffix in ("bin", "idx"):
        problem = _file_problem(directory / f"{name}.{suffix}", shard[suffix], checksums)
        if problem is not None:
            return problem
    return None


def _rerun_command(manifest: dict, directory: Path) -> str:
    """The recorded prepare command with ``--out`` set to ``directory``: a copy or a moved directory is remade where
    it is, not into the place the original was written to (which may hold a sound directory, or none)."""
    command = manifest.get("command")
    if not command:
        return "python -m ds_megatron.data prepare ... --out " + shlex.quote(str(directory))
    argv = shlex.split(command)
    if "--out" in argv and argv.index("--out") + 1 < len(argv):
        argv[argv.index("--out") + 1] = str(directory)
    return shlex.join(argv)


def check_prepared(directory: str | Path, checksums: bool = False) -> tuple[str, str, str] | None:
    """(problem, values, fix) when the directory is not a complete prepared directory matching its manifest; None
    when it is.  Sizes are always checked; sha256 only with ``checksums`` (it reads every byte)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    rerun = _rerun_command(manifest, directory) if manifest else ""
    if manifest is None:
        return "not a prepared directory", f"{directory} has no {MANIFEST}", "run python -m ds_megatron.data prepare"
    if manifest.get("version") != VERSION:
        return "prepared with another format version", f"{manifest.get('version')} != {VERSION}", f"rerun `{rerun}`"
    if not manifest.get("complete"):
        done = len(manifest.get("shards", []))
        return (
            "the prepared directory is incomplete",
            f"{directory}: {done} of {manifest.get('num_shards')} shards",
            f"rerun `{rerun}` (it resumes)",
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    problems = [p for s in manifest["shards"] if (p := shard_problem(directory, s, itemsize, checksums)) is not None]
    tok_dir = directory / TOKENIZER_DIR
    for name, entry in manifest["tokenizer"]["files"].items():
        problem = _file_problem(tok_dir / name, entry, checksums)
        if problem is not None:
            problems.append(f"{TOKENIZER_DIR}/{problem}")
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        return (
            "the prepared directory does not match its manifest",
            f"{directory}: {problems[0]}{more}",
            f"rerun `{rerun}` (it redoes the bad shards)",
        )
    return None


class ShardedTokens:
    """The shards' token arrays as one flat sequence.  ``x[a:b]`` is a view (nothing is read), ``np.asarray(x)``
    reads it; this is all ``split_train_valid`` and ``PackedSamples`` ask of a token array."""

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None, _offsets=None):
        self._arrays = arrays
        self._offsets = _offsets if _offsets is not None else np.cumsum([0] + [len(a) for a in arrays])
        self.start = start
        self.stop = int(self._offsets[-1]) if stop is None else stop
        self.dtype = arrays[0].dtype if arrays else np.dtype(np.uint16)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise IndexError("ShardedTokens slices take step 1 only")
            return ShardedTokens(self._arrays, self.start + a, self.start + max(a, b), self._offsets)
        i = key + len(self) if key < 0 else key
        if not 0 <= i < len(self):
            raise IndexError(key)
        return self._read(self.start + i, self.start + i + 1)[0]

    def _read(self, a: int, b: int) -> np.ndarray:
        pieces = []
        shard = int(np.searchsorted(self._offsets, a, side="right")) - 1
        while a < b:
            begin, end = int(self._offsets[shard]), int(self._offsets[shard + 1])
            take = min(b, end)
            if take > a:
                pieces.append(self._arrays[shard][a - begin : take - begin])
            a, shard = max(a, take), shard + 1
        return np.concatenate(pieces) if len(pieces) != 1 else np.asarray(pieces[0])

    def __array__(self, dtype=None, copy=None):
        out = self._read(self.start, self.stop) if len(self) else np.empty(0, self.dtype)
        return out.astype(dtype, copy=False) if dtype is not None else out


def check_one_tokenizer(fingerprints: dict[str, str], setting: str) -> None:
    """Blended prepared directories (directory -> its tokenizer's fingerprint) were all tokenised with one
    tokenizer: the same id must mean the same text in every one of them."""
    if len(set(fingerprints.values())) > 1:
        raise ConfigError(
            setting,
            "the directories were tokenised with different tokenizers",
            ", ".join(f"{d}: {f}" for d, f in fingerprints.items()),
            "prepare them all with the same --tokenizer directory",
        )


@dataclass(frozen=True)
class Prepared:
    directory: Path
    manifest: dict
    tokens: ShardedTokens

    @property
    def tokenizer_dir(self) -> Path:
        return self.directory / TOKENIZER_DIR

    def document_ends(self, shard: int) -> np.ndarray:
        """Where each document of a shard ends (exclusive), in tokens from the shard's start."""
        entry = self.manifest["shards"][shard]
        path = self.directory / f"{entry['name']}.idx"
        return np.fromfile(path, dtype=INDEX_DTYPE) if entry["num_docs"] else np.empty(0, INDEX_DTYPE)


def open_prepared(directory: str | Path, checksums: bool = False) -> Prepared:
    """Open a complete prepared directory read-only (memory-mapped shards); ConfigError when it does not match."""
    directory = Path(os.path.expanduser(str(directory)))
    problem = check_prepared(directory, checksums)
    if problem is not None:
        raise ConfigError("ds_megatron.data.path", *problem)
    manifest = read_manifest(directory)
    dtype = np.dtype(manifest["dtype"])
    arrays = [
        np.memmap(directory / f"{s['name']}.bin", dtype=dtype, mode="r", shape=(s["num_tokens"],))
        for s in manifest["shards"]
        if s["num_tokens"] > 0  # numpy cannot map an empty file; an empty shard adds nothing to the stream
    ]
    return Prepared(directory, manifest, ShardedTokens(arrays))
