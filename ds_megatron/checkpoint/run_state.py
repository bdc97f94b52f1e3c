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

What ``--load`` trusts: nothing in the tag.  Before launch, pre-flight refuses a tag with a file its manifest does
not list or a torch file whose unpickling would need more than tensors and plain types (``preflight.check_resume``).
In the launch, before the engine is built, :func:`verified_load_tag` reads every byte back against the manifest's
sha256, each rank a share; and DeepSpeed then reads the files through :class:`safe_load.WeightsOnlyReads`, so a
file swapped after those checks is refused too, never run.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ds_megatron.checkpoint import safe_load
from ds_megatron.checkpoint.manifest import (
    TAG_CONFIG,
    complete_tags,
    corrupt_checkpoint,
    file_record,
    manifest_records,
    newest_complete_tag,
    resume_tag,
    shares,
    tag_config,
    tag_files,
    tag_problem,
    write_manifest,
)
from ds_megatron.checkpoint.tokenizer import save_tokenizer
from ds_megatron.config import ConfigError
from ds_megatron.config.facts import (
    layout_text,
    needs_resharding,
    precision,
    saved_cp,
    saved_ep,
    saved_layout,
)
from ds_megatron.fileio import atomic_write_text
from ds_megatron.random import RNGTracker

# The record of a tag written by ``python -m ds_megatron.checkpoint import`` (weights from a transformers directory,
# no optimizer state): listed in the manifest like every file of the tag, so verified with it.
IMPORTED = "imported.json"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def save_run(
    engine,
    save_dir: str | Path,
    step: int,
    client_state: dict,
    rng: RNGTracker,
    keep_last: int = 0,
    topology=None,
    tokenizer=None,
    parallel=None,
) -> str:
    """Collective.  Writes tag ``step<N>``, its manifest, then moves ``latest`` to it.  With ``topology``, each rank
    also records its optimizer's parameter order by name, which lets the checkpoint resume at another layout; with
    ``tokenizer`` (the run's), rank 0 writes it into the tag (``checkpoint/tokenizer.py``).  With ``parallel`` (the
    run's context) at ep > 1, the experts are written as an ep 1 run holds them (``ep_state.experts_as_saved``)."""
    from ds_megatron.checkpoint.ep_state import experts_as_saved

    root = Path(save_dir)
    tag = tag_for(step)
    saving = contextlib.nullcontext()
    if parallel is not None and parallel.ep.size > 1:
        saving = experts_as_saved(engine, parallel, engine.module.writes_checkpoint_files())
    with saving:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    rank = dist.get_rank()
    torch.save(rng.state_dict(), root / tag / f"rng_rank{rank:05d}.pt")
    if topology is not None:
        from ds_megatron.checkpoint.reshard import param_names_record

        record = param_names_record(engine, topology)
        atomic_write_text(root / tag / f"params_rank{rank:05d}.json", json.dumps(record))
    if rank == 0 and "config" in client_state:
        atomic_write_text(root / tag / TAG_CONFIG, json.dumps(client_state["config"], indent=1))
    if rank == 0 and tokenizer is not None:
        save_tokenizer(tokenizer, root / tag)
    dist.barrier()  # every rank has written its files
    seal_tag(root, tag, step, keep_last)
    return tag


