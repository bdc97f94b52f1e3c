"""Export a ds_megatron DeepSpeed checkpoint (any tp / cp / pp / dp) to a Hugging Face directory of the run's family
(``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...).

Reads the pipeline's per-layer files (``layer_<i>-model_<tp>-model_states.pt``, written once per TP rank by DP rank
0), merges each parameter's TP shards and turns it into transformers' tensors through the family's state-dict
adapter (``checkpoint/adapter.py``: fused QKV by heads, vocabulary padding stripped, GPT-2's Conv1D weights
transposed, stacked experts one linear per expert), checks that replicated parameters agree across TP ranks and
writes safetensors shards (plus ``model.safetensors.index.json`` when there is more
than one), ``config.json``, ``generation_config.json`` and the tokenizer the weights were trained with (the one
saved in the tag, ``checkpoint/tokenizer.py``).  It streams layer by layer: at most one output shard and one layer's
TP shards are in memory at a time.  Every file of the tag is checked against its
manifest's sha256 before any is read.  Everything is written to a temporary directory (``<out>.partial-*``) renamed
at the end and removed on any failure, so a failed export leaves nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from ds_megatron.checkpoint import safe_load
from ds_megatron.checkpoint.adapter import StateDictAdapter, expected_shapes
from ds_megatron.checkpoint.layout import pipeline_layout, run_model_config, shard_context
from ds_megatron.checkpoint.manifest import complete_tags, source_tag, verify_tag
from ds_megatron.checkpoint.masters import MasterWeights
from ds_megatron.checkpoint.tokenizer import check_fits, check_same, load_tokenizer, tag_tokenizer
from ds_megatron.config import ConfigError, resolve
from ds_megatron.config.facts import saved_layout, saved_world
from ds_megatron.fileio import staged_directory
from ds_megatron.model import ModelConfig, family_of
from ds_megatron.parallelize import ParallelContext

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def read_checkpoint_config(ckpt_dir: Path, tag: str | None, trust: bool = False) -> tuple[str, dict]:
    tag = source_tag(ckpt_dir, tag)  # a --tag that is not there is named with the tags that are
    states = ckpt_dir / tag / "mp_rank_00_model_states.pt"
    if not states.exists():
        raise ConfigError("--checkpoint", "incomplete checkpoint", f"{states} is missing", "use a complete tag")
    # Every file against its sha256 before any is read (one pass over the tag's bytes).
    verify_tag(ckpt_dir / tag, "--checkpoint", f"export another tag (--tag; complete ones: {complete_tags(ckpt_dir)})")
    client = safe_load.load(states, trust=trust, mmap=True)
    if "config" not in client:
        raise ConfigError(
            "--checkpoint", "no ds_megatron config", str(states), "pass a checkpoint written by train_gpt.py"
        )
    return tag, client["config"]


def iter_full_parameters(
    ckpt: Path, config: ModelConfig, parallel: ParallelContext, tp: int, trust: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(full GPT name, merged tensor) for every parameter, one pipeline layer at a time.

    A mixed-precision checkpoint yields its fp32 master weights (``masters.py``), not the 16-bit copies of the
    per-layer files: those are the weights training continues from, and a 16-bit export is a rounding of them.
    Files are read weights-only unless ``trust`` (``safe_load``)."""
    masters = MasterWeights.open(ckpt, tp, pipeline_layout(config), trust=trust)
    adapter = StateDictAdapter(parallel)
    stage = 0
    for idx, prefix in pipeline_layout(config).saved_layers():
        shards = []
        for rank in range(tp):
            f = ckpt / f"layer_{idx:02d}-model_{rank:02d}-model_states.pt"
            if not f.exists():
                raise ConfigError("--checkpoint", "partial checkpoint", f"{f} is missing", "use a complete one")
            shards.append(safe_load.load(f, trust=trust))
        if masters is not None:
            stage = _stage_holding(masters, idx, next(iter(shards[0])), stage, f)
            masters.release(keep_from_pp=stage)
            shards = [
                {k: masters.find(idx, k, rank, stage).view(v.shape) for k, v in shard.items()}
                for rank, shard in enumerate(shards)
            ]
        for local in shards[0]:
            name = prefix + local.removeprefix("block.")
            parts = [s[local] for s in shards]
            if adapter.rule(name).replicated:
                for r, p in enumerate(parts[1:], start=1):
                    if not torch.equal(p, parts[0]):
                        raise ConfigError(
                            "--checkpoint",
                            "inconsistent checkpoint",
                            f"replicated parameter {name} differs between TP ranks 0 and {r}",
                            "export another tag",
                        )
                yield name, parts[0]
            else:
                yield name, adapter.merge(name, parts)  # the vocabulary padding stripped


def _stage_holding(masters: MasterWeights, idx: int, key: str, start: int, layer_file: Path) -> int:
    """The pipeline stage whose optimizer files hold layer ``idx``, searched from ``start`` on (under 1F1B layers
    come in stage order) and then from the first stage."""
    stage = masters.stage_of(idx, key, start)
    if stage is None:
        # A schedule whose ranks hold two stages (DualPipeV's V: rank r holds stages r and 2p-1-r) brings later
        # layers back to earlier ranks.
        stage = masters.stage_of(idx, key, 0)
    if stage is None:
        raise ConfigError(
            "--checkpoint",
            "no optimizer file holds an fp32 master",
            layer_file.name,
            "use a complete checkpoint written by train_gpt.py",
        )
    return stage


