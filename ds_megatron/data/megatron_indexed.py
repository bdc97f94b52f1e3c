"""A Megatron-LM / GPT-NeoX indexed dataset, read where it lies: ``PREFIX.bin`` (the token ids of every sequence,
concatenated) and ``PREFIX.idx``, little-endian:

    9 bytes    magic ``MMIDIDX\\x00\\x00``
    uint64     version (1)
    uint8      dtype code of the ids in .bin: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
               8 uint16
    uint64     N, the number of sequences
    uint64     D, the length of the document index (documents + 1)
    int32[N]   sequence lengths, in tokens
    int64[N]   byte offset of each sequence in .bin
    int64[D]   the sequence index at which each document starts (first 0, last N)

``open_indexed`` checks all of it before anything reads a token: the magic, version and dtype, that the arrays fill
the .idx exactly, that every offset is the running sum of the lengths times the item size (so the sequences lie
back to back from byte 0, in order), that the document index runs from 0 to N without going back, and that the .bin
holds exactly the bytes the index describes.  A truncated or foreign file is one ``ConfigError`` naming that file.
The arrays are memory-mapped and checked a chunk at a time; the .bin is mapped as one flat array (nothing copied),
which is the token stream training cuts into windows, exactly as it cuts ds_megatron's own packed files.

These files carry no tokenizer: the ids are trusted to be the run's tokenizer's (``--tokenizer``); only their range
is checked (``scan_ids``), since an id past the vocabulary would index outside the embedding.

Standard library and numpy only, so the pre-flight checks can read an index cheaply.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_megatron.config import ConfigError
from ds_megatron.fileio import atomic_write_text

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D: 34 bytes, no padding
DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
CHECK_ENTRIES = 1 << 22  # index entries checked at a time (32 MiB of int64): memory stays flat for any N
SCAN_BYTES = 1 << 26  # .bin bytes per chunk of the id scan
REBUILD = "rebuild the pair with the tool that wrote it (or copy it again), then pass its prefix"


@dataclass(frozen=True)
class IndexedDataset:
    """An opened, checked pair.  ``tokens`` is the whole .bin as one flat array (the sequences in order);
    ``lengths``, ``pointers`` and ``doc_index`` are the .idx arrays, memory-mapped."""

    prefix: str
    dtype: np.dtype
    lengths: np.ndarray  # int32 [N]
    pointers: np.ndarray  # int64 [N], bytes
    doc_index: np.ndarray  # int64 [D]
    tokens: np.ndarray  # [sum(lengths)], dtype

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_docs(self) -> int:
        return len(self.doc_index) - 1

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.lengths[i])]

    def document(self, j: int) -> np.ndarray:
        """The tokens of document ``j`` (its sequences are adjacent in the stream)."""
        a, b = int(self.doc_index[j]), int(self.doc_index[j + 1])
        if a == b:
            return self.tokens[:0]
        start = int(self.pointers[a]) // self.dtype.itemsize
        stop = int(self.pointers[b - 1]) // self.dtype.itemsize + int(self.lengths[b - 1])
        return self.tokens[start:stop]


def paths(prefix: str) -> tuple[Path, Path]:
    base = os.path.expanduser(prefix)
    return Path(base + ".bin"), Path(base + ".idx")


def megatron_prefix(path: str | None, setting: str = "ds_megatron.data.path") -> str | None:
    """``path`` when it is the prefix of a Megatron indexed dataset (PREFIX.idx or PREFIX.bin exists; a missing
    partner is ``open_indexed``'s refusal), else None.  A path naming the .bin or .idx itself is refused: the other
    half is found from the prefix."""
    if not path or any(ch in path for ch in "*,"):
        return None
    bin_path, idx_path = paths(path)
    if bin_path.is_file() or idx_path.is_file():
        return path
    stem, suffix = os.path.splitext(path)
    if suffix in (".bin", ".idx") and all(p.is_file() for p in paths(stem)):
        raise ConfigError(
            setting,
            "a Megatron indexed dataset is named by its prefix, not by one of its files",
            f"got {path}",
            f"pass {stem} (it reads {stem}.bin and {stem}.idx)",
        )
    return None


def _fail(path: Path, problem: str, values: str, fix: str = REBUILD) -> ConfigError:
    return ConfigError(str(path), problem, values, fix)


def _header(idx_path: Path, size: int) -> tuple[np.dtype, int, int]:
    with open(idx_path, "rb") as fh:
        head = fh.read(HEADER.size)
    if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
        raise _fail(
            idx_path,
            "not a Megatron indexed dataset index (wrong magic)",
            f"starts with {head[: len(MAGIC)]!r}, expected {MAGIC!r}",
            "pass the prefix of a Megatron-LM / GPT-NeoX .bin/.idx pair, or a directory written by "
            "`python -m ds_megatron.data prepare`",
        )
    if len(head) < HEADER.size:
        raise _fail(idx_path, "truncated index header", f"{size} bytes, the header alone takes {HEADER.size}")
    _, version, code, n, d = HEADER.unpack(head)
    if version != VERSION:
        raise _fail(
            idx_path,
            "unsupported index version",
            f"version {version}, this reader knows {VERSION}",
            "write the dataset in the version-1 format (Megatron-LM / GPT-NeoX's MMIDIDX)",
        )
    name = DTYPE_CODES.get(code)
    if name is None:
        raise _fail(idx_path, "unknown token dtype code", f"code {code}, known 1-8", REBUILD)
    dtype = np.dtype(name).newbyteorder("<")
    if dtype.kind == "f":
        raise _fail(
            idx_path,
            "token ids stored as floating point",
            f"dtype code {code} ({name})",
            "write the token ids as integers (uint16 when the vocabulary is below 65536, else int32)",
        )
    need = HEADER.size + 4 * n + 8 * n + 8 * d
    if size != need:
        what = "truncated index" if size < need else "index longer than its header describes"
        raise _fail(idx_path, what, f"{size} bytes, N={n} sequences and D={d} document entries need {need}")
    return dtype, n, d


def _check_arrays(idx_path: Path, lengths: np.ndarray, pointers: np.ndarray, doc_index: np.ndarray, itemsize: int):
    """Lengths non-negative, offsets the running sum of lengths x itemsize from 0, document index 0 .. N ascending;
    returns the bytes the sequences take.  A chunk at a time, carrying the running sum across chunks."""
    n = len(lengths)
    offset = 0  # where the next sequence must start, in bytes
    for a in range(0, n, CHECK_ENTRIES):
        length = np.asarray(lengths[a : a + CHECK_ENTRIES], dtype=np.int64)
        if (length < 0).any():
            i = a + int(np.argmax(length < 0))
            raise _fail(idx_path, "a negative sequence length", f"sequence {i}: {int(lengths[i])}")
        expected = offset + np.concatenate(([0], np.cumsum(length[:-1] * itemsize)))
        got = np.asarray(pointers[a : a + CHECK_ENTRIES])
        bad = np.flatnonzero(got != expected)
        if len(bad):
            i = a + int(bad[0])
            raise _fail(
                idx_path,
                "sequence byte offsets out of range (not the running sum of lengths x itemsize from 0)",
                f"sequence {i}: offset {int(pointers[i])}, expected {int(expected[bad[0]])}",
            )
        offset = int(expected[-1]) + int(length[-1]) * itemsize
    d = len(doc_index)
    if d == 0 or int(doc_index[0]) != 0 or int(doc_index[d - 1]) != n:
        ends = f"{int(doc_index[0])} .. {int(doc_index[d - 1])}" if d else "empty"
        raise _fail(idx_path, "the document index does not run from 0 to N", f"{ends}, N={n}")
    for a in range(0, d - 1, CHECK_ENTRIES):
        step = np.diff(np.asarray(doc_index[a : a + CHECK_ENTRIES + 1]))
        if (step < 0).any():
            j = a + int(np.argmax(step < 0))
            raise _fail(
                idx_path,
                "the document index goes back",
                f"document {j} starts at sequence {int(doc_index[j])}, document {j + 1} at {int(doc_index[j + 1])}",
            )
    return offset


def _map(path: Path, dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:  # numpy cannot map zero bytes
        return np.empty(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def open_indexed(prefix: str) -> IndexedDataset:
    """Open and check a .bin/.idx pair (module docstring); ConfigError naming the file at fault."""
    bin_path, idx_path = paths(prefix)
    for path, other in ((idx_path, bin_path), (bin_path, idx_path)):
        if not path.is_file():
            raise _fail(
                path,
                "missing half of a Megatron indexed dataset",
                f"{other.name} exists, {path.name} does not" if other.is_file() else "neither file exists",
                "pass the prefix of a complete .bin/.idx pair",
            )
    dtype, n, d = _header(idx_path, idx_path.stat().st_size)
    lengths = _map(idx_path, np.dtype("<i4"), HEADER.size, n)
    pointers = _map(idx_path, np.dtype("<i8"), HEADER.size + 4 * n, n)
    doc_index = _map(idx_path, np.dtype("<i8"), HEADER.size + 12 * n, d)
    nbytes = _check_arrays(idx_path, lengths, pointers, doc_index, dtype.itemsize)
    size = bin_path.stat().st_size
    if size != nbytes:
        what = "truncated token file" if size < nbytes else "token file longer than its index describes"
        fix = REBUILD if size < nbytes else "pass the prefix of a .bin/.idx pair written together"
        raise _fail(bin_path, what, f"{size} bytes, {idx_path.name} describes {nbytes} ({n} sequences)", fix)
    tokens = _map(bin_path, dtype, 0, nbytes // dtype.itemsize)
    return IndexedDataset(prefix, dtype, lengths, pointers, doc_index, tokens)


def scan_ids(
    tokens: np.ndarray, threads: int | None = None, on_chunk: Callable[[int], None] | None = None
) -> tuple[int, int | None]:
    """(the largest id, the smallest when some id is negative else None), reading the stream in chunks of
    ``SCAN_BYTES`` on ``threads`` threads (numpy's reductions release the GIL).  Signed ids are read as the unsigned
    type of their width, so one pass finds both: a negative id reads as at least 2**(bits - 1), beyond any
    vocabulary that type can index."""
    if len(tokens) == 0:
        return -1, None
    itemsize = tokens.dtype.itemsize
    signed = tokens.dtype.kind == "i"
    view = tokens.view(np.dtype(f"<u{itemsize}")) if signed else tokens
    step = max(1, SCAN_BYTES // itemsize)

    def chunk_max(a: int) -> int:
        top = int(view[a : a + step].max())
        if on_chunk is not None:
            on_chunk(min(step, len(view) - a) * itemsize)
        return top

    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        top = max(pool.map(chunk_max, range(0, len(view), step)))
    if signed and top >= 1 << (8 * itemsize - 1):
        return int(tokens.max()), int(tokens.min())  # rare, and fatal: read once more, signed, for the message
    return top, None


# How many documents' last tokens ``documents_ending_in`` reads: evenly spread over the .idx, so a pair written
# without EOS is seen at once, whatever its size, for about a millisecond of random reads.
EOS_SAMPLE_DOCS = 1000


def documents_ending_in(ds: IndexedDataset, token: int, sample: int = EOS_SAMPLE_DOCS) -> tuple[int, int]:
    """(documents whose last token is ``token``, documents looked at): up to ``sample`` non-empty documents evenly
    spaced over the .idx.  Packed-document masking finds documents by their EOS, so a pair written without EOS
    (Megatron's preprocessing without ``--append-eod``) would be masked as one document per window."""
    if ds.num_docs == 0:
        return 0, 0
    picked = sorted({int(j) for j in np.linspace(0, ds.num_docs - 1, min(sample, ds.num_docs))})
    lasts = [doc[-1] for j in picked if len(doc := ds.document(j))]
    return sum(int(t) == token for t in lasts), len(lasts)


def _id_record(ds: IndexedDataset, cache_dir: str | Path) -> Path:
    """Where the id range of this very pair is kept: keyed by its real path and both files' sizes and times, so a
    rewritten file is scanned again."""
    parts = [os.path.realpath(os.path.expanduser(ds.prefix))]
    for path in paths(ds.prefix):
        st = path.stat()
        parts += [str(st.st_size), str(st.st_mtime_ns)]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
    return Path(os.path.expanduser(str(cache_dir))) / "megatron_ids" / f"{key}.json"


def recorded_ids(ds: IndexedDataset, cache_dir: str | Path) -> tuple[int, int | None] | None:
    """The id range a previous scan of this unchanged pair recorded, or None."""
    try:
        found = json.loads(_id_record(ds, cache_dir).read_text())
        return int(found["max_id"]), None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_ids(ds: IndexedDataset, cache_dir: str | Path, max_id: int) -> None:
    """Keep a scan's result (only of ids that passed: a pair with negative ids is never recorded).  A cache that
    cannot be written (a read-only file system) costs the next launch a scan, nothing more."""
    record = _id_record(ds, cache_dir)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, json.dumps({"prefix": ds.prefix, "max_id": max_id}))
    except OSError:
        pass


def tokenizer_spec(spec: str | None, prepared_tokenizer: str | None, setting: str) -> str:
    """The tokenizer directory Megatron indexed data is read with: ``data.tokenizer``, else (in a blend) that of the
    prepared directories beside it.  Refused without one, or with only ``bpe:N`` (a tokenizer trained here could
    not match ids that were tokenised elsewhere)."""
    if spec is not None and not spec.startswith("bpe:"):
        return spec
    if prepared_tokenizer is not None:  # a bpe:N spec, like data.tokenizer for prepared data alone, is ignored
        return prepared_tokenizer
    raise ConfigError(
        setting,
        "Megatron indexed data carries no tokenizer, and the ids must be read with the one that made them",
        f"data.tokenizer={spec!r}",
        "pass --tokenizer DIR (the transformers tokenizer directory the .bin was tokenised with)",
    )
