"""L4.5: the training loop behind ``recipes/train_gpt.py`` (the configuration is already validated).

Reads top to bottom: :func:`train` builds the engine and the data, :meth:`Trainer.setup` resumes and starts the
logger; :meth:`Trainer.fit` loops ``step -> log -> maybe eval -> maybe save -> maybe stop``; :meth:`Trainer.finish`
evaluates, saves, prints two samples (greedy, top-k) and draws the loss curve.  Exit status: 0 done (or stopped on
request), 2 bad data or a ``--load`` tag that fails verification (a :class:`ConfigError` from those phases), 3 stopped
by the numerical guard.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from ds_megatron.checkpoint.run_state import disk_full_line, load_run, save_run, verified_load_tag
from ds_megatron.checkpoint.tokenizer import check_run_tokenizer
from ds_megatron.config import ConfigError, RunConfig
from ds_megatron.data import MicroBatchStream
from ds_megatron.data.prepare import RunData, prepare_data
from ds_megatron.engine import Built, build_engine, init_distributed, local_device
from ds_megatron.flops import block_fields
from ds_megatron.generate import Decoder
from ds_megatron.metrics import (
    MetricsLogger,
    WandbRun,
    format_record,
    lookup_peak_tflops,
    recompute_fields,
    throughput,
)
from ds_megatron.model.kernels import compile_report
from ds_megatron.pipeline_parallel.schedules import schedule_of
from ds_megatron.plot import read_records, write_loss_plot
from ds_megatron.stop import StopFlag

EXIT_BAD_DATA = 2
EXIT_NUMERICS = 3  # stopped by the numerical guard
EXIT_DISK_FULL = 4  # a save found no space left (the newest complete checkpoint is intact)


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def run_dir_for(run: RunConfig, config_name: str) -> Path | None:
    """The run directory the configuration names: ``logging.run_dir``, else the checkpoint directory (a run resumed
    with the same ``--save`` continues its own records there); None: a new one for this run (:func:`new_run_dir`)."""
    sec = run.section
    value = sec.logging.run_dir or sec.checkpoint.save
    return Path(value) if value else None


def new_run_dir(config_name: str) -> Path:
    """``runs/<config name>/<start time>-<pid>``: a directory of its own for a run that names none, so that no two
    runs' metrics, loss curve or tokenizer ever share one."""
    root = Path("runs") / config_name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir, n = root / f"{stamp}-{os.getpid()}", 1
    while run_dir.exists():
        n += 1
        run_dir = root / f"{stamp}-{os.getpid()}-{n}"
    return run_dir


@dataclass
class LogWindow:
    """Steps since the last log line: their mean loss (finite steps only) and time per step."""

    loss_sum: float = 0.0
    good_steps: int = 0
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)
    # what the model reports beside the loss (a mixture of experts' LM loss, router losses and expert loads), summed
    # over the finite steps
    extra_sums: dict[str, float] = field(default_factory=dict)

    def add(self, loss: float | None, extra: dict[str, float] | None = None) -> None:
        self.steps += 1
        if loss is not None:
            self.loss_sum, self.good_steps = self.loss_sum + loss, self.good_steps + 1
            for name, value in (extra or {}).items():
                self.extra_sums[name] = self.extra_sums.get(name, 0.0) + value

    def extra_means(self) -> dict[str, float]:
        return {name: total / self.good_steps for name, total in self.extra_sums.items()}

    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self.start) / max(1, self.steps)


