"""What the tuner is asked about: the model, the cluster, the pinned dimensions, and one candidate configuration.
Model and cluster are checked as they are built (the request in ``tune.training.validate``); bad input raises
:class:`ds_megatron.config.ConfigError`.  Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

from ds_megatron.config import ConfigError, ModelSection
from ds_megatron.config.ep_rules import resolved_expert_tp
from ds_megatron.config.errors import nearest
from ds_megatron.config.numbers import check_finite
from ds_megatron.config.schema import DEFAULT_SELECTIVE_MODULES, RECOMPUTE_MODULES
from ds_megatron.config.shape import ModelShape, Vocabulary, resolve_shape
from ds_megatron.config.sizes import named
from ds_megatron.model import DEFAULT_FAMILY, FAMILIES
from ds_megatron.pipeline_parallel.schedules import DEFAULT as DEFAULT_SCHEDULE
from ds_megatron.tune.core.gpus import DEFAULT_GPU, GPUS

SDPA_CORE_ATTN_REASON = (
    "recomputing core_attn with sdpa is not offered: it checkpoints the s x s attention core, which the sdpa kernel "
    "never stores, so it would save nothing and cost a recompute (the config loader refuses it); sdpa is searched "
    "with selective recompute of mlp_act and layernorm instead"
)

# The ceiling of the matmul-efficiency curve (tune.core.matmuls), the time model's one free parameter, fitted by
# calibration.fit_time_model to two published A100 step times (paper_runs.FIT_ROWS: 0.8687); the six other rows of
# the paper's table are then predicted within 6.2% (docs/tuner.md, "Time model").  Fit yours with --empirical.
DEFAULT_EFFICIENCY = 0.869
INTRA_NODE_LATENCY_S = 20e-6  # per collective or transfer inside a node (NCCL launch + ring set-up)
INTER_NODE_LATENCY_S = 50e-6  # per collective or transfer across nodes


@dataclass(frozen=True)
class Cluster:
    """The machines.  Bandwidths are per GPU, in GB/s (10^9 bytes per second, one direction)."""

    num_gpus: int
    gpus_per_node: int
    gpu_memory_gb: float  # usable device memory in GiB (an "80 GB" A100 or H100 has 80 GiB)
    peak_tflops: float  # dense bf16 peak per GPU (A100: 312)
    intra_node_gbps: float = 300.0  # NVLink (A100: 600 GB/s both directions = 300 each way)
    inter_node_gbps: float = 25.0  # InfiniBand share per GPU (one 200 Gb/s HDR NIC per GPU = 25 GB/s)
    memory_gbps: float = 2039.0  # HBM bandwidth (A100 80GB: 2,039 GB/s); the eager kernel's s x s passes run at it
    gpu: str | None = None  # the preset the figures came from (tune.core.gpus), with any flags that changed it
    efficiency: float = DEFAULT_EFFICIENCY  # ceiling of the matmul-efficiency curve (core.matmuls; calibrate fits)
    intra_node_latency_s: float = INTRA_NODE_LATENCY_S  # fixed cost of each collective or send inside a node
    inter_node_latency_s: float = INTER_NODE_LATENCY_S  # the same across nodes
    # Fixed time per optimizer step outside the model (optimizer update, Python and launch overheads); 0 unless
    # fitted by calibration.fit_time_model from short runs (tune --empirical) or passed as --step-overhead-s.
    step_overhead_s: float = 0.0
    # The inference model's decode reads (weights, KV cache) run at this fraction of memory_gbps; its matmuls at
    # ``efficiency`` of the peak of their precision.  1 here (the raw bandwidth); the inference command line applies
    # the fitted value (tune.inference.engines.inference_cluster).
    bandwidth_efficiency: float = 1.0
    fp8_peak_tflops: float | None = None  # dense fp8 Tensor Core peak (None: none, fp8 matmuls run at the bf16 peak)
    int8_peak_tflops: float | None = None  # dense int8 Tensor Core peak in TOPS (None: none)

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def matmul_peak_flops(self, dtype: str) -> float:
        """The peak a weight matmul runs at with weights (and activations) in ``dtype``: fp8 and int8 at their own
        Tensor Core peaks where the GPU has them (W8A8, as serving engines run such checkpoints), anything else
        (int4 is weight-only, dequantized to bf16) at the bf16 peak."""
        own = {"fp8": self.fp8_peak_tflops, "int8": self.int8_peak_tflops}.get(dtype)
        return max(own or 0.0, self.peak_tflops) * 1e12


@dataclass(frozen=True)
class Pins:
    """Dimensions fixed by the user (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    sequence_parallel: bool | None = None
    recompute: str | None = None  # "none" | "selective" | "full"
    zero: int | None = None  # 0 | 1
    attention: str | None = None  # "eager" | "sdpa"
    recompute_modules: tuple[str, ...] | None = None  # selective's modules, in any order (implies "selective")
    cp: int | None = None  # context-parallel size (None: searched for long sequences, space.CP_MIN_SEQ_LENGTH)
    cp_comm: str | None = None  # "ring" | "a2a"
    schedule: str | None = None  # a schedule name, or "all" (None: training.schedules.DEFAULT_SCHEDULES)
    virtual_stages: int | None = None  # stages per rank of a schedule whose record has a stages setting (v)
    ep: int | None = None  # expert-parallel size of a routed family (None: searched over the values its rules accept)
    expert_tp: int | None = None  # ranks each routed expert's width is split over, 1 or tp (None: both searched)


def ordered_modules(modules: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``modules`` in RECOMPUTE_MODULES order: one spelling per set, so that equal sets compare equal."""
    return tuple(m for m in RECOMPUTE_MODULES if m in modules)


@dataclass(frozen=True)
class Candidate:
    """One training configuration: layout, micro-batching, recompute policy and ZeRO stage."""

    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    micro_batch_size: int  # b
    num_micro_batches: int  # m = global batch / (dp * b), the gradient accumulation steps
    recompute: str  # "none" | "selective" | "full"
    recompute_layers: int = 1  # full only: chunk size (uniform) or recomputed blocks per stage (block)
    recompute_method: str = "uniform"  # full only: "uniform" | "block"
    zero: int = 1
    attention: str = "eager"  # "eager" | "sdpa" (sdpa never with core_attn recomputed)
    # What selective recompute recomputes (empty: DEFAULT_SELECTIVE_MODULES); stored in RECOMPUTE_MODULES order,
    # and emptied for the other policies (so that dataclasses.replace(c, recompute="full") stays valid).
    recompute_modules: tuple[str, ...] = ()
    # Context parallelism: each sequence split over cp ranks (world = tp x cp x pp x dp; dp counts replicas, so
    # m = global batch / (dp x b)), exchanging K/V around a ring or by all-to-all over heads ("a2a").
    cp: int = 1
    cp_comm: str = "ring"
    # The pipeline schedule (ds_megatron.parallel.pipeline_schedule; tune.training.schedules models each).
    schedule: str = DEFAULT_SCHEDULE.name
    # Model chunks per pipeline rank (ds_megatron.parallel.virtual_stages) of a schedule whose record has a stages
    # setting (interleaving's v); None for the others (Schedule.per_rank reads the field by the setting's name).
    virtual_stages: int | None = None
    # Blocks per stage in model-chunk order (ds_megatron.parallel.pipeline_layout) when the tuner moves blocks off
    # the last (or first) stage to balance the output layer's cost (tune.training.layout); None: the even split.
    pipeline_layout: tuple[int, ...] | None = None
    # Expert parallelism (ds_megatron.parallel.ep) of a routed family: each routed block's experts split over EP
    # groups of ep ranks (config.ep_rules), whole experts per rank; None for a dense model (nothing to split).
    ep: int | None = None
    # Expert tensor parallelism (ds_megatron.parallel.expert_tp): each routed expert's width F split over the tp
    # ranks at ep > 1 (expert_tp = tp; the EP group then spans the cp x dp ranks of one tp index).  None: the run's
    # default resolution (config.ep_rules.resolved_expert_tp: tp at ep 1, whole experts at ep > 1); a value equal
    # to it is stored as None, so that one layout has one spelling.
    expert_tp: int | None = None
    # ds_megatron.parallel.overlap_grad_reduce: the data-parallel reduction started per bucket during the step's last
    # backward work (the default; the time model hides part of it: tune.training.time_model.dp_comm_s).  The tuner's
    # configs are bf16 on DeepSpeed's BF16 optimizer (ZeRO 0 or 1) with fp32 reduction, which the overlap always
    # takes; False describes a run made with the setting off (calibrating against one, say).
    overlap_grad_reduce: bool = True

    def __post_init__(self) -> None:
        modules = tuple(self.recompute_modules)
        if set(modules) - set(RECOMPUTE_MODULES):
            raise ValueError(f"recompute_modules must be among {RECOMPUTE_MODULES}, got {modules}")
        if self.recompute != "selective":
            modules = ()
        else:
            modules = ordered_modules(modules or DEFAULT_SELECTIVE_MODULES)
        object.__setattr__(self, "recompute_modules", modules)
        if self.expert_tp is not None and self.expert_tp == resolved_expert_tp(None, self.ep_size, self.tp):
            object.__setattr__(self, "expert_tp", None)

    @property
    def ep_size(self) -> int:
        """The expert-parallel size the models compute with: 1 for a dense model."""
        return self.ep or 1

    @property
    def expert_tp_size(self) -> int:
        """Ranks each routed expert's width is split over (``config.ep_rules.resolved_expert_tp``)."""
        return resolved_expert_tp(self.expert_tp, self.ep_size, self.tp)

    @property
    def experts_split_at_ep(self) -> bool:
        """Whether the experts are split over TP at ep > 1 (expert_tp = tp > 1): the tokens gathered over TP as
        the dense MLP's, F / t of each of E / ep experts per rank, the EP group over one tp index's ranks."""
        return self.ep_size > 1 and self.expert_tp_size > 1

    def recompute_label(self) -> str:
        """``none``, ``selective`` (core attention, the default), ``selective[mlp_act,layernorm]``, ``full/block/1``."""
        if self.recompute == "full":
            return f"full/{self.recompute_method}/{self.recompute_layers}"
        if self.recompute == "selective" and self.recompute_modules != DEFAULT_SELECTIVE_MODULES:
            return f"selective[{','.join(self.recompute_modules)}]"
        return self.recompute

    def settings(self) -> dict:
        """The JSON record: the full-recompute fields None under the other policies, the modules under selective."""
        full = self.recompute == "full"
        layout = ("tp", "pp", "dp", "sequence_parallel", "micro_batch_size", "num_micro_batches", "recompute")
        return {
            **{key: getattr(self, key) for key in layout[:3]},
            **({"ep": self.ep} if self.ep is not None else {}),  # a routed family's layout names its ep (1 too)
            # and how its experts are split (resolved: tp at ep 1, 1 or tp at ep > 1)
            **({"expert_tp": self.expert_tp_size} if self.ep is not None else {}),
            **{key: getattr(self, key) for key in layout[3:]},
            "recompute_layers": self.recompute_layers if full else None,
            "recompute_method": self.recompute_method if full else None,
            "recompute_modules": list(self.recompute_modules) if self.recompute == "selective" else None,
            "zero_stage": self.zero,
            "attention": self.attention,
            # only with cp > 1: a cp 1 record is what it was before the tuner knew cp
            **({"cp": self.cp, "cp_comm": self.cp_comm} if self.cp > 1 else {}),
            # only off 1f1b: a 1f1b record is what it was before the tuner knew schedules
            **({"pipeline_schedule": self.schedule} if self.schedule != DEFAULT_SCHEDULE.name else {}),
            **({"virtual_stages": self.virtual_stages} if self.virtual_stages is not None else {}),
            **({"pipeline_layout": list(self.pipeline_layout)} if self.pipeline_layout is not None else {}),
            # only when off: a record with the overlap on (the default) is what it was before the tuner modelled it
            **({} if self.overlap_grad_reduce else {"overlap_grad_reduce": False}),
        }


def check_positive(setting: str, value: int | float | None, example: str) -> None:
    """Refuse a count or rate that is not positive, or not finite (the Python API's values; the flags refuse nan and
    inf as they are parsed), naming the flag."""
    check_finite(setting, value)
    if value is None or value <= 0:
        raise ConfigError(setting, "must be positive", f"got {value}", f"pass e.g. {setting} {example}")


# The tuner's flags for the model's fields, so that a shape error names the flag to change.
FLAGS = Vocabulary(
    prefix="",
    refs={
        "size": "--model",
        "family": "--family",
        "num_layers": "--layers",
        "hidden_size": "--hidden",
        "num_heads": "--heads",
        "vocab_size": "--vocab",
        "seq_length": "--seq-length",
        "num_kv_heads": "--kv-heads",
        "intermediate_size": "--intermediate-size",
        "tie_word_embeddings": "--tie-word-embeddings",
        # named by config.rules
        "zero": "--zero",
        "tp": "--tp",
        "recompute_modules": "--recompute-modules",
        "attention": "--attention",
        "batch_split": "--global-batch-size",
    },
    nouns={
        "num_heads": "the number of heads",
        "train_batch_size": "--global-batch-size",
        "train_micro_batch_size_per_gpu": "--micro-batch-size",
    },
)


def build_model_shape(
    model: str | None,
    layers: int | None,
    hidden: int | None,
    heads: int | None,
    vocab: int | None,
    seq_length: int | None,
    *,
    family: str | None = None,
    kv_heads: int | None = None,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool | None = None,
) -> ModelShape:
    """The model the tuner is asked about: a named size (``--model gpt3-175b``, ``--model llama3-70b``), optionally
    overridden, or an explicit shape (``family="llama"`` for a Llama one), resolved as a run's config would be (its
    ``size`` kept only when the named shape is unchanged).  Vocabulary, sequence length and dropout default to the
    named size's, else the family's (``Family.tuner``); the position table is as long as the sequence."""
    shape = named(model) if model is not None else None
    kind = shape.family if shape is not None else family or DEFAULT_FAMILY
    if kind not in FAMILIES:
        raise ConfigError("--family", "unknown family", repr(kind), f"use one of {', '.join(FAMILIES)}")
    facts = FAMILIES[kind].tuner
    vocab = vocab if vocab is not None else (shape and shape.vocab_size) or facts.default_vocab
    seq_length = seq_length if seq_length is not None else (shape and shape.seq_length) or facts.default_seq_length
    section = ModelSection(
        size=model,
        family=family,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        vocab_size=vocab,
        seq_length=seq_length,
        max_position_embeddings=max(seq_length, 1),
        num_kv_heads=kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        **({"dropout": facts.dropout} if facts.dropout is not None else {}),
    )
    return resolve_shape(section, FLAGS)


# Cluster field <- (GpuPreset field, command-line flag): what --gpu sets and which explicit flag overrides it.
PRESET_FIELDS = {
    "gpu_memory_gb": ("memory_gb", "--gpu-memory-gb"),
    "peak_tflops": ("peak_tflops", "--gpu-peak-tflops"),
    "memory_gbps": ("memory_gbps", "--memory-gbps"),
    "intra_node_gbps": ("intra_node_gbps", "--intra-node-gbps"),
    "inter_node_gbps": ("inter_node_gbps", "--inter-node-gbps"),
}


def build_cluster(gpu: str | None, num_gpus: int, gpus_per_node: int, **values: float | None) -> Cluster:
    """A cluster of ``gpu`` (a :data:`ds_megatron.tune.core.gpus.GPUS` name; None: the a100-80gb defaults) whose figures
    are replaced by every explicit value that is not None (``gpu_memory_gb=40``); other keywords (``efficiency``,
    latencies, ``step_overhead_s``) pass through to :class:`Cluster`."""
    if gpu is not None and gpu not in GPUS:
        near = nearest(gpu, list(GPUS))
        raise ConfigError("--gpu", "unknown GPU", repr(gpu), f"use one of {', '.join(GPUS)} ({near!r}?)")
    preset = GPUS[gpu or DEFAULT_GPU]
    fields, changed = {}, []
    for name, (column, flag) in PRESET_FIELDS.items():
        value = values.pop(name, None)
        fields[name] = getattr(preset, column) if value is None else value
        if value is not None and value != getattr(preset, column):
            changed.append(f"{flag} {value:g}")
    rest = {k: v for k, v in values.items() if v is not None}
    # The fp8 and int8 peaks scale with the bf16 peak a flag may have replaced (the datasheets' ratio, 2 on Hopper).
    scale = fields["peak_tflops"] / preset.peak_tflops
    low = {"fp8_peak_tflops": preset.fp8_tflops, "int8_peak_tflops": preset.int8_tops}
    low = {k: v * scale for k, v in low.items() if v is not None and k not in rest}
    label = None if gpu is None else gpu + (f" with {', '.join(changed)}" if changed else "")
    return Cluster(num_gpus=num_gpus, gpus_per_node=gpus_per_node, gpu=label, **fields, **low, **rest)


def cluster_from_flags(args) -> Cluster:
    """The cluster of a tuner command line (``argparse.Namespace``): the ``--gpu`` preset with the figures its flags
    override, the efficiency ceiling, the latencies and the step overhead."""
    figures = {name: getattr(args, flag[2:].replace("-", "_")) for name, (_, flag) in PRESET_FIELDS.items()}
    return build_cluster(
        args.gpu,
        args.gpus,
        args.gpus_per_node,
        **figures,  # the --gpu figures the command line overrides
        efficiency=args.efficiency,
        intra_node_latency_s=args.intra_node_latency_us * 1e-6,
        inter_node_latency_s=args.inter_node_latency_us * 1e-6,
        step_overhead_s=args.step_overhead_s,
    )
