"""ds_megatron: Megatron-style tensor/sequence parallelism and selective recompute for GPT on DeepSpeed."""

__version__ = "0.1.0"
