"""Initialise a pipeline module from a Hugging Face directory of the run's family (``GPT2LMHeadModel`` or
``LlamaForCausalLM``; ``train_gpt.py --init-from-hf HF_DIR``).

Each rank reads, lazily from the safetensors files, only the tensors its stage holds, converts them and keeps its TP
shard through the family's state-dict adapter (``checkpoint/adapter.py``: the same shard rules the layers were built
with).  The pipeline-tied embedding copies are both loaded, so they start identical.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ds_megatron.checkpoint.adapter import StateDictAdapter, expected_shapes
from ds_megatron.config import ConfigError
from ds_megatron.model import ModelConfig, family_of
from ds_megatron.parallelize import ParallelContext
from ds_megatron.pipeline_parallel.module import pipeline_param_name


class HFTensor(NamedTuple):
    path: Path  # the safetensors file holding it
    key: str  # its name in that file (a base model's file stores names without transformers' base prefix)


Stored = dict[str, dict[str, HFTensor]]  # our full name -> {canonical stored name: where it is} (experts: several)


def tensor_files(hf_dir: Path, adapter: StateDictAdapter, setting: str = "--init-from-hf") -> Stored:
    """Where each of our parameters is stored in a transformers directory (one file, or the shards its
    ``model.safetensors.index.json`` names), with names mapped as transformers maps them on load (the adapter's
    ``our_name``: the Hub's own GPT-2 files store ``GPT2Model`` names and causal-mask buffers; one expert's linear is
    a part of our stacked tensor).  A missing file, or one whose header does not read (damaged, cut short, not
    safetensors), is one ConfigError naming ``setting`` and the file: every reader calls this before launch."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        paths = sorted({hf_dir / f for f in weight_map.values()})
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise ConfigError(
                setting, "a shard named by model.safetensors.index.json is missing", f"{hf_dir}/{missing[0]}", "copy it"
            )
    else:
        paths = [hf_dir / "model.safetensors"]
        if not paths[0].exists():
            raise ConfigError(setting, "no model.safetensors", str(hf_dir), "pass an exported directory")
    found: Stored = {}
    for path in paths:  # every file's header, before anything is read or launched
        for key in _tensor_names(path, setting):
            name = adapter.our_name(key)
            if name is None:
                continue
            canonical, group = adapter.canonical(key), found.setdefault(name, {})
            if canonical in group:
                raise ConfigError(
                    setting,
                    "two stored tensors are the same parameter",
                    f"{group[canonical].key} in {group[canonical].path.name} and {key} in {path.name}",
                    "keep one of them",
                )
            group[canonical] = HFTensor(path, key)
    return found


def read_stored(
    adapter: StateDictAdapter, name: str, where: dict[str, HFTensor], read: Callable[[HFTensor], torch.Tensor]
) -> torch.Tensor:
    """Our full tensor ``name`` (fp32) from the tensors stored for it; ``read(HFTensor)`` reads one."""
    return adapter.from_hf(name, {canonical: read(t).float() for canonical, t in where.items()})


FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")  # safetensors' names of the floating-point dtypes


