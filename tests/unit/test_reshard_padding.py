"""Fast tier: resharding to a layout with another vocabulary padding, both families, tied and untied, fp32 (ZeRO 0)
and bf16 (DeepSpeed's BF16 optimizer, ZeRO-1), weights and Adam moments, offline and through the merge the on-load
path uses.  The padded size is a multiple of ``vocab_multiple`` x tp (here 100 x tp, for a vocabulary of 1,001:
1,200 rows at tp 2, 1,100 at tp 1), so a checkpoint saved at tp 2 holds 199 padding rows a tp-1 layout has no
room for (Llama 3 70B's 128,256 rows: 128,512 at tp 4, none at tp 2).

The source checkpoints are written in-process by the offline writer itself, from full tensors held in memory (a
stand-in for its reader, ``_FullState``), at tp 2 x pp 1 x dp 2; the launched runs of test_reshard.py check the same
files against DeepSpeed's own."""

from __future__ import annotations

import json
import pathlib
from collections import OrderedDict

import pytest
import torch

from ds_megatron.checkpoint import reshard_offline
from ds_megatron.checkpoint.export import iter_full_parameters
from ds_megatron.checkpoint.layout import pipeline_layout, run_model_config, shard_context
from ds_megatron.checkpoint.reshard import OldCheckpoint
from ds_megatron.config import load_json, resolve
from ds_megatron.model import build_model
from ds_megatron.parallelize import shard_rule
from ds_megatron.tensor_parallel import ShardRule, shard, unshard

ROOT = pathlib.Path(__file__).resolve().parents[2]
TAG = "step00000002"
VOCAB, MULTIPLE = 1001, 100
BF16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}
BF16["zero_allow_untested_optimizer"] = True


def _config(name: str, tie: bool | None, bf16: bool, tp: int = 2, pp: int = 1, dp: int = 2) -> dict:
    cfg = load_json(ROOT / "ds_configs" / name)
    sec = cfg["ds_megatron"]
    sec["model"].update(vocab_size=VOCAB, num_layers=2, hidden_size=32)
    if tie is not None:  # Llama: KV heads split over tp 4 too
        sec["model"].update(tie_word_embeddings=tie, num_kv_heads=4)
    sec["parallel"].update(tp=tp, pp=pp, vocab_multiple=MULTIPLE, sequence_parallel=False)
    sec["data"]["tokenizer"] = f"bpe:{VOCAB}"
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, train_batch_size=4 * dp)
    if bf16:
        cfg.update(BF16)
    return resolve(cfg, tp * pp * dp).ds_config


