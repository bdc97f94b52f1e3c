"""L5: the inference tuner's measuring run behind ``recipes/measure_inference.py``: TTFT and TPOT of an exported
transformers model under DeepSpeed's inference engine (AutoTP), for several (tp, request batch) candidates.

    deepspeed --num_gpus W recipes/measure_inference.py --plan PLAN.json --out RESULTS.jsonl

PLAN.json (written by ``ds_megatron.tune.inference_probe``): ``hf_dir``, ``prompt_length``, ``output_length``,
``dtype`` (fp32 | bf16 | fp16), ``warmup`` and ``repeats`` (requests per candidate: dropped, then measured) and
``candidates``: ``[{"index": 3, "tp": 1, "batch": 16}, ...]``, grouped by tp.  Every tp must be 1 or the world size W
(``tune.inference_probe.launch_tps``): a tp-W model spans every rank, a tp-1 model runs on rank 0 while the
other ranks wait.

Rank 0 appends one JSON line per event to RESULTS.jsonl and flushes it at once, so that a run killed at its timeout
or by a crash still leaves every finished candidate: ``{"event": "start", "index": i}`` before a candidate,
``{"event": "result", "index": i, "status": "ok", "ttft_s": .., "tpot_s": .., ...}`` after it, or a result with
``"status": "out of memory" | "failed"`` and the exception's line when it raised (the next candidate then runs).

A measured request: B prompts of P random tokens (the same on every rank: AutoTP's ranks must see the same input),
one prefill forward with a KV cache (TTFT: the first output token of every request), then O - 1 decode forwards of
one token per request with the greedy pick fed back (TPOT: their mean).  Each forward is timed between barriers of
the model's ranks (CUDA synchronised on GPUs); the slowest rank's time counts.  The first ``warmup`` requests of a
candidate are dropped (first-touch allocation, kernel selection); TTFT is the median prefill of the ``repeats``
measured requests, TPOT the mean of all their decode steps.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import sys
import time
from pathlib import Path

DTYPES = ("fp32", "bf16", "fp16")
OOM = re.compile(r"out of memory|OutOfMemoryError|Cannot allocate memory", re.IGNORECASE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="recipes/measure_inference.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="the plan JSON")
    p.add_argument("--out", required=True, help="JSON lines, appended by rank 0")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = p.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    if plan["dtype"] not in DTYPES:
        print(f"error: dtype: not measured by this run ({plan['dtype']!r}); use one of {', '.join(DTYPES)}")
        return 2

    import torch
    import torch.distributed as dist

    from ds_megatron.engine import default_cpu_threads, device_type, init_distributed
    from ds_megatron.tune.inference_probe import launch_tps

    default_cpu_threads()
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    tps = list(dict.fromkeys(c["tp"] for c in plan["candidates"]))
    if not set(tps) <= set(launch_tps(world)):
        print(f"error: --num_gpus: every tp must be 1 or the world size (tp {tps}, world {world})")
        return 2
    cuda = device_type() == "cuda"
    out = open(args.out, "a") if rank == 0 else None

    def emit(record: dict) -> None:
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    for tp in tps:
        if rank < tp:  # a tp-1 model lives on rank 0 alone; the other ranks wait at the barrier below
            model = build_engine(plan, tp, torch)
            for cand in (c for c in plan["candidates"] if c["tp"] == tp):
                emit({"event": "start", "index": cand["index"], "time": time.time()})
                try:
                    record = {"status": "ok", **measure(model, plan, cand["batch"], tp > 1, cuda, torch, dist)}
                except Exception as err:  # one candidate's failure (its batch out of memory) is its result only
                    text = str(err).strip()
                    line = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
                    record = {"status": "out of memory" if OOM.search(line) else "failed", "reason": line[:300]}
                emit({"event": "result", "index": cand["index"], **record})
            del model
            if cuda:
                torch.cuda.empty_cache()
        dist.barrier()
    if out is not None:
        out.close()
    return 0


def build_engine(plan: dict, tp: int, torch):
    """The exported model at ``plan["dtype"]``, under ``deepspeed.init_inference`` with AutoTP at ``tp``
    (no kernel injection: DeepSpeed's fused inference kernels are CUDA-only, and AutoTP is what works on both)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[plan["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(plan["hf_dir"], dtype=dtype)
    model.eval()
    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": tp}, dtype=dtype, replace_with_kernel_inject=False
    )
    return engine.module


def measure(model, plan: dict, batch: int, collective: bool, cuda: bool, torch, dist) -> dict:
    """TTFT and TPOT of ``batch`` requests (module docstring); every rank of the model returns the same figures.
    ``collective``: the model spans every rank (tp = world), so each forward is timed between their barriers."""
    prompt, output = plan["prompt_length"], plan["output_length"]
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(batch)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def timed(**inputs):
        """One forward of ``inputs`` and its seconds on the slowest rank."""
        if collective:
            dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = model(**inputs, use_cache=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if collective:
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's
        return result, float(seconds)

    ttfts, steps = [], []
    with torch.inference_mode():
        for request in range(plan["warmup"] + plan["repeats"]):
            ids = torch.randint(0, vocab, (batch, prompt), generator=generator).to(device)
            out, ttft = timed(input_ids=ids, logits_to_keep=1)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            decode = []
            for _ in range(output - 1):
                out, seconds = timed(input_ids=token, past_key_values=cache)
                cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                decode.append(seconds)
            if request >= plan["warmup"]:
                ttfts.append(ttft)
                steps += decode
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else max_rss_gib()
    return {
        "ttft_s": statistics.median(ttfts),
        "tpot_s": statistics.fmean(steps) if steps else None,
        "ttfts_s": ttfts,
        "decode_steps": len(steps),
        "peak_mem_gb": peak,
    }


def max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


if __name__ == "__main__":
    sys.exit(main())
