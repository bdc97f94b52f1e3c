"""L4: ``build_engine`` — topology -> model -> parallelize -> pipeline -> ``deepspeed.initialize``.

The only caller of ``deepspeed.initialize``.  Validate the config (``ds_megatron.config.resolve``) before calling it:
nothing here runs before the process group exists.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.pipe.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.pipe.schedule import ReduceGrads, ReduceTiedGrads

from ds_megatron.checkpoint.run_state import read_weights_only
from ds_megatron.config import ConfigError, RunConfig, unused_settings
from ds_megatron.config.ep_rules import resolved_expert_tp
from ds_megatron.config.facts import (
    BF16_OPTIMIZER,
    ZERO_OPTIMIZER,
    deepspeed_wraps_optimizer,
    optimizer_wrapper,
    precision,
)
from ds_megatron.config.schedule import warmup_cosine_from
from ds_megatron.expert_parallel.dispatch import attach_ep_groups
from ds_megatron.expert_parallel.layer import expert_group_name, reduce_expert_grad_tensors, reduce_expert_grads
from ds_megatron.model import ModelConfig, model_config
from ds_megatron.optim import ClippedAdamW, WarmupCosineScheduler, adamw_kwargs, global_grad_norm, param_groups
from ds_megatron.parallelize import ParallelContext
from ds_megatron.pipeline_parallel.grad_reduce import install_grad_reduce_overlap, overlap_refusal
from ds_megatron.pipeline_parallel.module import build_pipeline_module
from ds_megatron.pipeline_parallel.schedules import schedule_of
from ds_megatron.random import RNGTracker, build_rng
from ds_megatron.tensor_parallel import defer_sp_grad_sync, sum_sp_replicated_grads
from ds_megatron.tensor_parallel.weight_grad import WeightGradQueue, defer_weight_grads
from ds_megatron.topology import ParallelTopology


@dataclass
class Built:
    """Everything a training loop needs."""

    engine: deepspeed.runtime.pipe.engine.PipelineEngine
    topology: ParallelTopology
    parallel: ParallelContext
    rng: RNGTracker
    model_config: ModelConfig  # the model family's config (GPTConfig or LlamaConfig)
    run: RunConfig


def init_distributed(inference_all_reduce: bool = False) -> None:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPUs, gloo on CPU); idempotent.

    On CPU DeepSpeed's backend builds (a JIT C++ extension) and maps its shared-memory all-reduce, which only
    ``deepspeed.comm.inference_all_reduce`` uses: ``init_inference``'s tensor-parallel layers.  Training reduces
    through torch.distributed (ds_megatron's collectives, DeepSpeed's engines, AutoTP training's layers), so unless
    ``inference_all_reduce`` asks for it the backend starts without it: the build is cached, but the cache is keyed
    by the compiler command and was seen rebuilding for 40-150 s when two build flavours alternated, and each
    rank's 66 MB buffer in /dev/shm is not needed."""
    if dist.is_initialized():
        return
    set_local_device()
    if inference_all_reduce or device_type() != "cpu":
        deepspeed.init_distributed(verbose=False)
    else:
        with _without_shm_all_reduce():
            deepspeed.init_distributed(verbose=False)
    release_shm_buffer_name()


def set_local_device() -> None:
    """On CUDA, make ``cuda:LOCAL_RANK`` this process's device before the process group exists.  NCCL stages every
    collective, object collectives included (the ``--load`` tag's agreement), on the current device, which is cuda:0
    until set: every rank of a node would then use GPU 0 and NCCL refuses (DeepSpeed sets the device only inside
    ``deepspeed.initialize``).  Seeding the CUDA generators also acts on the current device."""
    if device_type() != "cuda":
        return
    local_rank, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= visible:  # DeepSpeed's engine would pick the same device later, and fail less clearly
        raise ConfigError(
            "LOCAL_RANK",
            "this process's local rank names a GPU it cannot see",
            f"LOCAL_RANK={local_rank}, {visible} visible GPU(s), "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}",
            "let every process of a node see all of the node's GPUs (srun --gpus-per-node=N, without "
            "--gpus-per-task or --gpu-bind)",
        )
    torch.cuda.set_device(local_rank)


