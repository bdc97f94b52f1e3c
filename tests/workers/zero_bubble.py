"""Zero-bubble worker: train each layout with DeepSpeed's 1F1B, with ZB-H1 and with ZB-H2 (deferred weight gradients
run in the pipeline's bubbles) from the same weights on the same data, and compare, on every rank.

Usage (under the deepspeed launcher):
    zero_bubble.py --out DIR --layouts 1,2,1 1,2,1,llama [--steps 3]
        writes DIR/<layout>.rank<r>.json: per zero-bubble schedule, its and 1F1B's losses, the largest step-1
        gradient and final weight differences, how many W passes it ran and how many were left at a step.
    zero_bubble.py --out DIR --measure --micro-batches 4 8 16 --repeats 5 [--pp 2] [--blocking]
        times every instruction of one step per schedule, interleaved (1f1b, zb-h1, zb-h2, 1f1b, ...), and writes
        DIR/measure.rank<r>.json: per repeat and micro-batch count, the seconds spent computing (forward, B, W,
        loading), waiting in pipeline sends/receives, in the step's reductions and optimizer ("step"), and the
        whole step ("step_total"); per instruction kind its seconds and its count ("n_<kind>"); and the wait for
        the step's async sends ("SendWait", inside ReduceTiedGrads).  ``--blocking`` adds each schedule with
        DeepSpeed's blocking sends ("<name>+blocking"), interleaved with the rest.
A layout is tp,pp,dp, optionally followed by ``llama`` (4 heads, 2 KV heads, untied), ``sp`` and ``bf16`` (DeepSpeed's
BF16 optimizer with ZeRO-1 and fp32 gradient accumulation).
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
from ds_megatron.pipeline_parallel.p2p import BlockingSends  # noqa: E402
from ds_megatron.pipeline_parallel.zero_bubble import WeightGradPass  # noqa: E402

LLAMA_FIELDS = {"family": "llama", "num_kv_heads": 2, "intermediate_size": 96, "rope_theta": 10000.0}
SCHEDULES = ("1f1b", "zb-h1", "zb-h2")
# DeepSpeed's BF16 optimizer (ZeRO-1, fp32 accumulation): gradients live in its fp32 accumulators (``_hp_grad``)
BF16 = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "data_types": {"grad_accum_dtype": "fp32"},
}


def config(tp: int, pp: int, dp: int, options: tuple[str, ...], schedule_name: str, **shape) -> dict:
    extra = BF16 if "bf16" in options else None
    cfg = tiny_ds_config(tp, pp, dp, sequence_parallel="sp" in options, extra=extra, **shape)
    if "llama" in options:
        cfg["ds_megatron"]["model"].update(LLAMA_FIELDS, tie_word_embeddings=False)
    cfg["ds_megatron"]["parallel"]["pipeline_schedule"] = schedule_name
    return cfg


def train(cfg: dict, steps: int):
    """Losses, step-1 gradients (by parameter name) and final weights of ``steps`` optimizer steps; for ZB-H1 also
    how many W passes ran and the most still queued when a step's reductions began."""
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    engine, topo = built.engine, built.topology
    bf16 = bool(getattr(engine, "using_bf16_optimizer", False))
    captured: dict[str, torch.Tensor] = {}
    counts = {"w_passes": 0, "left_at_reduce": 0}
    table = instruction_table(engine)
    step, run_w, reduce_tied = table[schedule.OptimizerStep], table.get(WeightGradPass), table[schedule.ReduceTiedGrads]

    def capturing_step(self, **kwargs):  # step 1's gradients as the optimizer gets them (bf16: fp32 accumulators)
        if not captured:
            for n, p in self.module.named_parameters():
                grad = getattr(p, "_hp_grad", None) if bf16 else p.grad
                if grad is not None:
                    captured[n] = grad.detach().float().clone()
        step(self, **kwargs)

    table[schedule.OptimizerStep] = capturing_step
    if run_w is not None:

        def counted_w(self):  # only W passes that found deferred work count
            counts["w_passes"] += bool(len(self.weight_grad_queue))
            run_w(self)

        def checked_reduce(self):  # what the schedule itself left for the reductions' flush
            counts["left_at_reduce"] = max(counts["left_at_reduce"], len(self.weight_grad_queue))
            reduce_tied(self)

        table.update({WeightGradPass: counted_w, schedule.ReduceTiedGrads: checked_reduce})
    engine._INSTRUCTION_MAP = table
    batches = token_batches(steps, run.global_batch_size, run.model.seq_length, run.model.vocab_size)
    losses = []
    for tokens in batches:
        losses.append(
            float(engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, run.dp, topo.dp_rank))))
        )
    weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if hasattr(engine, "zb_costs"):  # ZB-H2: the costs its order was rebuilt for after the first step
        counts["costs"] = list(engine.zb_costs)
    return losses, captured, weights, counts, run.grad_accum_steps


