"""The tuner's request as a whole, checked before any search: the cluster's figures, the pins against the model and
the cluster, and the recompute modules.  A request no search can satisfy raises
:class:`ds_megatron.config.ConfigError`, naming the values and the fix.  Standard library only."""

from __future__ import annotations

import difflib
import math

from ds_megatron.config import ConfigError, ModelShape
from ds_megatron.config.ep_rules import check_ep_model, check_num_experts
from ds_megatron.config.numbers import check_finite
from ds_megatron.config.rules import check_batch_split, check_core_attn, check_tp_fits, check_zero_stage
from ds_megatron.config.schema import ATTENTION_KERNELS, RECOMPUTE_MODULES, RECOMPUTE_POLICIES
from ds_megatron.tune.core.spec import FLAGS, Cluster, Pins, check_positive
from ds_megatron.tune.training import cp_rules, schedules
from ds_megatron.tune.training.space import tp_sizes


def validate_request(model: ModelShape, cluster: Cluster, global_batch_size: int, pins: Pins) -> None:
    """Refuse inputs no search can satisfy, naming the values and the fix (the checks run in this order)."""
    gpus, per_node = cluster.num_gpus, cluster.gpus_per_node
    for flag, value, example in (
        ("--gpus", gpus, "8"),
        ("--gpus-per-node", per_node, "8"),
        ("--gpu-memory-gb", cluster.gpu_memory_gb, "80"),
        ("--gpu-peak-tflops", cluster.peak_tflops, "312"),
        ("--intra-node-gbps", cluster.intra_node_gbps, "300"),
        ("--inter-node-gbps", cluster.inter_node_gbps, "25"),
        ("--memory-gbps", cluster.memory_gbps, "2039"),
        ("--global-batch-size", global_batch_size, "1536"),
    ):
        check_positive(flag, value, example)
    check_finite("--efficiency", cluster.efficiency)
    if not 0.0 < cluster.efficiency <= 1.0:
        raise ConfigError("--efficiency", "must be in (0, 1]", f"got {cluster.efficiency}", "pass e.g. 0.8")
    for flag, value in (
        ("--step-overhead-s", cluster.step_overhead_s),
        ("--intra-node-latency-us", cluster.intra_node_latency_s * 1e6),
        ("--inter-node-latency-us", cluster.inter_node_latency_s * 1e6),
    ):
        check_finite(flag, value)
        if value < 0.0:
            raise ConfigError(flag, "must not be negative", f"got {value:g}", "pass e.g. 0")
    if gpus > per_node and gpus % per_node != 0:
        values = f"gpus={gpus}, gpus_per_node={per_node}"
        raise ConfigError("--gpus", "not a whole number of nodes", values, f"pass a multiple of {per_node}")
    pinned = {"--tp": pins.tp, "--pp": pins.pp, "--dp": pins.dp, "--micro-batch-size": pins.micro_batch_size}
    if pins.cp is not None:
        pinned["--cp"] = pins.cp
    if pins.ep is not None:
        pinned["--ep"] = pins.ep
    if pins.expert_tp is not None:
        pinned["--expert-tp"] = pins.expert_tp
    for flag, value in pinned.items():
        if value is not None:
            check_positive(flag, value, "1")
    if pins.expert_tp is not None and not model.num_experts:
        values = f"expert_tp={pins.expert_tp}, family={model.family}"
        raise ConfigError("--expert-tp", "splits routed experts, and this model has none", values, "drop --expert-tp")
    if pins.ep is not None:  # the rules of config.ep_rules that need no layout
        check_ep_model(pins.ep, model.num_experts, model.family)
        if model.num_experts:
            check_num_experts(model.num_experts, pins.ep)
    if pins.tp is not None:
        _check_tp(model, cluster, pins)
    if pins.pp is not None and pins.pp > model.num_layers:
        values, fix = f"pp={pins.pp}, layers={model.num_layers}", f"pass --pp <= {model.num_layers}"
        raise ConfigError("--pp", "more pipeline stages than layers", values, fix)
    dims = (("tp", pins.tp), ("cp", pins.cp), ("pp", pins.pp), ("dp", pins.dp))
    fixed = [(n, v) for n, v in dims if v is not None and (n != "cp" or v > 1)]
    product = math.prod(v for _, v in fixed)
    layout = " x ".join(f"{n}({v})" for n, v in fixed)
    if fixed and gpus % product != 0:
        problem = "the pinned dimensions do not divide the GPU count"
        raise ConfigError("--gpus", problem, f"{layout} = {product}, gpus={gpus}", "change a pin or the GPU count")
    if pins.cp is not None and pins.cp > 1 and len(fixed) == 4 and product != gpus:
        problem, fix = "tp x cp x pp x dp must equal the GPU count", "drop one pin or fix the product"
        raise ConfigError("--gpus", problem, f"{layout} = {product} != {gpus}", fix)
    if len(fixed) == 3 and "cp" not in dict(fixed) and product != gpus:
        problem, fix = "tp x pp x dp must equal the GPU count", "drop one pin or fix the product"
        raise ConfigError("--gpus", problem, f"{layout} = {product} != {gpus}", fix)
    if pins.dp is not None:  # b is searched from 1 unless pinned
        check_batch_split(global_batch_size, pins.micro_batch_size or 1, pins.dp, FLAGS)
    if pins.cp_comm is not None:
        _check_cp_comm(pins)
    if pins.recompute is not None and pins.recompute not in RECOMPUTE_POLICIES:
        raise ConfigError("--recompute", "unknown policy", repr(pins.recompute), f"use one of {RECOMPUTE_POLICIES}")
    if pins.attention is not None and pins.attention not in ATTENTION_KERNELS:
        raise ConfigError("--attention", "unknown kernel", repr(pins.attention), f"use one of {ATTENTION_KERNELS}")
    if pins.recompute_modules is not None:
        _check_modules(pins, model)
    if pins.zero is not None:
        check_zero_stage(pins.zero, pins.pp, FLAGS)
    if pins.schedule is not None:
        _check_schedule(global_batch_size, pins)
    if pins.virtual_stages is not None:
        _check_virtual_stages(model, pins)