def local_device() -> torch.device:
    """The device this rank's collectives run on (``set_local_device``'s on CUDA)."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def _without_shm_all_reduce():
    """DeepSpeed's backend, built inside the block, without its CPU shared-memory all-reduce (its builder function
    returning None is the state DeepSpeed itself takes when the op is not compatible: plain torch.distributed)."""
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    build, comm_torch.build_shm_op = comm_torch.build_shm_op, lambda: None
    try:
        yield
    finally:
        comm_torch.build_shm_op = build


def release_shm_buffer_name() -> None:
    """DeepSpeed's CPU shared-memory all-reduce creates one ~66 MB file per rank in /dev/shm
    (``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and never removes it, so every CPU launch leaks
    memory until the machine runs out.  Each rank maps every peer's buffer during initialisation; after a barrier
    the names are no longer needed, and unlinking ours now leaves nothing behind, even if the job is killed."""
    if device_type() != "cpu":
        return
    dist.barrier()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)


def default_cpu_threads() -> int | None:
    """Several CPU ranks on one machine each start a thread per core unless told otherwise, and oversubscribed
    cores slow every rank several times over (benchmarks/results/cpu_threads.md).  When ``OMP_NUM_THREADS`` is unset,
    each rank takes its share of the cores it may run on (at least one); returns the count set, or None when left
    alone."""
    if device_type() != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))
    torch.set_num_threads(threads)
    return threads


def device_type() -> str:
    from deepspeed.accelerator import get_accelerator

    return "cuda" if get_accelerator().device_name() == "cuda" else "cpu"


def deepspeed_config_for(run: RunConfig, notes: list[str] | None = None) -> dict:
    """DeepSpeed's own keys, with our section removed and the settings we own filled in (``notes`` collects one line
    per setting changed behind the user's back)."""
    notes = notes if notes is not None else []
    ds = copy.deepcopy(run.ds_config)
    ds.pop("ds_megatron", None)
    ds.pop("optimizer", None)  # built here (optim.py)
    if warmup_cosine_from(run.ds_config) is not None:
        ds.pop("scheduler")  # built here with the published semantics (config/schedule.py)
    ds["train_micro_batch_size_per_gpu"] = run.micro_batch_size
    ds["gradient_accumulation_steps"] = run.grad_accum_steps
    # DeepSpeed's data axis holds dp x cp ranks (the CP ranks are folded into it, topology.py) and it checks
    # train_batch_size == micro x accumulation x (dp x cp).  A user's train_batch_size counts sequences, and the cp
    # ranks of one replica share each sequence, so DeepSpeed is handed the sequences times cp: what it counts as
    # "samples" are sequence pieces.  Everything of ours (data position, tokens/s, MFU) uses run.global_batch_size.
    ds["train_batch_size"] = run.global_batch_size * run.cp
    ds.setdefault("steps_per_print", 10**9)
    if not deepspeed_wraps_optimizer(run.ds_config):
        # DeepSpeed's wrappers compute a TP/PP-correct norm; on the plain fp32 path ClippedAdamW clips (optim.py)
        ds["gradient_clipping"] = 0.0
    if run.section.parallel.sequence_parallel and run.tp > 1:
        # Stage-boundary tensors are already sequence shards; DeepSpeed's TP partitioning of them would garble them
        # (DeepSpeed splits them over the TP group a second time).  Without it the boundary tensors are s/t long:
        # pipeline traffic falls by t.
        pipe = ds.setdefault("pipeline", {})
        if pipe.get("pipe_partitioned", True) or pipe.get("grad_partitioned", True):
            notes.append("sequence parallel: pipeline.pipe_partitioned and grad_partitioned turned off")
        pipe["pipe_partitioned"] = False
        pipe["grad_partitioned"] = False
    if run.model.num_experts and run.tp > 1 and not (run.section.parallel.sequence_parallel):
        # A routed family's boundary carries its routing statistics, which take a gradient; DeepSpeed's TP
        # partitioning of boundary tensors asserts that only the first one does.
        pipe = ds.setdefault("pipeline", {})
        if pipe.get("pipe_partitioned", True) or pipe.get("grad_partitioned", True):
            notes.append("mixture of experts: pipeline.pipe_partitioned and grad_partitioned turned off")
        pipe["pipe_partitioned"] = False
        pipe["grad_partitioned"] = False
    if schedule_of(run).per_rank(run.section.parallel) > 1 and run.tp > 1:
        # DeepSpeed's DualPipeV engine sends whole boundary tensors (it asserts both off); the config check refuses
        # them when set explicitly, so only DeepSpeed's default (on) is turned off here.
        pipe = ds.setdefault("pipeline", {})
        if "pipe_partitioned" not in pipe or "grad_partitioned" not in pipe:
            notes.append(f"{schedule_of(run).name}: pipeline.pipe_partitioned and grad_partitioned turned off")
        pipe["pipe_partitioned"] = False
        pipe["grad_partitioned"] = False
    notes.extend(unused_settings(run))
    if optimizer_wrapper(run.ds_config) == BF16_OPTIMIZER and ds.get("communication_data_type") is None:
        # DeepSpeed's pipeline engine all-reduces the BF16 optimizer's gradient buffers over its data axis (dp x cp:
        # PipelineEngine._exec_reduce_grads -> buffered_allreduce_fallback -> allreduce_bucket) in
        # communication_data_type, which is the model's dtype when unset: every fp32-accumulated gradient is copied
        # to bf16 and summed in bf16.  Megatron sums in fp32.  The cost: 4 bytes per parameter per ring pass
        # instead of 2 (a ring all-reduce sends 2 (n-1)/n x that per rank per step: 2x the bf16 traffic), and no
        # transient bf16 copy of the gradients.  A user's explicit value is kept.
        ds["communication_data_type"] = "fp32"
        notes.append(
            "bf16: communication_data_type fp32 (data-parallel gradients summed in fp32, 4 bytes per parameter; "
            'set "communication_data_type": "bf16" for half the bytes)'
        )
    return ds


def install_step_sp_grad_sync(engine, topology: ParallelTopology, run: RunConfig) -> bool:
    """Sum the gradients of SP-replicated parameters (LayerNorms, row-parallel biases, the position table) over the
    TP group once per optimizer step, in fp32, in one all-reduce per stage: after the last micro-batch's backward
    and before DeepSpeed's data-parallel reduction (its ``ReduceTiedGrads`` instruction runs first).  The layers'
    per-micro-batch sync in autograd is switched off.  On the BF16 optimizer the sum acts on its fp32 accumulation
    buffers (``_hp_grad``), elsewhere on ``.grad``.  fp16 keeps the per-micro-batch sync: its wrappers accumulate
    16-bit gradients.  Returns whether it was installed."""
    sp = run.section.parallel
    if not (sp.sequence_parallel and topology.tp > 1 and sp.sp_grad_sync == "step"):
        return False
    if precision(run.ds_config) == "fp16":
        return False
    params = [p for p in engine.module.parameters() if getattr(p, "sequence_parallel_replicated", False)]
    defer_sp_grad_sync(engine.module)
    bf16 = bool(getattr(engine, "using_bf16_optimizer", False))

    engine_class = type(engine)  # PipelineEngine, the zero-bubble one, or DualPipeVEngine (phase-aware table)

    def reduce_tied_then_sp_grads(self) -> None:
        engine_class._exec_reduce_tied_grads(self)
        grads = [getattr(p, "_hp_grad", None) if bf16 else p.grad for p in params]
        sum_sp_replicated_grads(params, grads, topology.tp_group)

    # The pipeline engine dispatches its schedule's instructions through this class-level table; an instance
    # entry replaces one instruction for this engine only.  The table is the engine's own class's: DualPipeV's
    # replaces the forward, backward and p2p instructions with phase-aware ones.
    engine._INSTRUCTION_MAP = {**engine_class._INSTRUCTION_MAP, ReduceTiedGrads: reduce_tied_then_sp_grads}
    return True


def register_expert_groups(topology: ParallelTopology) -> None:
    """At ep > 1, this rank's EP and expert-DP groups in DeepSpeed's group tables under the expert parameters'
    group name (``expert_parallel.layer.expert_group_name``): its engine broadcasts every marked expert parameter
    from the first rank of that expert-DP group when it starts (the ranks holding the same experts), its BF16
    optimizer cuts the expert parameter groups over it, and its gradient norm sums the experts' over the EP group,
    which needs the groups there.  DeepSpeed keeps these tables as module globals of ``deepspeed.utils.groups`` and
    has no public setter for groups laid out by someone else (its own builder lays EP over its data axis only).  At
    expert_tp = tp its expert-TP size too: its norm (``runtime.utils.get_global_norm_of_tensors``) then sums each
    expert group's over the model-parallel group (tp x pp) before the EP group, as each tp rank holds a slice of
    every expert of its EP group; at expert_tp 1 over the pipeline stages only."""
    if topology.ep == 1:
        return
    from deepspeed.utils import groups as ds_groups

    name = expert_group_name(topology.ep)
    ds_groups._EXPERT_PARALLEL_GROUP[name] = topology.ep_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = topology.expert_dp_group
    ds_groups.expert_tensor_parallel_world_size = topology.expert_tp


def expert_param_groups(groups: list[dict], topology: ParallelTopology) -> list[dict]:
    """At ep > 1, ``groups`` with the expert parameters moved to groups of their own, as DeepSpeed's optimizer
    wrappers want them (``moe: True`` and the expert group's name, by DeepSpeed's own
    ``split_params_into_different_moe_groups_for_optimizer``): the BF16 optimizer then cuts each expert group's fp32
    masters over that group's expert-DP group, the others over dp x cp, and sums the grad norm of each expert group
    over its EP group.  Unchanged at ep 1."""
    if topology.ep == 1:
        return groups
    named = [{**group, "name": f"group{i}"} for i, group in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


@contextlib.contextmanager
def experts_known_to_optimizer(topology: ParallelTopology):
    """At ep > 1, DeepSpeed's BF16 or ZeRO optimizer built inside the block is told the model has expert parameters.
    DeepSpeed tells them so (``has_moe_layers``) only when the model holds one of its own ``MoE`` modules, which ours
    are not; its engine keeps the flag for its gradient reduction and its checkpoint files too, where ours differ
    (``install_expert_grad_reduction``; DeepSpeed's MoE checkpoint layout is not the pipeline's), so the engine's flag
    is set only while it builds the optimizer, and the optimizer keeps its own (with it, the ZeRO optimizer also
    takes the engine's EP and expert-DP group tables, which ``register_expert_groups`` filled)."""
    if topology.ep == 1:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    builders = {
        name: getattr(DeepSpeedEngine, name) for name in ("_configure_bf16_optimizer", "_configure_zero_optimizer")
    }

    def with_experts(configure):
        def configure_with_experts(self, optimizer):
            self.has_moe_layers = True
            try:
                return configure(self, optimizer)
            finally:
                self.has_moe_layers = False

        return configure_with_experts

    for name, configure in builders.items():
        setattr(DeepSpeedEngine, name, with_experts(configure))
    try:
        yield
    finally:
        for name, configure in builders.items():
            setattr(DeepSpeedEngine, name, configure)


def uses_zero_optimizer(engine) -> bool:
    """Whether DeepSpeed put its ZeRO optimizer (``zero/stage_1_and_2.py``) around ours."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(engine.optimizer, DeepSpeedZeroOptimizer)


def count_experts_on_every_tp_rank(engine, topology: ParallelTopology) -> bool:
    """At ep > 1 on DeepSpeed's ZeRO optimizer, its gradient norm with each expert counted once.  Its per-group norm
    (``get_grad_norm_direct``: squares of this rank's partition, summed over its data group (dp x cp) and the model
    group (tp x pp)) counts a parameter not marked model-parallel on TP rank 0 only; with EP folded over the TP
    ranks (SP) the other TP ranks hold experts of their own, which it would leave out (measured on moe-tiny, fp32 +
    ZeRO-1 at tp 2 + SP x ep 2: step-1 norm 3.40514 against ep 1's 3.40798).  Each expert element lies in exactly
    one rank's partition of the stage (the EP ranks hold distinct experts, each cut over its expert-DP group), so
    for the expert groups every rank counts its partition: the same collectives, with TP rank 0's choice on every
    rank.  Marking the experts model-parallel instead would make every TP-keyed rule of ours treat them as TP
    shards.  Its later average of each expert group's norm over the expert-DP group (``_average_expert_grad_norms``)
    then averages equal values.  Returns whether it was installed."""
    if topology.ep == 1 or not uses_zero_optimizer(engine):
        return False
    optimizer = engine.optimizer
    direct = optimizer.get_grad_norm_direct  # bound: the class's method

    def grad_norm_direct(gradients, params, norm_type=2):
        if not any(is_moe_param(p) for p in params):  # a group is all experts or none (DeepSpeed asserts it)
            return direct(gradients, params, norm_type)
        tp_rank, optimizer.model_parallel_rank = optimizer.model_parallel_rank, 0
        try:
            return direct(gradients, params, norm_type)
        finally:
            optimizer.model_parallel_rank = tp_rank

    optimizer.get_grad_norm_direct = grad_norm_direct  # an instance entry: this optimizer only
    return True


def check_every_stage_has_experts(module: torch.nn.Module, topology: ParallelTopology, run: RunConfig) -> None:
    """At ep > 1 on DeepSpeed's BF16 or ZeRO optimizer with pp > 1, refuse (on every rank alike, in one line) a
    pipeline stage holding no routed layer (all its blocks in ``mlp_only_layers`` or off ``decoder_sparse_step``):
    either optimizer, once told of experts, asserts an expert parameter group on every rank, and its gradient norm
    runs collectives over the pipeline stages per expert group (the BF16 optimizer's sum of each expert group's, the
    ZeRO optimizer's per-group sum over the model group) that such a stage would never join.  Where the blocks fall
    is known only once the pipeline module is cut, so this runs after the process group exists (one all-reduce of pp
    numbers, before any file is written).  The fp32 path has no such collective (``optim.global_grad_norm``)."""
    wrapper = optimizer_wrapper(run.ds_config)
    if topology.ep == 1 or topology.pp == 1 or wrapper not in (BF16_OPTIMIZER, ZERO_OPTIMIZER):
        return
    holding = torch.zeros(topology.pp, device=local_device())
    holding[topology.pp_rank] = float(any(is_moe_param(p) for p in module.parameters()))
    dist.all_reduce(holding)  # per stage, how many of its ranks hold experts
    empty = [stage for stage, count in enumerate(holding.tolist()) if count == 0]
    if empty:
        shape = run.model
        raise ConfigError(
            "ds_megatron.parallel.ep",
            f"on DeepSpeed's {wrapper} optimizer every pipeline stage must hold a routed layer at ep > 1",
            f"ep={topology.ep}, pp={topology.pp}, stage(s) {empty} without one (num_layers={shape.num_layers}, "
            f"mlp_only_layers={list(shape.mlp_only_layers)}, decoder_sparse_step={shape.decoder_sparse_step})",
            "use fewer pipeline stages, train in fp32 at ZeRO 0, or use ep 1",
        )


def install_expert_grad_reduction(engine, topology: ParallelTopology) -> bool:
    """At ep > 1, DeepSpeed's data-parallel reduction of the non-expert gradients (over dp x cp, in
    ``communication_data_type``) followed by the experts' own rule (``expert_parallel.layer.reduce_expert_grads``: a
    sum over the expert-DP group, in fp32, divided by dp x cp), as the pipeline's ``ReduceGrads`` instruction.  On
    the plain fp32 optimizer the gradients are the parameters' ``.grad``; on DeepSpeed's BF16 optimizer, its flat
    accumulation buffers (``get_grads_for_reduction``: the non-expert groups' and the expert groups').  DeepSpeed's
    own pass would reduce expert gradients only for an engine that knows of its ``MoE`` modules
    (``experts_known_to_optimizer``: why ours does not).  DeepSpeed's ZeRO optimizer, told of the experts, applies
    the same rule itself and keeps DeepSpeed's instruction (``zero_reduces_experts_by_our_rule``).  Returns whether
    the experts' rule is in place."""
    if topology.ep == 1:
        return False
    if uses_zero_optimizer(engine):
        return zero_reduces_experts_by_our_rule(engine, topology)
    if getattr(engine, "using_bf16_optimizer", False):
        # persistent buffers, zeroed after each step: the same tensors every step
        dense, by_group = engine.optimizer.get_grads_for_reduction()
        experts = [buffer for buffers in by_group.values() for buffer in buffers]
    else:
        dense = [p for p in engine.module.parameters() if p.requires_grad and p.numel() and not is_moe_param(p)]
        experts = None

    def reduce_grads(self) -> None:
        self._force_grad_boundary = True
        if self.pipeline_enable_backward_allreduce:
            if experts is None:
                for p in dense:  # every rank of the data axis must send every gradient, as DeepSpeed's own pass does
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                self.buffered_allreduce_fallback(
                    grads=[p.grad for p in dense], elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE
                )
                reduce_expert_grads(self.module, topology.expert_dp_group, topology.expert_grad_divisor)
            else:
                self.buffered_allreduce_fallback(grads=dense, elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE)
                reduce_expert_grad_tensors(experts, topology.expert_dp_group, topology.expert_grad_divisor)
        self._force_grad_boundary = False

    # on top of the map the schedule's engine and the SP step sync left (an instance entry, this engine only)
    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, ReduceGrads: reduce_grads}
    return True


def zero_reduces_experts_by_our_rule(engine, topology: ParallelTopology) -> bool:
    """Check that DeepSpeed's ZeRO optimizer, told of the experts, reduces them by the rule of
    ``expert_parallel.layout``: its ZeRO-1 pass (``reduce_gradients`` -> ``average_tensor``, reduce-scatter on,
    which the config requires at ep > 1) divides every gradient bucket by its data group's size over DeepSpeed's
    sequence-parallel size, then sums each slice to its partition's owner over the group that partition is cut over:
    the expert-DP group for an expert (``real_dp_process_group``, registered under the experts' group name), the data
    group for the rest.  So the experts are summed over expert-DP and divided by that size, which must be dp x cp
    (DeepSpeed's data axis, where the CP ranks are folded in); raises if DeepSpeed's groups say otherwise."""
    opt = engine.optimizer
    divisor = dist.get_world_size(group=opt.dp_process_group) / float(opt.sequence_parallel_size)
    expert_groups = [g for i, g in enumerate(opt.real_dp_process_group) if opt.is_moe_param_group[i]]
    if (
        divisor != topology.expert_grad_divisor
        or not opt.reduce_scatter
        or any(
            dist.get_world_size(group=g) != dist.get_world_size(group=topology.expert_dp_group) for g in expert_groups
        )
    ):
        raise RuntimeError(
            f"DeepSpeed's ZeRO optimizer would reduce expert gradients otherwise than dp x cp = "
            f"{topology.expert_grad_divisor} over expert-DP: its divisor {divisor}, reduce_scatter "
            f"{opt.reduce_scatter}, expert groups of {[dist.get_world_size(group=g) for g in expert_groups]} ranks"
        )
    return True


def install_overlap(engine, topology: ParallelTopology, run: RunConfig, sp_step_sum: bool) -> str | None:
    """With ``parallel.overlap_grad_reduce`` (the default), the data-parallel reduction overlapped with the step's
    last backward work (``pipeline_parallel.grad_reduce``), installed last: its ``ReduceGrads`` replaces DeepSpeed's
    and the experts' (``install_expert_grad_reduction``).  Reduced after their own sums, as DeepSpeed does: tied
    weights shared by several stages and, with the once-per-step SP sum, the SP-replicated parameters.  Returns the
    line to print (what was installed, or why DeepSpeed reduces), None when off or nothing is reduced."""
    if not run.section.parallel.overlap_grad_reduce:
        return None
    experts_reduced = topology.ep > 1 and dist.get_world_size(topology.expert_dp_group) > 1
    if topology.dp * topology.cp == 1 and not experts_reduced:
        return None
    refusal = overlap_refusal(engine)
    if refusal is not None:
        return f"overlap_grad_reduce: DeepSpeed reduces the data-parallel gradients after the step ({refusal})"
    late = [w for w, group in engine.module.get_tied_weights_and_groups() if dist.get_world_size(group) > 1]
    if sp_step_sum:
        late += [p for p in engine.module.parameters() if getattr(p, "sequence_parallel_replicated", False)]
    groups = (topology.expert_dp_group, topology.expert_grad_divisor) if topology.ep > 1 else (None, 1)
    install_grad_reduce_overlap(engine, late, *groups)
    return "data-parallel gradients reduced while the step's last backward runs (parallel.overlap_grad_reduce)"


def build_engine(run: RunConfig) -> Built:
    threads = default_cpu_threads()
    init_distributed()
    topology = ParallelTopology.build(run.tp, run.pp, run.dp, run.cp)
    par = run.section.parallel
    expert_tp = resolved_expert_tp(par.expert_tp, par.ep, run.tp)
    attach_ep_groups(topology, par.ep, par.sequence_parallel, expert_tp)
    seed = run.section.train.seed
    # The default (data) RNG stream is keyed by the data-axis coordinate: CP ranks hold different tokens, so their
    # hidden-state dropout masks must differ (at cp 1 the coordinate is dp_rank, as before).
    rng = build_rng(seed, topology.tp_rank, topology.pp_rank, topology.data_coord, device_type())
    config = model_config(run.model)
    parallel = ParallelContext(
        config=config,
        tp=topology.tp_axis,
        sequence_parallel=run.section.parallel.sequence_parallel,
        rng=rng,
        vocab_multiple=run.section.parallel.vocab_multiple,
        recompute=run.section.recompute,
        cp=topology.cp_axis,
        cp_comm=run.section.parallel.cp_comm,
        compile=run.section.model.compile,
        ep=topology.ep_axis,
        ep_dispatch_chunks=run.section.parallel.ep_dispatch_chunks,
        expert_tp=expert_tp,
        # weights loaded from transformers replace every parameter (load_hf_into_pipeline): none is drawn first
        init_weights=not (run.section.checkpoint.init_from_hf and not run.section.checkpoint.load),
    )
    module = build_pipeline_module(
        config,
        parallel,
        topology,
        seed,
        run.section.parallel.partition_method,
        schedule_of(run).module_class(run.section.parallel),
        fused_loss=run.section.model.fused_loss,
        stage_blocks=run.section.parallel.pipeline_layout,
    )
    ckpt = run.section.checkpoint
    if ckpt.init_from_hf and not ckpt.load:
        # Before deepspeed.initialize: the bf16 optimizer copies the weights into its fp32 masters there.
        from ds_megatron.checkpoint.hf_import import load_hf_into_pipeline

        load_hf_into_pipeline(module, parallel, ckpt.init_from_hf)
    check_every_stage_has_experts(module, topology, run)
    opt_kwargs = adamw_kwargs(run.ds_config.get("optimizer"))
    groups = param_groups(module, opt_kwargs.pop("weight_decay"))
    if deepspeed_wraps_optimizer(run.ds_config):
        groups = expert_param_groups(groups, topology)
        optimizer = torch.optim.AdamW(groups, **opt_kwargs)
    else:
        norm_fn = functools.partial(global_grad_norm, list(module.parameters()), topology)
        max_norm = float(run.ds_config.get("gradient_clipping", 0.0) or 0.0)
        optimizer = ClippedAdamW(groups, grad_norm_fn=norm_fn, max_norm=max_norm, **opt_kwargs)
    notes: list[str] = []
    if threads is not None:
        notes.append(f"OMP_NUM_THREADS unset: {threads} CPU thread(s) per rank (the cores shared by the local ranks)")
    ds_config = deepspeed_config_for(run, notes)
    if run.pp > 1:
        how = "pipeline_layout" if run.section.parallel.pipeline_layout else run.section.parallel.partition_method
        notes.append(f"blocks per pipeline stage, in model order: {module.layout.blocks_of(module.parts)} ({how})")
    if topology.rank == 0:
        for line in notes:
            print(f"ds_megatron: {line}", flush=True)
    schedule = warmup_cosine_from(run.ds_config)
    scheduler = None if schedule is None else functools.partial(WarmupCosineScheduler, schedule=schedule)
    register_expert_groups(topology)
    with experts_known_to_optimizer(topology):
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=ds_config, lr_scheduler=scheduler
        )
    read_weights_only(engine)  # DeepSpeed's own checkpoint reads unpickle weights-only too
    # The schedule's engine replaces DeepSpeed's (every engine's pipeline sends are async, pipeline_parallel.p2p, so
    # that the schedules compare alike); with deferred weight gradients, every stage of the rank defers to one queue.
    pipeline = schedule_of(run)
    if pipeline.deferred_weight_grads:
        queue = WeightGradQueue()
        defer_weight_grads(engine.module, queue)
        pipeline.engine_class().install(engine, queue)
    else:
        pipeline.engine_class().install(engine)
    sp_step_sum = install_step_sp_grad_sync(engine, topology, run)
    if sp_step_sum and topology.rank == 0:
        print("ds_megatron: SP-replicated gradients summed over TP once per step (fp32)", flush=True)
    if install_expert_grad_reduction(engine, topology) and topology.rank == 0:
        print(f"ds_megatron: experts split over ep {topology.ep}; their gradients reduced over expert-DP", flush=True)
    count_experts_on_every_tp_rank(engine, topology)
    note = install_overlap(engine, topology, run, sp_step_sum)
    if note and topology.rank == 0:
        print(f"ds_megatron: {note}", flush=True)
    return Built(engine, topology, parallel, rng, config, run)