def export(
    ckpt_dir: str | Path,
    out: str | Path,
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
    tokenizer_dir: str | Path | None = None,
    progress: bool = True,
    trust_checkpoint: bool = False,
    weights_only: bool = False,
) -> Path:
    """``weights_only``: write no tokenizer (``--no-tokenizer``; BOS/EOS then unset)."""
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    if dtype not in DTYPES:
        raise ConfigError("--dtype", "unknown dtype", dtype, f"use one of {sorted(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise ConfigError("--out", "exists and is not empty", str(out), "choose a new directory")
    tag, ds_config = read_checkpoint_config(ckpt_dir, tag, trust_checkpoint)
    tp = saved_layout(ds_config)[0]
    run = resolve(ds_config, saved_world(ds_config))
    config = run_model_config(run)
    parallel = shard_context(config, run, tp)
    limit = parse_size(max_shard_size)
    tok = None if weights_only else export_tokenizer(ckpt_dir / tag, tokenizer_dir, config.vocab_size)
    bar = _bar(len(pipeline_layout(config).saved_layers()), progress)
    try:
        # A failed export leaves nothing: not its temporary directory, not the parents it created.
        with staged_directory(out, ".partial-") as tmp:
            _write_hf_dir(tmp, ckpt_dir, tag, config, parallel, tp, dtype, limit, tok, trust_checkpoint, bar)
    finally:
        if bar is not None:
            bar.close()  # ends the bar's line, so that an error printed next starts on a line of its own
    return out


def _write_hf_dir(tmp: Path, ckpt_dir: Path, tag: str, config, parallel, tp: int, dtype, limit, tok, trust, bar):
    """Everything ``export`` writes, into ``tmp``."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files, weight_map = 0, [], {}
    shapes = expected_shapes(config)
    adapter = StateDictAdapter(parallel)

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    last_prefix = None
    for name, tensor in iter_full_parameters(ckpt_dir / tag, config, parallel, tp, trust):
        if tuple(tensor.shape) != shapes.get(name):
            raise ConfigError(
                "--checkpoint",
                "the checkpoint does not match its config",
                f"{name} has shape {tuple(tensor.shape)}, the config says {shapes.get(name)}",
                "export a checkpoint written by train_gpt.py",
            )
        # one bar step per pipeline layer with a file
        prefix = pipeline_layout(config).index_of(name)
        if prefix != last_prefix and bar is not None:
            bar.update(1)
        last_prefix = prefix
        for key, stored in adapter.to_hf(name, tensor).items():
            hf = stored.to(DTYPES[dtype]).contiguous()
            size = hf.numel() * hf.element_size()
            if shard and shard_bytes + size > limit:
                flush()
            shard[key] = hf
            shard_bytes += size
    flush()
    if len(files) == 1:
        os.replace(tmp / files[0], tmp / "model.safetensors")
    else:
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        index["metadata"]["total_size"] = sum((tmp / f).stat().st_size for f in files)
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config = config.to_hf()
    hf_config.dtype = str(DTYPES[dtype]).removeprefix("torch.")
    eos = None
    if tok is not None:
        tok.save_pretrained(tmp)
        eos = tok.eos_token_id
    hf_config.bos_token_id = hf_config.eos_token_id = eos
    hf_config.architectures = [family_of(config).hf_architecture]
    hf_config.save_pretrained(tmp)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(tmp)


def export_tokenizer(tag_dir: Path, tokenizer_dir: str | Path | None, vocab_size: int):
    """The tokenizer to ship with the tag's weights: the one saved in the tag (``checkpoint/tokenizer.py``; its files
    were verified with the tag's), or ``--tokenizer``, which must then be the same tokenizer.  A tag without one
    needs ``--tokenizer``; whichever is shipped must fit the model's vocabulary."""
    saved = tag_tokenizer(tag_dir)
    if tokenizer_dir is None and saved is None:
        raise ConfigError(
            "--tokenizer",
            "the checkpoint holds no tokenizer (written before checkpoints kept theirs, or imported without one)",
            str(tag_dir),
            "pass --tokenizer DIR, the tokenizer its weights were trained with (--no-tokenizer: the weights alone)",
        )
    source = Path(tokenizer_dir) if tokenizer_dir is not None else saved
    tok = load_tokenizer(source, "--tokenizer")
    if tokenizer_dir is not None and saved is not None:
        fix = f"leave out --tokenizer (the checkpoint's own is shipped) or pass {saved}"
        check_same(tok, saved, "--tokenizer", f"{tag_dir} was trained with", fix)
    check_fits(tok, vocab_size, "--tokenizer", source)
    return tok


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="exporting", unit="layer")
    except ImportError:
        return None


__all__ = ["export", "iter_full_parameters"]
