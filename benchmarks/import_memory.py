"""Peak host memory of ``python -m ds_megatron.checkpoint import`` against the model's size and one layer's.

    python benchmarks/import_memory.py [--layers 12,24] [--hidden 768] [--tp 2 --pp 2] [--markdown OUT.md]

For each depth, a random GPT-2 (width ``--hidden``, 12 heads, vocabulary 8,192, 256 positions, fp32) is built and
saved with ``save_pretrained`` in this process, then imported into an fp32 run at tp x pp in a fresh process (the
command as a user runs it, from Python so that the imports can be measured apart).  That process reports its
resident set after the imports (torch, deepspeed, safetensors) and its peak (VmHWM) at the end: the difference is
what the conversion held at most, transformers' config reader (imported on first use) included.  Streaming holds
about one layer's TP shards plus one full tensor and its fp32 copy, whatever the depth, so the difference should
stay flat as the model grows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20

# The peak is /proc's VmHWM, the high-water mark of this process's own memory map: ``ru_maxrss`` would not do, since
# Linux carries it across exec from the forked parent, which held the model it had just built.
CHILD = """
import json, sys
from ds_megatron.checkpoint.import_cmd import import_checkpoint
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
base = status("VmRSS")
import_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), progress=False)
print(json.dumps({"base": base, "peak": status("VmHWM")}))
"""


def run_config(layers: int, hidden: int, tp: int, pp: int) -> dict:
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "ds_megatron": {
            "model": {
                "num_layers": layers,
                "hidden_size": hidden,
                "num_heads": 12,
                "vocab_size": 8192,
                "seq_length": 256,
            },
            "parallel": {"tp": tp, "pp": pp},
        },
    }


def build_hf(path: Path, cfg: dict) -> tuple[int, int, int]:
    """Save a random GPT-2 of ``cfg``'s shape; (file bytes, one block's bytes, largest tensor's bytes)."""
    import torch
    from transformers import GPT2LMHeadModel

    from ds_megatron.checkpoint.layout import run_model_config
    from ds_megatron.config import resolve

    par = cfg["ds_megatron"]["parallel"]
    config = run_model_config(resolve(cfg, par["tp"] * par["pp"]))
    torch.manual_seed(0)
    with torch.no_grad():
        model = GPT2LMHeadModel(config.to_hf())
    model.save_pretrained(path)
    block = sum(p.numel() * p.element_size() for p in model.transformer.h[0].parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    size = (path / "model.safetensors").stat().st_size
    del model
    return size, block, largest


def measure(layers: int, hidden: int, tp: int, pp: int, work: Path) -> dict:
    cfg = run_config(layers, hidden, tp, pp)
    hf, out, cfg_file = work / f"hf{layers}", work / f"ck{layers}", work / f"run{layers}.json"
    cfg_file.write_text(json.dumps(cfg))
    size, block, largest = build_hf(hf, cfg)
    cmd = [sys.executable, "-c", CHILD, str(hf), str(out), str(cfg_file), str(tp), str(pp)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"layers": layers, "size": size, "block": block, "largest": largest, "written": written, **got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="12,24")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in [int(x) for x in args.layers.split(",")]:
            r = measure(layers, args.hidden, args.tp, args.pp, Path(tmp))
            rows.append(r)
            print(json.dumps(r), flush=True)
    head = (
        "| layers | model (safetensors) | one block | largest tensor | written | RSS after imports | peak RSS "
        "| peak - after imports | / one block |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    body = head + "".join(
        f"| {r['layers']} | {r['size'] / MIB:,.0f} MiB | {r['block'] / MIB:,.1f} MiB | {r['largest'] / MIB:,.1f} MiB "
        f"| {r['written'] / MIB:,.0f} MiB | {r['base'] / MIB:,.0f} MiB | {r['peak'] / MIB:,.0f} MiB "
        f"| {(r['peak'] - r['base']) / MIB:,.0f} MiB | {(r['peak'] - r['base']) / r['block']:.1f} |\n"
        for r in rows
    )
    print(body)
    if args.markdown:
        from _results import write_markdown

        command = "python benchmarks/import_memory.py " + " ".join(sys.argv[1:])
        write_markdown(args.markdown, "checkpoint import: peak memory", command, body)


if __name__ == "__main__":
    main()