class _FullState:
    """The read side of a checkpoint (``OldCheckpoint``'s methods the offline writer calls) over full tensors in
    memory: random weights and Adam moments, step 2.  Under bf16 the writer takes the template of the BF16
    optimizer's files from ``tag_dir``, written here with what DeepSpeed's hold besides the partitions."""

    def __init__(self, ds_config: dict, tag_dir: pathlib.Path, bf16: bool):
        self.run = resolve(ds_config, 4)
        self.model_config = run_model_config(self.run)
        self.layout = pipeline_layout(self.model_config)
        self.root, self.tag, self.trust = tag_dir.parent, tag_dir.name, False
        g = torch.Generator().manual_seed(0)
        with torch.device("meta"):
            shapes = {n: p.shape for n, p in build_model(self.model_config).named_parameters()}
        self.weights = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        self.moments = {
            n: {k: torch.rand(s, generator=g) for k in ("exp_avg", "exp_avg_sq")} for n, s in shapes.items()
        }
        self.files = {}
        for name in shapes:
            idx = self.layout.index_of(name)
            self.files.setdefault(idx, OrderedDict())[self.layout.key_in_layer(name)] = None
        groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd, "params": []} for wd in (0.1, 0)]
        self._client = {"ds_config": ds_config, "config": ds_config, "step": 2, "global_steps": 2}
        self._client["optimizer"] = {"state": {}, "param_groups": groups}
        if bf16:
            tag_dir.mkdir(parents=True)
            base = {"state": {g: {"step": torch.tensor(2.0)} for g in range(2)}, "param_groups": groups}
            sd = {"clip_grad": 1.0, "base_optimizer_state": base, "ds_version": "0.19.8"}
            template = {"optimizer_state_dict": sd, "ds_config": ds_config, "ds_version": "0.19.8"}
            torch.save(template, tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")

    def layer_file(self, idx: int, tp_rank: int) -> dict:
        return self.files[idx]

    def client(self, mp_index: int = 0) -> dict:
        return self._client

    def full_shape(self, name: str) -> torch.Size:
        return self.weights[name].shape

    def full_weight(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def full_optimizer_state(self, name: str) -> dict:
        return {"step": torch.tensor(2.0), **self.moments[name]}


def _write_source(tmp_path: pathlib.Path, name: str, tie: bool | None, bf16: bool) -> tuple[_FullState, pathlib.Path]:
    """A complete checkpoint of random full tensors at tp 2 x pp 1 x dp 2 (the vocabulary padded to 1,200 rows)."""
    cfg = _config(name, tie, bf16)
    full = _FullState(cfg, tmp_path / "template" / TAG, bf16)
    src = tmp_path / "src"
    src.mkdir()
    reshard_offline._Writer(full, resolve(cfg, 4), "bf16" if bf16 else "fp32", src, TAG, False).write()
    (src / "latest").write_text(TAG)
    return full, src


VOCAB_TABLES = {"gpt_tiny.json": ["transformer.wte.weight"], "llama_tiny.json": ["model.embed_tokens.weight"]}

CASES = [
    ("gpt_tiny.json", None, False),
    ("gpt_tiny.json", None, True),
    ("llama_tiny.json", True, False),
    ("llama_tiny.json", False, False),
    ("llama_tiny.json", True, True),
    ("llama_tiny.json", False, True),
]


@pytest.mark.parametrize(("name", "tie", "bf16"), CASES, ids=lambda v: str(v))
def test_reshard_to_less_and_more_vocabulary_padding_keeps_weights_and_moments(tmp_path, name, tie, bf16):
    """tp 2 (1,200 rows) -> tp 1 x pp 2 (1,100 rows) -> tp 4 (1,200 rows again, 300 per rank), offline: every
    parameter's full fp32 weight (the master under bf16) and both Adam moments come back bit for bit, the padding
    rows are zero, and export reads the real 1,001 rows.  The on-load path merges each parameter with the same
    ``OldCheckpoint`` and cuts it with the new plan's rule: checked here at tp 1 and tp 4 without an engine."""
    full, src = _write_source(tmp_path, name, tie, bf16)
    source = OldCheckpoint(src, TAG)
    vocab = VOCAB_TABLES[name] + (["lm_head.weight"] if tie is False else [])
    assert source.layer_file(0, 0)[source.layout.key_in_layer(vocab[0])].shape[0] == 1200 // 2
    reshard_offline.reshard_checkpoint(src, tmp_path / "tp1", 1, 2, 1, progress=False)
    reshard_offline.reshard_checkpoint(tmp_path / "tp1", tmp_path / "tp4", 4, 1, 1, progress=False)
    for out, tp, rows in (("tp1", 1, 1100), ("tp4", 4, 1200)):
        ck = OldCheckpoint(tmp_path / out, TAG)
        assert (ck.masters is not None) == bf16
        assert json.loads((tmp_path / out / TAG / "config.json").read_text())["ds_megatron"]["parallel"]["tp"] == tp
        for param in full.weights:
            assert torch.equal(ck.full_weight(param), full.weights[param]), (out, param)
            state = ck.full_optimizer_state(param)
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[k], full.moments[param][k]), (out, param, k)
        for param in vocab:
            idx, key = ck.layout.index_of(param), ck.layout.key_in_layer(param)
            shards = [ck.layer_file(idx, r)[key] for r in range(tp)]
            assert all(s.shape[0] == rows // tp for s in shards), (out, param, [s.shape for s in shards])
            assert torch.count_nonzero(torch.cat(shards)[VOCAB:]) == 0
        exported = dict(iter_full_parameters(tmp_path / out / TAG, ck.model_config, ck.parallel, tp))
        assert all(torch.equal(exported[p], full.weights[p]) for p in vocab)
    # what the on-load path does with each parameter: merge at the old tp, cut with the new layout's rule
    for tp in (1, 4):
        plan = shard_context(source.model_config, source.run, tp)
        for param in vocab:
            rule = shard_rule(param, plan)
            merged = source.full_weight(param)
            assert merged.shape[0] == VOCAB and rule.padded_size == (1100 if tp == 1 else 1200)
            cut = [shard(merged, rule, r, tp) for r in range(tp)]
            assert torch.equal(unshard(cut, rule), full.weights[param])


def test_a_vocabulary_rule_strips_its_own_padding_and_refuses_a_table_larger_than_it():
    rule = ShardRule(dim=0, padded_size=1200, unpadded_size=VOCAB)
    table = torch.randn(VOCAB, 4)
    parts = [shard(table, rule, r, 2) for r in range(2)]
    assert torch.equal(unshard(parts, rule), table)
    with pytest.raises(ValueError, match="exceeds the padded size 1100"):
        shard(torch.cat(parts), ShardRule(dim=0, padded_size=1100, unpadded_size=VOCAB), 0, 1)
