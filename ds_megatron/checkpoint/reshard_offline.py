"""``python -m ds_megatron.checkpoint reshard``: rewrite a checkpoint at another tp x cp x pp x dp, offline, as the
files a run at the new layout would have saved at the same step, which ``--load`` resumes without resharding.  What is
written, what carries over exactly and what is refused: docs/checkpoints.md, "Resuming at another layout".
Context parallelism adds no weights: a cp change only changes the number of optimizer partitions, one per rank of
DeepSpeed's data axis (dp x cp, data coordinate ``d = dp_rank x cp + cp_rank``).  The values are those the on-load
path (``reshard.py``) puts into a new engine, by the same shard rules; no RNG files are written.

The BF16 optimizer's flat partition files this writes, the streaming that keeps memory near one parameter and what
differs from a run's own save: docs/design.md, "Offline resharding writes DeepSpeed's own files".  Everything is
written under ``<out>.tmp-<random>`` and renamed to ``<out>`` at the end.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections import OrderedDict
from pathlib import Path

import torch
from deepspeed.utils.tensor_fragment import fragment_address
from torch import nn

from ds_megatron.checkpoint import safe_load
from ds_megatron.checkpoint.adapter import StateDictAdapter
from ds_megatron.checkpoint.layout import layout_ranks, run_model_config, shard_context, stage_param_layers
from ds_megatron.checkpoint.manifest import (
    TAG_CONFIG,
    complete_tags,
    file_record,
    source_tag,
    tag_config,
    tag_files,
    verify_tag,
    write_manifest,
)
from ds_megatron.checkpoint.masters import MOMENTS, optimizer_files, rank_padding, zero_flat_layout
from ds_megatron.checkpoint.reshard import OldCheckpoint
from ds_megatron.checkpoint.run_state import IMPORTED
from ds_megatron.checkpoint.tokenizer import copy_tokenizer
from ds_megatron.config import ConfigError, RunConfig, resolve
from ds_megatron.config.facts import (
    BF16_OPTIMIZER,
    ZERO_OPTIMIZER,
    grad_accum_dtype,
    optimizer_wrapper,
    precision,
    saved_cp,
    saved_layout,
    saved_world,
    zero_stage,
)
from ds_megatron.config.rules import check_batch_split
from ds_megatron.config.shape import Vocabulary
from ds_megatron.fileio import atomic_write_text, staged_directory
from ds_megatron.optim import param_groups

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# The writer's kind for a checkpoint of weights alone (``import``): no optimizer state and no optimizer order, so a
# run loading it builds its optimizer afresh from the weights (``run_state.load_run``).
FRESH = "fresh"
# The kinds whose optimizer state is flat partitions over DeepSpeed's data axis: its BF16 and ZeRO optimizers'.
PARTITIONED = ("bf16", "zero")


def reshard_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    tp: int,
    pp: int,
    dp: int,
    tag: str | None = None,
    trust: bool = False,
    progress: bool = True,
    cp: int | None = None,
    pipeline_layout: tuple[int, ...] | None = None,
    ep: int | None = None,
    expert_tp: int | None = None,
) -> Path:
    """Write tag ``tag`` (default: the newest complete one) of ``checkpoint`` at tp x cp x pp x dp (``cp`` None: the
    saved cp) into the new directory ``out``, ``pipeline_layout`` blocks per stage (None: the saved layout at the
    saved pp, else the balanced split) and expert parallelism ``ep`` (None: the saved ep); every refusal is a
    ConfigError raised before anything is written.  The files do not depend on ep (an EP run saves its experts as an
    ep 1 run holds them, ``ep_state.py``), nor on ``expert_tp`` (None: the saved one): both only go into the recorded
    configuration, checked against the new layout."""
    src, out = Path(checkpoint), Path(out)
    check_new_out(out, "reshard")
    check_sizes({"--tp": tp, "--pp": pp, "--dp": dp, "--cp": 1 if cp is None else cp, "--ep": 1 if ep is None else ep})
    tag = source_tag(src, tag)
    old_cfg = tag_config(src, tag)
    # An imported tag (weights alone) stays one: resharded, it still loads with a fresh optimizer.
    imported = src / tag / IMPORTED
    kind = FRESH if imported.is_file() else _optimizer_kind(src / tag, old_cfg)
    target = _target_run(old_cfg, tp, pp, dp, saved_cp(old_cfg) if cp is None else cp, pipeline_layout, ep, expert_tp)
    verify_tag(src / tag, "--checkpoint", f"reshard another tag (--tag; complete ones: {complete_tags(src)})")
    for f in sorted((src / tag).glob("*.pt")):  # refuse before DeepSpeed-format files are unpickled for real
        what = None if trust else safe_load.unsafe_reason(f)
        if what is not None:
            raise safe_load.refusal(f, what)
    old = OldCheckpoint(src, tag, trust=trust)
    with staged_directory(out, ".tmp-") as tmp:  # a failure leaves no <out> and no temporary directory
        writer = _Writer(old, target, kind, tmp, tag, progress)
        if kind == FRESH:
            shutil.copy2(imported, writer.dir / IMPORTED)
        copy_tokenizer(src / tag, writer.dir)  # the weights' tokenizer stays with them, listed in the new manifest
        writer.write()
        atomic_write_text(tmp / "latest", tag)
        check_still_new(out, "reshard")
    return out


def check_new_out(out: Path, command: str) -> None:
    """The offline commands (reshard, import) write a new directory and never into an existing one."""
    if out.exists() or out.is_symlink():
        fix = f"choose a new directory ({command} never writes into one)"
        raise ConfigError("--out", "already exists", str(out), fix)


def check_still_new(out: Path, command: str) -> None:
    """Just before the staged directory becomes ``out``: nothing took its name meanwhile."""
    if out.exists():
        raise ConfigError("--out", f"appeared while {command}ing", str(out), "choose a new directory")


def check_sizes(flags: dict[str, int]) -> None:
    """The offline commands' parallel sizes (flag -> value): each at least 1."""
    for flag, value in flags.items():
        if value < 1:
            raise ConfigError(flag, "must be a positive integer", f"got {value}", "pass 1 or more")


