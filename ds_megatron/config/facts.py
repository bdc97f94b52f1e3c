"""Facts read off a DeepSpeed config in one place each: its precision, its ZeRO stage, its gradient accumulation
dtype, which optimizer wrapper DeepSpeed puts around ours, the (tp, pp, dp) layout a saved config was resolved
for, which pipeline stages each of its ranks held, and whether a checkpoint must be resharded to resume under
another config."""

from __future__ import annotations

from ds_megatron.config.schema import DEFAULT_PARTITION_METHOD, pipeline_schedule
from ds_megatron.pipeline_parallel.schedules import DEFAULT as DEFAULT_SCHEDULE


def precision(ds_config: dict) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"`` (DeepSpeed's ``bf16.enabled`` / ``fp16.enabled``)."""
    if (ds_config.get("bf16") or {}).get("enabled"):
        return "bf16"
    if (ds_config.get("fp16") or {}).get("enabled"):
        return "fp16"
    return "fp32"


def zero_stage(ds_config: dict) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


# DeepSpeed's spellings of data_types.grad_accum_dtype (its DtypeEnum), by precision.
_DTYPE_NAMES = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
}
BF16_OPTIMIZER, ZERO_OPTIMIZER, FP16_OPTIMIZER = "BF16", "ZeRO", "FP16"


def grad_accum_dtype(ds_config: dict) -> str:
    """``"fp32"``, ``"bf16"`` or ``"fp16"``: the dtype gradients accumulate in (``data_types.grad_accum_dtype``;
    unset: the model's precision, as DeepSpeed takes it).  An unknown spelling is returned as written."""
    value = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    if value is None:
        return precision(ds_config)
    return next((p for p, names in _DTYPE_NAMES.items() if str(value).lower() in names), str(value))


def optimizer_wrapper(ds_config: dict) -> str | None:
    """The wrapper DeepSpeed's engine puts around the optimizer of a pipeline run (its own choice, made in
    ``DeepSpeedEngine._do_optimizer_sanity_check``), or None for plain fp32 with ZeRO 0 (the optimizer itself):
    ``"BF16"``, the BF16 optimizer (bf16 with ZeRO 1, fp32 gradient accumulation and no CPU offload; bf16 with
    ZeRO 0 and bf16 accumulation); ``"ZeRO"``, the ZeRO optimizer (every other ZeRO >= 1 run, fp32 and fp16
    included; its files also hold its loss scaler); ``"FP16"`` (fp16 with ZeRO 0).  DeepSpeed builds no other mix
    of precision and accumulation dtype at ZeRO 0 (the config check refuses them before launch)."""
    prec, accum, stage = precision(ds_config), grad_accum_dtype(ds_config), zero_stage(ds_config)
    if stage > 0:
        offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
        bf16_optimizer = (prec, accum, stage) == ("bf16", "fp32", 1) and offload != "cpu"
        return BF16_OPTIMIZER if bf16_optimizer else ZERO_OPTIMIZER
    if prec == "fp32":
        return None
    return BF16_OPTIMIZER if prec == "bf16" else FP16_OPTIMIZER


def deepspeed_wraps_optimizer(ds_config: dict) -> bool:
    """bf16, fp16 and ZeRO replace the optimizer's parameters by flat fp32 partitions held in DeepSpeed's wrapper
    (which also computes the gradient norm and clips); plain fp32 with ZeRO 0 keeps the model's parameters."""
    return optimizer_wrapper(ds_config) is not None


def saved_layout(ds_config: dict) -> tuple[int, int, int]:
    """(tp, pp, dp) a resolved config (as saved with every checkpoint) was trained at; dp from its batch arithmetic
    (``train_batch_size = micro x accumulation x dp``)."""
    par = (ds_config.get("ds_megatron") or {}).get("parallel") or {}
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    micro, gas, glob = (
        ds_config.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    )
    dp = glob // (micro * gas) if micro and gas and glob else 1
    return tp, pp, dp


def layout_text(tp: int, cp: int, pp: int, dp: int, with_cp: bool | None = None) -> str:
    """``tp T x pp P x dp D`` for messages, with ``x cp C`` after tp where context parallelism is in play (by
    default when cp > 1; a message comparing two layouts passes whether either has it)."""
    cp_part = f" x cp {cp}" if (cp > 1 if with_cp is None else with_cp) else ""
    return f"tp {tp}{cp_part} x pp {pp} x dp {dp}"


