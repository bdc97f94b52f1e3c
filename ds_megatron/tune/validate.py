"""The tuner's request as a whole, checked before any search: the cluster's figures, the pins against the model and
the cluster, and the recompute modules.  A request no search can satisfy raises
:class:`ds_megatron.config.ConfigError`, naming the values and the fix.  Standard library only."""

from __future__ import annotations

import difflib

from ds_megatron.config import ConfigError
from ds_megatron.config.schema import RECOMPUTE_MODULES
from ds_megatron.tune.spec import ATTENTION_CHOICES, RECOMPUTE_CHOICES, Cluster, ModelSpec, Pins, check_positive


def tp_divides_model(model: ModelSpec, tp: int) -> bool:
    """TP splits the query heads, the KV heads and the MLP width: tp must divide all three."""
    return all(n % tp == 0 for n in (model.num_heads, model.num_kv_heads, model.intermediate_size))  # type: ignore[operator]


def tp_choices(model: ModelSpec, node: int) -> list[int]:
    """Tensor-parallel sizes the model and a node of ``node`` GPUs allow."""
    return [t for t in range(1, node + 1) if tp_divides_model(model, t) and node % t == 0]


def validate_request(model: ModelSpec, cluster: Cluster, global_batch_size: int, pins: Pins) -> None:
    """Refuse inputs no search can satisfy, naming the values and the fix."""
    check_positive("--gpus", cluster.num_gpus, "8")
    check_positive("--gpus-per-node", cluster.gpus_per_node, "8")
    check_positive("--gpu-memory-gb", cluster.gpu_memory_gb, "80")
    check_positive("--gpu-peak-tflops", cluster.peak_tflops, "312")
    check_positive("--intra-node-gbps", cluster.intra_node_gbps, "300")
    check_positive("--inter-node-gbps", cluster.inter_node_gbps, "25")
    check_positive("--memory-gbps", cluster.memory_gbps, "2039")
    check_positive("--global-batch-size", global_batch_size, "1536")
    if not 0.0 < cluster.efficiency <= 1.0:
        raise ConfigError("--efficiency", "must be in (0, 1]", f"got {cluster.efficiency}", "pass e.g. 0.8")
    for flag, value in (
        ("--step-overhead-s", cluster.step_overhead_s),
        ("--intra-node-latency-us", cluster.intra_node_latency_s * 1e6),
        ("--inter-node-latency-us", cluster.inter_node_latency_s * 1e6),
    ):
        if value < 0.0:
            raise ConfigError(flag, "must not be negative", f"got {value:g}", "pass e.g. 0")
    if cluster.num_gpus > cluster.gpus_per_node and cluster.num_gpus % cluster.gpus_per_node != 0:
        raise ConfigError(
            "--gpus",
            "not a whole number of nodes",
            f"gpus={cluster.num_gpus}, gpus_per_node={cluster.gpus_per_node}",
            f"pass a multiple of {cluster.gpus_per_node}",
        )
    for flag, value in (
        ("--tp", pins.tp),
        ("--pp", pins.pp),
        ("--dp", pins.dp),
        ("--micro-batch-size", pins.micro_batch_size),
    ):
        if value is not None:
            check_positive(flag, value, "1")
    if pins.tp is not None:
        if model.num_heads % pins.tp != 0:
            node = min(cluster.gpus_per_node, cluster.num_gpus)
            raise ConfigError(
                "--tp",
                "num_heads not divisible by tp",
                f"num_heads={model.num_heads}, tp={pins.tp}",
                f"choose tp from {tp_choices(model, node)}",
            )
        for name, value in (("num_kv_heads", model.num_kv_heads), ("intermediate_size", model.intermediate_size)):
            if value % pins.tp != 0:  # type: ignore[operator]
                node = min(cluster.gpus_per_node, cluster.num_gpus)
                what = "the KV heads like the query heads" if name == "num_kv_heads" else "the MLP width"
                raise ConfigError(
                    "--tp",
                    f"{name} not divisible by tp",
                    f"{name}={value}, tp={pins.tp}",
                    f"choose tp from {tp_choices(model, node)} (TP splits {what})",
                )
        node = min(cluster.gpus_per_node, cluster.num_gpus)
        if node % pins.tp != 0:
            raise ConfigError(
                "--tp",
                "a TP group must fit inside one node",
                f"tp={pins.tp}, gpus_per_node={cluster.gpus_per_node}, gpus={cluster.num_gpus}",
                f"choose tp dividing {node}",
            )
        if pins.sequence_parallel and pins.tp == 1:
            raise ConfigError(
                "--sequence-parallel", "needs tp > 1", "tp=1", "drop --sequence-parallel or pin --tp above 1"
            )
    if pins.pp is not None and pins.pp > model.num_layers:
        raise ConfigError(
            "--pp",
            "more pipeline stages than layers",
            f"pp={pins.pp}, layers={model.num_layers}",
            f"pass --pp <= {model.num_layers}",
        )
    fixed = [(n, v) for n, v in (("tp", pins.tp), ("pp", pins.pp), ("dp", pins.dp)) if v is not None]
    product = 1
    for _, value in fixed:
        product *= value
    if fixed and cluster.num_gpus % product != 0:
        desc = " x ".join(f"{n}({v})" for n, v in fixed)
        raise ConfigError(
            "--gpus",
            "the pinned dimensions do not divide the GPU count",
            f"{desc} = {product}, gpus={cluster.num_gpus}",
            "change a pin or the GPU count",
        )
    if len(fixed) == 3 and product != cluster.num_gpus:
        raise ConfigError(
            "--gpus",
            "tp x pp x dp must equal the GPU count",
            f"tp({pins.tp}) x pp({pins.pp}) x dp({pins.dp}) = {product} != {cluster.num_gpus}",
            "drop one pin or fix the product",
        )
    if pins.dp is not None and global_batch_size % pins.dp != 0:
        raise ConfigError(
            "--global-batch-size",
            "not divisible by dp",
            f"{global_batch_size} % {pins.dp} != 0",
            f"pass a multiple of {pins.dp}",
        )
    if pins.recompute is not None and pins.recompute not in RECOMPUTE_CHOICES:
        raise ConfigError("--recompute", "unknown policy", repr(pins.recompute), f"use one of {RECOMPUTE_CHOICES}")
    if pins.attention is not None and pins.attention not in ATTENTION_CHOICES:
        raise ConfigError("--attention", "unknown kernel", repr(pins.attention), f"use one of {ATTENTION_CHOICES}")
    if pins.recompute_modules is not None:
        _check_modules(pins)
    if pins.zero is not None and pins.zero not in (0, 1):
        raise ConfigError(
            "--zero", "DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only", f"got {pins.zero}", "pass 0 or 1"
        )


