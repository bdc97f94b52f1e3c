"""L3: checkpoint key map (HF <-> ds_megatron) and shard rules."""
