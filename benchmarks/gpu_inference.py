"""The inference half of benchmarks/gpu_check.sh: TTFT and TPOT of a 1B-class exported model on one GPU at batch 1
and 16, measured by the inference tuner's empirical mode, against its prediction before and after calibration.

    python benchmarks/gpu_inference.py [--markdown OUT.md] [--tiny]

Llama 3.2 1B's shape (16 layers, h 2048, 32 heads, 8 KV heads, V 128,256, tied embeddings) with random weights in
bf16, built on the GPU and saved with ``save_pretrained`` (no download), then
``python -m ds_megatron.tune inference --hf-dir DIR --gpu h200 --gpus 1 --empirical --device gpu`` at prompt 512,
output 64.  ``--tiny`` runs the same steps on CPU with the small Llama of inference_accuracy.py (fp32, one process),
so that this script does not rot between the sessions that have a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from inference_accuracy import LLAMA_1B, SMALL_LLAMA, save_random_llama, table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", help="write the table as markdown to this file")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test with a small model")
    p.add_argument("--max-minutes", type=float, default=2.0, help="the tuner's budget for its measured runs")
    args = p.parse_args()
    gpu = not args.tiny
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        shape = LLAMA_1B if gpu else SMALL_LLAMA
        with torch.device("cuda" if gpu else "cpu"):  # random init on the GPU: seconds instead of a minute
            hf_dir = save_random_llama(Path(tmp) / "model", **shape, dtype=torch.bfloat16 if gpu else None)
        built = time.monotonic() - start
        out = Path(tmp) / "tune.json"
        cluster = ["--gpu", "h200", "--gpus", "1", "--gpus-per-node", "1", "--weight-dtype", "bf16"]
        if not gpu:
            cluster = ["--gpus", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "16", "--gpu-peak-tflops", "0.1"]
            cluster += ["--memory-gbps", "20", "--weight-dtype", "fp32", "--kv-dtype", "fp32"]
        cmd = [sys.executable, "-m", "ds_megatron.tune", "inference", "--hf-dir", str(hf_dir), *cluster]
        cmd += ["--prompt-length", "512" if gpu else "32", "--output-length", "64" if gpu else "8"]
        cmd += ["--batch-sizes", "1,16", "--empirical", "--device", "gpu" if gpu else "cpu", "--empirical-top", "2"]
        cmd += ["--max-minutes", str(args.max_minutes), "--empirical-dir", str(Path(tmp) / "runs"), "--json", str(out)]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keeps gpu_check's wheels
        env = dict(os.environ, PYTHONPATH=path, PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        print(proc.stdout[-6000:], proc.stderr[-3000:])
        if proc.returncode != 0:
            raise SystemExit(f"gpu_inference: the tuner failed with {proc.returncode}")
        emp = json.loads(out.read_text())["empirical"]
    cal = emp["calibration"] or {}
    device = torch.cuda.get_device_name() if gpu else "CPU (--tiny)"
    text = (
        f"## Inference: {'Llama 3.2 1B shape' if gpu else 'small Llama'}, random weights, on {device}\n\n"
        f"Built and saved in {built:.0f} s; `python -m ds_megatron.tune inference --empirical` (DeepSpeed inference "
        f"engine, tp 1), batches 1 and 16; calibration: {cal.get('note', emp['calibration_note'])}, efficiency "
        f"{cal.get('efficiency', float('nan')):.3g}, overhead {cal.get('step_overhead_s', 0) * 1e3:.2f} ms per "
        f"forward.\n\n{table(emp)}\n"
    )
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
