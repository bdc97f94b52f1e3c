"""Documents in, packed token files out.

- ``load_documents``: a ``datasets.Dataset`` with one column ``text`` from the built-in corpus, local files
  (.txt: one document per file; .json/.jsonl/.parquet: one per record, text in ``text_field``; comma-separated paths,
  globs and directories) or a Hugging Face dataset name (needs a network).
- ``build_tokenizer``: a tokenizer directory (AutoTokenizer), or ``bpe:N``: a byte-level BPE of N tokens trained on
  the training text (cached by content hash), with ``<|endoftext|>`` as end-of-document token.
- ``pack``: tokenise once (``datasets.map`` in parallel, with a progress bar) into one flat memory-mapped file of
  token ids, EOS after every document, uint16 when the vocabulary fits, else uint32, cached by the hash of the text,
  the tokenizer and the settings; written to a temporary name and renamed, with a JSON manifest (dtype, token count,
  size, sha256) that ``open_packed`` verifies.  Big corpora are prepared outside the launch instead (``build.py``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_megatron.config import ConfigError, RunConfig, effective_tokenizer
from ds_megatron.data.prepared import token_dtype
from ds_megatron.fileio import atomic_write_text, sha256_file

EOS_TOKEN = "<|endoftext|>"
SUFFIX_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _writer_id() -> str:
    """Host and process: unique among the processes of a job, also across nodes sharing a filesystem."""
    return f"{socket.gethostname()}-{os.getpid()}"


def resolve_files(path: str) -> list[str]:
    """Expand comma-separated paths and globs; a directory stands for the text files under it (recursively, known
    suffixes only, sorted).  An empty result for a local-looking path is an error."""
    files: list[str] = []
    for part in [p.strip() for p in path.split(",") if p.strip()]:
        for match in sorted(glob.glob(os.path.expanduser(part))):
            if os.path.isfile(match):
                files.append(match)
            elif os.path.isdir(match):
                found = (str(f) for f in Path(match).rglob("*") if f.suffix in SUFFIX_BUILDERS and f.is_file())
                files += sorted(found)
    return files


def matching_files(path: str, setting: str) -> list[str]:
    """:func:`resolve_files` of ``path``, refusing a path that matches none (``setting`` names it to the user)."""
    files = resolve_files(path)
    if not files:
        raise ConfigError(setting, "no file matches", path, "check the path or glob")
    return files


def check_some_text(files: list[str], setting: str) -> None:
    """Refuse a corpus whose every file is empty, before anything is tokenised."""
    if all(os.path.getsize(f) == 0 for f in files):
        raise ConfigError(setting, "the corpus is empty", f"{len(files)} file(s) of 0 bytes", "point it at some text")


def is_local(path: str) -> bool:
    """Local files (paths, globs, lists) rather than a Hugging Face dataset name such as "owner/name"."""
    return (
        any(ch in path for ch in "*,")
        or path.startswith(("/", ".", "~"))
        or Path(path).suffix in SUFFIX_BUILDERS
        or os.path.exists(path)
    )


def load_documents(path: str | None, text_field: str = "text", split: str = "train", hf_config: str | None = None):
    """One ``text`` column; raises ConfigError for missing files, unknown formats or an empty corpus.  ``hf_config``:
    the configuration of a Hugging Face dataset ``path`` (``datasets.load_dataset(path, name=hf_config)``)."""
    import datasets

    if path is None:
        from ds_megatron.data.demo import builtin_documents

        return datasets.Dataset.from_dict({"text": builtin_documents()})
    if is_local(path):
        files = matching_files(path, "ds_megatron.data.path")
        suffixes = {Path(f).suffix for f in files}
        if len(suffixes) != 1 or next(iter(suffixes)) not in SUFFIX_BUILDERS:
            raise ConfigError(
                "ds_megatron.data.path",
                "mixed or unknown file types",
                str(sorted(suffixes)),
                f"use one of {sorted(SUFFIX_BUILDERS)}",
            )
        builder = SUFFIX_BUILDERS[suffixes.pop()]
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
        field = "text" if builder == "text" else text_field
    else:
        ds = _load_hub_dataset(path, hf_config, split)
        field = text_field
    if field not in ds.column_names:
        raise ConfigError(
            "ds_megatron.data.text_field", f"no column {field!r}", str(ds.column_names), "set data.text_field"
        )
    ds = ds.select_columns([field])
    if field != "text":
        ds = ds.rename_column(field, "text")
    if len(ds) == 0:
        raise ConfigError("ds_megatron.data.path", "the dataset is empty", str(path), "point it at some text")
    return ds


def _load_hub_dataset(name: str, config: str | None, split: str):
    """A Hugging Face dataset; pre-flight resolved the name already, so a failure here (the network went away since)
    is one ConfigError line like pre-flight's, not a traceback from every process."""
    import datasets

    from ds_megatron.data.hub import describe_failure

    try:
        return datasets.load_dataset(name, name=config, split=split)
    except Exception as err:
        raise describe_failure(name, config, split, err, bool(datasets.config.HF_HUB_OFFLINE)) from None


