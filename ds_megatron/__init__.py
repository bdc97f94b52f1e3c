"""ds_megatron: Megatron-style tensor/sequence parallelism and selective recompute for GPT on DeepSpeed."""

from ds_megatron.versions import check_installed

__version__ = "0.1.0"

# Before any module reaches DeepSpeed's private pipeline-engine names or a torch API newer than the floor: reads the
# installed versions from metadata only, so the torch-free tuner still imports without torch or deepspeed.
check_installed()
