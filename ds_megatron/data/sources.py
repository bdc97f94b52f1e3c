"""Streaming reads of local corpora, cut into chunks that tokenise independently (one chunk becomes one shard).

Documents come in the same order, with the same text, as ``corpus.load_documents`` gives them (files sorted as
``resolve_files`` lists them, records in file order), so a prepared directory holds the very token stream the
in-launch path packs.  Formats:

- ``.txt``: one document per file (read whole, in text mode: universal newlines, as ``datasets`` reads it); a chunk
  is a run of consecutive files.
- ``.jsonl`` and ``.json`` that starts with ``{``: one JSON record per line; a chunk is a byte range of a file, and a
  line belongs to the chunk its first byte falls in, so chunks of one file can be read by different processes.
- ``.json`` that starts with ``[``: a JSON array of records, one chunk per file (parsed whole: prefer JSON lines for
  big files).
- ``.parquet``: a chunk is a run of row groups, read a record batch at a time, the text column only.

Only a batch of documents is in memory at a time (about ``BATCH_BYTES`` of text), whatever the corpus size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ds_megatron.config import ConfigError
from ds_megatron.data.corpus import SUFFIX_BUILDERS

UTF8_SUFFIXES = tuple(s for s, builder in SUFFIX_BUILDERS.items() if builder != "parquet")  # bytes read as UTF-8
UTF8_BLOCK = 1 << 24  # bytes per read when a file's encoding is checked without reading it whole
BATCH_DOCS = 512  # documents per tokenizer call
BATCH_BYTES = 1 << 20  # ... or this many bytes of text, whichever comes first
TEXT_FIELD_FIX = "pass --text-field naming the field that holds the text"


@dataclass(frozen=True)
class Chunk:
    """A piece of the corpus: ``files`` (several for .txt, else one) and, for one file, a byte range (jsonl) or a
    row-group range (parquet) ``[start, stop)``.  ``nbytes`` is its share of the input, for progress."""

    index: int
    kind: str  # "txt", "jsonl", "json" (array) or "parquet"
    files: tuple[str, ...]
    start: int = 0
    stop: int = 0
    nbytes: int = 0

    def describe(self) -> dict:
        return {"kind": self.kind, "files": list(self.files), "start": self.start, "stop": self.stop}


def file_kind(path: str) -> str:
    suffix = os.path.splitext(path)[1]
    if suffix not in SUFFIX_BUILDERS:
        raise ConfigError("--data", "unknown file type", path, f"use {', '.join(sorted(SUFFIX_BUILDERS))} files")
    if suffix == ".txt":
        return "txt"
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".json":
        with open(path, "rb") as fh:
            head = fh.read(4096).lstrip()
        return "json" if head.startswith(b"[") else "jsonl"
    return "jsonl"


def plan_chunks(files: list[str], chunk_bytes: int) -> list[Chunk]:
    """Cut the corpus into chunks of about ``chunk_bytes`` of input each, in corpus order."""
    chunks: list[Chunk] = []
    txt_run: list[str] = []
    txt_bytes = 0

    def add(kind: str, group: tuple[str, ...], start: int = 0, stop: int = 0, nbytes: int = 0) -> None:
        chunks.append(Chunk(len(chunks), kind, group, start, stop, nbytes))

    def flush_txt() -> None:
        nonlocal txt_run, txt_bytes
        if txt_run:
            add("txt", tuple(txt_run), nbytes=txt_bytes)
        txt_run, txt_bytes = [], 0

    for path in files:
        kind, size = file_kind(path), os.path.getsize(path)
        if kind != "txt":
            flush_txt()
        if kind == "txt":
            txt_run.append(path)
            txt_bytes += size
            if txt_bytes >= chunk_bytes:
                flush_txt()
        elif kind == "jsonl":
            for start in range(0, max(size, 1), chunk_bytes):
                stop = min(start + chunk_bytes, size)
                add("jsonl", (path,), start, stop, stop - start)
        elif kind == "json":
            add("json", (path,), nbytes=size)
        else:
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            groups = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
            total = sum(groups) or 1
            start, acc = 0, 0
            for i, group_bytes in enumerate(groups):
                acc += group_bytes
                if acc >= chunk_bytes or i == len(groups) - 1:
                    add("parquet", (path,), start, i + 1, size * acc // total)
                    start, acc = i + 1, 0
    flush_txt()
    return chunks


def not_utf8(setting: str, path: str, offset: int, err: UnicodeDecodeError) -> ConfigError:
    """A file that is not UTF-8 text (a binary file passed by mistake, a Latin-1 corpus): where, to the byte."""
    return ConfigError(
        setting,
        "not UTF-8 text",
        f"{path} at byte {offset}: {err.reason}",
        "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out",
    )


def decode_utf8(data: bytes, path: str, offset: int = 0, setting: str = "--data") -> str:
    """``data`` (the bytes of ``path`` from byte ``offset``) as text; ConfigError naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise not_utf8(setting, path, offset + err.start, err) from None