def seal_tag(root: Path, tag: str, step: int, keep_last: int) -> None:
    """Collective, after every rank has written its files: the manifest, then ``latest``, then old tags go.
    Until the manifest exists the tag does not count as a checkpoint (a crash before this leaves it ignored)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = {name: {"bytes": (root / tag / name).stat().st_size} for name in tag_files(root / tag)}
    mine = {n: file_record(root / tag / n) for n in shares(sizes, world)[rank]}
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


def load_run(
    engine, load_dir: str | Path, rng: RNGTracker, parallel=None, topology=None, run_config=None, tag: str | None = None
) -> dict:
    """Collective.  Loads tag ``tag`` (default: the newest complete one; pass the one :func:`verified_load_tag`
    returned) into the engine and this rank's RNG states; returns the client state.  A checkpoint written at another
    layout (``facts.needs_resharding`` against ``run_config``, the resolved config of this run) is resharded
    (``reshard.py``)."""
    root = Path(load_dir)
    tag = tag or resume_tag(root)
    newer = [p.name for p in root.glob("step*") if p.is_dir() and p.name > tag]
    if newer and dist.get_rank() == 0:
        print(
            f"warning: skipping incomplete checkpoint(s) {sorted(newer)}; resuming from {tag}",
            file=sys.stderr,
            flush=True,
        )
    saved = tag_config(root, tag)
    if parallel is not None and saved is not None and saved_ep(saved) != parallel.ep.size and dist.get_rank() == 0:
        print(
            f"{root}/{tag} was saved at ep {saved_ep(saved)}: its experts are cut for ep {parallel.ep.size} (a "
            "checkpoint holds every expert as an ep 1 run does, whatever the ep it was saved at)",
            flush=True,
        )
    moved = saved is not None and run_config is not None and needs_resharding(saved, run_config)
    imported = (root / tag / IMPORTED).is_file()
    by_name = parallel is not None and parallel.ep.size > 1
    # DeepSpeed's own load of its BF16 optimizer at ZeRO 0 fails (DeepSpeed 0.19.8 hands the optimizer the
    # model-state file's one state dict where it indexes a list by data rank): read by name there too.
    by_name = by_name or (parallel is not None and not imported and _bf16_optimizer_at_zero0(engine))
    if by_name and saved is not None and not moved:
        # At ep > 1 the files hold the experts as an ep 1 run does (``ep_state``), which DeepSpeed's own load cannot
        # put into this rank's E / ep experts: the by-name reader cuts them (and their Adam moments), bit for bit,
        # and the RNG states are this layout's own.
        from ds_megatron.checkpoint.reshard import load_resharded

        client_state = load_resharded(engine, parallel, topology, root, tag)
        _load_rng(root, tag, rng, client_state, imported=imported)
        return client_state
    if parallel is not None and moved:
        from ds_megatron.checkpoint.reshard import load_resharded

        tp, pp, dp = saved_layout(saved)
        if dist.get_rank() == 0:
            with_cp = saved_cp(saved) > 1 or topology.cp > 1
            was = layout_text(tp, saved_cp(saved), pp, dp, with_cp)
            now = layout_text(topology.tp, topology.cp, topology.pp, topology.dp, with_cp)
            print(
                f"resharding {root}/{tag} from {was} to {now}: weights, {precision(saved)} optimizer state, "
                "schedule and data position carry over; dropout RNG streams start afresh (they depend on "
                "the layout)",
                flush=True,
            )
        return load_resharded(engine, parallel, topology, root, tag)
    # An imported tag holds weights alone: DeepSpeed's module-only load, after which its mixed-precision optimizer
    # takes its fp32 masters from the loaded weights and the schedule and counters stay at step 0.
    path, client_state = engine.load_checkpoint(str(root), tag=tag, load_module_only=imported)
    if path is None:
        raise ConfigError("--load", "checkpoint could not be loaded", f"{root}/{tag}", "check the directory")
    _load_rng(root, tag, rng, client_state, imported)
    return client_state or {}


def _bf16_optimizer_at_zero0(engine) -> bool:
    """Whether ``engine`` trains on DeepSpeed's BF16 optimizer without ZeRO (bf16 at stage 0)."""
    return hasattr(engine.optimizer, "bf16_groups") and not engine.zero_optimization()


def _load_rng(root: Path, tag: str, rng: RNGTracker, client_state: dict | None, imported: bool) -> None:
    """This rank's RNG states from a tag saved at this layout (or the message saying why there are none)."""
    rng_file = root / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if rng_file.exists():
        states = safe_load.load(rng_file, setting="--load", fix=UNSAFE_FIX)
        reseeded = rng.load_state_dict(states, step=(client_state or {}).get("step", 0))
        if reseeded and dist.get_rank() == 0:
            print(f"warning: {reseeded}", file=sys.stderr, flush=True)
    elif imported:
        if dist.get_rank() == 0:
            print(f"{root}/{tag} was imported from transformers: the optimizer starts afresh at step 0", flush=True)
    elif (client_state or {}).get("resharded_from"):
        if dist.get_rank() == 0:
            was = client_state["resharded_from"]
            print(
                f"{root}/{tag} was resharded offline from "
                f"{layout_text(was['tp'], was.get('cp', 1), was['pp'], was['dp'])}: dropout RNG streams start "
                "afresh (they depend on the layout)",
                flush=True,
            )
    else:
        print(f"warning: {rng_file} missing; dropout masks will not continue exactly", file=sys.stderr, flush=True)