def _check_virtual_stages(model: ModelShape, pins: Pins) -> None:
    """A --virtual-stages pin: with a schedule that reads it, at least 2, and cutting the layers into pp x v equal
    model chunks at the pinned pp (or at some pp)."""
    v, staged = pins.virtual_stages, " or ".join(schedules.STAGED)
    if pins.schedule not in (*schedules.STAGED, schedules.ALL):
        values, fix = f"virtual_stages={v}, schedule={pins.schedule}", f"pass --schedule {staged}, or drop it"
        raise ConfigError("--virtual-stages", "only a schedule with virtual stages reads it", values, fix)
    if v < 2:
        values, fix = f"virtual_stages={v}", "pass --virtual-stages 2 or more (one chunk per rank is 1f1b's loop)"
        raise ConfigError("--virtual-stages", "must be at least 2", values, fix)
    layers = model.num_layers
    if pins.pp is not None and layers % (pins.pp * v) != 0:
        valid = [n for n in range(2, layers // pins.pp + 1) if layers % (pins.pp * n) == 0]
        values = f"layers={layers}, pp={pins.pp}, virtual_stages={v}"
        fix = f"choose v from {valid}" if valid else "choose another --pp"
        raise ConfigError("--virtual-stages", "the layers do not split into pp x v equal model chunks", values, fix)
    if pins.pp is None and not any(layers % (pp * v) == 0 for pp in range(2, layers // v + 1)):
        values = f"layers={layers}, virtual_stages={v}"
        raise ConfigError(
            "--virtual-stages", "no pp >= 2 splits the layers into pp x v equal chunks", values, "choose another v"
        )


def _check_schedule(global_batch_size: int, pins: Pins) -> None:
    """A pinned schedule the pins leave no way to run (``schedules.refusal``), with the most micro-batches they allow:
    m = global batch / (dp x b), dp and b at least 1."""
    if pins.schedule == schedules.ALL:
        return
    if pins.schedule not in schedules.SCHEDULES:
        names = ", ".join((*schedules.SCHEDULES, schedules.ALL))
        raise ConfigError("--schedule", "unknown pipeline schedule", repr(pins.schedule), f"use one of {names}")
    if pins.pp is None:  # searched from pp 2 on where pp 1 cannot run it
        return
    most = global_batch_size // ((pins.dp or 1) * (pins.micro_batch_size or 1))
    why = schedules.refusal(pins.schedule, pins.pp, most)
    if why is not None:
        values = f"schedule={pins.schedule}, pp={pins.pp}, m={most}"
        fix = "raise the global batch or lower pp, dp or b" if pins.pp > 1 else "pass --pp 2 or more"
        raise ConfigError("--schedule", why, values, fix)


def _check_cp_comm(pins: Pins) -> None:
    comms = cp_rules.cp_comms()
    if pins.cp_comm not in comms:
        raise ConfigError("--cp-comm", "unknown exchange", repr(pins.cp_comm), f"use one of {', '.join(comms)}")
    if pins.cp in (None, 1):
        values, fix = f"cp_comm={pins.cp_comm}, cp={pins.cp}", "pass --cp N (N > 1) with it, or drop --cp-comm"
        raise ConfigError("--cp-comm", "chooses the exchange of cp > 1 only", values, fix)


def _check_tp(model: ModelShape, cluster: Cluster, pins: Pins) -> None:
    """A --tp pin: it divides what TP splits, a TP group fits in one node, and sequence parallelism has tp > 1."""
    check_tp_fits(model, pins.tp, FLAGS, choices=tp_sizes(model, cluster, Pins())[0])
    node = min(cluster.gpus_per_node, cluster.num_gpus)
    if node % pins.tp != 0:
        values = f"tp={pins.tp}, gpus_per_node={cluster.gpus_per_node}, gpus={cluster.num_gpus}"
        raise ConfigError("--tp", "a TP group must fit inside one node", values, f"choose tp dividing {node}")
    if pins.sequence_parallel and pins.tp == 1:
        fix = "drop --sequence-parallel or pin --tp above 1"
        raise ConfigError("--sequence-parallel", "needs tp > 1", "tp=1", fix)


def _check_modules(pins: Pins, model: ModelShape) -> None:
    """A --recompute-modules pin: known names, each once, under selective recompute, without core_attn for sdpa."""
    modules = pins.recompute_modules or ()
    listed = ",".join(modules)
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        near = difflib.get_close_matches(unknown[0], RECOMPUTE_MODULES, n=1)
        problem = f"unknown module {unknown[0]!r}" + (f" ({near[0]!r}?)" if near else "")
    else:
        problem = "no module" if not modules else "a module named twice" if len(set(modules)) < len(modules) else ""
    if problem:
        fix = f"pass a comma-separated list of {', '.join(RECOMPUTE_MODULES)}"
        raise ConfigError("--recompute-modules", problem, f"got {listed or 'nothing'}", fix)
    if "moe" in modules and not model.num_experts:  # the routed families' experts only
        fix = "drop moe (it recomputes routed experts: a qwen3_moe, mixtral or qwen2_moe model's)"
        raise ConfigError("--recompute-modules", "moe applies to routed experts only", f"got {listed}", fix)
    if pins.recompute not in (None, "selective"):
        values, fix = f"recompute={pins.recompute}, modules={listed}", "drop --recompute or pass --recompute selective"
        raise ConfigError("--recompute-modules", "applies to selective recompute only", values, fix)
    check_core_attn(pins.attention, modules, FLAGS)
