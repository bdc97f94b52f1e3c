"""Time from launch to the first training step of the demo, tokenising in the launch against a prepared directory.

    python benchmarks/first_step_time.py [--corpus-mb 0,50] [--repeats 3] [--markdown OUT.md]

The demo: ``ds_configs/gpt_tiny.json`` on 4 CPU processes (tp 2 x pp 2) with its tokenizer setting, a byte-level BPE
of 1,024 tokens trained on the training text.  Corpus 0 MB stands for the demo's own data, the built-in corpus
(CPython's reference documentation, 0.47 MB); any other size is a JSON-lines corpus of documentation paragraphs that
large (``prepare_throughput.make_corpus``), to show how the in-launch path grows with the text.  Every case is a fresh
``deepspeed --num_gpus 4 recipes/train_gpt.py`` launch for one step, timed from starting the launcher to three lines
of its output: ``resolved configuration`` (rank 0: the engine is built), ``training steps`` (the logging rank: the
data is ready and the sample stream built) and ``step 1/1`` (the first optimizer step is done).

- in-launch, cold: an empty ``data.cache_dir`` and ``HF_HOME`` (so ``datasets`` finds no earlier conversion or map
  result either).  The first process to take the cache lock trains the BPE and packs the tokens (``datasets.map``,
  ``data.num_proc`` 2); the other three wait on the lock, then open the cache.
- in-launch, warm: the cache left by the cold launch; each process finds it through the record and opens it.
- prepared: ``--data DIR``, a directory written beforehand by ``python -m ds_megatron.data prepare`` from the same
  documents (as JSON lines) with ``--tokenizer bpe:1024 --num-proc 2``; that command's own wall time is reported
  beside it, as the cost paid once, outside any launch.

The cases run interleaved (cold, warm, prepared; again) so that load on the machine spreads over all of them; the
tables give the median and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import write_markdown  # noqa: E402

MARKS = {"engine": "resolved configuration:", "data": "training steps ", "step": "step      1/1"}


def write_demo_corpus(path: Path) -> None:
    """The built-in corpus's documents as JSON lines, in the built-in order, for ``prepare``."""
    from ds_megatron.data.demo import builtin_documents

    with open(path, "w") as fh:
        fh.writelines(json.dumps({"text": text}) + "\n" for text in builtin_documents())


def timed_prepare(corpus: Path, out: Path) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "ds_megatron.data", "prepare", "--data", str(corpus), "--tokenizer", "bpe:1024"]
    subprocess.run([*cmd, "--out", str(out), "--num-proc", "2", "--no-progress"], cwd=ROOT, check=True)
    return time.perf_counter() - start


def timed_launch(work: Path, name: str, extra: list[str], hf_home: Path) -> dict[str, float]:
    """Seconds from starting the launcher to each mark, and to its exit."""
    launcher = Path(sys.executable).parent / "deepspeed"
    with socket.socket() as free:  # a port of its own: other jobs on the machine may hold DeepSpeed's default
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    cmd = [str(launcher), "--num_gpus", "4", "--master_port", port, "recipes/train_gpt.py"]
    cmd += ["--deepspeed_config", "ds_configs/gpt_tiny.json"]
    cmd += ["--train-iters", "1", "--log-interval", "1", "--set", f"ds_megatron.logging.run_dir={work / name}"]
    cmd += ["--set", "ds_megatron.logging.wandb_project=null", "--set", "ds_megatron.train.generate_tokens=0"]
    cmd += ["--set", "ds_megatron.train.eval_iters=1", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline", HF_HOME=str(hf_home))
    start = time.perf_counter()
    seen: dict[str, float] = {}
    tail: list[str] = []
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        now = time.perf_counter() - start
        tail = (tail + [line])[-40:]
        for mark, text in MARKS.items():
            if mark not in seen and text in line:
                seen[mark] = now
    if proc.wait() != 0 or len(seen) != len(MARKS):
        raise SystemExit(
            f"{name}: the launch failed ({proc.returncode}) or printed no {set(MARKS) - set(seen)}:\n" + "".join(tail)
        )
    seen["exit"] = time.perf_counter() - start
    return seen


def summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def measure(work: Path, corpus_mb: float, repeats: int) -> str:
    """The table of one corpus size."""
    corpus = work / f"corpus{corpus_mb:g}.jsonl"
    if corpus_mb == 0:
        write_demo_corpus(corpus)
        data: list[str] = []  # the demo as shipped: the built-in corpus
    else:
        from prepare_throughput import make_corpus

        make_corpus(corpus, corpus_mb)
        data = ["--data", str(corpus)]
    runs: dict[str, list[dict[str, float]]] = {"in-launch, cold": [], "in-launch, warm": [], "prepared": []}
    prepare_s: list[float] = []
    for r in range(repeats):
        tag = f"{corpus_mb:g}mb{r}"
        cache = ["--set", f"ds_megatron.data.cache_dir={work / f'cache{tag}'}"]
        hf_home = work / f"hf{tag}"  # datasets caches what map computed: a cold launch must not find the last one's
        runs["in-launch, cold"].append(timed_launch(work, f"cold{tag}", [*data, *cache], hf_home))
        runs["in-launch, warm"].append(timed_launch(work, f"warm{tag}", [*data, *cache], hf_home))
        prepare_s.append(timed_prepare(corpus, work / f"prepared{tag}"))
        prepared = ["--data", str(work / f"prepared{tag}"), *cache]
        runs["prepared"].append(timed_launch(work, f"prepared{tag}", prepared, hf_home))
        steps = ", ".join(f"{k} {v[-1]['step']:.1f} s" for k, v in runs.items())
        print(f"{corpus_mb:g} MB, repeat {r + 1}/{repeats}: {steps}", flush=True)
    name = "the built-in corpus (0.47 MB), the demo's data" if corpus_mb == 0 else f"{corpus_mb:g} MB of JSON lines"
    rows = [
        f"**{name}**; `prepare` beforehand (once, outside any launch): {summary(prepare_s)} s",
        "",
        "| data path | launch -> engine built (s) | engine -> data ready (s) | launch -> step 1 done (s) | "
        "launch -> exit (s) |",
        "|---|---|---|---|---|",
    ]
    for case, timings in runs.items():
        engine = [t["engine"] for t in timings]
        ready = [t["data"] - t["engine"] for t in timings]
        step = [t["step"] for t in timings]
        done = [t["exit"] for t in timings]
        rows.append(f"| {case} | {summary(engine)} | {summary(ready)} | {summary(step)} | {summary(done)} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-mb", default="0", help="comma-separated sizes; 0: the demo's built-in corpus")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--markdown", default=None)
    args = p.parse_args()
    load_before = os.getloadavg()[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        body = "\n\n".join(measure(work, float(mb), args.repeats) for mb in args.corpus_mb.split(","))
    # Other work on the machine stretches every phase; the load average says how much there was.
    body += f"\n\nLoad average (5 min) before / after the runs: {load_before:.1f} / {os.getloadavg()[1]:.1f}."
    print(body)
    if args.markdown:
        title = "Launch to first training step: in-launch tokenisation vs a prepared directory (the demo)"
        write_markdown(args.markdown, title, "python benchmarks/first_step_time.py " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
