"""Throughput and memory of ``python -m ds_megatron.data prepare`` against plain ``tokenizers`` batch encoding.

    python benchmarks/prepare_throughput.py [--sizes-mb 50,200] [--num-proc 2] [--markdown OUT.md]

For each corpus size, a JSON-lines corpus is generated (paragraphs of CPython's reference documentation drawn at
random into documents of 3 to 40 paragraphs; deterministic) and a byte-level BPE of 8,192 tokens is trained once on
the documentation itself.  Then, in ``--num-proc`` processes each:

- ``prepare``: the command as a user runs it (a fresh process: imports, planning, JSON parsing, shard writing with
  sha256, manifest); tokens/s over its tokenising phase (its own log line) and over its whole wall time.
- plain ``tokenizers``: the same texts, already in memory, split into as many contiguous parts as processes, each
  encoded with ``Tokenizer.encode_batch`` in batches of 512 (one thread per process, as prepare's workers), counting
  tokens only.  The timer runs from sending the parts to the warm pool to the last count.

Peak memory: the largest sum of the resident sets of a command's process tree (sampled every 50 ms with psutil), and
the largest single process.  Prepare's should not grow with the corpus; the plain encoder holds the corpus.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSON-lines corpus of about ``megabytes`` MB; returns the number of documents."""
    import random
    from pydoc_data.topics import topics

    paragraphs = [p for k in sorted(topics) for p in topics[k].split("\n\n") if p.strip()]
    rng = random.Random(seed)
    target, written, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w") as fh:
        while written < target:
            text = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(3, 40)))
            line = json.dumps({"text": text}) + "\n"
            fh.write(line)
            written, docs = written + len(line.encode()), docs + 1
    return docs


def make_tokenizer(out: Path) -> Path:
    from pydoc_data.topics import topics

    from ds_megatron.data.corpus import train_bpe_from_texts

    if not (out / "tokenizer.json").is_file():
        train_bpe_from_texts((topics[k] for k in sorted(topics)), 8192, out)
    return out


class PeakRSS:
    """Samples the resident set of a process and its descendants until stopped."""

    def __init__(self, pid: int):
        import psutil

        self.root, self.total, self.single = psutil.Process(pid), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                sizes = []
                for p in procs:
                    try:
                        sizes.append(p.memory_info().rss)
                    except psutil.Error:
                        pass
                self.total, self.single = max(self.total, sum(sizes)), max([self.single, *sizes])
            except psutil.Error:
                pass
            time.sleep(0.05)

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._thread.join()
        return self.total / 2**20, self.single / 2**20


def run_prepare(corpus: Path, tok: Path, out: Path, num_proc: int) -> dict:
    cmd = [sys.executable, "-m", "ds_megatron.data", "prepare", "--data", str(corpus), "--tokenizer", str(tok)]
    cmd += ["--out", str(out), "--num-proc", str(num_proc), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = PeakRSS(proc.pid)
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    total_mb, single_mb = peak.stop()
    if proc.returncode != 0:
        raise RuntimeError(err)
    match = re.search(r"prepared .*: ([\d,]+) tokens .* tokenised in ([\d.]+) s", err)
    tokens, seconds = int(match.group(1).replace(",", "")), float(match.group(2))
    return {
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "wall_tok_s": tokens / wall,
        "wall": wall,
        "rss_total": total_mb,
        "rss_single": single_mb,
    }


# ---- plain tokenizers ------------------------------------------------------------------------------------------------
_TOK = None


def _load(path: str) -> None:
    """Pool initializer: every worker loads the tokenizer once and encodes on one thread."""
    global _TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _TOK = Tokenizer.from_file(path)


def _ready(_) -> int:
    time.sleep(0.2)  # holds this worker, so that every worker takes one of the warm-up tasks
    return os.getpid()


def _count(texts: list[str]) -> int:
    n = 0
    for i in range(0, len(texts), 512):
        n += sum(len(e.ids) + 1 for e in _TOK.encode_batch(texts[i : i + 512], add_special_tokens=False))
    return n


def plain_worker(corpus: str, tok_json: str, num_proc: int, queue) -> None:
    """Runs in its own process (so that its memory is measured apart): read, split, encode in a warm pool."""
    with open(corpus, "rb") as fh:
        texts = [json.loads(line)["text"] for line in fh]
    step = -(-len(texts) // num_proc)
    parts = [texts[i : i + step] for i in range(0, len(texts), step)]
    with multiprocessing.get_context("spawn").Pool(num_proc, initializer=_load, initargs=(tok_json,)) as pool:
        pool.map(_ready, range(num_proc), chunksize=1)  # every worker started, its tokenizer loaded
        t0 = time.perf_counter()
        tokens = sum(pool.map(_count, parts, chunksize=1))
        seconds = time.perf_counter() - t0
    queue.put({"tokens": tokens, "tok_s": tokens / seconds})


def run_plain(corpus: Path, tok: Path, num_proc: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=plain_worker, args=(str(corpus), str(tok / "tokenizer.json"), num_proc, queue))
    proc.start()
    peak = PeakRSS(proc.pid)
    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except Exception:  # queue.Empty; a worker that died says so instead of hanging
            if not proc.is_alive():
                raise RuntimeError(f"the plain tokenizers run failed (exit {proc.exitcode})") from None
    proc.join()
    total_mb, single_mb = peak.stop()
    return {**result, "rss_total": total_mb, "rss_single": single_mb}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="50,200")
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--markdown", default=None)
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="prepare_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(work / "bpe8192")
    rows = []
    for mb in [float(x) for x in args.sizes_mb.split(",")]:
        corpus = work / f"corpus_{mb:g}mb.jsonl"
        docs = make_corpus(corpus, mb) if not corpus.exists() else sum(1 for _ in open(corpus))
        out = work / f"prepared_{mb:g}mb"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        prep = run_prepare(corpus, tok, out, args.num_proc)
        plain = run_plain(corpus, tok, args.num_proc)
        assert plain["tokens"] == prep["tokens"], (plain["tokens"], prep["tokens"])  # the same text, the same tokens
        rows.append((mb, docs, prep, plain))
        print(f"{mb:g} MB, {docs} docs: prepare {prep} | plain {plain}", flush=True)
    lines = [
        "# prepare throughput and memory",
        "",
        f"{datetime.date.today().isoformat()}, {platform.machine()} ({os.cpu_count()} cores, shared), "
        f"Python {platform.python_version()}, `python benchmarks/prepare_throughput.py --sizes-mb {args.sizes_mb} "
        f"--num-proc {args.num_proc}`",
        "",
        f"JSON-lines corpus of CPython documentation paragraphs, byte-level BPE of 8,192 tokens, {args.num_proc} "
        "processes each (see the script's docstring for what each column times).",
        "",
        "| corpus | documents | tokens | prepare tok/s (tokenising) | prepare tok/s (whole command) | plain tokenizers "
        "tok/s | prepare / plain | prepare peak RSS, all processes / largest | plain peak RSS, all / largest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mb, docs, prep, plain in rows:
        lines.append(
            f"| {mb:g} MB | {docs:,} | {prep['tokens']:,} | {prep['tok_s']:,.0f} | {prep['wall_tok_s']:,.0f} | "
            f"{plain['tok_s']:,.0f} | {prep['tok_s'] / plain['tok_s']:.2f} | {prep['rss_total']:,.0f} / "
            f"{prep['rss_single']:,.0f} MiB | {plain['rss_total']:,.0f} / {plain['rss_single']:,.0f} MiB |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
