"""``prepare``: local text files in, a prepared directory (see ``prepared.py``) out, outside any training launch.

1. Resolve the files, check the text field, cut the corpus into chunks (``sources.plan_chunks``) and key the plan
   (files with their sizes and modification times, chunk size, text field, tokenizer spec).
2. An output directory that already holds this plan resumes: its complete shards (manifest entries whose files match
   their sizes) are kept, everything else is redone.  A directory holding another plan is refused, never overwritten.
3. The tokenizer: a directory is copied into OUT/tokenizer; ``bpe:N`` trains a byte-level BPE on the corpus first
   (streamed once, ``corpus.train_bpe_from_texts``, the in-launch path's trainer), or reuses the one a previous,
   interrupted run of the same plan saved.
4. Pending chunks go to ``num_proc`` worker processes (``spawn``: no thread pool or tokenizer state inherited), each
   reading its chunk a batch of documents at a time and writing one shard.  The main process writes the manifest
   after every finished shard and draws the progress bar (input bytes, tokens/s).
5. Bad input found only while reading (a bad line or byte deep in a file) leaves nothing when no shard is complete,
   and otherwise keeps the complete shards, resumable (``_after_bad_input``); an interrupt keeps everything.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import queue
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_megatron.config import ConfigError
from ds_megatron.data.corpus import (
    check_some_text,
    eos_id,
    matching_files,
    tokenizer_fingerprint,
    train_bpe_from_texts,
)
from ds_megatron.data.lock import file_lock
from ds_megatron.data.prepared import (
    FORMAT,
    INDEX_DTYPE,
    MANIFEST,
    TOKENIZER_DIR,
    VERSION,
    file_entry,
    read_manifest,
    shard_name,
    shard_problem,
    token_dtype,
)
from ds_megatron.data.sources import Chunk, check_fields, iter_texts, plan_chunks, read_batches
from ds_megatron.fileio import atomic_write_text

# Without --chunk-mb a corpus is cut into about TARGET_CHUNKS chunks of 1 to 64 MiB: enough pieces to keep every
# worker busy to the end (a lone last chunk would leave the others idle), few enough to keep files and manifest small.
# It depends on the corpus alone, so a resumed run with another --num-proc finds the same plan.
TARGET_CHUNKS = 64
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 1 << 20, 64 << 20
LOCK = ".prepare.lock"  # held while a prepare writes the directory: two at once would undo each other's shards


@dataclass(frozen=True)
class PrepareArgs:
    data: str
    tokenizer: str
    out: str
    num_proc: int = 1
    text_field: str = "text"
    valid_fraction: float = 0.02
    chunk_bytes: int | None = None  # input bytes per chunk (shard); None: chosen from the corpus size
    progress: bool = True


@dataclass(frozen=True)
class ShardJob:
    chunk: Chunk
    out: str
    tokenizer_json: str
    eos: int
    dtype: str
    text_field: str


# ---- one shard (runs in a worker process, or in-process with num_proc 1) ------------------------------------------
_TOKENIZERS: dict = {}
_REPORT = None


def _init_worker(report_queue) -> None:
    global _REPORT
    # Each worker encodes on one thread: num_proc processes share the cores, not num_proc x cores threads.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _REPORT = report_queue.put


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS[path] = Tokenizer.from_file(path)
    return _TOKENIZERS[path]


def _write(fh, hasher, array: np.ndarray) -> None:
    data = array.tobytes()
    fh.write(data)
    hasher.update(data)


def tokenize_chunk(job: ShardJob, report=None) -> dict:
    """Tokenise one chunk into ``shard_NNNNN.{bin,idx}``; returns the shard's manifest entry."""
    report = report or _REPORT or (lambda item: None)
    tok, dtype = _tokenizer(job.tokenizer_json), np.dtype(job.dtype)
    name, out = shard_name(job.chunk.index), Path(job.out)
    tmp = {s: out / f"{name}.{s}.tmp{os.getpid()}" for s in ("bin", "idx")}
    hashes = {s: hashlib.sha256() for s in tmp}
    num_tokens = num_docs = 0
    with open(tmp["bin"], "wb") as fb, open(tmp["idx"], "wb") as fi:
        for texts, nbytes in read_batches(job.chunk, job.text_field):
            flat: list[int] = []
            ends = np.empty(len(texts), dtype=INDEX_DTYPE)
            for i, enc in enumerate(tok.encode_batch(texts, add_special_tokens=False)):
                flat.extend(enc.ids)
                flat.append(job.eos)
                ends[i] = num_tokens + len(flat)
            _write(fb, hashes["bin"], np.asarray(flat, dtype=dtype))
            _write(fi, hashes["idx"], ends)
            num_tokens, num_docs = num_tokens + len(flat), num_docs + len(texts)
            report((nbytes, len(flat)))
        for fh in (fb, fi):
            fh.flush()
            os.fsync(fh.fileno())  # on disk before the manifest can name it
    for suffix, path in tmp.items():
        os.replace(path, out / f"{name}.{suffix}")
    return {
        "name": name,
        "index": job.chunk.index,
        "num_tokens": num_tokens,
        "num_docs": num_docs,
        "bin": {"bytes": num_tokens * dtype.itemsize, "sha256": hashes["bin"].hexdigest()},
        "idx": {"bytes": num_docs * INDEX_DTYPE.itemsize, "sha256": hashes["idx"].hexdigest()},
        "source": job.chunk.describe(),
    }