def inputs_key(run: RunConfig) -> str:
    """A cheap key of what the packed cache is built from (file names, sizes and times, not contents): processes
    that wait for the builder find its result by it without reading the corpus."""
    data = run.section.data
    spec = effective_tokenizer(run)
    parts: list = [data.path, data.text_field, data.split, spec, sys.version_info[:2]]
    if data.hf_config is not None:  # appended only when set: the keys of runs without one stay as they were
        parts.append(data.hf_config)
    if data.path is not None and is_local(data.path):
        parts += [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in resolve_files(data.path)]
    if not spec.startswith("bpe:") and Path(spec).is_dir():
        parts += [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(Path(spec).iterdir()) if p.is_file()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def launch_record(run: RunConfig) -> Path:
    """The small record by which a launch's processes find the packed cache built from the run's inputs (written by
    the builder once the cache is complete; pre-flight reads it to skip checking text the launch will not read)."""
    return Path(run.section.data.cache_dir) / f"launch-{inputs_key(run)}.json"


def fingerprint_documents(ds, path: str | None) -> str:
    """A content hash of the corpus: file contents for local files, the texts themselves otherwise."""
    h = hashlib.sha256()
    if path is not None and is_local(path):
        for f in resolve_files(path):
            h.update(f.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()
    for batch in ds.iter(batch_size=1000):
        for text in batch["text"]:
            h.update(text.encode("utf-8", errors="replace"))
            h.update(b"\0")
    return h.hexdigest()


def train_bpe(ds, vocab_size: int, out_dir: Path):
    """Train a byte-level BPE on the corpus and save it as a transformers tokenizer directory."""

    def texts():
        for batch in ds.iter(batch_size=1000):
            yield from batch["text"]

    return train_bpe_from_texts(texts(), vocab_size, out_dir, len(ds))


def train_bpe_from_texts(texts, vocab_size: int, out_dir: Path, length: int | None = None):
    """Train a byte-level BPE on an iterable of documents (read once, streamed) and save it as a transformers
    tokenizer directory (written under a temporary name, then renamed)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN], show_progress=True, length=length
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, unk_token=EOS_TOKEN
    )
    # A name of this process's own: processes that build the same tokenizer at once never write into one directory.
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{_writer_id()}")
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process renamed an identical tokenizer into place first
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def tokenizer_fingerprint(tok) -> str:
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def build_tokenizer(spec: str, ds, corpus_hash: str, cache_dir: Path):
    """Load (directory) or train-and-cache (``bpe:N``) the tokenizer; returns (tokenizer, its directory)."""
    from transformers import AutoTokenizer

    if spec.startswith("bpe:"):
        size = int(spec.removeprefix("bpe:"))
        out = cache_dir / "tokenizers" / f"bpe{size}-{corpus_hash[:16]}"
        if out.is_dir():
            return AutoTokenizer.from_pretrained(out), str(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        return train_bpe(ds, size, out), str(out)
    return AutoTokenizer.from_pretrained(spec), spec


def eos_id(tok, setting: str = "ds_megatron.data.tokenizer") -> int:
    """The end-of-document token every document ends in; ConfigError naming ``setting`` (the config key, or the
    prepare command's flag) for a tokenizer without one."""
    if tok.eos_token_id is None:
        raise ConfigError(
            setting,
            "the tokenizer has no EOS token",
            f"{tok.name_or_path or type(tok).__name__}: eos_token is None",
            "use one that defines it",
        )
    return int(tok.eos_token_id)


@dataclass(frozen=True)
class PackedTokens:
    """A flat token file opened read-only as a numpy memmap."""

    path: Path
    tokens: np.ndarray
    manifest: dict


def _manifest_path(bin_path: Path) -> Path:
    return bin_path.with_suffix(".json")


def pack(ds, tok, key: str, cache_dir: Path, num_proc: int = 1) -> Path:
    """Tokenise ``ds`` into ``cache_dir/<key>.bin`` (skipped when a verified file exists).  Returns the path."""
    out = cache_dir / f"{key}.bin"
    if out.exists() and _manifest_path(out).exists():
        try:
            open_packed(out)
            return out
        except ConfigError as err:
            print(f"warning: {err.problem} ({err.values}); rebuilding the token cache", flush=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    eos = eos_id(tok)
    dtype = token_dtype(len(tok))

    def encode(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": ids, "n": [len(x) + 1 for x in ids]}

    encoded = ds.map(
        encode,
        batched=True,
        batch_size=256,
        num_proc=num_proc if len(ds) >= 2 * num_proc else None,
        remove_columns=["text"],
        desc="tokenizing",
    )
    total = int(sum(encoded["n"]))  # one int per document; the ids stay on disk in the Arrow cache
    if total <= len(encoded):
        raise ConfigError(
            "ds_megatron.data.path",
            "the corpus has no tokens",
            f"{len(encoded)} empty documents",
            "point it at some text",
        )
    tmp = out.with_name(f"{out.name}.tmp-{_writer_id()}")  # concurrent builders never share a temporary file
    arr = np.memmap(tmp, dtype=dtype, mode="w+", shape=(total,))
    pos = 0
    for batch in encoded.iter(batch_size=1000):  # a batch at a time: memory stays bounded by the batch
        for ids in batch["ids"]:
            n = len(ids)
            arr[pos : pos + n] = ids
            arr[pos + n] = eos
            pos += n + 1
    arr.flush()
    del arr
    manifest = {
        "dtype": np.dtype(dtype).name,
        "num_tokens": total,
        "num_docs": len(encoded),
        "bytes": total * np.dtype(dtype).itemsize,
        "sha256": sha256_file(tmp),
        "eos_id": eos,
        "key": key,
    }
    os.replace(tmp, out)
    atomic_write_text(_manifest_path(out), json.dumps(manifest, indent=1))
    return out


def open_packed(path: Path, verify_checksum: bool = True) -> PackedTokens:
    """Open a packed token file, checking its size (and checksum) against the manifest."""
    manifest_path = _manifest_path(path)
    setting, fix = "ds_megatron.data.cache_dir", f"delete {path} and its manifest to build it again"
    if not path.exists() or not manifest_path.exists():
        raise ConfigError(setting, "the token cache is incomplete", f"{path}: file or manifest missing", fix)
    manifest = json.loads(manifest_path.read_text())
    if path.stat().st_size != manifest["bytes"]:
        size = f"{path}: {path.stat().st_size} bytes, the manifest says {manifest['bytes']}"
        raise ConfigError(setting, "the token cache has the wrong size", size, fix)
    if verify_checksum and sha256_file(path) != manifest["sha256"]:
        raise ConfigError(
            setting, "the token cache fails its checksum", f"{path}: sha256 differs from the manifest", fix
        )
    tokens = np.memmap(path, dtype=np.dtype(manifest["dtype"]), mode="r", shape=(manifest["num_tokens"],))
    return PackedTokens(path, tokens, manifest)
