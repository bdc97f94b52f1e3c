"""Saving and resuming a training run with DeepSpeed checkpoints.

A checkpoint tag ``step<N>`` holds DeepSpeed's files (per-layer weights, optimizer and scheduler states) plus
``client_state``: the resolved configuration, the step (the data position follows from it), and the wandb run id.
RNG states differ per rank (dropout seeds depend on pp/dp/tp rank), so every rank also writes its own
``rng_rank<r>.pt`` into the tag; resuming restores them and the run continues bit for bit.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ds_megatron.random import RNGTracker


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(load_dir: str | Path) -> str | None:
    latest = Path(load_dir) / "latest"
    return latest.read_text().strip() if latest.exists() else None


def save_run(engine, save_dir: str | Path, step: int, client_state: dict, rng: RNGTracker, keep_last: int = 0) -> str:
    """Collective.  Writes tag ``step<N>`` and moves ``latest`` to it."""
    tag = tag_for(step)
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state)
    rank = dist.get_rank()
    torch.save(rng.state_dict(), Path(save_dir) / tag / f"rng_rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0 and keep_last > 0:
        tags = sorted(p.name for p in Path(save_dir).glob("step*") if p.is_dir())
        for old in tags[:-keep_last]:
            shutil.rmtree(Path(save_dir) / old, ignore_errors=True)
    dist.barrier()
    return tag


def load_run(engine, load_dir: str | Path, rng: RNGTracker) -> dict:
    """Collective.  Loads the latest tag into the engine and this rank's RNG states; returns the client state."""
    tag = latest_tag(load_dir)
    if tag is None:
        raise FileNotFoundError(f"error: --load: no checkpoint in {load_dir} (no 'latest' file); pass a checkpoint dir")
    path, client_state = engine.load_checkpoint(str(load_dir), tag=tag)
    if path is None:
        raise FileNotFoundError(f"error: --load: checkpoint {load_dir}/{tag} could not be loaded; check the directory")
    rng_file = Path(load_dir) / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if rng_file.exists():
        rng.load_state_dict(torch.load(rng_file, weights_only=False))
    else:
        print(f"warning: {rng_file} missing; dropout masks will not continue exactly", file=sys.stderr, flush=True)
    return client_state or {}
