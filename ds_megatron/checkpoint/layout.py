"""The model facts the checkpoint tools read off a run's saved configuration, each obtained in one place: the
model's config, its pipeline layout, the context whose shard rules cut it at a given tp, the pipeline stages'
layers and the ranks of a (tp, pp, dp) layout.  Everything here works without a process group."""

from __future__ import annotations

from deepspeed.pipe import TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from ds_megatron.config import ConfigError, RunConfig
from ds_megatron.config.schema import pipeline_schedule
from ds_megatron.model import ModelConfig, model_config
from ds_megatron.parallelize import ParallelContext
from ds_megatron.pipeline_parallel.module import PipelineLayout, layer_specs, stage_parts
from ds_megatron.topology import Group


def run_model_config(run: RunConfig) -> ModelConfig:
    """The single-device model's config of a resolved run."""
    return model_config(run.model)


def pipeline_layout(config: ModelConfig) -> PipelineLayout:
    """Which pipeline layer index holds which parameter, and DeepSpeed's names for them."""
    return PipelineLayout.of(config)


def shard_context(config: ModelConfig, run: RunConfig, tp: int) -> ParallelContext:
    """The parallel context whose shard rules cut (and merge) parameters at ``tp``: no group, only the rules."""
    return ParallelContext(config, Group(size=tp), False, None, run.section.parallel.vocab_multiple)


def stage_param_layers(config: ModelConfig, run: RunConfig, pp: int) -> list[list[int]]:
    """Per pipeline rank, the layer indices whose parameters the rank holds, in the order DeepSpeed's
    ``PipelineModule`` registers them (which is the optimizer's order): tied modules first, each under the index of
    its first layer (whose file holds it), then the rank's own layers in order, stage by stage.  The split into
    ``pp x stages_per_rank`` stages is the module's (``pipeline_parallel.module.stage_parts``: the run's
    ``pipeline_layout``, else DeepSpeed's ``partition_balanced`` over the layers matching ``type:<regex>`` or
    ``partition_uniform``), computed from the layer specs without building a layer; which
    stages a rank holds is the run's pipeline schedule's (1F1B: stage r; DualPipeV: stages r and 2p-1-r, so rank 0
    holds the embedding and the output layer)."""
    specs = layer_specs(config, shard_context(config, run, 1), run.section.train.seed)
    schedule = pipeline_schedule(run.section.parallel.pipeline_schedule).for_settings(run.section.parallel)
    num_stages = pp * schedule.per_rank(run.section.parallel)
    par = run.section.parallel
    parts = stage_parts(PipelineLayout.of(config), specs, num_stages, par.partition_method, par.pipeline_layout)
    if parts is None:
        raise ConfigError(
            "ds_megatron.parallel.partition_method",
            "offline resharding reproduces DeepSpeed's 'uniform' and 'type:<regex>' stage splits only (the others "
            "measure built layers)",
            f"partition_method={par.partition_method!r}",
            "resume with --load at the new layout instead (it reshards on load)",
        )
    first_of_key: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            first_of_key.setdefault(spec.key, i)
    ranks = []
    for r in range(pp):
        tied, own = [], []
        for s in schedule.stages_of(r, pp):
            for i in range(parts[s], parts[s + 1]):
                if isinstance(specs[i], TiedLayerSpec):
                    if first_of_key[specs[i].key] not in tied:
                        tied.append(first_of_key[specs[i].key])
                else:
                    own.append(i)
        ranks.append(tied + own)
    return ranks


def layout_ranks(tp: int, pp: int, dp: int) -> list[tuple[int, int, int, int]]:
    """(global rank, tp rank, pp rank, data coordinate) of every process, in DeepSpeed's topology order (axes pipe,
    data, model: the one ``ParallelTopology`` builds on); ``dp`` is the size of DeepSpeed's data axis, dp x cp under
    context parallelism (coordinate ``dp_rank x cp + cp_rank``)."""
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    coords = [topo.get_coord(r) for r in range(tp * pp * dp)]
    return [(r, c.model, c.pipe, c.data) for r, c in enumerate(coords)]
