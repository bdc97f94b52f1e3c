"""The recipe with faults injected, for the reliability tests (production code carries no test hooks).

    faulty_train.py [--nan-steps 2,4] [--pause-before-manifest STEP:SECONDS] [--pause-in PHASE:DIR]
                    <train_gpt.py flags>

``--nan-steps``: the loss of those optimizer steps is made NaN (its gradients become NaN too).
``--pause-before-manifest``: when saving that step, every rank sleeps after the checkpoint files are written and
before the manifest (so a test can kill the job in the middle of a save).
``--pause-in``: in that start-up phase (``group``: just before the process group starts, the imports done;
``checksum``: the ``--load`` checksum pass; ``tokenise``: the in-launch tokenising, in the process that builds the
token cache) the process
writes ``DIR/PHASE.rank<R>``, then waits until its launcher has lost the ``deepspeed`` command (at most 60 s) and two
of the launcher watch's polls more, then goes on: a stop sent to the command lands in that phase."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STARTER = psutil.Process(os.getppid()).ppid()  # the launcher's parent: the deepspeed command

from ds_megatron import stop, trainer  # noqa: E402
from ds_megatron.checkpoint import run_state  # noqa: E402
from ds_megatron.cli.train import main  # noqa: E402
from ds_megatron.data import prepare  # noqa: E402
from ds_megatron.pipeline_parallel import module as pipeline  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--nan-steps", default="")
ap.add_argument("--pause-before-manifest", default="")
ap.add_argument("--pause-in", default="")
faults, rest = ap.parse_known_args()
nan_steps = {int(x) for x in faults.nan_steps.split(",") if x}
state = {"nan": False}

if nan_steps:
    loss_call, train_step = pipeline.VocabParallelLoss.__call__, trainer.Trainer.train_step

    def poisoned_loss(self, logits, labels):
        loss = loss_call(self, logits, labels)
        return loss * float("nan") if state["nan"] else loss

    def marked_step(self, step):
        state["nan"] = step in nan_steps
        return train_step(self, step)

    pipeline.VocabParallelLoss.__call__ = poisoned_loss
    trainer.Trainer.train_step = marked_step

if faults.pause_before_manifest:
    pause_step, pause_s = (float(x) for x in faults.pause_before_manifest.split(":"))
    seal = run_state.seal_tag

    def slow_seal(root, tag, step, keep_last):
        if step == int(pause_step):
            time.sleep(pause_s)
        return seal(root, tag, step, keep_last)

    run_state.seal_tag = slow_seal

if faults.pause_in:
    phase, marker_dir = faults.pause_in.split(":", 1)
    owner, name = {"checksum": (run_state, "_share_problem"), "group": (trainer, "init_distributed")}.get(
        phase, (prepare, "_build")
    )
    real = getattr(owner, name)

    def paused(*args, **kwargs):
        (Path(marker_dir) / f"{phase}.rank{os.environ.get('RANK', '0')}").touch()
        deadline = time.time() + 60
        while psutil.Process(os.getppid()).ppid() == STARTER and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(2 * stop.POLL_SECONDS)
        return real(*args, **kwargs)

    setattr(owner, name, paused)

sys.exit(main(rest))
