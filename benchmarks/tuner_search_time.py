"""CPU time of the tuner's search: GPT-3 1.3B, 13B and 175B (global batch 512, 1024, 1536 on 8, 64 and 1024 GPUs)
on every GPU preset, each search once per fresh process (the CLI's case: its caches start empty), CPU seconds of
the process (``time.process_time``, which moves less with the machine's load than wall time).  ``--baseline DIR``
times another checkout of the repository the same way, in the same run (alternating, so both see the same load).

    python benchmarks/tuner_search_time.py [--repeats 3] [--baseline /path/to/other/checkout] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [("gpt3-1.3b", 512, 8), ("gpt3-13b", 1024, 64), ("gpt3-175b", 1536, 1024)]
ONE_PASS = """
import json, time
from ds_megatron.tune import GPUS, build_cluster, build_model_shape, search
runs = {runs!r}
seconds = {{}}
for gpu in GPUS:
    for size, batch, gpus in runs:
        model, cluster = build_model_shape(size, None, None, None, None, 2048), build_cluster(gpu, gpus, 8)
        start = time.process_time()
        result = search(model, cluster, batch)
        seconds[f"{{gpu}} {{size}}"] = (time.process_time() - start, len(result.evaluations))
print(json.dumps(seconds))
"""


def one_pass(tree: Path) -> dict[str, list]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    code = ONE_PASS.format(runs=RUNS)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", type=Path, default=None, help="another checkout, timed alongside")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tuner_search_time.md"))
    args = p.parse_args()
    trees = {"this tree": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    passes: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            passes[name].append(one_pass(tree))
    keys = list(passes["this tree"][0])
    median = {name: {k: statistics.median(run[k][0] for run in runs) for k in keys} for name, runs in passes.items()}
    header = "| search | candidates | " + " | ".join(f"{name} CPU s" for name in trees) + " |"
    lines = [header, "|" + "---|" * (2 + len(trees))]
    for k in keys:
        cells = " | ".join(f"{median[name][k]:.3f}" for name in trees)
        lines.append(f"| {k} | {passes['this tree'][0][k][1]:,} | {cells} |")
    totals = " | ".join(f"**{sum(median[name].values()):.2f}**" for name in trees)
    lines.append(f"| all {len(keys)} | | {totals} |")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _results import write_markdown

    command = "python benchmarks/tuner_search_time.py" + (" --baseline <checkout>" if args.baseline else "")
    body = f"Median of {args.repeats} fresh processes per search, CPU seconds (`time.process_time`).\n\n" + "\n".join(
        lines
    )
    write_markdown(args.out, "Tuner search time", command, body)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
