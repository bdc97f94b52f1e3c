"""L5: the inference tuner's measuring run behind ``recipes/measure_inference.py``: TTFT and TPOT of an exported
transformers model under DeepSpeed's inference engine (AutoTP), for several (tp, request batch) candidates.

    deepspeed --num_gpus W recipes/measure_inference.py --plan PLAN.json --out RESULTS.jsonl

PLAN.json (written by ``ds_megatron.tune.inference.probe``): ``hf_dir``, ``prompt_length``, ``output_length``,
``dtype`` (fp32 | bf16 | fp16), ``warmup`` and ``repeats`` (requests per candidate: dropped, then measured) and
``candidates``: ``[{"index": 3, "tp": 1, "batch": 16}, ...]``, grouped by tp.  Every tp must be 1 or the world size W
(``tune.inference.probe.launch_tps``): a tp-W model spans every rank, a tp-1 model runs on rank 0 while the
other ranks wait.

Rank 0 appends one JSON line per event to RESULTS.jsonl and flushes it at once, so that a run killed at its timeout
or by a crash still leaves every finished tp's results and names the candidate it was in:
``{"event": "build", "tp": t}`` before a tp's model is loaded, ``{"event": "start", "index": i, "request": r}``
before each request, ``{"event": "result", "index": i, "status":
"ok", "ttft_s": .., "tpot_s": .., ...}`` once a tp's rounds are done (``measure_tp``), or at once a result with
``"status": "out of memory" | "failed"`` and the exception's line when a candidate raised (the others go on).

A measured request, the rounds and warm-up, and what TTFT and TPOT are: docs/tuner.md, "A measured request".
"""

from __future__ import annotations

import argparse
import json
import os
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
    from ds_megatron.tune.inference.probe import launch_tps

    default_cpu_threads()
    init_distributed(inference_all_reduce=True)  # init_inference's layers reduce through its shm all-reduce on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    tps = list(dict.fromkeys(c["tp"] for c in plan["candidates"]))
    if not set(tps) <= set(launch_tps(world)):
        print(f"error: --num_gpus: every tp must be 1 or the world size (tp {tps}, world {world})")
        return 2
    cuda = device_type() == "cuda"
    if cuda:  # DeepSpeed sets it only when it builds a TP group; a tp-1 model and the barriers need it too
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    out = open(args.out, "a") if rank == 0 else None

    def emit(record: dict) -> None:
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    for tp in tps:
        if rank < tp:  # a tp-1 model lives on rank 0 alone; the other ranks wait at the barrier below
            measure_tp(plan, tp, [c for c in plan["candidates"] if c["tp"] == tp], emit, cuda, torch, dist)
            if cuda:
                torch.cuda.empty_cache()
        dist.barrier()
    if out is not None:
        out.close()
    return 0


def measure_tp(plan: dict, tp: int, cands: list[dict], emit, cuda: bool, torch, dist) -> None:
    """Every candidate of one tp on one model, in rounds of one request each (in plan order): a burst of load from
    elsewhere on the machine then slows every batch size alike instead of the one that happened to be running.  A
    "start" line precedes each request, so a crash names the candidate it was in; a candidate that raises (its batch
    out of memory, say) gets its result line at once and leaves the rounds; the others get theirs at the end."""
    emit({"event": "build", "tp": tp, "time": time.time()})
    model = build_engine(plan, tp, torch)
    samples: dict[int, dict] = {c["index"]: {"ttfts_s": [], "steps_s": [], "peak_mem_gb": 0.0} for c in cands}
    failed: set[int] = set()
    with torch.inference_mode():
        for request in range(plan["warmup"] + plan["repeats"]):
            for cand in (c for c in cands if c["index"] not in failed):
                emit({"event": "start", "index": cand["index"], "request": request, "time": time.time()})
                try:
                    ttft, steps, peak = one_request(model, plan, cand["batch"], request, tp > 1, cuda, torch, dist)
                except Exception as err:  # one candidate's failure is its result only
                    text = str(err).strip()
                    line = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
                    status = "out of memory" if OOM.search(line) else "failed"
                    emit({"event": "result", "index": cand["index"], "status": status, "reason": line[:300]})
                    failed.add(cand["index"])
                    if cuda:
                        torch.cuda.empty_cache()
                    continue
                got = samples[cand["index"]]
                got["peak_mem_gb"] = max(got["peak_mem_gb"], peak)
                if request >= plan["warmup"]:
                    got["ttfts_s"].append(ttft)
                    got["steps_s"] += steps
    for cand in (c for c in cands if c["index"] not in failed):
        got = samples[cand["index"]]
        emit(
            {
                "event": "result",
                "index": cand["index"],
                "status": "ok",
                "ttft_s": statistics.median(got["ttfts_s"]),
                "tpot_s": statistics.fmean(got["steps_s"]),
                "ttfts_s": got["ttfts_s"],
                "decode_steps": len(got["steps_s"]),
                "peak_mem_gb": got["peak_mem_gb"],
            }
        )


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


def one_request(model, plan: dict, batch: int, request: int, collective: bool, cuda: bool, torch, dist):
    """(TTFT, the decode steps' seconds, peak memory in GiB) of one request of ``batch`` prompts (module docstring);
    every rank of the model returns the same times.  ``collective``: the model spans every rank (tp = world), so each
    forward is timed between their barriers and the slowest rank's time counts."""
    prompt, output = plan["prompt_length"], plan["output_length"]
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(1000 * request + batch)  # the same prompts on every rank
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def timed(**inputs):
        if collective:
            dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = model(**inputs, use_cache=True)
        if cuda:
            torch.cuda.synchronize()
        # on the model's device: NCCL reduces CUDA tensors only (a CPU one fails "No backend type associated with
        # device type cpu"); on CPU the model's device is the CPU, as gloo wants
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        if collective:
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return result, float(seconds)

    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=generator).to(device)
    out, ttft = timed(input_ids=ids, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    steps = []
    for _ in range(output - 1):
        out, seconds = timed(input_ids=token, past_key_values=cache)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(seconds)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else max_rss_gib()
    return ttft, steps, peak


def max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


if __name__ == "__main__":
    sys.exit(main())
