"""The training half of the tool: the candidate space, the step-time model, the search, the empirical loop's
training probe, and what it writes (report, JSON, a DeepSpeed config); over ``tune.core``."""