def check_hf_tensors(hf_dir: Path, config: ModelConfig, setting: str) -> tuple[Stored, dict[str, tuple[int, ...]]]:
    """(where each tensor is stored, every parameter's full shape): refused in one line, from the files' headers
    alone, unless every parameter of ``config``'s model is there, floating point, of its shape (once the family's
    adapter has turned the stored shapes into ours)."""
    from safetensors import safe_open

    adapter = StateDictAdapter.of(config)
    files, shapes = tensor_files(hf_dir, adapter, setting), expected_shapes(config)
    missing = [n for n in shapes if n not in files]
    if missing:
        raise ConfigError(
            setting, f"{len(missing)} tensor(s) of the model missing", f"first {missing[0]}", "pass a full model"
        )
    handles: dict[Path, Any] = {}  # each file's header read once (a routed layer stores 3 E tensors)
    for name, want in shapes.items():
        headers = {}
        for canonical, where in files[name].items():
            if where.path not in handles:
                handles[where.path] = safe_open(str(where.path), "pt")
            meta = handles[where.path].get_slice(where.key)
            headers[canonical] = (meta.get_dtype(), tuple(meta.get_shape()))
        dtypes = sorted({d for d, _ in headers.values()}, key=lambda d: d in FLOAT_DTYPES)
        metas = {c: torch.empty(shape, device="meta") for c, (_, shape) in headers.items()}
        try:
            got: object = tuple(adapter.from_hf(name, metas).shape)
        except (ValueError, RuntimeError) as err:  # experts incomplete or of unequal shapes, a name stored twice
            got = str(err).strip().splitlines()[0]
        if dtypes[0] not in FLOAT_DTYPES or got != want:
            raise ConfigError(
                setting,
                "a tensor disagrees with the config's model",
                f"{name}: {dtypes[0]} {got}, the config's model has {want}",
                "pass the model the config describes (or a config of this model's shape)",
            )
    return files, shapes


def _tensor_names(path: Path, setting: str) -> list[str]:
    """The tensor names in one safetensors file.  Opening it reads and checks its header: its length against the
    file's, the JSON, and that the data it describes covers the file exactly, so a truncated or overwritten file
    fails here."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    except Exception as err:  # SafetensorError (not importable by name in every release), OSError
        problem = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            setting,
            "not a readable safetensors file (damaged, cut short or another format)",
            f"{path}: {problem}",
            "copy the file again from its source",
        ) from None


def check_hf_config(hf_dir: Path, config: ModelConfig, setting: str = "--init-from-hf") -> None:
    """The HF model must be of the run's family and exactly its shape; one ConfigError naming ``setting`` and every
    differing key otherwise."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(hf_dir)
    family = config.family
    if hf.model_type != family_of(config).hf_model_type:
        raise ConfigError(
            setting,
            f"model type {hf.model_type!r} is not the run's family ({family})",
            str(hf_dir),
            f"export a {family} model or set ds_megatron.model.family to match",
        )
    try:
        theirs = family_of(config).config.from_hf(hf, attention=config.attention)
    except ValueError as err:
        raise ConfigError(
            setting, "unsupported model settings", str(err).removeprefix("error: "), "use another model"
        ) from None
    ignore = {"attention", "initializer_range", "embd_pdrop", "attn_pdrop", "resid_pdrop", "attention_dropout"}
    differing = [
        f"{key}: {getattr(theirs, key)} in {hf_dir.name}, {getattr(config, key)} in the config"
        for key in vars(config)
        if key not in ignore and getattr(theirs, key) != getattr(config, key)
    ]
    if differing:
        raise ConfigError(setting, "shape differs from the run's", "; ".join(differing), "set the model shape to match")


@torch.no_grad()
def load_hf_into_pipeline(module, parallel: ParallelContext, hf_dir: str | Path) -> int:
    """Copy this rank's shards of the HF weights into ``module``; returns the number of tensors loaded."""
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    check_hf_config(hf_dir, parallel.config)
    adapter = StateDictAdapter(parallel)
    files = tensor_files(hf_dir, adapter)
    handles: dict[Path, Any] = {}

    def read(where: HFTensor) -> torch.Tensor:
        if where.path not in handles:
            handles[where.path] = safe_open(str(where.path), "pt")
        return handles[where.path].get_tensor(where.key)

    loaded = 0
    for local_name, param in module.named_parameters():
        full = pipeline_param_name(local_name, module)
        if full is None or full not in files:
            raise ConfigError(
                "--init-from-hf", "missing tensor", f"{hf_dir} has none for {full or local_name}", "re-export"
            )
        part = adapter.shard(full, read_stored(adapter, full, files[full], read))
        if part.shape != param.shape:
            raise ConfigError(
                "--init-from-hf", "shape mismatch", f"{full}: {tuple(part.shape)} != {tuple(param.shape)}", "re-export"
            )
        param.copy_(part.to(param.dtype))
        loaded += 1
    return loaded
