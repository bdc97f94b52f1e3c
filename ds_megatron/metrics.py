"""L3.2: what a run reports, from one rank: console progress bar, ``metrics.jsonl``, wandb (imported lazily).

Throughput: tokens/s; TFLOP/s per GPU and MFU from the model FLOPs (Narayanan et al. 2021), HFU counting the
recomputation that was executed.  wandb logs against the optimizer step and resumes the same run from the id stored
in the checkpoint (wandb drops a log to a smaller step with only a warning, so a resume must continue the run); with
no credentials it runs offline (``wandb sync`` uploads later), and any wandb failure
becomes a warning, never a crash.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ds_megatron import gpus
from ds_megatron.config.schema import RecomputeSection
from ds_megatron.flops import executed_flops_per_step, model_flops_per_step

_UNKNOWN_GPUS_TOLD: set[str] = set()  # device names the user was already told have no peak (one message each)


def lookup_peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of ``device_name`` (``ds_megatron.gpus``), or None: on CPU (no name) silently, for a GPU the
    table does not know with a one-time message naming the setting that supplies it."""
    peak = gpus.peak_tflops(device_name)
    if peak is None and device_name and device_name not in _UNKNOWN_GPUS_TOLD:
        _UNKNOWN_GPUS_TOLD.add(device_name)
        print(
            f"ds_megatron: no dense bf16 peak known for GPU {device_name!r}: MFU and HFU are not reported; pass "
            "--peak-tflops (ds_megatron.logging.peak_tflops) with its dense bf16 TFLOP/s to get them",
            file=sys.stderr,
            flush=True,
        )
    return peak


def recompute_fields(recompute: RecomputeSection, pp: int, num_layers: int) -> dict:
    """What ``throughput`` needs to know of a run's recompute: the policy, the layers full recompute re-runs (all,
    or with method ``block`` its first ``num_layers`` per stage) and the modules selective recompute re-runs."""
    recomputed_layers = None
    if recompute.policy == "full" and recompute.method == "block":
        recomputed_layers = min(recompute.num_layers * pp, num_layers)
    return {
        "recompute": recompute.policy,
        "recomputed_layers": recomputed_layers,
        "recompute_modules": recompute.selective_modules,
    }


def throughput(
    step_seconds: float,
    global_batch: int,
    seq: int,
    layers: int,
    hidden: int,
    vocab: int,
    num_gpus: int,
    recompute: str,
    recomputed_layers: int | None,
    peak_tflops: float | None,
    recompute_modules: tuple[str, ...] = (),
    **block: str | int | None,
) -> dict:
    """tokens/s, model TFLOP/s per GPU, MFU and HFU (None without a peak).  ``recompute_modules``: what selective
    recompute re-runs (empty: the default, core_attn); ``block``: the family's shape fields
    (``ds_megatron.flops.block_fields(run.model)``; none for GPT)."""
    model = model_flops_per_step(global_batch, seq, layers, hidden, vocab, **block)
    executed = executed_flops_per_step(
        global_batch,
        seq,
        layers,
        hidden,
        vocab,
        recompute,
        recomputed_layers,
        recompute_modules=recompute_modules,
        **block,
    )
    tflops = model / step_seconds / num_gpus / 1e12
    return {
        "tokens_per_s": global_batch * seq / step_seconds,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "hfu": executed / step_seconds / num_gpus / 1e12 / peak_tflops if peak_tflops else None,
    }


