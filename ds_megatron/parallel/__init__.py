"""L2: context parallelism: the load-balanced sequence layout and its rules (``cp``), the attention block kernels
with their log-sum-exp (``cp_kernels``) and causal attention across CP ranks, ring and a2a (``cp_comm``).

Process groups are always passed in; nothing here keeps global state.
"""