def check_utf8_file(path: str, setting: str) -> None:
    """``path`` is UTF-8 throughout, read a block at a time (a character cut by a block's end is carried over)."""
    with open(path, "rb") as fh:
        base, pending = 0, b""  # base: the file offset of pending's first byte
        while True:
            block = fh.read(UTF8_BLOCK)
            data = pending + block
            if not data:
                return
            try:
                data.decode("utf-8")
                good = len(data)
            except UnicodeDecodeError as err:
                if not (block and err.reason == "unexpected end of data" and len(data) - err.start < 4):
                    raise not_utf8(setting, path, base + err.start, err) from None
                good = err.start  # the start of a character the next block completes
            pending, base = data[good:], base + good


def _field(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError("--text-field", f"no field {field!r} in {where}", str(keys), "pass --text-field")
    text = record[field]
    if not isinstance(text, str):
        raise _not_text(field, where, text)
    return text


def _not_text(field: str, where: str, value) -> ConfigError:
    return ConfigError(
        "--text-field", f"{field!r} is not text in {where}", f"got {type(value).__name__}", TEXT_FIELD_FIX
    )


def check_fields(files: list[str], field: str) -> None:
    """The first record of every structured file has the text field (checked before any work starts)."""
    for path in files:
        kind = file_kind(path)
        if kind == "jsonl":
            with open(path, "rb") as fh:
                pos = 0
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        where = f"{path} line {number}"
                        _field(_loads(line, where, path, pos), field, where)
                        break
                    pos += len(line)
        elif kind == "parquet":
            import pyarrow.parquet as pq

            names = pq.ParquetFile(path).schema_arrow.names
            if field not in names:
                raise ConfigError("--text-field", f"no column {field!r} in {path}", str(names), "pass --text-field")


def _loads(data: bytes, where: str, path: str, offset: int = 0):
    """One JSON line, or a whole JSON array, from the bytes of ``path`` at ``offset`` (decoded as UTF-8 first, so
    that a bad byte is named by its offset rather than by json's guess at another encoding)."""
    text = decode_utf8(data, path, offset)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        place = err.msg if err.lineno == 1 else f"{err.msg} at line {err.lineno} column {err.colno}"
        raise ConfigError("--data", f"invalid JSON in {where}", place, "fix or remove that line") from None


def _documents(chunk: Chunk, field: str) -> Iterator[tuple[str, int]]:
    """(text, input bytes it accounts for) for every document of the chunk, in order."""
    if chunk.kind == "txt":
        for path in chunk.files:
            with open(path, "rb") as fh:
                text = decode_utf8(fh.read(), path)
            # universal newlines, as a file opened in text mode reads (and datasets' text builder does)
            yield text.replace("\r\n", "\n").replace("\r", "\n"), os.path.getsize(path)
    elif chunk.kind == "jsonl":
        path = chunk.files[0]
        with open(path, "rb") as fh:
            if chunk.start > 0:
                fh.seek(chunk.start - 1)
                fh.readline()  # the line holding byte start - 1 belongs to the previous chunk
            pos = fh.tell()
            while pos < chunk.stop:
                line = fh.readline()
                if not line:
                    break
                if line.strip():
                    where = f"{path} at byte {pos}"
                    yield _field(_loads(line, where, path, pos), field, where), len(line)
                pos += len(line)
    elif chunk.kind == "json":
        path = chunk.files[0]
        with open(path, "rb") as fh:
            records = _loads(fh.read(), path, path)
        share = chunk.nbytes // max(1, len(records))
        for i, record in enumerate(records):
            yield _field(record, field, f"{path} record {i}"), share
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(chunk.files[0])
        groups = list(range(chunk.start, chunk.stop))
        rows = sum(pf.metadata.row_group(i).num_rows for i in groups) or 1
        for batch in pf.iter_batches(batch_size=BATCH_DOCS, row_groups=groups, columns=[field]):
            share = chunk.nbytes // rows
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise _not_text(field, chunk.files[0], text)
                yield text, share


def read_batches(chunk: Chunk, field: str) -> Iterator[tuple[list[str], int]]:
    """The chunk's documents in batches: (texts, input bytes they account for)."""
    texts: list[str] = []
    size = nbytes = 0
    for text, accounted in _documents(chunk, field):
        texts.append(text)
        size += len(text)
        nbytes += accounted
        if len(texts) >= BATCH_DOCS or size >= BATCH_BYTES:
            yield texts, nbytes
            texts, size, nbytes = [], 0, 0
    if texts:
        yield texts, nbytes


def iter_texts(chunks: list[Chunk], field: str) -> Iterator[str]:
    """Every document of the corpus, in order (to train a tokenizer on)."""
    for chunk in chunks:
        for text, _ in _documents(chunk, field):
            yield text