def _optimizer_kind(tag_dir: Path, cfg: dict) -> str:
    """``"fp32"`` (ds_megatron's AdamW, state in the mp_rank files), ``"bf16"`` (DeepSpeed's BF16 optimizer) or
    ``"zero"`` (DeepSpeed's ZeRO optimizer: fp32 with ZeRO 1, bf16 with ZeRO 1 without fp32 gradient accumulation;
    the BF16 optimizer's flat partitions with its own keys, and its options' layout).  fp16 is refused; bf16 files
    alone do not tell the optimizers apart (DeepSpeed names them after the precision, whichever wrapper wrote
    them)."""
    prec, stage, wrapper = precision(cfg), zero_stage(cfg), optimizer_wrapper(cfg)
    files = [f for files in optimizer_files(tag_dir).values() for f in files]
    bf16_files = any(f.name.startswith("bf16_") for f in files)
    if wrapper is None:
        return "fp32"
    if wrapper == BF16_OPTIMIZER and prec == "bf16" and bf16_files:
        return "bf16"
    if wrapper == ZERO_OPTIMIZER and prec != "fp16" and files:
        return "zero"
    accum = "" if grad_accum_dtype(cfg) == prec else f", {grad_accum_dtype(cfg)} gradient accumulation"
    raise ConfigError(
        "--checkpoint",
        "offline resharding writes fp32 and bf16 checkpoints (ZeRO 0, DeepSpeed's BF16 and ZeRO optimizers)",
        f"this one is {prec} with ZeRO stage {stage}{accum}: DeepSpeed's {wrapper or 'no'} optimizer",
        "resume at the saved layout, or export and --init-from-hf",
    )