def _check_modules(pins: Pins) -> None:
    """A --recompute-modules pin: known names, each once, under selective recompute, without core_attn for sdpa."""
    modules = pins.recompute_modules or ()
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        near = difflib.get_close_matches(unknown[0], RECOMPUTE_MODULES, n=1)
        problem = f"unknown module {unknown[0]!r}" + (f" ({near[0]!r}?)" if near else "")
    else:
        problem = "no module" if not modules else "a module named twice" if len(set(modules)) < len(modules) else ""
    if problem:
        raise ConfigError(
            "--recompute-modules",
            problem,
            f"got {','.join(modules) or 'nothing'}",
            f"pass a comma-separated list of {', '.join(RECOMPUTE_MODULES)}",
        )
    if pins.recompute not in (None, "selective"):
        raise ConfigError(
            "--recompute-modules",
            "applies to selective recompute only",
            f"recompute={pins.recompute}, modules={','.join(modules)}",
            "drop --recompute or pass --recompute selective",
        )
    if pins.attention == "sdpa" and "core_attn" in modules:
        raise ConfigError(
            "--recompute-modules",
            "core_attn recomputes the s x s attention core, which sdpa never stores",
            f"modules={','.join(modules)}, attention=sdpa",
            "drop core_attn (e.g. --recompute-modules mlp_act,layernorm) or pin --attention eager",
        )
