"""What the tuner writes: the JSON of every candidate (``--json``) and the winner's config (``--write-config``; a
GPT's or a Llama's: the family's fields are written so that the config resolves to the same shape).  Neither
replaces an existing file unless ``--force`` is given, and neither creates a directory (a mistyped one would hide
the file where nobody looks): both are checked before any work (``check_output``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ds_megatron.config.rules import GRAD_REDUCE_BUCKET_ELEMENTS
from ds_megatron.config.schema import DEFAULT_SELECTIVE_MODULES, DEFAULT_VOCAB_MULTIPLE
from ds_megatron.config.shape import DEFAULT_ROPE_THETA, SHAPE_FIELDS
from ds_megatron.model import family_of
from ds_megatron.pipeline_parallel.schedules import DEFAULT as DEFAULT_SCHEDULE
from ds_megatron.tune.core import memory_model
from ds_megatron.tune.core.cli import write_output
from ds_megatron.tune.core.memory_model import total_param_count
from ds_megatron.tune.training import time_model
from ds_megatron.tune.training.ep_rules import written_precision
from ds_megatron.tune.training.search import Evaluation, SearchResult

MODEL_KEYS = ("size", "family", *SHAPE_FIELDS, "vocab_size", "seq_length")  # the JSON's model, in this order
# A config's model section, in this order: every family's fields, then a Llama's.
WRITTEN_SHAPE = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length")
LLAMA_WRITTEN = ("family", "num_kv_heads", "intermediate_size", "tie_word_embeddings", "dropout")


def to_json(result: SearchResult) -> dict:
    """Every candidate with its settings, memory breakdown and prediction; every rejected family with its reason."""
    m, cl = result.model, result.cluster
    return {
        "model": {**{key: getattr(m, key) for key in MODEL_KEYS}, "parameters": total_param_count(m)},
        "cluster": dataclasses.asdict(cl),  # in Cluster's field order
        "global_batch_size": result.global_batch_size,
        "search_seconds": result.elapsed_s,
        "winner": result.winner.as_dict() if result.winner else None,
        "common_configuration": result.common.as_dict() if result.common else None,
        "common_configuration_note": result.common_note,
        "speedup_over_common": result.speedup,
        "candidates": [e.as_dict() for e in result.evaluations],
        "rejected": [r.as_dict() for r in result.rejections],
        "assumptions": {
            "weight_bytes_per_param": memory_model.WEIGHT_BYTES,
            "grad_bytes_per_param": memory_model.GRAD_BYTES,
            "optimizer_bytes_per_param": memory_model.OPTIMIZER_BYTES,
            "activation_bytes": memory_model.ACT_BYTES,
            "dropout_mask_bytes": memory_model.MASK_BYTES,
            "memory_margin_fraction": memory_model.MARGIN_FRACTION,
            "memory_margin_bytes": memory_model.MARGIN_BYTES,
            "vocab_multiple": DEFAULT_VOCAB_MULTIPLE,
            # the overlapped data-parallel reduction's bucket (time_model.dp_comm_s; 0 reductions hidden when off)
            "dp_overlap_bucket_elements": GRAD_REDUCE_BUCKET_ELEMENTS,
            "grad_reduce_bytes_per_param": time_model.GRAD_REDUCE_BYTES,
            "intra_node_latency_s": cl.intra_node_latency_s,
            "inter_node_latency_s": cl.inter_node_latency_s,
            "attention": {
                "eager": "s x s softmax materialised (the paper's setting); its elementwise passes over the scores "
                "run at the HBM bandwidth",
                "sdpa": "fused kernel (CUDA flash / memory-efficient): no s x s term stored, fp32 log-sum-exp instead",
                "eager_score_bytes_forward": time_model.EAGER_FORWARD_BYTES,
                "eager_score_bytes_backward": time_model.EAGER_BACKWARD_BYTES,
            },
            "recomputed_elementwise_bytes": {  # per element of each pass's output, by family and module
                family: {module: time_model.pass_bytes(ops) for module, ops in passes.items()}
                for family, passes in time_model.RECOMPUTED_PASSES.items()
            },
        },
    }


def ds_config(result: SearchResult, e: Evaluation) -> dict:
    """A ds_configs-style JSON for ``e``: DeepSpeed's keys plus the "ds_megatron" section."""
    c, m = e.candidate, result.model
    model = {"size": m.size} if m.size else {}
    model.update({key: getattr(m, key) for key in WRITTEN_SHAPE})
    # never sdpa with core_attn recomputed: the search does not generate it, the loader refuses it
    model["attention"] = c.attention
    if not family_of(m).fixed_kv_and_width:  # the loader refuses the llama-only fields for a GPT
        # dropout: what the memory model assumed (the loader's default, 0.1, is GPT's)
        model.update({key: getattr(m, key) for key in LLAMA_WRITTEN})
        if not m.size:  # a named size brings its own; a custom or changed shape keeps its origin's
            if m.rope_theta != DEFAULT_ROPE_THETA:
                model["rope_theta"] = m.rope_theta
            if m.rope_scaling:
                model["rope_scaling"] = dict(m.rope_scaling)
    recompute = {"policy": c.recompute, "num_layers": c.recompute_layers, "method": c.recompute_method}
    if c.recompute == "selective" and c.recompute_modules != DEFAULT_SELECTIVE_MODULES:
        recompute["modules"] = list(c.recompute_modules)
    return {
        "train_batch_size": result.global_batch_size,
        "train_micro_batch_size_per_gpu": c.micro_batch_size,
        "gradient_accumulation_steps": c.num_micro_batches,
        "gradient_clipping": 1.0,
        **written_precision(c.zero),  # bf16, fp32 gradient accumulation, the candidate's ZeRO stage
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": m.learning_rate, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "ds_megatron": {
            "model": model,
            "parallel": {
                "tp": c.tp,
                **({"cp": c.cp, "cp_comm": c.cp_comm} if c.cp > 1 else {}),  # a cp 1 config is written as before
                "pp": c.pp,
                "sequence_parallel": c.sequence_parallel,
                **({"ep": c.ep} if c.ep is not None else {}),  # a routed family's, 1 included
                # only where it differs from the loader's resolution (tp at ep 1, 1 at ep > 1): split at ep > 1
                **({"expert_tp": c.expert_tp} if c.expert_tp is not None else {}),
                # a 1f1b config is written as before the tuner knew schedules (1f1b is the loader's default)
                **({"pipeline_schedule": c.schedule} if c.schedule != DEFAULT_SCHEDULE.name else {}),
                **({"virtual_stages": c.virtual_stages} if c.virtual_stages is not None else {}),
                # written only when uneven (tune.training.layout): the loader's default is the even split
                **({"pipeline_layout": list(c.pipeline_layout)} if c.pipeline_layout is not None else {}),
                **({} if c.overlap_grad_reduce else {"overlap_grad_reduce": False}),  # on: the loader's default
            },
            "recompute": recompute,
        },
    }


def write_config(result: SearchResult, path: str | Path, chosen: Evaluation | None = None, force: bool = False) -> str:
    """Write ``chosen`` (default: the winner) as a config to ``path`` (replacing a file there only with ``force``);
    returns the launch command."""
    chosen = chosen or result.winner
    if chosen is None:
        raise ValueError("no configuration fits, so there is no config to write")
    write_output("--write-config", path, json.dumps(ds_config(result, chosen), indent=2) + "\n", force)
    return f"deepspeed --hostfile hostfile recipes/train_gpt.py --deepspeed_config {path}"