def _target_run(
    old_cfg: dict,
    tp: int,
    pp: int,
    dp: int,
    cp: int,
    pipeline_layout: tuple[int, ...] | None = None,
    ep: int | None = None,
    expert_tp: int | None = None,
) -> RunConfig:
    """The old run's configuration at the new layout, validated.  The global batch stays (the step count is the
    data position), and so does the micro batch; gradient accumulation takes up the change of dp (the cp ranks of a
    replica share its sequences, so cp leaves it alone).  The pipeline schedule stays too (below pp 2, 1F1B), and
    its blocks per stage (``pipeline_layout``) at the same pp; at another pp the saved counts have the wrong length
    and the blocks are balanced, unless ``pipeline_layout`` gives the new ones."""
    old = resolve(old_cfg, saved_world(old_cfg))
    glob, micro = old.global_batch_size, old.micro_batch_size
    check_batch_split(glob, micro, dp, Vocabulary(prefix="", refs={"batch_split": "--dp"}))
    cfg = copy.deepcopy(old.ds_config)
    parallel = cfg["ds_megatron"].setdefault("parallel", {})
    parallel.update(tp=tp, pp=pp, cp=cp)
    if ep is not None:  # else the saved one stays (the files do not depend on it)
        parallel["ep"] = ep
    if expert_tp is not None:  # likewise
        parallel["expert_tp"] = expert_tp
    if pp == 1:  # one stage has one schedule: a DualPipeV checkpoint resharded to pp 1 resumes as 1F1B (the default)
        parallel.pop("pipeline_schedule", None)
    if pipeline_layout is not None:
        parallel["pipeline_layout"] = list(pipeline_layout)
    elif pp != old.pp:
        parallel.pop("pipeline_layout", None)
    cfg["gradient_accumulation_steps"] = glob // (micro * dp)
    return resolve(cfg, tp * cp * pp * dp)


class _Scratch:
    """Zero-filled tensors backed by files of a scratch directory and mapped into memory: what is written to them
    goes to the page cache (which the kernel writes back and frees under pressure), not to process memory."""

    def __init__(self, root: Path):
        self.root, self.count = root, 0
        root.mkdir()

    def zeros(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        numel = int(torch.Size(shape).numel())
        if numel == 0:
            return torch.zeros(shape)
        path = self.root / f"{self.count}.bin"
        self.count += 1
        with open(path, "wb") as fh:
            fh.truncate(numel * 4)
        return torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32).view(shape)