# ---- the whole run -------------------------------------------------------------------------------------------------
def command_line(args: PrepareArgs) -> str:
    """The command that (re)makes this directory, recorded so that error messages can say what to rerun."""
    argv = ["python", "-m", "ds_megatron.data", "prepare", "--data", args.data, "--tokenizer", args.tokenizer]
    argv += ["--out", args.out, "--num-proc", str(args.num_proc)]
    if args.text_field != "text":
        argv += ["--text-field", args.text_field]
    if args.valid_fraction != 0.02:
        argv += ["--valid-fraction", f"{args.valid_fraction:g}"]
    if args.chunk_bytes is not None:  # it decides the shards, so a resume must repeat it
        argv += ["--chunk-mb", f"{args.chunk_bytes / (1 << 20):.12g}"]
    return shlex.join(argv)


def chunk_bytes(files: list[str], args: PrepareArgs) -> int:
    if args.chunk_bytes is not None:
        return args.chunk_bytes
    total = sum(os.path.getsize(f) for f in files)
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, total // TARGET_CHUNKS))


def plan_key(files: list[str], args: PrepareArgs, size: int) -> tuple[str, list[dict]]:
    sources = [
        {"path": os.path.abspath(f), "bytes": os.path.getsize(f), "mtime_ns": os.stat(f).st_mtime_ns} for f in files
    ]
    spec = args.tokenizer
    if not spec.startswith("bpe:"):
        spec = os.path.abspath(spec)
    blob = json.dumps([sources, size, args.text_field, spec], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24], sources


def _existing(out: Path, key: str) -> dict | None:
    """The manifest of a previous run of this plan in ``out`` (to resume), None for an empty directory; ConfigError
    for a directory that holds anything else."""
    if not out.exists() or (out.is_dir() and not any(p.name != LOCK for p in out.iterdir())):
        return None
    manifest = read_manifest(out)
    if manifest is None:
        raise ConfigError(
            "--out",
            f"{out} is not empty and is not a prepared directory",
            f"no {MANIFEST}",
            "pass a new --out directory",
        )
    if manifest.get("plan") != key:
        raise ConfigError(
            "--out",
            f"{out} holds another preparation",
            f"other files, tokenizer or settings: plan {manifest.get('plan')} != {key}",
            "pass a new --out directory or delete that one",
        )
    return manifest


