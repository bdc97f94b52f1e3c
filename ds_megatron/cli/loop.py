"""L5: the training loop of ``recipes/train_gpt.py`` (configuration already validated)."""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ds_megatron.checkpoint.run_state import load_run, save_run
from ds_megatron.config import RunConfig
from ds_megatron.data import DataError, MicroBatchStream
from ds_megatron.data.prepare import prepare_data
from ds_megatron.engine import build_engine
from ds_megatron.generate import greedy_continuation
from ds_megatron.metrics import MetricsLogger, WandbRun, format_record, lookup_peak_tflops, throughput

NAN_STEPS_ENV = "DS_MEGATRON_TEST_NAN_STEPS"  # test hook: comma-separated steps whose loss is made NaN
EXIT_NUMERICS = 3  # stopped by the numerical guard


class StopFlag:
    """SIGTERM / SIGINT ask for a graceful stop: finish the current step, save, exit 0."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, device) -> bool:
        """Collective: stop when any rank was asked to."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def evaluate(engine, run: RunConfig, samples, dp_rank: int, iters: int) -> float:
    stream = MicroBatchStream(samples, run.micro_batch_size, run.grad_accum_steps, dp_rank, run.dp)
    losses = [float(engine.eval_batch(stream)) for _ in range(iters)]
    engine.module.train()
    return sum(losses) / len(losses)


def run_dir_for(run: RunConfig, config_name: str) -> Path:
    sec = run.section
    return Path(sec.logging.run_dir or sec.checkpoint.save or f"runs/{config_name}")


