"""L3.7: checkpoint key map (HF <-> ds_megatron) and shard rules."""
