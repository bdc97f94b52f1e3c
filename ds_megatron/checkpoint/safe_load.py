"""Reading checkpoint files without running code from them.

``torch.load`` unpickles: with ``weights_only=False`` a crafted file can name any importable function and have the
unpickler call it (write files, start processes).  Every read of a checkpoint by ds_megatron goes through
:func:`load`, which unpickles with ``weights_only=True``: tensors, containers and plain types only, plus the one
classes DeepSpeed's files need beyond those (found by loading every file that bf16 and fp32 checkpoints hold, with
ZeRO 0 and 1, with and without a pipeline): ``fragment_address``, the (numel, start) pair naming each parameter's
slice of the flat fp32 partition in the mixed-precision optimizer files, a plain dataclass whose unpickling only
sets two integers; and what DeepSpeed's ZeRO optimizer (fp32 or fp16 with ZeRO 1, bf16 with ZeRO 1 without fp32
gradient accumulation) adds to its optimizer files: its loss scaler (``LossScaler``, static scale 1 under fp32 and
bf16; ``DynamicLossScaler`` under fp16), plain classes whose state is a few numbers (and a dtype) set as
attributes, and its stage as a ``ZeroStageEnum`` (an integer enum: unpickling looks a member up by its value).
None of them runs anything but setting attributes or looking up a member.
ds_megatron's own files (RNG states, run state, configs) hold tensors and plain types and need nothing more.

A file that needs anything else is refused with one line naming it and what it asks for, unless the caller was
given an explicit trust flag (``--trust-checkpoint`` on the offline commands).  DeepSpeed's own reads go through the
same reader once its engine holds a :class:`WeightsOnlyReads` checkpoint engine (``run_state.read_weights_only``).
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from ds_megatron.config import ConfigError

SAFE_GLOBALS = [fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum]


def unsafe_reason(path: Path) -> str | None:
    """What the weights-only unpickler refuses in ``path`` (``"GLOBAL pathlib.Path.touch"``), or None when the
    file reads safely.  Tensor data is memory-mapped, not read, so this costs about one pickle's parse."""
    try:
        _weights_only(path, mmap=True)
    except pickle.UnpicklingError as err:
        return _what(err)
    return None


def cheap_to_check(path: Path) -> bool:
    """Whether :func:`unsafe_reason` reads only the pickle of ``path`` (torch's zip format, what ``torch.save`` and
    DeepSpeed write by default: tensor data is memory-mapped) rather than the whole file (the legacy format, which
    cannot be memory-mapped; DeepSpeed writes it with ``"checkpoint": {"checkpoint_serialization": false}``)."""
    return zipfile.is_zipfile(path)


def load(path: Path, *, trust: bool = False, mmap: bool = False, setting: str = "--checkpoint", fix: str = "") -> Any:
    """``torch.load`` of one checkpoint file on the CPU, weights only unless ``trust``.  ``mmap`` maps tensor data
    instead of reading it (host memory then holds only the pages touched).  A refused file raises a ConfigError
    naming ``setting`` and ``fix`` (default: the offline commands' ``--trust-checkpoint``)."""
    if trust:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
    try:
        return _weights_only(path, mmap)
    except pickle.UnpicklingError as err:
        raise refusal(path, _what(err), setting, fix) from None
    except (RuntimeError, EOFError) as err:  # torch's reader on a truncated or foreign file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = f"{path.parent.name}/{path.name}: {first}"
        raise ConfigError(setting, "a checkpoint file cannot be read", where, "use a complete checkpoint") from None


class WeightsOnlyReads:
    """A DeepSpeed checkpoint engine whose ``load`` is :func:`load` (weights only) and which is the wrapped engine in
    everything else (saving, commits, writers).  DeepSpeed's engine and pipeline module read every file of a
    checkpoint through ``engine.checkpoint_engine.load`` (model states, per-layer files, optimizer partitions), and
    its torch engine unpickles with ``weights_only=False``.  Files always land on the CPU, as DeepSpeed's callers
    ask (``"cpu"`` or a ``map_location`` that keeps each storage where it was read)."""

    def __init__(self, inner, setting: str, fix: str):
        self.inner, self.setting, self.fix = inner, setting, fix

    def load(self, path: str, map_location=None) -> Any:
        return load(Path(path), setting=self.setting, fix=self.fix)

    def __getattr__(self, name: str) -> Any:  # only for names this class lacks
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def refusal(path: Path, what: str, setting: str = "--checkpoint", fix: str = "") -> ConfigError:
    return ConfigError(
        setting,
        "a checkpoint file needs more than tensors and plain types to unpickle, and unpickling it could run code "
        "from the file",
        f"{path.parent.name}/{path.name} asks for {what}",
        fix or "pass --trust-checkpoint only if you trust where the checkpoint came from",
    )


def _weights_only(path: Path, mmap: bool) -> Any:
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
        except RuntimeError as err:
            if not mmap or "mmap" not in str(err):
                raise
            # Files in torch's legacy (non-zip) format cannot be memory-mapped; read them whole.
            return torch.load(path, map_location="cpu", weights_only=True)


def _what(err: pickle.UnpicklingError) -> str:
    found = re.search(r"GLOBAL [\w.]+", str(err))
    if found:
        return found.group(0)
    lines = [line.strip() for line in str(err).splitlines() if "WeightsUnpickler error" in line]
    return lines[0].removeprefix("WeightsUnpickler error: ") if lines else "an object the weights-only reader refuses"
