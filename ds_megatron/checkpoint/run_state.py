"""Saving and resuming a training run with DeepSpeed checkpoints, crash-safe.

A checkpoint tag ``step<N>`` holds DeepSpeed's files (per-layer weights, optimizer and scheduler states) plus
``client_state``: the resolved configuration, the step (the data position follows from it), and the wandb run id.
RNG states differ per rank (dropout seeds depend on pp/dp/tp rank), so every rank also writes its own
``rng_rank<r>.pt``.

DeepSpeed writes files in place and moves ``latest`` from rank 0 before the other ranks are done, so a crash can leave
a half-written tag that ``latest`` names.  Here a tag counts only once every rank has finished (a barrier) and
``manifest.json`` lists every file with its size and sha256 (computed in parallel, each rank a share of the files);
only then is ``latest`` replaced, atomically (write a temporary file, rename).  Loading takes the newest *complete*
tag and warns about any newer incomplete one; ``keep_last`` counts complete tags only and never deletes the newest.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ds_megatron.checkpoint import safe_load
from ds_megatron.checkpoint.manifest import (
    MANIFEST,
    TAG_CONFIG,
    complete_tags,
    file_record,
    newest_complete_tag,
    tag_config,
    write_manifest,
)
from ds_megatron.config import ConfigError
from ds_megatron.config.facts import needs_resharding, precision, saved_layout
from ds_megatron.fileio import atomic_write_text
from ds_megatron.random import RNGTracker


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def save_run(
    engine, save_dir: str | Path, step: int, client_state: dict, rng: RNGTracker, keep_last: int = 0, topology=None
) -> str:
    """Collective.  Writes tag ``step<N>``, its manifest, then moves ``latest`` to it.  With ``topology``, each rank
    also records its optimizer's parameter order by name, which lets the checkpoint resume at another layout."""
    root = Path(save_dir)
    tag = tag_for(step)
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    rank = dist.get_rank()
    torch.save(rng.state_dict(), root / tag / f"rng_rank{rank:05d}.pt")
    if topology is not None:
        from ds_megatron.checkpoint.reshard import param_names_record

        record = param_names_record(engine, topology)
        atomic_write_text(root / tag / f"params_rank{rank:05d}.json", json.dumps(record))
    if rank == 0 and "config" in client_state:
        atomic_write_text(root / tag / TAG_CONFIG, json.dumps(client_state["config"], indent=1))
    dist.barrier()  # every rank has written its files
    seal_tag(root, tag, step, keep_last)
    return tag


def seal_tag(root: Path, tag: str, step: int, keep_last: int) -> None:
    """Collective, after every rank has written its files: the manifest, then ``latest``, then old tags go.
    Until the manifest exists the tag does not count as a checkpoint (a crash before this leaves it ignored)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sorted(p.name for p in (root / tag).iterdir() if p.is_file() and p.name != MANIFEST)
    mine = {n: file_record(root / tag / n) for n in names[rank::world]}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        files = {k: v for part in gathered for k, v in part.items()}
        write_manifest(root / tag, step, files)
        atomic_write_text(root / "latest", tag)
        if keep_last > 0:
            for old in complete_tags(root)[:-keep_last]:
                shutil.rmtree(root / old, ignore_errors=True)
    dist.barrier()


def load_run(engine, load_dir: str | Path, rng: RNGTracker, plan=None, topology=None, run_config=None) -> dict:
    """Collective.  Loads the newest complete tag into the engine and this rank's RNG states; returns the client
    state.  A checkpoint written at another layout (``facts.needs_resharding`` against ``run_config``, the resolved
    config of this run) is resharded (``reshard.py``)."""
    root = Path(load_dir)
    tag = newest_complete_tag(root)
    if tag is None:
        raise ConfigError("--load", "no complete checkpoint", str(root), "pass a directory written by --save")
    newer = [p.name for p in root.glob("step*") if p.is_dir() and p.name > tag]
    if newer and dist.get_rank() == 0:
        print(
            f"warning: skipping incomplete checkpoint(s) {sorted(newer)}; resuming from {tag}",
            file=sys.stderr,
            flush=True,
        )
    refuse_unsafe_files(root / tag)
    saved = tag_config(root, tag)
    if plan is not None and saved is not None and run_config is not None and needs_resharding(saved, run_config):
        from ds_megatron.checkpoint.reshard import load_resharded

        tp, pp, dp = saved_layout(saved)
        if dist.get_rank() == 0:
            print(
                f"resharding {root}/{tag} from tp {tp} x pp {pp} x dp {dp} to tp {topology.tp} x pp {topology.pp} "
                f"x dp {topology.dp}: weights, {precision(saved)} optimizer state, schedule and data position carry "
                "over; dropout RNG streams start afresh (they depend on the layout)",
                flush=True,
            )
        return load_resharded(engine, plan, topology, root, tag)
    path, client_state = engine.load_checkpoint(str(root), tag=tag)
    if path is None:
        raise ConfigError("--load", "checkpoint could not be loaded", f"{root}/{tag}", "check the directory")
    rng_file = root / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if rng_file.exists():
        rng.load_state_dict(safe_load.load(rng_file, setting="--load", fix=UNSAFE_FIX))
    elif (client_state or {}).get("resharded_from"):
        if dist.get_rank() == 0:
            was = client_state["resharded_from"]
            print(
                f"{root}/{tag} was resharded offline from tp {was['tp']} x pp {was['pp']} x dp {was['dp']}: dropout "
                "RNG streams start afresh (they depend on the layout)",
                flush=True,
            )
    else:
        print(f"warning: {rng_file} missing; dropout masks will not continue exactly", file=sys.stderr, flush=True)
    return client_state or {}


UNSAFE_FIX = (
    "if you trust where it came from, rewrite it with `python -m ds_megatron.checkpoint reshard --checkpoint DIR "
    "--tp T --pp P --dp D --out NEW --trust-checkpoint` (any layout, the saved one too) and --load NEW"
)


def refuse_unsafe_files(tag_dir: Path) -> None:
    """Collective.  DeepSpeed's ``engine.load_checkpoint`` unpickles its files with ``weights_only=False`` (its
    torch checkpoint engine), so a crafted file would run code in every process.  Before DeepSpeed reads anything,
    every ``.pt`` file of the tag is read weights-only once (each rank a share; tensor data is memory-mapped, not
    read), and a file that needs more refuses the resume on every rank with the same line."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sorted(p.name for p in tag_dir.glob("*.pt"))
    mine = None
    for name in names[rank::world]:
        what = safe_load.unsafe_reason(tag_dir / name)
        if what is not None:
            mine = (name, what)
            break
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    found = next((g for g in gathered if g is not None), None)
    if found is not None:
        raise safe_load.refusal(tag_dir / found[0], found[1], "--load", UNSAFE_FIX)
