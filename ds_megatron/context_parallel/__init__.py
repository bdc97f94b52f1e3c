"""L2: context parallelism: the load-balanced sequence layout and its rules (``layout``), the attention block
kernels with their log-sum-exp (``kernels``) and causal attention across CP ranks, ring and a2a (``attention``).

Process groups are always passed in; nothing here keeps global state.
"""