class WandbRun:
    """A wandb run that never takes the training down."""

    def __init__(
        self,
        project: str,
        name: str | None,
        tags: tuple,
        mode: str | None,
        config: dict,
        run_dir: Path,
        run_id: str | None,
    ):
        self.run = None
        self.id = run_id
        if mode is None:
            has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
            mode = os.environ.get("WANDB_MODE") or ("online" if has_key else "offline")
        for attempt in (mode, "offline"):
            try:
                import wandb

                self.run = wandb.init(
                    project=project,
                    name=name,
                    tags=list(tags),
                    config=config,
                    dir=str(run_dir),
                    mode=attempt,
                    id=run_id,
                    resume="allow" if run_id else None,
                )
                self.id = self.run.id
                return
            except Exception as err:  # misconfigured or unreachable: warn, then try offline, then go on without
                print(f"warning: wandb ({attempt}) failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                if attempt == "offline":
                    break
        print("warning: wandb disabled for this run; metrics.jsonl still has every record", file=sys.stderr, flush=True)

    def log(self, record: dict, step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=step)
        except Exception as err:
            print(f"warning: wandb log failed ({err})", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as err:
                print(f"warning: wandb finish failed ({err})", file=sys.stderr, flush=True)


def _netrc_has_wandb() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class MetricsLogger:
    """Console lines, a progress bar with ETA and ``metrics.jsonl`` (one JSON object per logged step)."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool, wandb_run: WandbRun | None):
        self.enabled = enabled
        self.wandb = wandb_run
        self.bar = None
        self.file = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        note = keep_own_history(run_dir / "metrics.jsonl", start_step)
        self.file = open(run_dir / "metrics.jsonl", "a")
        try:
            from tqdm.auto import tqdm

            # disable=None: a live bar on a terminal; in logs the step lines carry the ETA instead.
            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="training",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                disable=None,
            )
        except ImportError:
            self.bar = None
        if note is not None:
            self.say(note)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def say(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)
        sys.stdout.flush()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def keep_own_history(path: Path, start_step: int) -> str | None:
    """Make ``metrics.jsonl`` (and so ``loss.png``, drawn from it) hold this run's records only, before it appends
    to it: a run from step 0 moves an earlier run's file aside to ``metrics.previous-<k>.jsonl``; a run resumed at
    ``start_step`` keeps the records up to that step and drops later ones (steps trained after the checkpoint, which
    it trains again).  Returns the line saying what it did, None when there was nothing to do."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    if start_step == 0:
        k = 1
        while (aside := path.with_name(f"metrics.previous-{k}.jsonl")).exists():
            k += 1
        os.replace(path, aside)
        return f"{path} held an earlier run's records: moved to {aside.name} (this run starts at step 1)"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if _step(line) <= start_step]
    if len(kept) == len(lines):
        return None
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return f"{path}: dropped {len(lines) - len(kept)} record(s) after step {start_step} (trained again from there)"


def _step(line: str) -> float:
    """A record's step; a line cut short by a crash counts as after every step (it is dropped)."""
    try:
        return json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return float("inf")


def format_record(r: dict, total_steps: int) -> str:
    parts = [
        f"step {r['step']:>6}/{total_steps}",
        f"loss {r['loss']:.4f}",
    ]
    if "aux_loss" in r:  # a mixture of experts: the LM loss, the load-balancing loss, the expert loads' range
        parts.append(f"lm {r['lm_loss']:.4f} aux {r['aux_loss']:.4f}")
        parts.append(f"expert load {r['expert_load_min']:.2f}-{r['expert_load_max']:.2f}")
    parts += [
        f"lr {r['lr']:.3e}",
        f"grad norm {r['grad_norm']:.3f}",
        f"{r['tokens_per_s']:,.0f} tok/s",
        f"{r['tflops_per_gpu']:.2f} TFLOP/s/GPU",
    ]
    if r.get("mfu") is not None:
        active = " (active parameters)" if "aux_loss" in r else ""  # a mixture of experts counts the experts run
        parts.append(f"MFU {100 * r['mfu']:.1f}% HFU {100 * r['hfu']:.1f}%{active}")
    parts.append(f"{r['step_ms']:.0f} ms/step")
    if r.get("peak_mem_gb") is not None:
        parts.append(f"mem {r['peak_mem_gb']:.2f} GB")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    remaining = (total_steps - r["step"]) * r["step_ms"] / 1000
    parts.append(f"ETA {int(remaining // 3600)}:{int(remaining % 3600 // 60):02d}:{int(remaining % 60):02d}")
    return " | ".join(parts)