UNSAFE_FIX = (
    "if you trust where it came from, rewrite it with `python -m ds_megatron.checkpoint reshard --checkpoint DIR "
    "--tp T --pp P --dp D --out NEW --trust-checkpoint` (any layout, the saved one too) and --load NEW"
)


LOAD_SETTING = "ds_megatron.checkpoint.load"


def corrupt_fix(root: Path, tag: str) -> str:
    """What to do about a tag whose files are not the ones its manifest lists."""
    return (
        f"put back the files of {tag} as they were saved (from a copy), or move {root}/{tag} out of the directory to "
        "resume from the complete tag before it"
    )


def verified_load_tag(load_dir: str | Path | None) -> str | None:
    """Collective, before the engine is built: the tag ``--load`` resumes from (the newest complete one; None
    without ``--load``), once every file its manifest lists has been read back with the recorded sha256 and every
    torch file pre-flight could not check cheaply (``safe_load.cheap_to_check``) has been found weights-only.  Each
    rank reads its share (``manifest.shares``, by bytes: no rank reads every file), then all agree: a problem any
    rank found raises the same ConfigError on every rank."""
    if load_dir is None:
        return None
    root = Path(load_dir)
    tag = resume_tag(root, LOAD_SETTING)  # pre-flight found one: refused here only if it was removed since
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mine = _share_problem(root, tag, rank, world)
    except Exception as err:  # a rank that fails must still reach the agreement, or the others wait in it for good
        first = (str(err).strip().splitlines() or [""])[0]
        mine = ConfigError(
            LOAD_SETTING, "a checkpoint file cannot be read", f"{type(err).__name__}: {first}", "check it"
        )
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)  # a ConfigError pickles whole (config/errors.py)
    found = next((g for g in gathered if g is not None), None)
    if found is not None:
        raise found
    return tag


def _share_problem(root: Path, tag: str, rank: int, world: int) -> ConfigError | None:
    """This rank's part of :func:`verified_load_tag`: the refusal it found, or None."""
    problem = tag_problem(root / tag, rank, world)
    if problem is not None:
        return corrupt_checkpoint(LOAD_SETTING, problem, corrupt_fix(root, tag))
    for name in shares(manifest_records(root / tag), world)[rank]:
        f = root / tag / name
        # pre-flight skipped these: reading them weights-only reads them whole
        if name.endswith(".pt") and not safe_load.cheap_to_check(f):
            what = safe_load.unsafe_reason(f)
            if what is not None:
                return safe_load.refusal(f, what, LOAD_SETTING, UNSAFE_FIX)
    return None


def read_weights_only(engine) -> None:
    """Make DeepSpeed read this engine's checkpoint files weights-only (``safe_load.WeightsOnlyReads``); a file that
    needs more is refused with the same line as pre-flight's."""
    engine.checkpoint_engine = safe_load.WeightsOnlyReads(engine.checkpoint_engine, LOAD_SETTING, UNSAFE_FIX)


# Free space below which a failed save is taken for a full disk: a write that ran out of space has used what was left
# (torch's writer reports it as "unexpected pos ..." or "file write failed", with no errno to read).
DISK_FULL_BYTES = 64 << 20


def disk_full_line(err: BaseException, save_dir: str | Path, step: int) -> str | None:
    """The one line that says a save failed for want of space (None when ``err`` is something else): the directory
    and its free space, the tag that was not written, the newest complete one (a resume starts there: the partial
    tag has no manifest, so it is never read), and what to do."""
    import errno

    root = Path(save_dir)
    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        free = None
    enospc = isinstance(err, OSError) and err.errno == errno.ENOSPC
    if not enospc and (free is None or free >= DISK_FULL_BYTES):
        return None
    last = newest_complete_tag(root)
    values = f"{root}: {free / 2**20:.0f} MiB free" if free is not None else str(root)
    kept = f"the last complete checkpoint is {root / last}" if last else "no complete checkpoint was written yet"
    return str(
        ConfigError(
            "ds_megatron.checkpoint.save",
            f"no space left on the device while writing {tag_for(step)} (left incomplete, never resumed from)",
            values,
            f"{kept}; free space or set --save to a larger disk, then resume with --load",
        )
    )
