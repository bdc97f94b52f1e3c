"""Typed, frozen dataclasses for the ``"ds_megatron"`` section of a DeepSpeed JSON config.

DeepSpeed ignores top-level sections it does not know, so one JSON file carries both DeepSpeed's own keys and
ours.  Every field has a one-line doc; unknown keys are errors (see ``loader.py``).  Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ds_megatron.model import FAMILIES
from ds_megatron.pipeline_parallel.schedules import DEFAULT as DEFAULT_SCHEDULE
from ds_megatron.pipeline_parallel.schedules import SCHEDULES, Schedule, schedule_named

ATTENTION_KERNELS = ("eager", "sdpa")
MODEL_FAMILIES = tuple(FAMILIES)  # the registry's families (model/<family>/: each one's config, shapes and rules)
ROPE_SCALING_TYPES = ("llama3",)  # rope_scaling.rope_type values the llama family implements
RECOMPUTE_POLICIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# What selective recompute can recompute instead of storing: the attention core's s x s tensors, the MLP
# activation's output (the second linear's input), the two norms' outputs (the first linears' inputs).
# ``moe``: the routed experts' activations (their gathered inputs kept; mixture-of-experts families only).
RECOMPUTE_MODULES = ("core_attn", "mlp_act", "layernorm", "moe")
DEFAULT_SELECTIVE_MODULES = ("core_attn",)  # what selective recomputes when no modules are named (the paper's)
SP_GRAD_SYNC = ("step", "micro_batch")
# Positions of packed documents under data.document_mask: restart at each document (Llama 3's) or the window index.
DOCUMENT_POSITIONS = ("restart", "global")
DEFAULT_VOCAB_MULTIPLE = 128  # vocabulary padded to a multiple of this x tp (fast matmul shapes on GPUs)


# The pipeline schedules (ds_megatron.pipeline_parallel.schedules: one record each, standard library only).
PipelineSchedule = Schedule
PIPELINE_SCHEDULES = SCHEDULES
pipeline_schedule = schedule_named


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = DEFAULT_VOCAB_MULTIPLE) -> int:
    """Smallest multiple of ``multiple * tp`` that holds ``vocab_size`` rows (the vocab-parallel embedding's and
    output layer's rows: every TP rank gets an equal slice of a size that keeps the matmuls fast)."""
    step = multiple * tp
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class ModelSection:
    """Shape of the model.  ``size`` picks a named shape (and its family); explicit fields override it."""

    size: str | None = None  # named shape from ds_megatron.config.sizes (e.g. "gpt3-125m", "llama3-8b")
    family: str | None = None  # one of MODEL_FAMILIES; None: the named size's family, else the registry's default
    num_layers: int | None = None  # transformer blocks (L)
    hidden_size: int | None = None  # model width (h)
    num_heads: int | None = None  # attention heads (a)
    vocab_size: int | None = None  # real vocabulary size (V), before padding for TP
    seq_length: int | None = None  # training sequence length (s); also the position table size by default
    max_position_embeddings: int | None = None  # rows of the learned position table (>= seq_length)
    dropout: float = 0.1  # every dropout of the family's block (a Llama has only the attention's)
    # "sdpa" (torch's fused kernels: on a GPU flash or memory-efficient attention, no s x s tensor) or "eager" (the
    # materialised softmax of the paper's tables, whose s x s scores a GPU holds per head and micro-batch)
    attention: str = "sdpa"
    layer_norm_epsilon: float = 1e-5  # the norms' epsilon (LayerNorm's or RMSNorm's rms_norm_eps)
    init_std: float = 0.02  # std of the normal init; residual projections use init_std / sqrt(2 L)
    # chosen by a family without fixed_kv_and_width (config.shape.CHOSEN; refused for the others):
    num_kv_heads: int | None = None  # grouped-query attention's KV heads (None: num_heads); must divide num_heads
    intermediate_size: int | None = None  # SwiGLU width (gate_proj/up_proj outputs)
    rope_theta: float | None = None  # rotary embedding base (None: the named size's, else 10000)
    rope_scaling: dict | None = None  # Llama 3's {"rope_type": "llama3", "factor", "low_freq_factor", ...} or None
    tie_word_embeddings: bool | None = None  # output layer shares the embedding (None: the size's, else False)
    # mixture of experts (families qwen3_moe, mixtral, qwen2_moe; refused for the dense ones; None: the named size's
    # value):
    head_dim: int | None = None  # a head's width d when the family sets its own (Qwen3: 128 at h 2048, a 32)
    num_experts: int | None = None  # routed experts per MoE layer (E)
    experts_per_token: int | None = None  # experts each token is routed to (top-k), 1..num_experts
    moe_intermediate_size: int | None = None  # each expert's SwiGLU width (split over TP like the MLP's)
    norm_topk_prob: bool | None = None  # renormalise the k routing weights to sum 1 (Mixtral: always)
    decoder_sparse_step: int | None = None  # layer i is routed when (i + 1) % step == 0 and not in mlp_only_layers
    mlp_only_layers: tuple | None = None  # layers with a dense SwiGLU of intermediate_size instead of experts
    router_aux_loss_coef: float | None = None  # weight of the load-balancing loss in the training loss
    router_z_loss_coef: float | None = None  # weight of the router z-loss (0: off)
    # tokens per expert in training at most ceil(c n k / E) of a rank's n routed tokens, the pairs of the largest
    # router probability kept, the rest dropped (model.moe_layer); 0 or None: dropless (every token reaches its k)
    moe_capacity_factor: float | None = None
    # a shared expert's SwiGLU width (Qwen2-MoE: a dense MLP every token passes through, sigmoid-gated, beside the
    # routed experts; split over TP like the MLP's); qwen3_moe and mixtral have none (0)
    shared_expert_intermediate_size: int | None = None
    # the output layer and the cross entropy computed together in chunks of tokens, never holding the logits
    # [s, b, V/t] whole (ds_megatron.tensor_parallel.fused_cross_entropy); false: logits, then the loss
    fused_loss: bool = True
    # the block's memory-bound pieces (RMSNorm, rotary, SwiGLU) as torch.compile (inductor) kernels, compiled once
    # at the first step (ds_megatron.model.kernels); off by default: compiling costs tens of seconds per process, more
    # than a test or tiny run saves; the shipped configs (but the tiny ones) turn it on
    compile: bool = False


# The class name of the pipeline layer that holds one transformer block (pipeline_parallel.module.BlockPipe):
# DeepSpeed's "type:<regex>" partitioning balances the layers whose class name matches, so the default names it.
BLOCK_LAYER_CLASS = "BlockPipe"
DEFAULT_PARTITION_METHOD = f"type:{BLOCK_LAYER_CLASS}"


@dataclass(frozen=True)
class ParallelSection:
    """How the model is split.  dp is derived: world_size / (tp * cp * pp)."""

    tp: int = 1  # tensor-parallel size (t); stays inside a node
    cp: int = 1  # context-parallel size: each sequence split over cp ranks (load-balanced chunks); next to tp
    cp_comm: str = "ring"  # how CP attention exchanges: "ring" (K/V point-to-point) or "a2a" (all-to-all over heads)
    pp: int = 1  # pipeline-parallel size (p)
    ep: int = 1  # expert-parallel size: each routed layer's experts split over ep ranks holding distinct tokens
    # at ep > 1, C > 1 sends each routed layer's rows in C chunks of local experts, each chunk's all-to-all in
    # flight while another's experts (and the shared expert) compute (expert_parallel.overlap); 1: one blocking
    # all-to-all each way
    ep_dispatch_chunks: int = 1
    # expert tensor parallelism: each routed expert's width split over expert_tp ranks, 1 or tp (config.ep_rules);
    # None: tp at ep 1, 1 at ep > 1.  At expert_tp = tp the EP group spans cp x dp ranks of one tp index
    expert_tp: int | None = None
    sequence_parallel: bool = False  # Megatron sequence parallelism inside the TP group (needs tp > 1)
    vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE  # vocabulary padded to a multiple of vocab_multiple * tp
    partition_method: str = DEFAULT_PARTITION_METHOD  # DeepSpeed's pipeline partitioning (balance blocks per stage)
    sp_grad_sync: str = "step"  # SP-replicated gradients summed over TP once per "step" (fp32), or per "micro_batch"
    # the data-parallel gradient all-reduce started per bucket as each gradient is final (during the step's last
    # backward work) instead of all at once after it (pipeline_parallel.grad_reduce; the same sums, see docs)
    overlap_grad_reduce: bool = True
    pipeline_schedule: str = DEFAULT_SCHEDULE.name  # one of PIPELINE_SCHEDULES' names
    # model chunks (virtual stages) per pipeline rank, v >= 2, for a schedule whose record reads it
    # (Schedule.stages_setting; None: the record's default)
    virtual_stages: int | None = None
    # blocks per pipeline stage, in model order (pp x the schedule's stages per rank entries, summing to num_layers;
    # the first stage also holds the embedding, the last the final norm, output layer and loss; None: the blocks
    # balanced by partition_method).  Read through pipeline_parallel.module.stage_parts.
    pipeline_layout: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RecomputeSection:
    """Activation recomputation policy."""

    policy: str = "none"  # "none", "selective" (the modules below) or "full"
    modules: tuple = ()  # selective only: any of "core_attn", "mlp_act", "layernorm", "moe" (empty: ["core_attn"])
    num_layers: int = 1  # full only: layers per checkpointed chunk (uniform) or recomputed layers per stage (block)
    method: str = "uniform"  # full only: "uniform" or "block"

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """The modules selective recompute applies to (none for the other policies)."""
        if self.policy != "selective":
            return ()
        return tuple(self.modules) or DEFAULT_SELECTIVE_MODULES

    def chunks(self, num_blocks: int) -> list[tuple[int, int, bool]]:
        """Cover a stage's local blocks [0, num_blocks) with (start, end, recomputed) ranges, in order."""
        if self.policy != "full" or num_blocks == 0:
            return [(0, num_blocks, False)] if num_blocks else []
        k = self.num_layers
        if self.method == "uniform":
            return [(s, min(s + k, num_blocks), True) for s in range(0, num_blocks, k)]
        recomputed = [(i, i + 1, True) for i in range(min(k, num_blocks))]
        rest = [(k, num_blocks, False)] if k < num_blocks else []
        return recomputed + rest


@dataclass(frozen=True)
class TrainSection:
    """The training loop."""

    train_iters: int = 100  # optimizer steps
    seed: int = 1234  # base seed: init, data order and dropout
    log_interval: int = 10  # steps between log lines
    eval_interval: int = 0  # steps between validation runs (0: only at the end)
    eval_iters: int = 4  # validation batches per evaluation
    max_bad_steps: int = 10  # stop (with a checkpoint) after this many non-finite steps in a row
    prompt: str = "The "  # prompt of the greedy continuation printed at the end
    generate_tokens: int = 48  # tokens of that continuation (0: none)
    sample_top_k: int = 40  # the sampled continuation printed beside it draws from this many most likely tokens
    sample_temperature: float = 0.8  # that sample divides its logits by this (< 1 sharper, > 1 flatter)
    eval_only: bool = False  # evaluate what checkpoint.load or init_from_hf loaded on the validation split; no training


@dataclass(frozen=True)
class DataSection:
    """Training text and tokenizer."""

    path: str | None = None  # HF dataset name, or local .txt/.json/.jsonl/.parquet files or globs (comma-separated);
    # None: the built-in corpus (CPython's reference documentation text, no network needed)
    text_field: str = "text"  # field holding the text in json/jsonl/parquet/HF datasets
    split: str = "train"  # HF dataset split
    hf_config: str | None = None  # configuration name of the HF dataset data.path names (e.g. "wikitext-103-raw-v1")
    tokenizer: str | None = None  # a tokenizer directory (AutoTokenizer), or "bpe:N" to train a byte-level BPE of N
    # tokens on the training text; None: bpe with the model's vocab_size
    cache_dir: str = ".cache/ds_megatron"  # packed token files, keyed by content hash
    valid_fraction: float = 0.02  # tail of the token stream held out for validation
    num_proc: int = 2  # tokenisation processes
    blend: tuple = ()  # instead of path: [[prepared directory, weight], ...]; samples drawn in those proportions
    max_inlaunch_bytes: int = 1_000_000_000  # local text above this is refused in a launch: prepare it beforehand
    verify_checksums: bool = False  # check every prepared file's sha256 at start (reads it all); sizes always
    document_mask: bool = False  # attention stays inside each packed document (EOS ends one); False: whole window
    document_positions: str = "restart"  # with document_mask: "restart" positions at each document, or "global"


@dataclass(frozen=True)
class LoggingSection:
    """Console, metrics.jsonl and wandb."""

    run_dir: str | None = None  # metrics.jsonl, loss.png, tokenizer and resolved config go here (default: --save,
    # else a new runs/<config name>/<start time>-<pid> per run: docs/runs.md)
    wandb_project: str | None = None  # None: wandb off
    wandb_run_name: str | None = None
    wandb_tags: tuple = ()
    wandb_mode: str | None = None  # "online", "offline", "disabled" or None (offline without credentials)
    peak_tflops: float | None = None  # per-GPU peak for MFU; None: looked up from the GPU name


@dataclass(frozen=True)
class CheckpointSection:
    """When and where to save."""

    save: str | None = None  # checkpoint directory (None: no checkpoints)
    load: str | None = None  # resume from this checkpoint directory (its latest complete tag)
    init_from_hf: str | None = None  # start from a transformers directory of the run's family (ignored with load)
    save_interval: int = 0  # steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)
    keep_last: int = 0  # keep this many checkpoints (0: all)


@dataclass(frozen=True)
class DsMegatronConfig:
    """The whole ``"ds_megatron"`` section."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    recompute: RecomputeSection = field(default_factory=RecomputeSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