@dataclass
class Trainer:
    run: RunConfig
    built: Built
    data: RunData
    logger: MetricsLogger
    stream: MicroBatchStream
    start_step: int
    wandb_id: str | None
    skipped: int = 0
    bad_in_row: int = 0
    last_saved: int | None = None
    window: LogWindow = field(default_factory=LogWindow)
    stop: StopFlag = field(default_factory=StopFlag)

    # ---- setup -------------------------------------------------------------------------------------------------
    @classmethod
    def setup(
        cls,
        run: RunConfig,
        built: Built,
        run_dir: Path,
        data: RunData,
        load_tag: str | None = None,
        stop: StopFlag | None = None,
    ) -> Trainer:
        """Resume from ``checkpoint.load`` (tag ``load_tag``, the one verified), start the logger and the micro-batch
        stream; ``stop`` is the flag made at the worker's start (a new one without)."""
        sec = run.section
        topo = built.topology
        start_step, wandb_id, skipped = 0, None, 0
        if sec.checkpoint.load:
            client = load_run(
                built.engine, sec.checkpoint.load, built.rng, built.parallel, topo, run.ds_config, load_tag
            )
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
        iters = sec.train.train_iters
        logger = MetricsLogger(run_dir, iters, start_step, topo.is_logging_rank, wandb_run)
        logger.say(
            f"training steps {start_step + 1}..{iters}: tp {run.tp} cp {run.cp} pp {run.pp} dp {run.dp}"
            + (f" ep {run.section.parallel.ep}" if run.section.parallel.ep > 1 else "")
            + ", "
            f"{run.global_batch_size * run.model.seq_length} tokens per step, {data.num_tokens:,} tokens of data"
        )
        stream = MicroBatchStream(
            data.train,
            run.micro_batch_size,
            run.grad_accum_steps,
            topo.dp_rank,
            run.dp,
            start_step,
            topo.cp_rank,
            topo.cp,
            data.documents,
        )
        return cls(run, built, data, logger, stream, start_step, id_box[0], skipped, stop=stop or StopFlag())

    # ---- the loop ----------------------------------------------------------------------------------------------
    def fit(self) -> int:
        if self.run.section.train.eval_only:
            return self.evaluate_only()
        iters = self.run.section.train.train_iters
        step = self.start_step
        while step < iters:
            step += 1
            record = self.train_step(step)
            if step == self.start_step + 1 and (compiled := compile_report()) is not None:
                self.logger.say(compiled)  # the first step compiled every graph (model.compile): say what it cost
            if self.bad_in_row >= self.run.section.train.max_bad_steps:
                return self.stop_on_numerics(step)
            record = self.maybe_eval(step, record)
            self.log(step, record)
            self.maybe_save(step)
            if self.stop.agreed(self.built.engine.device):
                why = self.stop.reason or "by another rank"
                self.logger.say(f"stop requested: saving at step {step} and exiting ({why})")
                if self.last_saved != step:
                    self.save(step)
                self.logger.close()
                return 0
        self.finish(step)
        return 0

    def train_step(self, step: int) -> dict | None:
        """One optimizer step; the record to log when this step ends a log window."""
        engine = self.built.engine
        lr = engine.get_lr()[0]  # the rate this step uses (the schedule moves on inside train_batch)
        loss = float(engine.train_batch(self.stream))
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        finite = math.isfinite(norm) and math.isfinite(loss)
        if not finite:
            self.skipped += 1
            self.bad_in_row += 1
            self.logger.say(
                f"step {step:>6}/{self.run.section.train.train_iters} | non-finite loss {loss} or grad norm {norm}: "
                f"update skipped ({self.bad_in_row} in a row, {self.skipped} in total)"
            )
        else:
            self.bad_in_row = 0
        # A routed family's LM loss, router losses and expert loads of this step (the pipeline module's additional
        # losses, averaged by DeepSpeed over the micro-batches and the data axis and broadcast to every stage).
        extra = {name: float(v) for name, v in (getattr(engine, "agg_additional_losses", None) or {}).items()}
        self.window.add(loss if finite else None, extra)
        self.logger.advance()
        last = step == self.run.section.train.train_iters
        if not ((step % self.run.section.train.log_interval == 0 or last) and self.window.good_steps > 0):
            return None
        record = self.metrics(step, lr, norm, self.window)
        self.window = LogWindow()
        return record

    def metrics(self, step: int, lr: float, norm: float, window: LogWindow) -> dict:
        run = self.run
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        peak = run.section.logging.peak_tflops or lookup_peak_tflops(device_name)
        seconds = window.seconds_per_step()
        return {
            "step": step,
            "loss": window.loss_sum / window.good_steps,
            "lr": lr,
            "grad_norm": norm,
            "step_ms": 1000 * seconds,
            "peak_mem_gb": peak_memory_gb(),
            "skipped_steps": self.skipped,
            **window.extra_means(),
            **throughput(
                seconds,
                run.global_batch_size,
                run.model.seq_length,
                run.model.num_layers,
                run.model.hidden_size,
                run.model.vocab_size,
                run.world_size,
                peak_tflops=peak,
                **recompute_fields(run.section.recompute, run.pp, run.model.num_layers),
                **block_fields(run.model),
            ),
        }

    def maybe_eval(self, step: int, record: dict | None) -> dict | None:
        train = self.run.section.train
        if not (train.eval_interval and step % train.eval_interval == 0 and step != train.train_iters):
            return record
        val = self.evaluate()
        return {**(record or {"step": step}), "val_loss": val, "val_ppl": math.exp(min(val, 50))}

    def log(self, step: int, record: dict | None) -> None:
        if record is None:
            return
        self.logger.log(record)
        iters = self.run.section.train.train_iters
        if "loss" in record:
            self.logger.say(format_record(record, iters))
        if "val_loss" in record:
            val, ppl = record["val_loss"], record["val_ppl"]
            self.logger.say(f"step {step:>6}/{iters} | validation loss {val:.4f} | perplexity {ppl:.2f}")

    def maybe_save(self, step: int) -> None:
        interval = self.run.section.checkpoint.save_interval
        if interval and step % interval == 0:
            self.save(step)

    def save(self, step: int) -> None:
        ck = self.run.section.checkpoint
        if not ck.save:
            return
        client = {"step": step, "config": self.run.ds_config, "wandb_run_id": self.wandb_id, "skipped": self.skipped}
        built, tok = self.built, self.data.tokenizer
        try:
            tag = save_run(
                built.engine, ck.save, step, client, built.rng, ck.keep_last, built.topology, tok, built.parallel
            )
        except (OSError, RuntimeError) as err:
            line = disk_full_line(err, ck.save, step)
            if line is None:
                raise
            # This rank stops; the launcher ends the others (waiting for it in the save's barrier).
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(EXIT_DISK_FULL) from None
        self.last_saved = step
        self.logger.say(f"saved checkpoint {ck.save}/{tag}")

    def stop_on_numerics(self, step: int) -> int:
        self.save(step)
        self.logger.say(
            f"error: training: {self.bad_in_row} steps in a row with a non-finite loss or gradient norm "
            f"(max_bad_steps={self.run.section.train.max_bad_steps}); lower the learning rate or check the data, then "
            "resume from the checkpoint just saved (its weights are those of the last good step)"
        )
        self.logger.close()
        return EXIT_NUMERICS

    # ---- the end -----------------------------------------------------------------------------------------------
    def evaluate(self) -> float:
        run, engine = self.run, self.built.engine
        topo = self.built.topology
        stream = MicroBatchStream(
            self.data.valid,
            run.micro_batch_size,
            run.grad_accum_steps,
            topo.dp_rank,
            run.dp,
            0,
            topo.cp_rank,
            topo.cp,
            self.data.documents,
        )
        losses = [float(engine.eval_batch(stream)) for _ in range(run.section.train.eval_iters)]
        engine.module.train()
        return sum(losses) / len(losses)

    def evaluate_only(self) -> int:
        """The validation loss and perplexity of exactly the weights loaded (``--load``'s tag, or ``--init-from-hf``),
        over ``eval_iters`` validation batches, logged at the loaded step; nothing is trained or saved."""
        ck, step = self.run.section.checkpoint, self.start_step
        what = f"{ck.load} (step {step})" if ck.load else f"{ck.init_from_hf} (transformers)"
        val = self.evaluate()
        self.logger.log({"step": step, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
        self.logger.say(
            f"evaluation only: {what} | validation loss {val:.6f} | perplexity {math.exp(min(val, 50)):.4f} "
            f"({self.run.section.train.eval_iters} batches of {self.run.global_batch_size} sequences)"
        )
        self.logger.close()
        dist.barrier()
        return 0

    def finish(self, step: int) -> None:
        val = self.evaluate()
        self.logger.log({"step": step, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
        self.logger.say(f"validation | loss {val:.4f} | perplexity {math.exp(min(val, 50)):.2f}")
        if self.last_saved != step:
            self.save(step)
        if self.run.section.train.generate_tokens > 0 and self.run.cp > 1:
            # The decoder feeds whole sequences to every rank; under CP each rank's attention expects its chunks.
            self.logger.say("sample skipped: generation is not built for cp > 1 (export and generate at cp 1)")
        elif self.run.section.train.generate_tokens > 0:
            self.sample(step)
        self.plot()
        self.logger.close()
        dist.barrier()

    def sample(self, step: int) -> None:
        """Two continuations of the prompt, logged in one record: greedy (what transformers' greedy generate gives
        for the exported model; a small model soon repeats itself) and top-k with temperature (reads more like text)."""
        train, tok = self.run.section.train, self.data.tokenizer
        prompt_ids = tok(train.prompt, add_special_tokens=False)["input_ids"]
        decoder = Decoder(
            self.built.engine,
            self.built.topology,
            self.run.model.seq_length,
            self.run.micro_batch_size,
            tok.eos_token_id,
            self.run.model.vocab_size,
            schedule_of(self.run),
        )

        def is_blank(token: int) -> bool:
            return not tok.decode([token]).strip()

        new = decoder.greedy(prompt_ids, train.generate_tokens)
        self.logger.say(f"sample (greedy) | {train.prompt!r} -> {_shown(tok, new, is_blank)}")
        drawn, why = decoder.sampled(
            prompt_ids,
            train.generate_tokens,
            train.sample_top_k,
            train.sample_temperature,
            train.seed,
            eos_id=tok.eos_token_id,
            is_blank=is_blank,
        )
        settings = f"top-k {train.sample_top_k}, temperature {train.sample_temperature:g}"
        ending = {"eos": " (stopped at EOS)", "blank": " (stopped: whitespace only)"}.get(why, "")
        self.logger.say(f"sample ({settings}) | {train.prompt!r} -> {_shown(tok, drawn, is_blank)}{ending}")
        record = {"sample_prompt": train.prompt, "sample": tok.decode(new), "sample_ids": new, "prompt_ids": prompt_ids}
        topk = {"sample_topk": tok.decode(drawn), "sample_topk_ids": drawn, "sample_topk_stop": why}
        knobs = {"sample_top_k": train.sample_top_k, "sample_temperature": train.sample_temperature}
        self.logger.log({"step": step, **record, **topk, **knobs})

    def plot(self) -> None:
        """The logging rank draws ``loss.png`` next to ``metrics.jsonl`` (the logger's file names the run directory),
        from every record there: a resumed run's figure shows the whole run.  Titled with the wandb run name, else
        the run directory's name."""
        if self.logger.file is None:
            return
        metrics = Path(self.logger.file.name)
        tokens_per_step = self.run.global_batch_size * self.run.model.seq_length
        title = self.run.section.logging.wandb_run_name or metrics.parent.name
        try:
            path = write_loss_plot(read_records(metrics), metrics.with_name("loss.png"), tokens_per_step, title)
        except Exception as err:  # a picture is not worth failing a finished, saved run, nor hanging the other ranks
            self.logger.say(f"warning: loss curve not drawn: {type(err).__name__}: {err}")
            return
        self.logger.say(f"loss curve | {path} (loss, validation loss, learning rate, grad norm, tokens/s vs tokens)")


def _shown(tok, ids: list[int], is_blank) -> str:
    """The continuation as the console shows it: a trailing run of whitespace tokens (a small model's greedy decoding
    often ends in newlines) is counted instead of printed; the record keeps the full text."""
    blank = 0
    while blank < len(ids) and is_blank(ids[len(ids) - 1 - blank]):
        blank += 1
    if blank < 4:
        return repr(tok.decode(ids))
    return f"{tok.decode(ids[: len(ids) - blank])!r} + {blank} whitespace tokens"


def start_run_dir(run: RunConfig, config_name: str, rank: int) -> Path:
    """Collective when the configuration names no run directory (rank 0 makes a new one and tells the others).  The
    run directory, with the resolved configuration in it (written, and printed, by rank 0)."""
    run_dir = run_dir_for(run, config_name)
    if run_dir is None:
        box = [str(new_run_dir(config_name)) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        run_dir = Path(box[0])
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        print("resolved configuration:\n" + json.dumps(run.ds_config, indent=2), flush=True)
        print(f"run directory: {run_dir} (metrics.jsonl, loss.png, tokenizer, config.json)", flush=True)
        (run_dir / "config.json").write_text(json.dumps(run.ds_config, indent=2))
    return run_dir


def stopped_in_start_up(stop: StopFlag, phase: str, close=None) -> bool:
    """Collective, at the end of a start-up phase: whether any rank was asked to stop; False when none was.  When one
    was, every rank exits 0 here, before training, with nothing saved (``close``: called first, e.g. the logger's):
    a phase is never cut off half-way (a token cache or a checkpoint half-written), and one rank leaving alone would
    leave the others waiting in the next collective."""
    if not stop.agreed(local_device()):
        return False
    if dist.get_rank() == 0:
        why = stop.reason or "by another rank"
        line = f"stop requested during start-up ({why}): exiting after {phase}, before training; nothing saved"
        print(line, flush=True)
    if close is not None:
        close()
    dist.barrier()
    leave_at_once(0)


def leave_at_once(status: int) -> NoReturn:
    """Exit this process with ``status`` now, its output flushed, running no teardown.  Every rank gets here together
    (after a barrier) and leaves at once: a rank running the destructors of its gloo groups and of torch's store
    while a peer's sockets were already closing ended in std::terminate ("terminate called without an active
    exception", exit -6): in one start-up stop in three without the barrier, and still now and then with the barrier
    and ``destroy_process_group`` once the engine's groups exist (the data phase).  Nothing open then needs closing:
    nothing was saved, the logger and wandb start later (or are closed by the caller), and the run locks are
    ``flock`` locks, which the kernel releases."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def train(run: RunConfig, config_name: str = "run", stop: StopFlag | None = None) -> int:
    """Train ``run``; the exit status of the recipe.  ``stop``: the flag made at the worker's start (``cli.train``),
    agreed on after each start-up phase (:func:`stopped_in_start_up`) and after each step; without it, a flag that
    only another rank's stop sets (the caller owns this process's signals).

    A ConfigError out of the data phase is a problem pre-flight could not see, found while reading the data inside the
    launch (a text field missing in the third file, a corpus without tokens, a tokenizer that is not the one the
    ``--load`` or ``--init-from-hf`` weights were trained with): every rank stops with EXIT_BAD_DATA and rank 0 prints
    the line.  So does one out of the verification of a ``--load`` tag (a file that fails its sha256),
    which runs before the engine is built and needs the process group only to spread the reading over the ranks.
    Only those phases are caught: a ConfigError from building the engine or resuming keeps its traceback."""
    stop = stop or StopFlag(watch_launcher=False, handle_signals=False)
    init_distributed()
    if stopped_in_start_up(stop, "starting the process group"):
        return 0
    try:
        load_tag = verified_load_tag(run.section.checkpoint.load)
    except ConfigError as err:
        if dist.get_rank() == 0:
            print(str(err), file=sys.stderr, flush=True)
        return EXIT_BAD_DATA
    if stopped_in_start_up(stop, "verifying the --load checkpoint"):
        return 0
    built = build_engine(run)
    if stopped_in_start_up(stop, "building the engine"):
        return 0
    rank = built.topology.rank
    run_dir = start_run_dir(run, config_name, rank)
    try:
        data = prepare_data(run, rank, run_dir if rank == 0 else None)
        check_run_tokenizer(run, data.tokenizer, load_tag)  # the weights' tokenizer, if they bring one
    except ConfigError as err:
        if rank == 0:
            print(str(err), file=sys.stderr, flush=True)
        return EXIT_BAD_DATA
    if stopped_in_start_up(stop, "preparing the data"):
        return 0
    trainer = Trainer.setup(run, built, run_dir, data, load_tag, stop)
    if stopped_in_start_up(stop, "resuming", close=trainer.logger.close):
        return 0
    return trainer.fit()
