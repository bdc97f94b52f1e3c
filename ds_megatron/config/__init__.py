"""L0.2: the ``"ds_megatron"`` config section: typed dataclasses and validation.  Standard library only."""

from ds_megatron.config.errors import ConfigError
from ds_megatron.config.loader import (
    RunConfig,
    check_text_settings,
    check_tokenizer,
    effective_tokenizer,
    load_json,
    parse_section,
    resolve,
    resolve_batch,
    unused_settings,
)
from ds_megatron.config.schema import DsMegatronConfig, ModelSection, ParallelSection, RecomputeSection, TrainSection
from ds_megatron.config.shape import ModelShape, resolve_shape

__all__ = [
    "ConfigError",
    "DsMegatronConfig",
    "ModelSection",
    "ModelShape",
    "ParallelSection",
    "RecomputeSection",
    "RunConfig",
    "check_text_settings",
    "check_tokenizer",
    "effective_tokenizer",
    "TrainSection",
    "load_json",
    "parse_section",
    "resolve",
    "resolve_batch",
    "resolve_shape",
    "unused_settings",
]