class _Writer:
    """Writes one tag at the target layout from ``old`` (see the module docstring for the files).  ``old`` is an
    ``OldCheckpoint`` or any source with its reading methods (``layout``, ``layer_file``, ``full_shape``,
    ``full_weight``, ``full_optimizer_state``, ``client``); with ``kind`` FRESH only the weights and the counters
    are written, in the target run's precision."""

    def __init__(self, old: OldCheckpoint, target: RunConfig, kind: str, tmp: Path, tag: str, progress: bool):
        self.old, self.run, self.kind, self.progress = old, target, kind, progress
        self.tp, self.pp, self.dp, self.cp = target.tp, target.pp, target.dp, target.cp
        # The optimizer's partitions are cut over DeepSpeed's data axis, dp x cp ranks.
        self.data = target.dp * target.cp
        self.dir = tmp / tag
        self.dir.mkdir()
        self.scratch = _Scratch(tmp / ".scratch")
        self.model_config = run_model_config(target)
        self.adapter = StateDictAdapter(shard_context(self.model_config, target, self.tp))
        layout = old.layout
        self.saved = layout.saved_layers()
        self.keys = {idx: list(old.layer_file(idx, 0)) for idx, _ in self.saved}
        self.name = {(i, k): self._full_name(i, k) for i, keys in self.keys.items() for k in keys}
        self.shape = {n: self._new_shape(n) for n in self.name.values()}
        # Which stage holds which layer matters only to the optimizer's files and order (per-layer files are named
        # by layer index and TP rank alone), so a FRESH tag takes any partition method.
        stages = stage_param_layers(self.model_config, target, self.pp) if kind != FRESH else [[]] * self.pp
        self.stage_of = {i: [s for s, layers in enumerate(stages) if i in layers] for i in self.keys}
        self.local = [
            {self.name[(i, k)]: layout.local_name(i, k) for i in layers for k in self.keys[i]} for layers in stages
        ]
        self.groups = [self._optimizer_groups(list(local)) for local in self.local]
        self.client = self.old.client(0)
        self.ds_config = {**self.client["ds_config"], **{k: target.ds_config[k] for k in BATCH_KEYS}}
        # DeepSpeed is handed the sequences times cp (it counts a sequence's piece on one CP rank as a sample).
        self.ds_config["train_batch_size"] = target.global_batch_size * target.cp
        self.fp32_state: dict[tuple[int, int], dict[str, dict]] = {}
        if kind in PARTITIONED:
            self._plan_partitions()

    # ---- the new layout ----------------------------------------------------------------------------------------
    def _full_name(self, idx: int, key: str) -> str:
        name = self.old.layout.full_name(self.old.layout.local_name(idx, key))
        if name is None:
            raise ConfigError(
                "--checkpoint",
                "a layer file holds an entry that is not a parameter of the model",
                f"{key} in layer {idx}",
                "reshard only checkpoints written by recipes/train_gpt.py",
            )
        return name

    def _new_shape(self, name: str) -> torch.Size:
        meta = torch.empty(self.old.full_shape(name), device="meta")
        return self.adapter.saved_shard(name, meta, 0).shape

    def _optimizer_groups(self, names: list[str]) -> list[list[str]]:
        """The optimizer's groups of one stage, in its order: ``optim.param_groups`` (the one owner of that rule)
        applied to placeholders of the new shapes that take no memory."""
        holder, by_id = nn.Module(), {}
        for i, name in enumerate(names):
            p = nn.Parameter(torch.empty(self.shape[name], device="meta"))
            holder.register_parameter(f"p{i}", p)
            by_id[id(p)] = name
        return [[by_id[id(p)] for p in g["params"]] for g in param_groups(holder, 0.0)]

    def _plan_partitions(self) -> None:
        """Per stage and group, the flat buffer's partition size and padding, the group's names in buffer order and
        the zeros after each (the ZeRO optimizer's ``round_robin_gradients`` and ``parameter_alignment`` at the new
        data axis), and per parameter its fragments (data coordinate, group, start in the parameter, start in the
        partition, numel); then the scratch partitions."""
        zero = (self.run.ds_config.get("zero_optimization") or {}) if self.kind == "zero" else {}
        options = (zero.get("round_robin_gradients", False), zero.get("parameter_alignment", False))
        element_size = 2 if precision(self.run.ds_config) == "bf16" else 4  # the model copies'
        self.part_size: list[list[int]] = []
        self.padding: list[list[int]] = []
        self.flat_order: list[list[list[str]]] = []
        self.param_padding: list[list[list[int]]] = []
        self.fragments: list[dict[str, list[tuple[int, int, int, int, int]]]] = []
        for groups in self.groups:
            sizes, pads, orders, after, frags = [], [], [], [], {}
            for g, names in enumerate(groups):
                numels = [self.shape[n].numel() for n in names]
                order, size, padding, pieces, zeros = zero_flat_layout(numels, self.data, *options, element_size)
                for n, mine in zip(names, pieces):
                    if mine:
                        frags[n] = [(d, g, at, hp, numel) for d, at, hp, numel in mine]
                sizes.append(size)
                pads.append(padding)
                orders.append([names[i] for i in order])
                after.append(zeros)
            self.part_size.append(sizes)
            self.padding.append(pads)
            self.flat_order.append(orders)
            self.param_padding.append(after)
            self.fragments.append(frags)
        self.partitions = {
            (s, t, d): [{k: self.scratch.zeros((size,)) for k in ("master", *MOMENTS)} for size in self.part_size[s]]
            for s in range(self.pp)
            for t in range(self.tp)
            for d in range(self.data)
        }

    # ---- writing ------------------------------------------------------------------------------------------------
    def write(self) -> None:
        from tqdm.auto import tqdm

        desc = "importing" if self.kind == FRESH else "resharding"
        for idx, _ in tqdm(self.saved, desc=desc, unit="layer", disable=not self.progress):
            self._write_layer(idx)
        self._write_model_states()
        if self.kind in PARTITIONED:
            self._write_partitions()
        shutil.rmtree(self.scratch.root)
        self._write_records()

    @torch.no_grad()
    def _write_layer(self, idx: int) -> None:
        """Every parameter of layer ``idx``: its new per-layer files, and its optimizer state into the scratch."""
        dtype = torch.bfloat16 if precision(self.run.ds_config) == "bf16" else torch.float32
        template = self.old.layer_file(idx, 0)
        files = [OrderedDict() for _ in range(self.tp)]
        for f in files:
            if hasattr(template, "_metadata"):
                f._metadata = copy.deepcopy(template._metadata)  # module versions, as load_state_dict expects
        for key in self.keys[idx]:
            name = self.name[(idx, key)]
            weight, state = self.old.full_weight(name), self.old.full_optimizer_state(name)
            for t in range(self.tp):
                w = self.adapter.saved_shard(name, weight, t)
                files[t][key] = w.to(dtype)
                moments = None if state is None else {k: self.adapter.saved_shard(name, state[k], t) for k in MOMENTS}
                for s in self.stage_of[idx]:
                    if self.kind in PARTITIONED:
                        self._scatter(s, t, name, {"master": w, **(moments or {})})
                    elif moments is not None:
                        copies = {k: self.scratch.zeros(v.shape).copy_(v) for k, v in moments.items()}
                        self.fp32_state.setdefault((s, t), {})[name] = {"step": state["step"].clone(), **copies}
            del weight, state
        for t, f in enumerate(files):
            torch.save(f, self.dir / f"layer_{idx:02d}-model_{t:02d}-model_states.pt")

    def _scatter(self, s: int, t: int, name: str, values: dict[str, torch.Tensor]) -> None:
        for d, g, at, hp, n in self.fragments[s].get(name, []):
            part = self.partitions[(s, t, d)][g]
            for k, v in values.items():
                part[k].narrow(0, hp, n).copy_(v.reshape(-1).narrow(0, at, n))

    def _write_model_states(self) -> None:
        """One ``mp_rank`` file per (stage, TP rank): the old counters, schedule and client state, with the
        layout's fields and (fp32) the optimizer's state renumbered for this rank's parameters."""
        for s in range(self.pp):
            for t in range(self.tp):
                out = dict(self.client)
                if self.kind == "fp32":
                    out["optimizer"] = self._fp32_optimizer(s, t)
                if self.client.get("param_shapes") is not None:  # in flat-buffer order, as DeepSpeed records them
                    groups = self.flat_order[s] if self.kind in PARTITIONED else self.groups[s]
                    out["param_shapes"] = [
                        OrderedDict((self.local[s][n], torch.Size(self.shape[n])) for n in names) for names in groups
                    ]
                out.update(dp_world_size=self.data, mp_world_size=self.tp * self.pp, ds_config=self.ds_config)
                if "checkpoint_parallel_dimensions" in self.client:
                    out["checkpoint_parallel_dimensions"] = {"pp_degree": self.pp, "tp_degree": self.tp}
                out["config"] = self.run.ds_config
                if self.kind != FRESH:
                    old_layout = saved_layout(self.old.run.ds_config)
                    out["resharded_from"] = {
                        **dict(zip(("tp", "pp", "dp"), old_layout)),
                        "cp": saved_cp(self.old.run.ds_config),
                    }
                torch.save(out, self.dir / f"mp_rank_{s * self.tp + t:02d}_model_states.pt")

    def _fp32_optimizer(self, s: int, t: int) -> dict:
        """ds_megatron's AdamW state dict for one rank: per-parameter state keyed by position over the groups."""
        saved = self.client["optimizer"]
        state, groups, pos = {}, [], 0
        mine = self.fp32_state.get((s, t), {})
        for saved_group, names in zip(saved["param_groups"], self.groups[s]):
            groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": []})
            for n in names:
                if n in mine:
                    state[pos] = mine[n]
                groups[-1]["params"].append(pos)
                pos += 1
        return {"state": state, "param_groups": groups}

    def _write_partitions(self) -> None:
        """The BF16 or ZeRO optimizer's file of every (data coordinate, stage, TP rank), laid out as its
        ``state_dict``: the ZeRO optimizer's masters without their padding, each rank's share of it, the zeros
        after each parameter; bf16 files named ``bf16_*`` whichever optimizer wrote them."""
        files = optimizer_files(self.old.root / self.old.tag)
        template = safe_load.load(files[min(files)][0], trust=self.old.trust, mmap=True)
        sd = template["optimizer_state_dict"]
        base = sd["base_optimizer_state"]
        for (s, t, d), parts in self.partitions.items():
            state = {
                g: {"step": base["state"][g]["step"].clone(), **{k: p[k] for k in MOMENTS}}
                for g, p in enumerate(parts)
                if g in base["state"]
            }
            mappings = [OrderedDict() for _ in parts]
            for names in self.groups[s]:
                for n in names:
                    for dd, g, _, hp, numel in self.fragments[s].get(n, []):
                        if dd == d:
                            mappings[g][self.local[s][n]] = fragment_address(numel=numel, start=hp)
            masters = [p["master"] for p in parts]
            paddings = [pad if d == self.data - 1 else 0 for pad in self.padding[s]]
            if self.kind == "zero":
                sizes = self.part_size[s]
                paddings = [rank_padding(n, pad, self.data, d) for n, pad in zip(sizes, self.padding[s])]
                masters = [m.narrow(0, 0, n - pad) for m, n, pad in zip(masters, sizes, paddings)]
            new_sd = {
                **sd,
                "base_optimizer_state": {"state": state, "param_groups": copy.deepcopy(base["param_groups"])},
                "single_partition_of_fp32_groups": masters,
                "group_paddings": paddings,
                "partition_count": [self.data] * len(parts),
                "param_slice_mappings": mappings,
            }
            if self.kind == "zero":
                new_sd["param_alignment_paddings"] = self.param_padding[s]
            bf16 = self.kind == "bf16" or precision(self.run.ds_config) == "bf16"
            name = f"{'bf16_' if bf16 else ''}zero_pp_rank_{d}_mp_rank_{s * self.tp + t:02d}_optim_states.pt"
            torch.save({**template, "optimizer_state_dict": new_sd, "ds_config": self.ds_config}, self.dir / name)

    def _write_records(self) -> None:
        """ds_megatron's own files: every rank's parameter order by name, the config, then the manifest."""
        for rank, t, s, d in layout_ranks(self.tp, self.pp, self.data) if self.kind != FRESH else []:
            ranks = {"tp_rank": t, "pp_rank": s, "dp_rank": d // self.cp, "cp_rank": d % self.cp}
            record = {**ranks, "groups": self.groups[s]}
            atomic_write_text(self.dir / f"params_rank{rank:05d}.json", json.dumps(record))
        atomic_write_text(self.dir / TAG_CONFIG, json.dumps(self.run.ds_config, indent=1))
        files = {name: file_record(self.dir / name) for name in tag_files(self.dir)}
        write_manifest(self.dir, self.client.get("step", self.client.get("global_steps", 0)), files)