def saved_cp(ds_config: dict) -> int:
    """The context-parallel size a resolved config was trained at (1 when unset)."""
    return ((ds_config.get("ds_megatron") or {}).get("parallel") or {}).get("cp", 1)


def saved_ep(ds_config: dict) -> int:
    """The expert-parallel size a resolved config was trained at (1 when unset).  Its checkpoints do not depend on
    it (an EP run saves its experts as an ep 1 run holds them): it is a fact of the run, not of the files."""
    return ((ds_config.get("ds_megatron") or {}).get("parallel") or {}).get("ep", 1)


def saved_schedule(ds_config: dict) -> str:
    """The pipeline schedule a config ran (``ds_megatron.parallel.pipeline_schedule``; before the key, 1F1B)."""
    return ((ds_config.get("ds_megatron") or {}).get("parallel") or {}).get("pipeline_schedule", DEFAULT_SCHEDULE.name)


def saved_world(ds_config: dict) -> int:
    """The number of processes a resolved config was trained on: tp x cp x pp x dp (what ``resolve`` needs to
    validate it again)."""
    tp, pp, dp = saved_layout(ds_config)
    return tp * saved_cp(ds_config) * pp * dp


def data_axis(ds_config: dict) -> int:
    """The size of DeepSpeed's data axis in a resolved config's run: dp x cp (context-parallel ranks are folded into
    it), which is the number of partitions ZeRO-1 and the BF16 optimizer cut their flat state into, and the number of
    ``zero_pp_rank_<d>`` files per model-parallel rank."""
    return saved_layout(ds_config)[2] * saved_cp(ds_config)


def stage_placement(ds_config: dict) -> tuple[tuple[int, ...], ...] | str:
    """Which of the pipeline's stages each pipeline rank of a resolved config's run holds, rank by rank (its
    schedule's ``PipelineSchedule.stages_of``; so also how many stages a rank holds): 1F1B, ZB-H1 and ZB-H2 put
    stage r on rank r, DualPipeV (with or without deferred weight gradients) stages r and 2p-1-r, interleaved 1F1B
    stages r, r + p, ... (as many as the record's ``per_rank`` reads off the saved parallel section).  A schedule
    this version does not know is returned by name (equal only to itself)."""
    name, pp = saved_schedule(ds_config), saved_layout(ds_config)[1]
    parallel = (ds_config.get("ds_megatron") or {}).get("parallel") or {}
    try:
        schedule = pipeline_schedule(name)
    except KeyError:
        return name
    return tuple(schedule.stages_of(rank, pp, schedule.per_rank(parallel)) for rank in range(pp))


def stage_split(ds_config: dict) -> tuple[str, tuple[int, ...] | None]:
    """How a resolved config's run cut its layers into pipeline stages, as written: (partition_method,
    pipeline_layout).  Two runs with the same split hold the same layers per stage; a written-out layout equal to
    the balanced split counts as another split (resuming across it reshards: the same result, a slower load)."""
    parallel = (ds_config.get("ds_megatron") or {}).get("parallel") or {}
    layout = parallel.get("pipeline_layout")
    return parallel.get("partition_method", DEFAULT_PARTITION_METHOD), None if layout is None else tuple(layout)


def needs_resharding(saved: dict, now: dict) -> bool:
    """Whether a checkpoint saved with config ``saved`` must be resharded to resume with config ``now``: another
    tp or pp always; another placement of the pipeline's stages on its ranks (``stage_placement``: 1F1B <-> DualPipeV
    moves layers between ranks, so the optimizer files' contents, while 1F1B, ZB-H1 and ZB-H2 build the same module
    with the same layers per rank, as do DualPipeV and its zero-bubble variant, whose files DeepSpeed's own load
    reads as they are); another split of the layers into stages (``stage_split``: a rank's optimizer files then
    hold other layers, though DeepSpeed's per-layer weight files do not change); another data axis too when either
    run partitions its optimizer state over it (bf16, fp16 or ZeRO: the flat partitions are cut per rank of
    DeepSpeed's data axis, which holds dp x cp ranks, so cp 2 x dp 1 and cp 1 x dp 2 hold the same partitions)."""
    (tp0, pp0, _), (tp1, pp1, _) = saved_layout(saved), saved_layout(now)
    partitioned = deepspeed_wraps_optimizer(saved) or deepspeed_wraps_optimizer(now)
    moved = (tp0, pp0) != (tp1, pp1) or stage_placement(saved) != stage_placement(now)
    moved = moved or stage_split(saved) != stage_split(now)
    return moved or (partitioned and data_axis(saved) != data_axis(now))