def _load_tokenizer(args: PrepareArgs, out: Path, chunks: list[Chunk], resumed: dict | None, log):
    """The transformers tokenizer, saved as OUT/tokenizer (a BPE trained by an interrupted run of this plan is kept:
    training it again could break ties differently and would cost the time again)."""
    from transformers import AutoTokenizer

    tok_dir = out / TOKENIZER_DIR
    for leftover in out.glob(f"{TOKENIZER_DIR}.tmp*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if args.tokenizer.startswith("bpe:"):
        if resumed is None or not (tok_dir / "tokenizer.json").is_file():
            shutil.rmtree(tok_dir, ignore_errors=True)
            size = int(args.tokenizer.removeprefix("bpe:"))
            log(f"training a byte-level BPE of {size} tokens on the corpus")
            train_bpe_from_texts(iter_texts(chunks, args.text_field), size, tok_dir)
        return AutoTokenizer.from_pretrained(tok_dir)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    tmp = tok_dir.with_name(f"{TOKENIZER_DIR}.tmp{os.getpid()}")
    tok.save_pretrained(tmp)
    if not getattr(tok, "is_fast", False) or not (tmp / "tokenizer.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            "--tokenizer",
            "prepare needs a fast tokenizer, one with a tokenizer.json",
            args.tokenizer,
            "convert it with transformers (AutoTokenizer.from_pretrained(...).save_pretrained(...)), or use bpe:N",
        )
    shutil.rmtree(tok_dir, ignore_errors=True)
    os.replace(tmp, tok_dir)
    return tok


def _tokenizer_identity(args: PrepareArgs, tok, out: Path) -> dict:
    tok_dir = out / TOKENIZER_DIR
    files = {p.name: file_entry(p) for p in sorted(tok_dir.iterdir()) if p.is_file()}
    return {
        "spec": args.tokenizer,
        "fingerprint": tokenizer_fingerprint(tok),
        "vocab_size": len(tok),
        "dir": TOKENIZER_DIR,
        "files": files,
    }


class Progress:
    """A tqdm bar over input bytes with tokens/s beside it (silent when disabled)."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.tokens, self.start = 0, time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="prepare", smoothing=0.1)

    def add(self, nbytes: int, ntokens: int) -> None:
        self.tokens += ntokens
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.tokens_per_s():,.0f} tok/s", refresh=False)

    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, time.perf_counter() - self.start)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def prepare(args: PrepareArgs, log=print) -> dict:
    """Prepare (or resume preparing) ``args.out``; returns the final manifest.  ConfigError for bad input."""
    files = matching_files(args.data, "--data")
    check_some_text(files, "--data")
    check_fields(files, args.text_field)
    size = chunk_bytes(files, args)
    chunks = plan_chunks(files, size)
    key, sources = plan_key(files, args, size)
    out = Path(args.out)
    _existing(out, key)
    before = {p.name for p in out.iterdir()} if out.is_dir() else None  # None: this run creates the directory
    created = next((d for d in reversed([out, *out.parents]) if not d.exists()), None)  # the topmost one it creates
    out.mkdir(parents=True, exist_ok=True)
    try:
        with file_lock(out / LOCK, blocking=False):
            try:
                return _prepare_locked(args, out, key, sources, chunks, size, log)
            except ConfigError as err:  # bad input found while tokenising
                raise _after_bad_input(out, err, before, created) from None
    except BlockingIOError:
        raise ConfigError(
            "--out", f"another prepare is writing {out}", f"it holds {out / LOCK}", "wait for it or pick another --out"
        ) from None


def _after_bad_input(out: Path, err: ConfigError, before: set[str] | None, created: Path | None) -> ConfigError:
    """What a preparation stopped by bad input leaves (called holding the lock), and ``err`` saying which.  With no
    complete shard of tokens it leaves nothing: a stub manifest, a lock or a tokenizer would make the rerun with the
    fixed input a directory "holding another preparation"; a directory that existed (empty) is left as it was.
    Complete shards (of this run or an earlier one) are kept, resumable as after an interrupt."""
    manifest = read_manifest(out) or {}
    kept = [s for s in manifest.get("shards", []) if s["num_tokens"] > s["num_docs"]]
    if kept or not (before is None or before <= {LOCK}):
        note = (
            f"{out} keeps its {len(kept)} complete shard(s), and the same command resumes from them; after changing "
            f"the input, delete {out} or pass a new --out"
        )
        return ConfigError(err.setting, err.problem, err.values, f"{err.fix} ({note})")
    for path in out.iterdir():
        if before is None or path.name not in before:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    if created is not None:  # the directories this run made, from out up to the topmost, each once empty
        for directory in [out, *out.parents]:
            if not any(directory.iterdir()):
                directory.rmdir()
            if directory == created:
                break
    note = f"nothing is left in {out}" if before is not None else f"{out} is removed"
    return ConfigError(err.setting, err.problem, err.values, f"{err.fix}, then rerun ({note})")


def _prepare_locked(args: PrepareArgs, out: Path, key: str, sources: list, chunks: list[Chunk], size: int, log) -> dict:
    resumed = _existing(out, key)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "plan": key,
        "complete": False,
        "command": command_line(args),
        "num_shards": len(chunks),
        "shards": (resumed or {}).get("shards", []),
        "tokenizer": (resumed or {}).get("tokenizer"),
    }
    # Written first, so that a run interrupted even while training the BPE leaves a directory that resumes.
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    tok = _load_tokenizer(args, out, chunks, resumed, log)
    identity = _tokenizer_identity(args, tok, out)
    if manifest["tokenizer"] is not None and manifest["tokenizer"]["fingerprint"] != identity["fingerprint"]:
        raise ConfigError(
            "--tokenizer",
            f"{out} was partly prepared with another tokenizer",
            f"{args.tokenizer} changed",
            "pass a new --out directory",
        )
    dtype = token_dtype(len(tok))
    manifest.update(
        dtype=dtype.name,
        eos_id=eos_id(tok, "--tokenizer"),
        text_field=args.text_field,
        valid_fraction=args.valid_fraction,
        chunk_bytes=size,
        tokenizer=identity,
        sources=sources,
    )
    done = {}
    for shard in manifest["shards"]:
        if shard_problem(out, shard, dtype.itemsize, checksums=False) is None:
            done[shard["index"]] = shard
    manifest["shards"] = [done[i] for i in sorted(done)]
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    pending = [c for c in chunks if c.index not in done]
    if done:
        log(f"resuming {out}: {len(done)} of {len(chunks)} shards are complete and kept")
    jobs = [
        ShardJob(
            c, str(out), str(out / TOKENIZER_DIR / "tokenizer.json"), manifest["eos_id"], dtype.name, args.text_field
        )
        for c in pending
    ]
    start = time.perf_counter()
    progress = Progress(sum(c.nbytes for c in chunks), sum(c.nbytes for c in chunks if c.index in done), args.progress)

    def finished(entry: dict) -> None:
        done[entry["index"]] = entry
        manifest["shards"] = [done[i] for i in sorted(done)]
        atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))

    try:
        _run_jobs(jobs, args.num_proc, progress, finished)
    finally:
        progress.close()
    _remove_leftovers(out, manifest)
    manifest["num_tokens"] = sum(s["num_tokens"] for s in manifest["shards"])
    manifest["num_docs"] = sum(s["num_docs"] for s in manifest["shards"])
    if manifest["num_tokens"] <= manifest["num_docs"]:
        raise ConfigError("--data", "the corpus has no tokens", args.data, "point it at some text")
    manifest["complete"] = True
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    seconds = time.perf_counter() - start
    log(
        f"prepared {out}: {manifest['num_tokens']:,} tokens in {manifest['num_docs']:,} documents, "
        f"{len(chunks)} shards ({dtype.name}); {len(jobs)} tokenised in {seconds:.2f} s "
        f"({progress.tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    )
    return manifest


def _run_jobs(jobs: list[ShardJob], num_proc: int, progress: Progress, finished) -> None:
    if not jobs:
        return
    if num_proc <= 1 or len(jobs) == 1:
        for job in jobs:
            finished(tokenize_chunk(job, report=lambda item: progress.add(*item)))
        return
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    with ctx.Pool(min(num_proc, len(jobs)), initializer=_init_worker, initargs=(reports,)) as pool:
        pending = [pool.apply_async(tokenize_chunk, (job,)) for job in jobs]
        while pending:
            try:
                progress.add(*reports.get(timeout=0.2))
            except queue.Empty:
                pass
            for result in [r for r in pending if r.ready()]:
                pending.remove(result)
                finished(result.get())  # re-raises a worker's ConfigError here
        while True:  # the last reports of the last shards
            try:
                progress.add(*reports.get_nowait())
            except queue.Empty:
                break


def _remove_leftovers(out: Path, manifest: dict) -> None:
    """Temporary files of interrupted runs, and shard files no manifest entry names, go."""
    named = {f"{s['name']}.{suffix}" for s in manifest["shards"] for suffix in ("bin", "idx")}
    for path in out.glob("shard_*"):
        if path.name not in named:
            path.unlink(missing_ok=True)
