"""``python -m ds_megatron.checkpoint import``: a transformers directory -> a DeepSpeed checkpoint at tp x pp (x ep),
offline.

The output is the step-0 tag a run of ``--config`` at that layout would load: DeepSpeed's per-layer files
(``layer_<i>-model_<tp>-model_states.pt``) in the run's precision (bf16 or fp32), one
``mp_rank_<pp*tp+tp>_model_states.pt`` per model-parallel rank (counters at 0, the resolved config), ``config.json``,
``imported.json`` (where the weights came from), the transformers directory's tokenizer in ``tokenizer/`` when it
has one (refused when its ids reach past the config's vocabulary), ``manifest.json`` with every file's sha256, and
``latest``, written last and atomically.  The files are written by the offline reshard's writer
(``reshard_offline._Writer``, kind FRESH) with the same shard rules as every other path (fused QKV by heads,
vocabulary rows padded for tp); the transformers tensors become ours through the family's state-dict adapter
(``checkpoint/adapter.py``), which reads a mixture of experts' routed MLP one linear per expert (the published
layout, what ``save_pretrained`` writes by default) or stacked (transformers 5's fused ``experts.gate_up_proj`` and
``experts.down_proj``).

Expert parallelism: ``ep`` goes into the written run's configuration only, checked by the config's rules
(``config/ep_rules.py``, with the config's dp and sequence parallelism) before anything is written.  The files are
those of the same run at ep 1, as every checkpoint's are (``checkpoint/ep_state.py``): a ``--load`` at ep > 1 cuts
each rank's experts out of them, and the same tag loads at any ep the run's layout admits.

Optimizer state: none is written.  A fresh DeepSpeed optimizer is a function of the weights (the BF16 optimizer's
fp32 masters are the weights, the Adam moments zero, the step 0), so files holding it would only repeat the weights;
``--load`` of an imported tag is DeepSpeed's module-only load (``run_state.load_run``), after which its optimizer
takes its masters from the loaded weights and the schedule starts at step 0, as after ``--init-from-hf``.  A bf16
run therefore starts from the bf16 rounding of fp32 weights, exactly as ``--init-from-hf`` does.

Streaming: the tensors are read one at a time from the safetensors files (each read opens its file and closes it,
so no mapping of a large file outlives the tensor read from it), converted to fp32, cut into TP shards and kept
only until their layer's files are written: memory holds about one layer's shards plus one full tensor, whatever
the model's size (``benchmarks/import_memory.py`` measures it).  Everything is refused before a file is written
(another architecture, a shape the config disagrees with, missing or extra tensors, a tp the heads do not divide,
an existing output) and written under ``<out>.tmp-<random>`` renamed at the end: a failure leaves nothing.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ds_megatron.checkpoint.adapter import StateDictAdapter, is_copy
from ds_megatron.checkpoint.hf_import import HFTensor, check_hf_config, check_hf_tensors, read_stored
from ds_megatron.checkpoint.layout import pipeline_layout, run_model_config
from ds_megatron.checkpoint.reshard_offline import FRESH, _Writer, check_new_out, check_sizes, check_still_new
from ds_megatron.checkpoint.run_state import IMPORTED, tag_for
from ds_megatron.checkpoint.tokenizer import check_fits, has_tokenizer, load_tokenizer, save_tokenizer
from ds_megatron.config import ConfigError, RunConfig, load_json, resolve
from ds_megatron.config.facts import precision, saved_world
from ds_megatron.fileio import atomic_write_text, staged_directory
from ds_megatron.model import FAMILIES, ModelConfig, family_of


def import_checkpoint(
    hf_dir: str | Path,
    out: str | Path,
    config_path: str | Path,
    tp: int,
    pp: int,
    progress: bool = True,
    ep: int | None = None,
) -> Path:
    """Write the transformers directory ``hf_dir`` as a step-0 DeepSpeed checkpoint of the run ``config_path`` at
    tp x pp (and expert parallelism ``ep``; None: the config's) into the new directory ``out``; every refusal is a
    ConfigError raised before anything is written."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_new_out(out, "import")
    check_sizes({"--tp": tp, "--pp": pp, "--ep": 1 if ep is None else ep})
    model_type = _hf_model_type(hf_dir)
    run = _target_run(config_path, tp, pp, ep)
    config = run_model_config(run)
    if model_type != family_of(config).hf_model_type:
        raise ConfigError(
            "--hf",
            f"model type {model_type!r} is not the config's family ({config.family})",
            str(hf_dir),
            f"pass a config of the {_family_of_hf(model_type)} family",
        )
    check_hf_config(hf_dir, config, "--hf")
    source = HFSource(hf_dir, run, config)
    tok = None
    if has_tokenizer(hf_dir):  # the weights' tokenizer goes with them (``checkpoint/tokenizer.py``)
        tok = load_tokenizer(hf_dir, "--hf")
        check_fits(tok, config.vocab_size, "--hf", hf_dir)
    tag = tag_for(0)
    with staged_directory(out, ".tmp-") as tmp:  # a failure leaves no <out> and no temporary directory
        writer = _Writer(source, run, FRESH, tmp, tag, progress)
        record = {"hf_dir": str(hf_dir.resolve()), "model_type": model_type, "optimizer": "fresh", "step": 0}
        atomic_write_text(writer.dir / IMPORTED, json.dumps(record, indent=1))
        if tok is not None:
            save_tokenizer(tok, writer.dir)
        writer.write()  # the layer files, the mp_rank files, config.json, then the manifest listing them all
        atomic_write_text(tmp / "latest", tag)
        check_still_new(out, "import")
    return out


def _hf_model_type(hf_dir: Path) -> str:
    """``model_type`` of ``hf_dir/config.json``, refused unless a registered family reads it."""
    if not hf_dir.is_dir():
        raise ConfigError("--hf", "no such directory", str(hf_dir), "pass a transformers model directory")
    cfg_file = hf_dir / "config.json"
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise ConfigError(
            "--hf", "no readable config.json", str(cfg_file), "pass a directory written by save_pretrained or export"
        ) from None
    known = sorted(f.hf_model_type for f in FAMILIES.values())
    if model_type not in known:
        raise ConfigError("--hf", "unsupported architecture", f"model_type={model_type!r}", f"import one of {known}")
    return model_type


def _family_of_hf(model_type: str) -> str:
    return next(f.name for f in FAMILIES.values() if f.hf_model_type == model_type)


def _target_run(config_path: str | Path, tp: int, pp: int, ep: int | None) -> RunConfig:
    """The run of ``config_path`` at tp x pp (dp from its batch split, 1 when that leaves it open) and ``ep`` (None:
    the config's), validated: an ep the folding cannot form is refused here, naming the valid values (a run that
    resolves loads its import at any ep: EP checkpoints do not depend on ep, ``checkpoint/ep_state.py``)."""
    if not Path(config_path).is_file():
        raise ConfigError("--config", "file not found", str(config_path), "pass the run's DeepSpeed config")
    cfg = copy.deepcopy(load_json(config_path))
    parallel = cfg.setdefault("ds_megatron", {}).setdefault("parallel", {})
    parallel.update(tp=tp, pp=pp)
    if ep is not None:
        parallel["ep"] = ep
    prec = precision(cfg)
    if prec not in ("bf16", "fp32"):
        raise ConfigError(
            "--config", "import writes bf16 and fp32 runs", f"{config_path} is {prec}", "import with a bf16 config"
        )
    return resolve(cfg, saved_world(cfg))


class HFSource:
    """A transformers directory read the way the offline writer reads a checkpoint: full fp32 tensors by (HF =
    ds_megatron) name, no optimizer state, counters at step 0.  Construction checks every tensor's presence, dtype
    and shape against the config's model from the files' headers alone, and that any tensor the model has no
    parameter for is a copy of one it keeps (transformers' tied ``lm_head``): nothing is silently dropped."""

    def __init__(self, hf_dir: Path, run: RunConfig, config: ModelConfig):
        self.run, self.layout, self.adapter = run, pipeline_layout(config), StateDictAdapter.of(config)
        self.files, self.shapes = check_hf_tensors(hf_dir, config, "--hf")
        for extra in sorted(set(self.files) - set(self.shapes)):
            self._check_copy(extra)
        self.keys: dict[int, list[str]] = {}
        for name in self.shapes:
            self.keys.setdefault(self.layout.index_of(name), []).append(self.layout.key_in_layer(name))
        self._client = {
            "module": None,  # DeepSpeed's pipeline engine then reads the per-layer files
            "global_steps": 0,
            "global_samples": 0,
            "skipped_steps": 0,
            "dp_world_size": run.dp,
            "mp_world_size": run.tp * run.pp,
            "ds_config": run.ds_config,
            "step": 0,
            "config": run.ds_config,
            "skipped": 0,
            "imported_from": str(hf_dir.resolve()),
        }

    def _check_copy(self, extra: str) -> None:
        """Refuse ``extra`` (a tensor without a parameter) unless it equals a kept tensor of its shape."""
        tensor = self._read(extra)
        if not is_copy(tensor, self.shapes, self._read):
            raise ConfigError(
                "--hf",
                "a tensor the model has no parameter for (it would be lost)",
                f"{extra} {tuple(tensor.shape)}",
                "import a model of the config's family and shape",
            )

    def _read(self, name: str) -> torch.Tensor:
        """The full fp32 tensor in ds_megatron's names and orientation, read from its files."""
        return read_stored(self.adapter, name, self.files[name], _read_one)

    # ---- what the writer reads -------------------------------------------------------------------------------------
    def layer_file(self, idx: int, tp_rank: int) -> dict[str, None]:
        """The keys of layer ``idx``'s file (the writer reads only the keys)."""
        return dict.fromkeys(self.keys[idx])

    def full_shape(self, name: str) -> torch.Size:
        return torch.Size(self.shapes[name])

    def full_weight(self, name: str) -> torch.Tensor:
        return self._read(name).contiguous()

    def full_optimizer_state(self, name: str) -> None:
        return None

    def client(self, mp_index: int = 0) -> dict:
        return self._client


def _read_one(where: HFTensor) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(where.path), "pt") as f:  # closed at once: the file's mapping goes with it
        return f.get_tensor(where.key)


__all__ = ["import_checkpoint"]
