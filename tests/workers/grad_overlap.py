"""Overlapped data-parallel reduction worker: train each case with ``parallel.overlap_grad_reduce`` off (DeepSpeed's
own reduction after the step's last backward) and on, from the same weights on the same data, and compare.

Usage (under the deepspeed launcher):
    grad_overlap.py --out DIR --cases 1,1,2,fp32,1f1b,2 1,2,2,bf16,zb-h1,4 ...
        writes DIR/<case>.rank<r>.json: both runs' losses and grad norms, whether every final weight is bit-equal,
        the largest weight difference, per step the buckets the overlap started before ``ReduceGrads`` and of those
        inside a gradient pass, and the bucket count.
    grad_overlap.py --out DIR --measure --accumulation 2 8 --repeats 7 [--hidden 512 --layers 4 --seq 128]
        times whole training steps at dp 2 (fp32, ZeRO 0) with the overlap off and on, every (accumulation, mode)
        engine built first and the runs interleaved within each repeat; writes DIR/measure.rank<r>.json: per repeat,
        accumulation and mode the step's wall seconds, this process's CPU seconds (all its threads, gloo's
        included) and the seconds spent in ``ReduceGrads`` (the reduction left exposed).
A case is tp,pp,dp,precision,schedule,gradient accumulation steps, optionally followed by ``sp``; precision is fp32
(ZeRO 0) or bf16 (DeepSpeed's BF16 optimizer, ZeRO-1, fp32 accumulation).  Buckets are cut small
(``--bucket-elements``) so that a tiny model has several, launched in the step's last backward.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from common import log, micro_batches, tiny_ds_config, token_batches, write_result  # noqa: E402
from deepspeed.runtime.pipe import schedule  # noqa: E402

from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402
from ds_megatron.pipeline_parallel import grad_reduce  # noqa: E402

BF16 = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "data_types": {"grad_accum_dtype": "fp32"},
}


def config(case: str, overlap: bool) -> dict:
    tp, pp, dp, precision, schedule_name, gas, *options = case.split(",")
    tp, pp, dp, gas = int(tp), int(pp), int(dp), int(gas)
    extra = BF16 if precision == "bf16" else None
    cfg = tiny_ds_config(
        tp, pp, dp, sequence_parallel="sp" in options, extra=extra, global_batch=2 * gas * dp, layers=2 * pp
    )
    cfg["ds_megatron"]["parallel"]["pipeline_schedule"] = schedule_name
    cfg["ds_megatron"]["parallel"]["overlap_grad_reduce"] = overlap
    return cfg


def train(cfg: dict, steps: int):
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    engine, topo = built.engine, built.topology
    overlap = getattr(engine, "grad_reduce_overlap", None)
    early = []
    if overlap is not None:
        table = dict(engine._INSTRUCTION_MAP)
        reduce = table[schedule.ReduceGrads]

        def counted(self):  # how many buckets started before ReduceGrads, per step
            early.append((overlap.launched_early, overlap.launched_in_pass))
            reduce(self)

        table[schedule.ReduceGrads] = counted
        engine._INSTRUCTION_MAP = table
    batches = token_batches(steps, run.global_batch_size, run.model.seq_length, run.model.vocab_size)
    losses, norms = [], []
    for tokens in batches:
        loss = engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, run.dp, topo.dp_rank)))
        losses.append(float(loss))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    buckets = 0 if overlap is None else len(overlap.buckets)
    return losses, norms, weights, early, buckets


def compare(case: str, steps: int, out: str) -> None:
    l0, n0, w0, _, _ = train(config(case, False), steps)
    l1, n1, w1, early, buckets = train(config(case, True), steps)
    assert w0.keys() == w1.keys()
    payload = {
        "losses_off": l0,
        "losses_on": l1,
        "norms_off": n0,
        "norms_on": n1,
        "weights_equal": all(torch.equal(w0[k], w1[k]) for k in w0),
        "weight_diff": max(float((w0[k] - w1[k]).abs().max()) for k in w0),
        "early": early,
        "buckets": buckets,
    }
    log(case, payload["losses_on"], payload["weights_equal"], early, buckets)
    write_result(out, case.replace(",", "-"), payload)


def measure(args) -> None:
    engines = {}
    for gas in args.accumulation:
        for overlap in (False, True):
            cfg = tiny_ds_config(
                1, 1, 2, hidden=args.hidden, layers=args.layers, heads=8, seq=args.seq, global_batch=2 * gas * 2
            )
            cfg["ds_megatron"]["parallel"]["overlap_grad_reduce"] = overlap
            run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
            built = build_engine(run)
            engine, spent = built.engine, {"reduce": 0.0}
            table = dict(engine._INSTRUCTION_MAP)
            table[schedule.ReduceGrads] = timed(table[schedule.ReduceGrads], spent)
            engine._INSTRUCTION_MAP = table
            engines[(gas, overlap)] = (engine, run, built.topology, spent)
    rows = []
    for repeat in range(args.repeats + 1):  # the first round warms up every engine (and teaches the overlap its
        for (gas, overlap), (engine, run, topo, spent) in engines.items():  # stream) and is dropped
            tokens = token_batches(1, run.global_batch_size, run.model.seq_length, run.model.vocab_size, repeat)[0]
            spent["reduce"] = 0.0
            torch.distributed.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, run.dp, topo.dp_rank)))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if repeat:
                rows.append({"gas": gas, "overlap": overlap, "repeat": repeat, "step": wall, "cpu": cpu, **spent})
    params = sum(p.numel() for p in next(iter(engines.values()))[0].module.parameters())
    write_result(args.out, "measure", {"rows": rows, "params": params})


def timed(fn, spent: dict):
    def run(self, **kwargs):
        start = time.perf_counter()
        try:
            return fn(self, **kwargs)
        finally:
            spent["reduce"] += time.perf_counter() - start

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="*", default=[])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket-elements", type=int, default=20_000, help="cases only (--measure: the package's)")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--accumulation", type=int, nargs="*", default=[2, 8])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    if args.measure:
        measure(args)
        return
    grad_reduce.BUCKET_ELEMENTS = args.bucket_elements
    for case in args.cases:
        compare(case, args.steps, args.out)


if __name__ == "__main__":
    main()