def instruction_table(engine) -> dict:
    """A copy of the engine's instruction table (its own entries, e.g. the step's SP sum, or its class's)."""
    return dict(engine._INSTRUCTION_MAP)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def compare(layout: str, args) -> None:
    fields = layout.split(",")
    tp, pp, dp = (int(x) for x in fields[:3])
    options = tuple(fields[3:])
    results = {name: train(config(tp, pp, dp, options, name), args.steps) for name in SCHEDULES}
    l1, g1, w1, _, gas = results["1f1b"]
    payload = {"grad_scale": max(float(g.abs().max()) for g in g1.values()), "grad_names": sorted(g1)}
    for name in SCHEDULES[1:]:
        losses, grads, weights, counts, _ = results[name]
        payload[name] = {
            "losses_1f1b": l1,
            "losses_zb": losses,
            "grad_diff": max_diff(g1, grads),
            "param_diff": max_diff(w1, weights),
            "w_passes": counts["w_passes"],
            "left_at_reduce": counts["left_at_reduce"],
            "expected_w_passes": args.steps * gas,
            "costs": counts.get("costs"),
        }
    log(layout, {name: (payload[name]["losses_zb"], payload[name]["grad_diff"]) for name in SCHEDULES[1:]}, l1)
    write_result(args.out, layout.replace(",", "-"), payload)


BLOCKING = "+blocking"  # a measured schedule's name suffix: its engine sends as DeepSpeed's own p2p does


def measure(args) -> None:
    """Per instruction kind, seconds of one step, for each schedule and micro-batch count, interleaved (with
    ``--blocking``: each schedule also with DeepSpeed's blocking sends, as "<name>+blocking")."""
    kinds = {
        "compute": (schedule.ForwardPass, schedule.BackwardPass, WeightGradPass, schedule.LoadMicroBatch),
        "wait": (schedule.SendActivation, schedule.RecvActivation, schedule.SendGrad, schedule.RecvGrad),
        "step": (schedule.ReduceTiedGrads, schedule.ReduceGrads, schedule.OptimizerStep),
    }
    shape = {"layers": 2 * args.pp, "hidden": args.hidden, "heads": 8, "seq": args.seq, "vocab": 1001, "micro": 2}
    # Not ZB-H2 with blocking sends: its order is built for async sends, and where a stage sends ahead of what its
    # peer receives next, two blocking sends wait on each other (deadlock).
    names = SCHEDULES + tuple(name + BLOCKING for name in SCHEDULES if args.blocking and name != "zb-h2")
    engines = {}
    for m in args.micro_batches:
        for name in names:
            cfg = config(1, args.pp, 1, (), name.removesuffix(BLOCKING), global_batch=2 * m, **shape)
            run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
            built = build_engine(run)
            engine = built.engine
            if name.endswith(BLOCKING):
                engine.pending_sends = BlockingSends()
            spent: dict = {k: 0.0 for k in kinds}
            table = (
                dict(engine._INSTRUCTION_MAP)
                if "_INSTRUCTION_MAP" in vars(engine)
                else dict(type(engine)._INSTRUCTION_MAP)
            )
            for kind, instrs in kinds.items():
                for instr in instrs:
                    if instr in table:
                        table[instr] = timed(table[instr], spent, kind, instr.__name__)
            engine._INSTRUCTION_MAP = table
            engine.pending_sends.wait_all = timed_call(engine.pending_sends.wait_all, spent, "SendWait")
            engines[(m, name)] = (engine, run, spent)
    rows = []
    for repeat in range(args.repeats + 1):  # the first round warms up every engine and is dropped
        for m in args.micro_batches:
            for name in names:
                engine, run, spent = engines[(m, name)]
                tokens = token_batches(1, run.global_batch_size, run.model.seq_length, run.model.vocab_size, repeat)[0]
                spent.clear()
                spent.update({k: 0.0 for k in kinds})
                torch.distributed.barrier()
                start = time.perf_counter()
                engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, 1, 0)))
                total = time.perf_counter() - start
                if repeat:
                    rows.append({"m": m, "schedule": name, "repeat": repeat, **spent, "step_total": total})
    write_result(args.out, "measure", {"rows": rows, "pp_rank": engines[(args.micro_batches[0], "1f1b")][0].stage_id})


def timed_call(fn, spent: dict, name: str):
    """``fn`` adding its seconds to ``spent[name]`` only: the wait for the step's async sends, which runs inside
    ``ReduceTiedGrads`` (already timed as a step instruction), or after the schedule."""

    def run():
        start = time.perf_counter()
        try:
            return fn()
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

    return run


def timed(fn, spent: dict, kind: str, name: str):
    """``fn`` adding its seconds to ``spent[kind]`` and to ``spent[name]`` (the instruction's own total)."""

    def run(self, **kwargs):
        start = time.perf_counter()
        try:
            return fn(self, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            spent[kind] += elapsed
            spent[name] = spent.get(name, 0.0) + elapsed
            spent[f"n_{name}"] = spent.get(f"n_{name}", 0) + 1

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", nargs="*", default=[])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--micro-batches", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--blocking", action="store_true", help="--measure: also each schedule with blocking sends")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    if args.measure:
        measure(args)
    for layout in args.layouts:
        compare(layout, args)


if __name__ == "__main__":
    main()