def train(run: RunConfig, config_name: str = "run") -> int:
    sec = run.section
    built = build_engine(run)
    engine, topo = built.engine, built.topology
    run_dir = run_dir_for(run, config_name)
    is_rank0 = topo.rank == 0
    if is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        print("resolved configuration:\n" + json.dumps(run.ds_config, indent=2), flush=True)
        (run_dir / "config.json").write_text(json.dumps(run.ds_config, indent=2))
    try:
        data = prepare_data(run, topo.rank, run_dir if is_rank0 else None)
    except DataError as err:
        if is_rank0:
            print(str(err), file=sys.stderr, flush=True)
        return 2

    start_step, wandb_id, skipped = 0, None, 0
    if sec.checkpoint.load:
        client = load_run(engine, sec.checkpoint.load, built.rng, built.plan, topo)
        start_step, wandb_id, skipped = client.get("step", 0), client.get("wandb_run_id"), client.get("skipped", 0)

    log = sec.logging
    wandb_run = None
    if topo.is_logging_rank and log.wandb_project:
        wandb_run = WandbRun(
            log.wandb_project, log.wandb_run_name, log.wandb_tags, log.wandb_mode, run.ds_config, run_dir, wandb_id
        )
    # Every rank needs the id for its checkpoint client state.
    id_box = [wandb_run.id if wandb_run is not None else wandb_id]
    dist.broadcast_object_list(id_box, src=topo.ds_topology.get_rank(pipe=run.pp - 1, data=0, model=0))
    wandb_id = id_box[0]

    iters, log_every = sec.train.train_iters, sec.train.log_interval
    logger = MetricsLogger(run_dir, iters, start_step, topo.is_logging_rank, wandb_run)
    logger.say(
        f"training steps {start_step + 1}..{iters}: tp {run.tp} pp {run.pp} dp {run.dp}, "
        f"{run.global_batch_size * run.model.seq_length} tokens per step, {data.num_tokens:,} tokens of data"
    )
    stream = MicroBatchStream(data.train, run.micro_batch_size, run.grad_accum_steps, topo.dp_rank, run.dp, start_step)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    peak = log.peak_tflops or lookup_peak_tflops(device_name)
    recompute = sec.recompute
    recomputed_layers = None
    if recompute.policy == "full" and recompute.method == "block":
        recomputed_layers = min(recompute.num_layers * run.pp, run.model.num_layers)
    stop = StopFlag()
    # Test hook: steps whose loss is made NaN, to exercise the numerical guards end to end.
    poisoned = {int(x) for x in os.environ.get(NAN_STEPS_ENV, "").split(",") if x.strip()}
    bad_in_row = 0

    def client_state(step: int) -> dict:
        return {"step": step, "config": run.ds_config, "wandb_run_id": wandb_id, "skipped": skipped}

    def checkpoint(step: int) -> None:
        if sec.checkpoint.save:
            tag = save_run(
                engine, sec.checkpoint.save, step, client_state(step), built.rng, sec.checkpoint.keep_last, topo
            )
            logger.say(f"saved checkpoint {sec.checkpoint.save}/{tag}")

    step = start_step
    window_loss, window_good, window_steps, window_start = 0.0, 0, 0, time.perf_counter()
    last_saved = None
    while step < iters:
        step += 1
        engine.module.loss_fn.poison = step in poisoned
        lr = engine.get_lr()[0]  # the rate this step uses (the schedule moves on inside train_batch)
        loss = float(engine.train_batch(stream))
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if not math.isfinite(norm) or not math.isfinite(loss):
            skipped += 1
            bad_in_row += 1
            logger.say(
                f"step {step:>6}/{iters} | non-finite loss {loss} or grad norm {norm}: update skipped "
                f"({bad_in_row} in a row, {skipped} in total)"
            )
            if bad_in_row >= sec.train.max_bad_steps:
                checkpoint(step)
                logger.say(
                    f"error: training: {bad_in_row} steps in a row with a non-finite loss or gradient norm "
                    f"(max_bad_steps={sec.train.max_bad_steps}); lower the learning rate or check the data, then "
                    "resume from the checkpoint just saved (its weights are those of the last good step)"
                )
                logger.close()
                return EXIT_NUMERICS
        else:
            bad_in_row = 0
            window_loss, window_good = window_loss + loss, window_good + 1
        window_steps += 1
        logger.advance()
        record = None
        if (step % log_every == 0 or step == iters) and window_good > 0:
            elapsed = (time.perf_counter() - window_start) / window_steps
            record = {
                "step": step,
                "loss": window_loss / window_good,
                "lr": lr,
                "grad_norm": norm,
                "step_ms": 1000 * elapsed,
                "peak_mem_gb": peak_memory_gb(),
                "skipped_steps": skipped,
                **throughput(
                    elapsed,
                    run.global_batch_size,
                    run.model.seq_length,
                    run.model.num_layers,
                    run.model.hidden_size,
                    run.model.vocab_size,
                    run.world_size,
                    recompute.policy,
                    recomputed_layers,
                    peak,
                ),
            }
            window_loss, window_good, window_steps, window_start = 0.0, 0, 0, time.perf_counter()
        if sec.train.eval_interval and step % sec.train.eval_interval == 0 and step != iters:
            val = evaluate(engine, run, data.valid, topo.dp_rank, sec.train.eval_iters)
            record = {**(record or {"step": step}), "val_loss": val, "val_ppl": math.exp(min(val, 50))}
        if record is not None:
            logger.log(record)
            if "loss" in record:
                logger.say(format_record(record, iters))
            if "val_loss" in record:
                logger.say(
                    f"step {step:>6}/{iters} | validation loss {record['val_loss']:.4f} | "
                    f"perplexity {record['val_ppl']:.2f}"
                )
        if sec.checkpoint.save_interval and step % sec.checkpoint.save_interval == 0:
            checkpoint(step)
            last_saved = step
        if stop.agreed(engine.device):
            logger.say(f"stop requested: saving at step {step} and exiting")
            if last_saved != step:
                checkpoint(step)
            logger.close()
            return 0

    val = evaluate(engine, run, data.valid, topo.dp_rank, sec.train.eval_iters)
    logger.log({"step": step, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
    logger.say(f"validation | loss {val:.4f} | perplexity {math.exp(min(val, 50)):.2f}")
    if last_saved != step:
        checkpoint(step)
    if sec.train.generate_tokens > 0:
        tok = data.tokenizer
        prompt_ids = tok(sec.train.prompt, add_special_tokens=False)["input_ids"]
        new = greedy_continuation(
            engine,
            topo,
            prompt_ids,
            sec.train.generate_tokens,
            run.model.seq_length,
            run.micro_batch_size,
            tok.eos_token_id,
            run.model.vocab_size,
        )
        logger.log(
            {
                "step": step,
                "sample_prompt": sec.train.prompt,
                "sample": tok.decode(new),
                "sample_ids": new,
                "prompt_ids": prompt_ids,
            }
        )
        logger.say(f"sample | {sec.train.prompt!r} -> {tok.decode(new)!r}")
    logger.close()
    dist.barrier()
    return 0
